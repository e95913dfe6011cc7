"""How a model's stack of identical layers is applied: one call the strategy can swap (scan, or a pipeline).

Models keep their blocks as one module whose parameters have a leading `layers` dimension and call

    x = sk.layers.apply_stack(block_fn, stacked_state, x, positions, segment_ids, remat="none")

with `block_fn(layer_state, x, *args) -> x`; `args` are per-example arrays ([batch, ...], or None) that travel
with `x`. The default kernel is a `lax.scan` (compile time independent of depth). A strategy whose `layers`
kernel table names another `layers` kernel (e.g. a pipeline schedule) gets the same call instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from shardkit import kernels
from shardkit.errors import ShardkitError

REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block in backward
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
}

BlockFn = Callable[..., jax.Array]
StackKernel = Callable[..., jax.Array]


def register_stack(name: str, fn: StackKernel, configure: Callable[[str, dict], str] | None = None) -> None:
    """A strategy with `kernels={"layers": name}` makes `apply_stack` call
    `fn(block_fn, stacked, x, *args, remat, context)`; a name may carry options after a colon ("pipeline:1f1b")."""
    kernels.register("layers", name, fn, configure=configure)


def scan_stack(
    block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """x -> block_fn(stacked[L-1], ... block_fn(stacked[0], x, *args) ..., *args) as one `lax.scan`."""

    def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return block_fn(layer, x, *args), None

    if REMAT_POLICIES[remat] is not None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    return jax.lax.scan(body, _varying_like(x, stacked), stacked)[0]


def _varying_like(carry: Any, stacked: Any) -> Any:
    """Inside shard_map (hetero_dp's per-device loop), the carry's leaves varying over every manual axis that any
    carry leaf or layer varies over: a layer mixes them, and scan needs the carry's type to be the same after it
    (the MoE GPT's (x, zeros(3)) carry: x varies over `data`, the zeros did not)."""

    def vma(a: Any) -> frozenset:
        t = jax.typeof(a)  # jax 0.12: aval.vma; jax 0.10: aval.manual_axis_type.varying
        return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))

    axes = frozenset().union(*(vma(a) for a in jax.tree.leaves((carry, stacked))))
    cast = lambda a: jax.lax.pcast(a, tuple(sorted(axes - vma(a))), to="varying") if axes - vma(a) else a
    return jax.tree.map(cast, carry) if axes else carry


register_stack("scan", scan_stack)


def unrolled_stack(
    block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """The same as `scan_stack` as L inlined layers: no per-layer dynamic slices of the weights, no stacked
    residuals written and read back by dynamic-update-slice; compile time grows with L."""
    body = lambda layer, x: block_fn(layer, x, *args)
    if REMAT_POLICIES[remat] is not None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    # one split per weight (its transpose is one concatenation), not L slices (whose transposes are L pads + adds)
    n = jax.tree.leaves(stacked)[0].shape[0]
    pieces = jax.tree.map(lambda a: [p[0] for p in jnp.split(a, n)], stacked)
    for i in range(n):
        x = body(jax.tree.map(lambda a, i=i: a[i], pieces, is_leaf=lambda a: isinstance(a, list)), x)
    return x


register_stack("unrolled", unrolled_stack)


def apply_stack(block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none") -> jax.Array:
    """Applies the L stacked layers to x with the kernel the active strategy chose (default: scan)."""
    if remat not in REMAT_POLICIES:
        raise ShardkitError(f"remat={remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
    kernel, _, ctx = kernels.active("layers")
    return kernel.fn(block_fn, stacked, x, *args, remat=remat, context=ctx)


# ------------------------------------------------------------------------------------------------------------
# Convolution and pooling slots (3D CNNs). A model builds Flax's own conv layer with the slot's function,
#
#     nnx.Conv(c_in, c_out, (3, 3, 3), conv_general_dilated=sk.layers.conv_fn(VOLUME, name="block1.conv"), ...)
#     y = sk.layers.pool(x, (2, 2, 2), axes=VOLUME, name="block1.pool")
#
# with `VOLUME = ("batch", "depth", "height", "width", "channels")` the activation's logical names, and the
# strategy's `kernels` table picks the implementation: "xla" (default: one `lax` op, sharded by GSPMD from the
# rules, which inserts the halos itself) or "halo" (explicit ppermute halo exchange). Both kernels live and register
# themselves in shardkit/parallel/spatial.py and check the split against the same constraints first, so a bad split
# is an error naming the layer.
DEFAULTS = kernels.DEFAULTS
DEFAULTS.setdefault("conv", "xla")
DEFAULTS.setdefault("pool", "xla")


@dataclasses.dataclass(frozen=True)
class ConvFn:
    """A drop-in for `lax.conv_general_dilated` (Flax's `nnx.Conv(conv_general_dilated=...)`) that runs the conv
    slot's kernel; `axes` are the logical names of the input `[batch, *spatial, channels]`, `name` the layer's."""

    axes: tuple[str | None, ...]
    name: str = "conv"

    def __call__(self, lhs: jax.Array, rhs: jax.Array, window_strides: Any, padding: Any, lhs_dilation: Any = None,
                 rhs_dilation: Any = None, dimension_numbers: Any = None, feature_group_count: int = 1,
                 batch_group_count: int = 1, precision: Any = None,
                 preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:  # fmt: skip
        if any(d != 1 for d in (lhs_dilation or ())) or batch_group_count != 1:
            raise ShardkitError(f"{self.name}: input dilation / batch groups are not supported by the conv slot")
        if len(self.axes) != lhs.ndim:
            raise ShardkitError(
                f"{self.name}: {len(self.axes)} logical names {self.axes} for an input of shape {lhs.shape}"
            )
        kernel, _, ctx = kernels.active("conv")
        more = {} if preferred_element_type is None else {"preferred_element_type": preferred_element_type}
        if out_sharding is not None:  # Flax's eager-sharding path; the kernels place their outputs themselves
            more["out_sharding"] = out_sharding
        return kernel.fn(lhs, rhs, strides=tuple(window_strides), padding=padding,
                         rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
                         feature_group_count=feature_group_count, precision=precision, axes=self.axes, name=self.name,
                         context=ctx, **more)  # fmt: skip


def conv_fn(axes: Sequence[str | None], name: str = "conv") -> ConvFn:
    """`nnx.Conv(..., conv_general_dilated=conv_fn(axes, name))`: the layer's conv runs the strategy's conv kernel."""
    return ConvFn(tuple(axes), name)


def pool(x: jax.Array, window: Sequence[int], strides: Sequence[int] | None = None, padding: Any = "VALID",
         reduce: str = "max", *, axes: Sequence[str | None], name: str = "pool") -> jax.Array:  # fmt: skip
    """[B, *S, C] -> [B, *S/stride, C] max / mean pooling by the strategy's pool kernel (strides default: window)."""
    if reduce not in ("max", "mean"):
        raise ShardkitError(f"{name}: reduce={reduce!r}; use 'max' or 'mean'")
    if len(axes) != x.ndim:
        raise ShardkitError(f"{name}: {len(axes)} logical names {tuple(axes)} for an input of shape {x.shape}")
    window = tuple(window)
    strides = window if strides is None else tuple(strides)
    kernel, _, ctx = kernels.active("pool")
    return kernel.fn(x, window=window, strides=strides, padding=padding, reduce=reduce, axes=tuple(axes), name=name,
                     context=ctx)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# BatchNorm statistics slot. "global" (default): statistics over the whole global batch, the one-device
# computation, whatever the mesh (GSPMD reduces across data and spatial shards). "group": one set per data-parallel
# group, i.e. per shard of the batch over its mesh axes (what unsynchronised data-parallel BatchNorm computes),
# still over each sample's whole volume across spatial shards; "group:G" fixes G (e.g. to emulate it on one device).
DEFAULTS.setdefault("norm", "global")


def _global_groups(batch: int, context: Any, name: str = "global") -> int:
    return 1


def _data_groups(batch: int, context: Any, name: str = "group") -> int:
    if ":" in name:
        groups = int(name.split(":", 1)[1])
    elif context is None:
        groups = 1
    else:
        batch_axes = [a for a in (context.rules.get("batch") or ()) if a in context.mesh.shape]
        groups = math.prod(context.mesh.shape[a] for a in batch_axes)
    if groups < 1 or batch % groups:
        raise ShardkitError(f"BatchNorm statistics per group: batch {batch} does not split into {groups} groups")
    return groups


kernels.register("norm", "global", _global_groups, description="BatchNorm statistics over the global batch")
kernels.register("norm", "group", _data_groups, description="BatchNorm statistics per data-parallel group")


def norm_groups(batch: int) -> int:
    """How many equal groups of the batch (in order) get their own BatchNorm statistics under the active strategy."""
    kernel, name, ctx = kernels.active("norm")
    return kernel.fn(batch, ctx, name)
