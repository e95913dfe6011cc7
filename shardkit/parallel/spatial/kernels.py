"""The conv and pool slots' kernels of spatial parallelism, and the spatial* strategies that pick them.

`sk.layers.conv_fn` / `sk.layers.pool` (shardkit/layers.py) call the active strategy's kernel: "xla" (one lax op,
GSPMD partitions it and inserts the halos) or "halo" (spatial.py's explicit ppermute exchange, then a local op).
Both check the split against `spatial.plan_layer` first, so a volume the mesh cannot split is a `ShardkitError`
naming the layer. The spatial mesh axes come from the compute rules for `depth`, `height`, `width`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from shardkit import kernels
from shardkit.errors import ShardkitError
from shardkit.parallel.spatial.exchange import _reduce_window, conv, plan_layer, pool, resolve_padding
from shardkit.strategies import Strategy, register_strategy, table


def _mesh_axes(context: Any, axes: Sequence[str | None], name: str) -> tuple[tuple[str | None, ...], tuple[str, ...]]:
    """(mesh axis per spatial dimension, batch mesh axes) of an activation named `axes` = (batch, *spatial,
    channels) under the active compute rules; a spatial dimension split over several mesh axes is an error."""
    resolve = lambda logical: tuple(a for a in (context.rules.get(logical) or ()) if a in context.mesh.shape)
    spatial = []
    for logical in axes[1:-1]:
        found = resolve(logical) if logical else ()
        if len(found) > 1:
            raise ShardkitError(
                f"{name}: {logical!r} maps to mesh axes {found}; a spatial dimension splits over one mesh axis "
                "(e.g. space / space_h / space_w)"
            )
        spatial.append(found[0] if found else None)
    return tuple(spatial), resolve(axes[0]) if axes[0] else ()


def _split_plan(x: jax.Array, window: Any, strides: Any, dilation: Any, padding: Any, axes: Any, name: str,
                context: Any, op: str) -> Any:  # fmt: skip
    """The checked split of a conv / pool (this module's constraints), None if nothing is split."""
    if context is None:
        return None
    spatial_axes, _ = _mesh_axes(context, axes, name)
    if not any(spatial_axes):
        return None
    return plan_layer(name, x.shape, window, strides, dilation, padding, spatial_axes, context.mesh, op=op)


def xla_conv_kernel(x: jax.Array, w: jax.Array, *, strides: Any, padding: Any, rhs_dilation: Any,
                    feature_group_count: int, precision: Any, axes: Any, name: str, context: Any,
                    **more: Any) -> jax.Array:  # fmt: skip
    """The conv as one `lax.conv_general_dilated`; GSPMD partitions it (and inserts halos) from the rules."""
    nsp = x.ndim - 2
    _split_plan(x, w.shape[:nsp], strides, rhs_dilation or 1, padding, axes, name, context, "conv")
    spatial = "DHW"[3 - nsp :]
    return jax.lax.conv_general_dilated(
        x, w, strides, padding, rhs_dilation=rhs_dilation, dimension_numbers=(f"N{spatial}C", f"{spatial}IO",
        f"N{spatial}C"), feature_group_count=feature_group_count, precision=precision, **more,
    )  # fmt: skip


def xla_pool_kernel(x: jax.Array, *, window: Any, strides: Any, padding: Any, reduce: str, axes: Any, name: str,
                    context: Any) -> jax.Array:  # fmt: skip
    """Pooling as one `lax.reduce_window`, partitioned by GSPMD. Refuses a *max* pool with overlapping windows on
    a split dimension: XLA:CPU's GSPMD gets its gradient wrong (docs/jax_pitfalls.md §13); the halo kernel is exact."""
    plan = _split_plan(x, window, strides, 1, padding, axes, name, context, f"{reduce} pool")
    if plan is not None and reduce == "max":
        bad = [d for d, (n, k, s) in enumerate(zip(plan.degrees, plan.window, plan.strides, strict=True))
               if n > 1 and k > s]  # fmt: skip
        if bad:
            raise ShardkitError(
                f"{name}: a max pool with overlapping windows (window {plan.window}, stride {plan.strides}) on split "
                f"spatial dim {bad[0]}: GSPMD's gradient of it is wrong on XLA:CPU (jax 0.10); use the halo kernel "
                "(kernels={'conv': 'halo', 'pool': 'halo'}) or non-overlapping windows"
            )
    pads = resolve_padding(padding, x.shape[1:-1], window, strides, (1,) * len(window))
    return _reduce_window(x, window, strides, pads, reduce)


def halo_conv_kernel(x: jax.Array, w: jax.Array, *, strides: Any, padding: Any, rhs_dilation: Any,
                     feature_group_count: int, precision: Any, axes: Any, name: str, context: Any,
                     **more: Any) -> jax.Array:  # fmt: skip
    """`sk.spatial.conv` over the mesh axes the rules give depth / height / width (xla_conv_kernel if none)."""
    spatial_axes, batch = _mesh_axes(context, axes, name) if context is not None else ((), ())
    if not any(spatial_axes):
        return xla_conv_kernel(x, w, strides=strides, padding=padding, rhs_dilation=rhs_dilation,
                               feature_group_count=feature_group_count, precision=precision, axes=axes, name=name,
                               context=context, **more)  # fmt: skip
    if axes[-1] and context.rules.get(axes[-1]):
        raise ShardkitError(
            f"{name}: the halo conv keeps channels whole, but {axes[-1]!r} maps to {context.rules[axes[-1]]}; "
            "replicate it in the compute rules, or use the GSPMD conv kernel (kernels={'conv': 'xla'})"
        )
    return conv(x, w, mesh=context.mesh, spatial_axes=spatial_axes, strides=strides, padding=padding,
                        rhs_dilation=rhs_dilation, batch_axes=batch, feature_group_count=feature_group_count,
                        precision=precision, name=name)  # fmt: skip


def halo_pool_kernel(x: jax.Array, *, window: Any, strides: Any, padding: Any, reduce: str, axes: Any, name: str,
                     context: Any) -> jax.Array:  # fmt: skip
    """`sk.spatial.pool` over the mesh axes the rules give depth / height / width (one reduce_window if none)."""
    spatial_axes, batch = _mesh_axes(context, axes, name) if context is not None else ((), ())
    if not any(spatial_axes):
        return xla_pool_kernel(x, window=window, strides=strides, padding=padding, reduce=reduce, axes=axes,
                               name=name, context=context)  # fmt: skip
    return pool(x, window=window, strides=strides, mesh=context.mesh, spatial_axes=spatial_axes,
                        reduce=reduce, padding=padding, batch_axes=batch, name=name)  # fmt: skip


kernels.register("conv", "xla", xla_conv_kernel, description="one lax conv, partitioned by GSPMD")
kernels.register("pool", "xla", xla_pool_kernel, description="one lax.reduce_window, partitioned by GSPMD")
kernels.register("conv", "halo", halo_conv_kernel, description="explicit halo exchange (ppermute) + local conv")
kernels.register("pool", "halo", halo_pool_kernel, description="explicit halo exchange (ppermute) + local pool")


# ------------------------------------------------------------------------------------------------------------
# Spatial + data parallelism for 3D CNNs (Oyama et al. 2007.12856; shardkit/parallel/spatial/exchange.py): each sample's
# depth / height / width over space / space_h / space_w (whichever the mesh has), the batch over data; weights
# replicated, their gradients all-reduced over every axis. "xla": GSPMD partitions the convs and inserts the
# halos; "halo": the explicit ppermute halo-exchange kernels fill the conv and pool slots.
_SPATIAL = {"depth": "space", "height": "space_h", "width": "space_w"}
for _name, _required, _kernel, _what in (
    ("spatial", ("space",), "xla", "GSPMD inserts the halos"),
    ("spatial_dp", ("data", "space"), "xla", "GSPMD inserts the halos"),
    ("spatial_halo", ("space",), "halo", "explicit ppermute halo exchange per conv / pool"),
    ("spatial_dp_halo", ("data", "space"), "halo", "explicit ppermute halo exchange per conv / pool"),
):
    register_strategy(
        Strategy(
            _name,
            table(),
            table(batch="data", **_SPATIAL),
            required_axes=_required,
            kernels={"conv": _kernel, "pool": _kernel},
            description=f"3D CNNs: each sample split over depth / height / width (space, space_h, space_w), batch "
            f"over data; {_what}",
            collectives="per conv: halo collective-permutes over each split axis (fwd and bwd); one all-reduce of "
            "the weight gradient over data x space axes",
        )
    )
