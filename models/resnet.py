"""A small ResNet for images (He et al. 1512.03385, v1 basic blocks) in Flax NNX, with logical names only.

    cfg = ResNetConfig(widths=(32, 64), blocks=(1, 1), num_classes=10)
    model = sk.sharded_init(lambda rngs: ResNet(cfg, rngs=rngs), mesh, strategy)  # any strategy that fits it
    logits = model(images)               # f32[batch, height, width, in_channels] -> f32[batch, num_classes]
    step = sk.make_train_step(model, tx, mesh, strategy, loss_fn=classification_loss, batch_axes=BATCH_AXES)

(Built directly, outside `sk.sharded_init`, it needs `with nnx.use_eager_sharding(False):`, Flax's default being
to take `with_partitioning` names for mesh axes at creation.)

Layout: a 3x3 conv stem, then one `Stage` per entry of `widths` (`model.stages[i]`), then global average pool,
dropout and a dense classifier. Each stage holds `blocks[i]` basic residual blocks (conv3x3 - BatchNorm - ReLU -
conv3x3 - BatchNorm, + identity or a 1x1 projection, ReLU) as two modules:

    stages/i/first   one BasicBlock c_in -> c; stride 2 in every stage after the first (halving height and width),
                     with a 1x1 projection + BatchNorm on the shortcut when the shape changes
    stages/i/stack   the other blocks[i] - 1 blocks (identity shortcut, c -> c, stride 1) as ONE BasicBlock whose
                     parameters and BatchNorm statistics all have a leading stacked dimension named `layers`
                     (absent, None, when blocks[i] == 1)

The identical blocks of a stage are stacked so that they run as one `lax.scan` (compile time flat in depth, as the
GPT's `layers`) and so that a strategy can find them by the logical name `layers`: Subnetwork Data Parallelism
gives each device a subset of a stage's stacked blocks and merges the model with that shorter stack, which is why
the scan's length is the stack's leading dimension, never `cfg.blocks`. In training the scan returns each block's
updated running statistics and writes them back, exactly as the blocks run one by one would; in eval mode
(`model.eval()`) the running statistics are used and left as they are. Each stacked block runs under the strategy's
`remat` kernel (docs/memory.md; its two convolutions' outputs are tagged `conv1`, `conv2` for `names:`).
Convolutions have no bias (BatchNorm follows each).

Every parameter is named through `nnx.with_partitioning`, as Flax writes names: conv kernels
`(None, None, None, "channels")` (their output channels), BatchNorm scale / bias `("channels",)`, the head
`("channels", "classes")` + bias `("classes",)`; inside a stage's `stack` every variable's names start with
`layers` (Flax's `out_sharding` metadata, which `sk.state_logical_axes` reads), its BatchNorm statistics, unnamed
elsewhere, included: `("layers", None)`. Activations are pinned to `(batch, height, width, channels)` after every
block (`sk.constrain`, a no-op outside a train step), so a strategy that shards `channels` (`tp_channels`) keeps
them sharded between the blocks. BatchNorm's running statistics (`nnx.BatchStat`) and dropout's RNG counter are
model state that `make_train_step` carries in `state.model_state`; the layers are `sk.layers.BatchNorm` and
`sk.layers.Dropout` (Flax's, with one dropout key per example), which hetero_dp's uneven splits keep equal to one
device. Which mesh axes any of these names go to is
the strategy's business: no mesh axis appears here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk
from models.axes import BATCH, LAYERS

HEIGHT, WIDTH, CHANNELS, CLASSES = "height", "width", "channels", "classes"
#: Logical names of a batch `{"image": f32[B, H, W, C], "label": int32[B]}`. The image's own (input) channel
#: dimension is left unnamed: it is 1 for grayscale, 3 for RGB, and a strategy that shards `channels` (such as
#: `tp_channels`) means the network's feature channels, which the stem creates; an input of 1 channel cannot be split.
BATCH_AXES = {"image": (BATCH, HEIGHT, WIDTH, None), "label": (BATCH,)}
_ACT = (BATCH, HEIGHT, WIDTH, CHANNELS)


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    widths: Sequence[int] = (32, 64)  # channels per stage (divisible by the degree of the mesh axes that shard them)
    blocks: Sequence[int] = (1, 1)  # basic residual blocks per stage
    num_classes: int = 10
    in_channels: int = 1  # channels of the input image (1: grayscale)
    dropout: float = 0.1  # before the classifier, on the pooled features
    bn_momentum: float = 0.9  # running statistics' decay (0.9: settled after a few dozen steps)
    dtype: str = "float32"  # compute dtype; parameters and BatchNorm statistics stay float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "blocks", tuple(int(b) for b in self.blocks))
        if not self.widths or len(self.widths) != len(self.blocks) or min(self.blocks) < 1:
            raise ValueError(f"widths {self.widths} and blocks {self.blocks}: one entry (>= 1 block) per stage")

    def num_params(self) -> int:
        """Trainable parameters (BatchNorm statistics excluded)."""
        n, c_in = 9 * self.in_channels * self.widths[0] + 2 * self.widths[0], self.widths[0]
        for i, (w, b) in enumerate(zip(self.widths, self.blocks, strict=True)):
            for j in range(b):
                n += 9 * c_in * w + 9 * w * w + 4 * w
                n += c_in * w + 2 * w if (i > 0 and j == 0) or c_in != w else 0
                c_in = w
        return n + c_in * self.num_classes + self.num_classes

    def flops_per_example(self, height: int, width: int) -> float:
        """Training FLOPs per image: 3 x the forward pass's convolution and classifier multiply-adds x 2 (the
        backward pass computes the input and the weight gradient of each: 2x forward, as 6N for a transformer).
        BatchNorm, ReLU, pooling and the optimizer are elementwise and not counted. "SAME" convs: out = ceil(in / s)."""
        macs, c_in, h, w = 9 * self.in_channels * self.widths[0] * height * width, self.widths[0], height, width
        for i, (c, b) in enumerate(zip(self.widths, self.blocks, strict=True)):
            for j in range(b):
                stride = 2 if i > 0 and j == 0 else 1
                h, w = -(-h // stride), -(-w // stride)
                macs += 9 * c_in * c * h * w + 9 * c * c * h * w + (c_in * c * h * w if stride > 1 or c_in != c else 0)
                c_in = c
        return 3 * 2 * (macs + c_in * self.num_classes)


def _named(init: Any, *names: str | None) -> Any:
    return nnx.with_partitioning(init, names)


def _conv(cfg: ResNetConfig, c_in: int, c_out: int, kernel: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
    init = nnx.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")  # He init for ReLU
    return nnx.Conv(
        c_in, c_out, (kernel, kernel), (stride, stride), padding="SAME", use_bias=False, dtype=jnp.dtype(cfg.dtype),
        kernel_init=_named(init, None, None, None, CHANNELS), rngs=rngs,
    )  # fmt: skip


def _norm(cfg: ResNetConfig, c: int, rngs: nnx.Rngs) -> sk.layers.BatchNorm:
    """BatchNorm over (batch, height, width) per channel: batch statistics in training, running ones in eval."""
    return sk.layers.BatchNorm(
        c, momentum=cfg.bn_momentum, dtype=jnp.dtype(cfg.dtype),
        scale_init=_named(nnx.initializers.ones_init(), CHANNELS),
        bias_init=_named(nnx.initializers.zeros_init(), CHANNELS), rngs=rngs,
    )  # fmt: skip


class BasicBlock(nnx.Module):
    """relu(norm2(conv2(relu(norm1(conv1(x))))) + shortcut(x)); shortcut = 1x1 conv + norm when the shape changes."""

    def __init__(self, cfg: ResNetConfig, c_in: int, c_out: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1, self.norm1 = _conv(cfg, c_in, c_out, 3, stride, rngs), _norm(cfg, c_out, rngs)
        self.conv2, self.norm2 = _conv(cfg, c_out, c_out, 3, 1, rngs), _norm(cfg, c_out, rngs)
        if stride != 1 or c_in != c_out:
            self.proj, self.proj_norm = _conv(cfg, c_in, c_out, 1, stride, rngs), _norm(cfg, c_out, rngs)
        else:
            self.proj, self.proj_norm = nnx.data(None), nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.norm1(sk.layers.tag(self.conv1(x), "conv1")))  # tagged for the `names:` remat policy
        h = self.norm2(sk.layers.tag(self.conv2(h), "conv2"))
        skip = x if self.proj is None else self.proj_norm(self.proj(x))
        return sk.constrain(nnx.relu(h + skip), _ACT)


def _stack_blocks(cfg: ResNetConfig, c: int, n: int, rngs: nnx.Rngs) -> BasicBlock:
    """n identity blocks (c -> c, stride 1) as one BasicBlock whose variables have a leading `layers` dimension:
    created under vmap from n split keys (as models/gpt.py's `_stack_blocks`), then `layers` is prepended to the
    names of every variable, Params (Flax's `out_sharding`, from `with_partitioning`) and BatchStats alike."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: BasicBlock(cfg, c, c, 1, rngs=nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), n)
    states = jax.vmap(lambda key: nnx.split(BasicBlock(cfg, c, c, 1, rngs=nnx.Rngs(params=key)))[1])(keys)
    stack = nnx.merge(graphdef, states)
    for _, var in nnx.iter_graph(stack):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata().get("out_sharding") or (None,) * (var.get_value().ndim - 1)
            var.set_metadata("out_sharding", (LAYERS, *names))
    return stack


class Stage(nnx.Module):
    """`first` (BasicBlock c_in -> c_out at `stride`), then `stack`: n - 1 stacked identity blocks (None if n == 1)."""

    def __init__(self, cfg: ResNetConfig, c_in: int, c_out: int, stride: int, n: int, *, rngs: nnx.Rngs):
        self.first = BasicBlock(cfg, c_in, c_out, stride, rngs=rngs)
        self.stack = _stack_blocks(cfg, c_out, n - 1, rngs) if n > 1 else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.first(x)
        if self.stack is None:
            return x
        graphdef, stacked = nnx.split(self.stack)  # Params + BatchStats, each [L, ...]
        train = not self.stack.norm1.use_running_average

        def body(x: jax.Array, layer: nnx.State) -> tuple[jax.Array, nnx.State | None]:
            block = nnx.merge(graphdef, layer)
            x = block(x)  # constrained to _ACT inside
            return x, nnx.state(block, nnx.BatchStat) if train else None

        # The length is the stack's leading dimension (SDP merges a stack of k < blocks[i] - 1 blocks). Each block
        # runs under the strategy's remat kernel (`kernels={"remat": ...}`, docs/memory.md), as `sk.layers` stacks do.
        x, stats = jax.lax.scan(sk.layers.checkpoint(body), x, stacked)
        if train:  # each block's running statistics, updated from its own batch statistics
            nnx.update(self.stack, stats)
        return x


class ResNet(nnx.Module):
    """ResNet(cfg, rngs=nnx.Rngs(0))(images f32[batch, height, width, in_channels]) -> logits f32[batch, classes]."""

    batch_axes = BATCH_AXES

    def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        w0 = cfg.widths[0]
        self.stem, self.stem_norm = _conv(cfg, cfg.in_channels, w0, 3, 1, rngs), _norm(cfg, w0, rngs)
        stages, c_in = [], w0
        for i, (w, n) in enumerate(zip(cfg.widths, cfg.blocks, strict=True)):
            stages.append(Stage(cfg, c_in, w, 2 if i > 0 else 1, n, rngs=rngs))
            c_in = w
        self.stages = nnx.List(stages)
        self.dropout = sk.layers.Dropout(cfg.dropout, rngs=rngs)  # one key per example
        self.head = nnx.Linear(
            c_in, cfg.num_classes, kernel_init=_named(nnx.initializers.lecun_normal(), CHANNELS, CLASSES),
            bias_init=_named(nnx.initializers.zeros_init(), CLASSES), rngs=rngs,
        )  # fmt: skip

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.astype(jnp.dtype(self.cfg.dtype))
        x = sk.constrain(nnx.relu(self.stem_norm(self.stem(x))), _ACT)
        for stage in self.stages:
            x = stage(x)
        pooled = x.astype(jnp.promote_types(x.dtype, jnp.float32)).mean(axis=(1, 2))  # [batch, channels]
        with sk.scope("head"):  # a strategy may give the classifier rules of its own (Strategy.scopes)
            pooled = sk.constrain(self.dropout(pooled), (BATCH, CHANNELS))  # the layout change into the scope
            return sk.constrain(self.head(pooled), (BATCH, CLASSES))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return classification_loss(self, batch)

    def validate_batch(self, batch: dict[str, jax.Array]) -> None:
        """What `classification_loss` reads, before XLA: a floating `image` [batch, height, width, in_channels]
        and integer `label` [batch] in [0, num_classes) (checked on concrete arrays)."""
        sk.batch.expect(batch, "ResNet", {"image": (4, "floating"), "label": (1, "integer")})
        if batch["image"].shape[-1] != self.cfg.in_channels:
            shape, want = tuple(batch["image"].shape), self.cfg.in_channels
            raise sk.ShardkitError(f"ResNet: batch['image'] {shape} has {shape[-1]} channels; the model takes "
                                   f"in_channels={want}")  # fmt: skip
        sk.batch.expect_ids(batch, "ResNet", "label", self.cfg.num_classes, f"num_classes={self.cfg.num_classes}",
                            "give the model as many classes as the data has")  # fmt: skip


def classification_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean cross-entropy in nats, {"accuracy": fraction of argmax == label}) of `{"image", "label"}`."""
    logits = model(batch["image"])
    accuracy = (jnp.argmax(logits, axis=-1) == batch["label"]).astype(jnp.float32).mean()
    return sk.cross_entropy(logits, batch["label"]), {"accuracy": accuracy}
