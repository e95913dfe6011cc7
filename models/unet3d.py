"""A 3D U-Net for voxel segmentation (Çiçek et al., "3D U-Net", MICCAI 2016, arXiv 1606.06650) in Flax NNX.

Encoder: per level two [conv3d k=3 -> BatchNorm -> ReLU], then 2^3 max pooling; a bottleneck of the same pair;
decoder: nearest-neighbour 2x upsampling + a conv3d k=3 (the "up-conv"), concatenation with the encoder's
skip at that level, two [conv -> BatchNorm -> ReLU]; a 1^3 conv to `num_classes` logits per voxel. Every
activation keeps the volume layout `[batch, depth, height, width, channels]`, so under a spatial strategy
every layer runs on its shard of each sample; BatchNorm statistics are those of the whole global batch.

    cfg = UNet3DConfig(widths=(8, 16, 32), num_classes=3)
    logits = UNet3D(cfg, rngs=nnx.Rngs(0))(volumes)    # f32[B, S, S, S, C] -> f32[B, S, S, S, num_classes]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk
from models import conv3d
from models.axes import BATCH, DEPTH, HEIGHT, WIDTH

#: Logical names of a batch `{"volume": f32[B, D, H, W, C], "label": int32[B, D, H, W]}`.
BATCH_AXES = {"volume": (BATCH, DEPTH, HEIGHT, WIDTH, None), "label": (BATCH, DEPTH, HEIGHT, WIDTH)}


@dataclasses.dataclass(frozen=True)
class UNet3DConfig:
    widths: Sequence[int] = (8, 16, 32)  # channels per level; the last is the bottleneck
    in_channels: int = 1
    num_classes: int = 3
    bn_momentum: float = 0.9
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # parameters and BatchNorm statistics

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if len(self.widths) < 2 or min(self.widths) < 1:
            raise sk.ShardkitError(f"widths={self.widths}: at least two levels (one pooling), widths >= 1")

    def dtypes(self) -> dict[str, str]:
        return {"dtype": self.dtype, "param_dtype": self.param_dtype}

    def num_params(self) -> int:
        """Trainable parameters (BatchNorm statistics excluded): pairs 2 x (27 c_in c + 2c), up-convs, the head."""
        w, pair = self.widths, lambda c_in, c: 27 * c_in * c + 2 * c + 27 * c * c + 2 * c
        n = sum(pair(c_in, c) for c_in, c in zip((self.in_channels, *w[:-1]), w, strict=True))
        n += sum(27 * w[i + 1] * w[i] + w[i] + pair(2 * w[i], w[i]) for i in range(len(w) - 1))
        return n + w[0] * self.num_classes + self.num_classes

    def flops_per_example(self, size: int) -> float:
        """Training FLOPs per volume of size^3: 3 x 2 x the convolutions' forward multiply-adds."""
        w, macs = self.widths, 0
        pair = lambda c_in, c, s: 27 * (c_in * c + c * c) * s**3
        for i, (c_in, c) in enumerate(zip((self.in_channels, *w[:-1]), w, strict=True)):
            macs += pair(c_in, c, size // 2**i)
        for i in range(len(w) - 1):
            s = size // 2**i
            macs += 27 * w[i + 1] * w[i] * s**3 + pair(2 * w[i], w[i], s)
        return 3 * 2 * (macs + w[0] * self.num_classes * size**3)

    def min_size(self) -> int:
        """The input extent must be divisible by this (one halving per pooling)."""
        return 2 ** (len(self.widths) - 1)


class _Pair(nnx.Module):
    """[conv3d -> BatchNorm -> ReLU] x 2."""

    def __init__(self, cfg: UNet3DConfig, c_in: int, c_out: int, name: str, *, rngs: nnx.Rngs):
        dt, m = cfg.dtypes(), cfg.bn_momentum
        self.conv1 = conv3d.conv3d(c_in, c_out, 3, name=f"{name}.conv1", use_bias=False, **dt, rngs=rngs)
        self.norm1 = conv3d.batch_norm(c_out, momentum=m, **dt, rngs=rngs)
        self.conv2 = conv3d.conv3d(c_out, c_out, 3, name=f"{name}.conv2", use_bias=False, **dt, rngs=rngs)
        self.norm2 = conv3d.batch_norm(c_out, momentum=m, **dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.norm1(self.conv1(x)))
        return sk.constrain(nnx.relu(self.norm2(self.conv2(x))), conv3d.names())


def _run_pair(pair: _Pair, x: jax.Array) -> jax.Array:
    """One conv pair; a function of the module, so `sk.layers.checkpoint_module` can rematerialize it."""
    return pair(x)


class UNet3D(nnx.Module):
    """UNet3D(cfg, rngs=...)(volumes f32[B, S, S, S, C]) -> logits f32[B, S, S, S, num_classes]."""

    batch_axes = BATCH_AXES

    def __init__(self, cfg: UNet3DConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        w = cfg.widths
        c_ins = (cfg.in_channels, *w[:-2])
        self.down = nnx.List([_Pair(cfg, c_in, c, f"down{i}", rngs=rngs)
                              for i, (c_in, c) in enumerate(zip(c_ins, w[:-1], strict=True))])  # fmt: skip
        self.bottom = _Pair(cfg, w[-2], w[-1], "bottom", rngs=rngs)
        ups, pairs = [], []
        for i in reversed(range(len(w) - 1)):  # from the deepest skip up
            ups.append(conv3d.conv3d(w[i + 1], w[i], 3, name=f"up{i}.conv", **cfg.dtypes(), rngs=rngs))
            pairs.append(_Pair(cfg, 2 * w[i], w[i], f"up{i}", rngs=rngs))
        self.ups, self.up_pairs = nnx.List(ups), nnx.List(pairs)
        self.head = conv3d.conv3d(w[0], cfg.num_classes, 1, name="head", **cfg.dtypes(), rngs=rngs,
                                  init=nnx.initializers.lecun_normal())  # fmt: skip

    def __call__(self, volumes: jax.Array) -> jax.Array:
        x = sk.constrain(volumes.astype(jnp.dtype(self.cfg.dtype)), (BATCH, DEPTH, HEIGHT, WIDTH, None))
        skips = []
        run = sk.layers.checkpoint_module(_run_pair)  # each conv pair under the strategy's remat kernel
        for i, pair in enumerate(self.down):
            x = run(pair, x)
            skips.append(x)
            x = conv3d.pool(x, name=f"down{i}.pool")
        x = run(self.bottom, x)
        for up, pair, skip in zip(self.ups, self.up_pairs, reversed(skips), strict=True):
            x = nnx.relu(up(conv3d.upsample(x)))
            x = run(pair, jnp.concatenate([skip, x], axis=-1))
        return self.head(x).astype(jnp.promote_types(x.dtype, jnp.float32))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return segmentation_loss(self, batch)

    def validate_batch(self, batch: dict[str, jax.Array]) -> None:
        """What `segmentation_loss` reads, before XLA: a floating `volume` [batch, D, H, W, in_channels] and an
        integer `label` [batch, D, H, W] of the same volume, in [0, num_classes) (checked on concrete arrays)."""
        sk.batch.expect(batch, "UNet3D", {"volume": (5, "floating"), "label": (4, "integer")})
        volume, label = tuple(batch["volume"].shape), tuple(batch["label"].shape)
        if volume[:4] != label or volume[4] != self.cfg.in_channels:
            c = self.cfg.in_channels
            raise sk.ShardkitError(f"UNet3D: batch['volume'] {volume} and batch['label'] {label} must be "
                                   f"[B, D, H, W, {c}] and [B, D, H, W] (in_channels={c})")  # fmt: skip
        sk.batch.expect_ids(batch, "UNet3D", "label", self.cfg.num_classes, f"num_classes={self.cfg.num_classes}",
                            "give the model as many classes as the labels have")  # fmt: skip


def segmentation_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean voxel cross-entropy, {"accuracy": voxel accuracy, "dice": mean Dice of the foreground classes})."""
    logits = model(batch["volume"])
    labels = batch["label"]
    pred = jnp.argmax(logits, axis=-1)
    metrics = {"accuracy": (pred == labels).astype(jnp.float32).mean(), "dice": dice(pred, labels, logits.shape[-1])}
    return sk.cross_entropy(logits, labels), metrics


def dice(pred: jax.Array, labels: jax.Array, num_classes: int) -> jax.Array:
    """Mean over classes 1..K-1 of 2|P ∩ L| / (|P| + |L|) over the whole batch (1 for a class absent from both)."""
    scores = []
    for c in range(1, num_classes):
        p, t = pred == c, labels == c
        inter, total = jnp.sum(p & t), jnp.sum(p) + jnp.sum(t)
        scores.append(jnp.where(total > 0, 2 * inter / jnp.maximum(total, 1), 1.0))
    return jnp.mean(jnp.stack(scores)).astype(jnp.float32)


__all__ = ["BATCH_AXES", "UNet3D", "UNet3DConfig", "dice", "segmentation_loss"]
