"""Building blocks the 3D CNNs share (models/cosmoflow.py, models/unet3d.py): Flax's own layers, logical names only.

A volume activation is `[batch, depth, height, width, channels]` (`VOLUME`). Convolutions are Flax's
`nnx.Conv` with its `conv_general_dilated` set to the `conv` kernel slot (`sk.layers.conv_fn`) and pooling goes
through the `pool` slot (`sk.layers.pool`), so a strategy can run them as GSPMD-partitioned ops ("xla", the
default) or as explicit halo-exchange kernels ("halo", shardkit/parallel/spatial/exchange.py) without a change here.

A block whose spatial dimensions should stay whole (deep in a network, where the volume has shrunk below the
spatial split; LBANN's CosmoFlow stops splitting there) names them None: `names(split=False)` =
`(batch, None, None, None, channels)`, and `sk.constrain` to it is the explicit spatial -> batch layout change.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk
from models.axes import BATCH, CHANNELS, DEPTH, HEIGHT, VOLUME, WIDTH


def names(split: bool = True) -> tuple[str | None, ...]:
    """Logical names of a volume activation; `split=False` keeps depth / height / width whole."""
    return VOLUME if split else (BATCH, None, None, None, CHANNELS)


def conv3d(
    c_in: int, c_out: int, kernel: int, *, name: str, split: bool = True, stride: int = 1, use_bias: bool = True,
    dtype: str = "float32", param_dtype: str = "float32", init: Any = None, rngs: nnx.Rngs,
) -> nnx.Conv:  # fmt: skip
    """A "SAME" 3D conv `[B, D, H, W, c_in] -> [B, D/s, H/s, W/s, c_out]` whose kernel is named by its output
    channels, `(None, None, None, None, channels)`, and whose conv runs the strategy's `conv` kernel."""
    init = init or nnx.initializers.variance_scaling(2.0, "fan_in", "truncated_normal")
    return nnx.Conv(
        c_in, c_out, (kernel,) * 3, (stride,) * 3, padding="SAME", use_bias=use_bias, dtype=jnp.dtype(dtype),
        param_dtype=jnp.dtype(param_dtype), kernel_init=nnx.with_partitioning(init, (None, None, None, None, CHANNELS)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (CHANNELS,)),
        conv_general_dilated=sk.layers.conv_fn(names(split), name=name), rngs=rngs,
    )  # fmt: skip


#: Flax's BatchNorm whose training statistics follow the strategy's `norm` slot ("global": the one-device statistics
#: under any split; "group": one set per data-parallel group) and hetero_dp's uneven parts (shardkit/batch_layers.py).
BatchNorm = sk.layers.BatchNorm


def batch_norm(
    c: int, *, momentum: float = 0.9, dtype: str = "float32", param_dtype: str = "float32", rngs: nnx.Rngs
) -> BatchNorm:
    """BatchNorm over (batch, depth, height, width) per channel (`BatchNorm`: global statistics by default)."""
    return BatchNorm(
        c, momentum=momentum, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype),
        scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), (CHANNELS,)),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (CHANNELS,)), rngs=rngs,
    )  # fmt: skip


def pool(x: jax.Array, *, name: str, split: bool = True, reduce: str = "max") -> jax.Array:
    """2^3 / stride-2 pooling `[B, D, H, W, C] -> [B, D/2, H/2, W/2, C]` by the strategy's `pool` kernel."""
    return sk.layers.pool(x, (2, 2, 2), (2, 2, 2), "VALID", reduce, axes=names(split), name=name)


def upsample(x: jax.Array, *, split: bool = True) -> jax.Array:
    """Nearest-neighbour 2x upsampling `[B, D, H, W, C] -> [B, 2D, 2H, 2W, C]` (local on every shard)."""
    for dim in (1, 2, 3):
        x = jnp.repeat(x, 2, axis=dim)
    return sk.constrain(x, names(split))


def remat_unmodelled(strategy: Any) -> str:
    """The cost models' note when `strategy` sets a remat policy their activation formulas (written for `none`) do
    not model ("" when it sets none): docs/spatial.md, Remat."""
    remat = sk.strategy(strategy).kernels.get("remat") or "none"
    return f"; remat {remat} not modelled: memory and collectives as without it" if remat != "none" else ""


__all__ = ["DEPTH", "HEIGHT", "VOLUME", "WIDTH", "BatchNorm", "batch_norm", "conv3d", "names", "pool",
           "remat_unmodelled", "upsample"]  # fmt: skip
