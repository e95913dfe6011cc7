"""CosmoFlow: a 3D CNN regressing the parameters that generated a cosmological density volume, in Flax NNX.

Mathuriya et al., "CosmoFlow: using deep learning to learn the universe at scale" (SC'18, arXiv 1808.04728);
the LBANN / MLPerf-HPC variant Oyama et al. (arXiv 2007.12856) train with spatial parallelism at 512^3:
5 x [conv3d k=3 -> LeakyReLU -> 2^3 max pool], flatten, dense layers with dropout, a linear output of
`num_outputs` (4: the generating parameters, normalised to [-1, 1]) and an MSE loss.

    cfg = CosmoFlowConfig(size=32, widths=(8, 16, 16, 32, 32))
    model = sk.sharded_init(lambda rngs: CosmoFlow(cfg, rngs=rngs), mesh, "spatial_dp_halo")
    y = model(volumes)                   # f32[batch, size, size, size, in_channels] -> f32[batch, num_outputs]

`spatial_blocks` says how many leading conv blocks keep the volume split over the spatial mesh axes (all by
default); the later ones, and the dense head always, run on the batch layout (spatial dimensions whole). The
change of layout is one `sk.constrain` after the last split block, explicit and visible in `sk.explain`. This is
LBANN's rule: split spatially only while the volume is large; a deep layer whose extent no longer divides by
the spatial degree would otherwise be a ShardkitError naming the layer and its extent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import shardkit as sk
from models import conv3d
from models.axes import BATCH, CHANNELS, DEPTH, HEIGHT, WIDTH

#: Logical names of a batch `{"volume": f32[B, D, H, W, C], "target": f32[B, P]}` (input channels unnamed).
BATCH_AXES = {"volume": (BATCH, DEPTH, HEIGHT, WIDTH, None), "target": (BATCH, None)}


@dataclasses.dataclass(frozen=True)
class CosmoFlowConfig:
    size: int = 32  # cubic input extent; divisible by 2^len(widths) (each block halves it)
    in_channels: int = 1
    widths: Sequence[int] = (8, 16, 16, 32, 32)  # output channels of the conv blocks (published: 16 ... 256)
    dense: Sequence[int] = (64, 32)  # hidden dense layers (published: 128, 64)
    num_outputs: int = 4  # the regressed parameters
    dropout: float = 0.0  # before each hidden dense layer (published: 0.5)
    leaky_slope: float = 0.3  # LeakyReLU's negative slope (LBANN / MLPerf CosmoFlow)
    batch_norm: bool = False  # BatchNorm after each conv (the MLPerf reference has none)
    spatial_blocks: int | None = None  # leading conv blocks split spatially (None: all)
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # parameters and BatchNorm statistics

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "dense", tuple(int(w) for w in self.dense))
        if not self.widths or min(self.widths) < 1 or (self.dense and min(self.dense) < 1):
            raise sk.ShardkitError(f"widths={self.widths}, dense={self.dense}: at least one conv block, widths >= 1")
        if self.size < 1 or self.size % 2 ** len(self.widths):
            raise sk.ShardkitError(
                f"size={self.size} must be divisible by 2^{len(self.widths)} = {2 ** len(self.widths)} (each of the "
                f"{len(self.widths)} conv blocks halves it); e.g. size={2 ** len(self.widths) * 4}"
            )
        if self.spatial_blocks is not None and not 0 <= self.spatial_blocks <= len(self.widths):
            raise sk.ShardkitError(
                f"spatial_blocks={self.spatial_blocks}: between 0 and the {len(self.widths)} conv blocks of "
                f"widths={self.widths}"
            )

    def dtypes(self) -> dict[str, str]:
        return {"dtype": self.dtype, "param_dtype": self.param_dtype}

    def split(self, block: int) -> bool:
        return self.spatial_blocks is None or block < self.spatial_blocks

    def num_params(self) -> int:
        """Trainable parameters (BatchNorm statistics excluded)."""
        n, c = 0, self.in_channels
        for w in self.widths:
            n += 27 * c * w + (2 * w if self.batch_norm else w)  # BatchNorm scale + shift, or a bias
            c = w
        f = c * (self.size // 2 ** len(self.widths)) ** 3
        for h in (*self.dense, self.num_outputs):
            n += f * h + h
            f = h
        return n

    def flops_per_example(self) -> float:
        """Training FLOPs per volume: 3 x 2 x the forward multiply-adds of the convs and dense layers."""
        macs, c, s = 0, self.in_channels, self.size
        for w in self.widths:
            macs += 27 * c * w * s**3
            c, s = w, s // 2
        f = c * s**3
        for h in (*self.dense, self.num_outputs):
            macs, f = macs + f * h, h
        return 3 * 2 * macs


class CosmoFlow(nnx.Module):
    """CosmoFlow(cfg, rngs=...)(volumes f32[B, S, S, S, C]) -> f32[B, num_outputs]."""

    batch_axes = BATCH_AXES

    def __init__(self, cfg: CosmoFlowConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        convs, norms, c = [], [], cfg.in_channels
        for i, w in enumerate(cfg.widths):
            convs.append(
                conv3d.conv3d(
                    c, w, 3, name=f"conv{i}", split=cfg.split(i), use_bias=not cfg.batch_norm, **cfg.dtypes(), rngs=rngs
                )
            )  # fmt: skip  (BatchNorm's shift replaces a bias)
            norms.append(conv3d.batch_norm(w, **cfg.dtypes(), rngs=rngs) if cfg.batch_norm else None)
            c = w
        self.convs, self.norms = nnx.List(convs), nnx.List(norms)
        f = c * (cfg.size // 2 ** len(cfg.widths)) ** 3
        dense = []
        for h in (*cfg.dense, cfg.num_outputs):
            dense.append(
                nnx.Linear(f, h, param_dtype=jnp.dtype(cfg.param_dtype),
                           kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (CHANNELS, None)),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,)), rngs=rngs)
            )  # fmt: skip
            f = h
        self.dense = nnx.List(dense)
        self.dropout = sk.layers.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, volumes: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = sk.constrain(volumes.astype(jnp.dtype(cfg.dtype)), (*conv3d.names(cfg.split(0))[:4], None))
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms, strict=True)):
            # each block under the strategy's remat kernel (docs/memory.md): the blocks differ in shape, no stack
            x = sk.layers.checkpoint_module(functools.partial(_block, cfg, i))(conv, norm, x)
        h = x.reshape(x.shape[0], -1).astype(jnp.promote_types(x.dtype, jnp.float32))  # the batch layout
        for layer in self.dense[:-1]:
            h = jax.nn.leaky_relu(layer(self.dropout(h)), cfg.leaky_slope)
        return self.dense[-1](h)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return regression_loss(self, batch)

    def validate_batch(self, batch: dict[str, jax.Array]) -> None:
        """What `regression_loss` reads, before XLA: a floating `volume` [batch, D, H, W, in_channels] and a
        `target` [batch, num_outputs]."""
        sk.batch.expect(batch, "CosmoFlow", {"volume": (5, "floating"), "target": (2, "number")})
        volume, target = tuple(batch["volume"].shape), tuple(batch["target"].shape)
        if volume[4] != self.cfg.in_channels or target[1] != self.cfg.num_outputs:
            raise sk.ShardkitError(f"CosmoFlow: batch['volume'] {volume} and batch['target'] {target} must be "
                                   f"[B, D, H, W, {self.cfg.in_channels}] and [B, {self.cfg.num_outputs}] "
                                   "(in_channels, num_outputs of the config)")  # fmt: skip


def _block(cfg: CosmoFlowConfig, i: int, conv: nnx.Module, norm: nnx.Module | None, x: jax.Array) -> jax.Array:
    """Conv block i: conv3d -> (BatchNorm) -> LeakyReLU -> 2^3 max pool, laid out for the next block."""
    x = sk.layers.tag(conv(x), f"conv{i}")  # tagged for the `names:` remat policy
    x = norm(x) if norm is not None else x
    x = jax.nn.leaky_relu(x, cfg.leaky_slope)
    x = conv3d.pool(x, name=f"pool{i}", split=cfg.split(i))
    return sk.constrain(x, conv3d.names(cfg.split(i + 1) if i + 1 < len(cfg.widths) else False))


def regression_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean squared error over batch x parameters, {"mae": mean absolute error}) of `{"volume", "target"}`."""
    pred = model(batch["volume"])
    err = pred - batch["target"].astype(pred.dtype)
    return optax.l2_loss(pred, batch["target"].astype(pred.dtype)).mean() * 2, {"mae": jnp.abs(err).mean()}


__all__ = ["BATCH_AXES", "CosmoFlow", "CosmoFlowConfig", "regression_loss"]
