"""Layers whose training computation depends on which examples a call sees: BatchNorm and dropout.

    self.norm = sk.layers.BatchNorm(c, rngs=rngs)        # nnx.BatchNorm; statistics per the strategy's `norm` slot
    self.drop = sk.layers.Dropout(0.1, rngs=rngs)        # nnx.Dropout with one key per example

Under GSPMD a layer sees the global batch, so `nnx.BatchNorm` and `nnx.Dropout` already compute what one device
computes. A step that runs the model on a *part* of the batch inside `shard_map` (hetero_dp's per-device blocks of
uneven size: shardkit/parallel/hetero/step.py) says which part with `local_batch(rows, valid, axes)`, and these two
layers use it:

- `BatchNorm`: with `axes`, its training statistics are the sums and sums of squares over the `valid` rows, summed
  over those (mesh or vmap) axes, over the total count: the global batch's mean and variance, as one device takes
  them, however unevenly the rows are split and whatever padding a part carries. (Flax's `mask=` with `axis_name=`
  takes the mean of each part's masked mean: wrong for parts of different sizes.) Without `axes` a call's own rows
  are its batch. Under the "group" `norm` kernel (shardkit/layers.py) each data-parallel group of the batch, in
  order, gets its own statistics (`norm="group:G"`: G groups, also on one device).
- `Dropout`: example i's mask is drawn from `fold_in(key, rows[i])`, `rows` being the examples' indices in the
  global batch (0 .. B-1 without `local_batch`): the same bits however the batch is split.
Evaluation (`model.eval()`) is Flax's: running statistics, no dropout.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit import kernels
from shardkit.errors import ShardkitError


@dataclasses.dataclass(frozen=True)
class LocalBatch:
    """The part of the global batch a call sees: `rows` int[n] (its examples' global indices), `valid` (bool
    broadcastable to [n]; None: all), the mesh axes (inside shard_map) whose other members hold the rest of the
    batch, and `lanes`: the call runs under a `jax.vmap` whose other lanes hold more of it."""

    rows: jax.Array
    valid: jax.Array | None = None
    axes: tuple[str, ...] = ()
    lanes: bool = False

    @property
    def partial(self) -> bool:
        """The global batch is more than this call's rows."""
        return bool(self.axes) or self.lanes


_LOCAL: contextvars.ContextVar[LocalBatch | None] = contextvars.ContextVar("shardkit_local_batch", default=None)


@contextlib.contextmanager
def local_batch(
    rows: jax.Array, valid: jax.Array | None = None, axes: tuple[str, ...] = (), lanes: bool = False
) -> Iterator[None]:
    """While tracing: the model's calls see the global batch's `rows` (int[n]), of which `valid` count, the rest
    of the batch being on the other members of the mesh `axes` (inside shard_map) and, with `lanes`, on the other
    lanes of the `jax.vmap` the calls run under (its innermost)."""
    token = _LOCAL.set(LocalBatch(jnp.asarray(rows), valid, tuple(axes), lanes))
    try:
        yield
    finally:
        _LOCAL.reset(token)


def current_local_batch() -> LocalBatch | None:
    return _LOCAL.get()


def norm_groups(batch: int) -> int:
    """How many equal groups of the batch (in order) get their own BatchNorm statistics under the active strategy
    (the `norm` slot, whose kernels shardkit/layers.py registers)."""
    kernel, name, ctx = kernels.active("norm")
    return kernel.fn(batch, ctx, name)


@jax.custom_batching.custom_vmap
def lane_sum(x: jax.Array) -> jax.Array:
    """x -> x (same shape) summed over the lanes of the innermost `jax.vmap`, each lane getting the sum.

    `lax.psum` over a named vmap axis inside `shard_map` fails jax 0.10's varying-axes check (it casts the operand
    to vary over the vmap axis as if it were a mesh axis); this is the same reduction as a batching rule."""
    return x


@lane_sum.def_vmap
def _lane_sum_vmap(axis_size: int, in_batched: list[bool], x: jax.Array) -> tuple[jax.Array, bool]:
    if not in_batched[0]:
        return x * axis_size, False
    return jnp.broadcast_to(x.sum(0), x.shape), True


def _global_sum(x: jax.Array, local: LocalBatch) -> jax.Array:
    x = lane_sum(x) if local.lanes else x
    for axis in local.axes:
        x = jax.lax.psum(x, axis)
    return x


class BatchNorm(nnx.BatchNorm):
    """`nnx.BatchNorm` whose training statistics follow the strategy's `norm` kernel and a step's `local_batch`
    (module doc); identical to Flax's on the global batch under the default "global" kernel."""

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None) -> jax.Array:
        running = self.use_running_average if use_running_average is None else use_running_average
        if running or mask is not None:
            return super().__call__(x, use_running_average, mask=mask)
        local = current_local_batch()
        groups = norm_groups(x.shape[0])
        if groups == 1 and (local is None or not local.partial):
            return super().__call__(x, use_running_average)
        self._check_options(groups, local)
        dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        xg = x.reshape(groups, x.shape[0] // groups, *x.shape[1:]).astype(dtype)
        axes = tuple(range(1, xg.ndim - 1))
        if groups == 1 and local is not None:  # the global batch's statistics from every part's valid rows
            w = jnp.ones((x.shape[0],), dtype) if local.valid is None else jnp.broadcast_to(local.valid, x.shape[:1])
            w = w.astype(dtype).reshape(1, -1, *(1,) * (x.ndim - 1))
            count = _global_sum(w.sum() * math.prod(x.shape[1:-1]), local)
            sums = jnp.stack([(xg * w).sum(axes, keepdims=True), (xg * xg * w).sum(axes, keepdims=True)])
            sums = _global_sum(sums, local) / count  # one all-reduce of f32[2, C]
            mean, mean2 = sums[0], sums[1]
        else:
            mean, mean2 = xg.mean(axes, keepdims=True), (xg * xg).mean(axes, keepdims=True)
        var = jnp.maximum(mean2 - mean * mean, 0.0)  # Flax's fast variance
        y = (xg - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * self.scale[...].astype(dtype) + self.bias[...].astype(dtype)
        decay = lambda old, new: jax.lax.stop_gradient(
            self.momentum * old + (1 - self.momentum) * new.reshape(-1, old.shape[-1]).mean(0).astype(old.dtype)
        )
        self.mean[...], self.var[...] = decay(self.mean[...], mean), decay(self.var[...], var)
        return y.reshape(x.shape).astype(self.dtype or x.dtype)

    def _check_options(self, groups: int, local: Any) -> None:
        """The options this layer's own statistics implement; the others are refused, not ignored."""
        defaults = {"axis": -1, "use_scale": True, "use_bias": True, "axis_name": None, "use_fast_variance": True}
        bad = {k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v and (k, v) != ("axis", -1)}
        if self.axis not in (-1, (-1,)):
            bad["axis"] = self.axis
        if bad:
            where = f"norm=group:{groups}" if groups > 1 else "a step that runs the model on parts of the batch"
            given = ", ".join(f"{k}={v!r}" for k, v in bad.items())
            raise ShardkitError(
                f"sk.layers.BatchNorm({given}): under {where} its statistics support Flax's defaults for these "
                "(features last, scale and bias, fast variance, no axis_name: the step reduces over its own axes); "
                "drop these options"
            )


class Dropout(nnx.Dropout):
    """`nnx.Dropout` drawing example i's mask from `fold_in(key, i)` (i: its index in the global batch, from the
    step's `local_batch`), so that the masks do not depend on how the batch is split (module doc)."""

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None, rngs: Any = None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if self.rate == 0.0 or deterministic or self.rate == 1.0 or 0 in self.broadcast_dims:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        stream = self.rngs if rngs is None else rngs
        if stream is None:  # Flax's error: no key
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        if isinstance(stream, jax.Array):
            key = stream
        else:
            key = stream[self.rng_collection]() if isinstance(stream, nnx.Rngs) else stream()
        local = current_local_batch()
        rows = jnp.arange(inputs.shape[0]) if local is None else local.rows
        if rows.shape[0] != inputs.shape[0]:
            raise ShardkitError(
                f"sk.layers.Dropout: input {inputs.shape} does not start with the batch's {rows.shape[0]} examples "
                "this call sees; apply it to [batch, ...] activations (or use nnx.Dropout outside hetero_dp)"
            )
        keep = 1.0 - self.rate
        shape = [1 if d in self.broadcast_dims else n for d, n in enumerate(inputs.shape)][1:]
        masks = jax.vmap(lambda r: jax.random.bernoulli(jax.random.fold_in(key, r), keep, shape))(rows)
        return jax.lax.select(jnp.broadcast_to(masks, inputs.shape), inputs / keep, jnp.zeros_like(inputs))


__all__ = ["BatchNorm", "Dropout", "LocalBatch", "current_local_batch", "lane_sum", "local_batch", "norm_groups"]
