"""Building blocks the 3D CNNs share (models/cosmoflow.py, models/unet3d.py): Flax's own layers, logical names only.

A volume activation is `[batch, depth, height, width, channels]` (`VOLUME`). Convolutions are Flax's
`nnx.Conv` with its `conv_general_dilated` set to the `conv` kernel slot (`sk.layers.conv_fn`) and pooling goes
through the `pool` slot (`sk.layers.pool`), so a strategy can run them as GSPMD-partitioned ops ("xla", the
default) or as explicit halo-exchange kernels ("halo", shardkit/parallel/spatial.py) without a change here.

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


class BatchNorm(nnx.BatchNorm):
    """Flax's BatchNorm whose training statistics may be taken per group of the batch (the strategy's `norm` slot).

    With the default "global" kernel it is `nnx.BatchNorm`: statistics over the whole global batch (the one-device
    computation), under any split, since the reductions run on the global array. With "group" each data-parallel
    group of samples (a shard of the batch over its mesh axes, each sample whole over its spatial shards) is
    normalised by its own mean and variance; the running statistics then move towards the groups' average mean and
    variance. Evaluation uses the running statistics either way.
    """

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None) -> jax.Array:
        running = self.use_running_average if use_running_average is None else use_running_average
        groups = 1 if running else sk.layers.norm_groups(x.shape[0])
        if groups == 1 or mask is not None:
            return super().__call__(x, use_running_average, mask=mask)
        dtype = jnp.promote_types(x.dtype, jnp.float32)
        xg = x.reshape(groups, x.shape[0] // groups, *x.shape[1:]).astype(dtype)
        axes = tuple(range(1, xg.ndim - 1))
        mean = xg.mean(axes, keepdims=True)
        var = jnp.maximum((xg * xg).mean(axes, keepdims=True) - mean * mean, 0.0)  # Flax's fast variance
        y = (xg - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.scale[...].astype(dtype) + self.bias[...].astype(dtype)
        decay = lambda old, new: jax.lax.stop_gradient(
            self.momentum * old + (1 - self.momentum) * new.reshape(groups, -1).mean(0).astype(old.dtype)
        )
        self.mean[...], self.var[...] = decay(self.mean[...], mean), decay(self.var[...], var)
        return y.reshape(x.shape).astype(self.dtype or x.dtype)


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


__all__ = ["DEPTH", "HEIGHT", "VOLUME", "WIDTH", "BatchNorm", "batch_norm", "conv3d", "names", "pool", "upsample"]
