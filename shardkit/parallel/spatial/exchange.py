"""Spatial parallelism for 3D CNNs: each sample split over depth / height / width, halos exchanged per layer.

Oyama, Maruyama, Dryden et al., "The Case for Strong Scaling in Deep Learning: Training Large 3D CNNs with
Hybrid Parallelism" (IEEE TPDS 2021, arXiv 2007.12856) and Dryden et al. (IPDPS'19 / SC'19, LBANN's DistConv):
a sample too large for one device (CosmoFlow at 512^3) is split over its spatial dimensions, the batch over
`data`. A convolution needs, at each shard's faces, the few planes its neighbours hold (the *halo*):

    low halo  = pad                               (planes from the previous shard; the first gets padding)
    high halo = max(0, k_dilated - stride - pad)  (planes from the next shard; the last gets padding)

per split dimension, the local extent divisible by the stride. k=3, s=1 -> (1, 1); k=5 -> (2, 2); k=3, s=2,
"SAME" on an even extent pads (0, 1) -> (0, 1); 2^3 / stride-2 pooling -> none. The kernels here exchange exactly
these faces with `ppermute`, one split dimension after another (so corners arrive with the second exchange), then
run `lax.conv_general_dilated` / `lax.reduce_window` with no padding on the split dimensions. The backward pass is
the autodiff of the exchange (the transposed permutes send the halo gradients back and add them); the weight
gradient is one all-reduce over every mesh axis (data x spatial), inserted by `shard_map` for the replicated
weight. Bytes per device per direction of one exchange: local batch x halo x the face's other local extents x
channels x dtype bytes (`halo_bytes`).

    y = sk.spatial.conv(x, w, mesh=mesh, spatial_axes=("space", None, None), strides=(1, 1, 1), padding="SAME")
    y = sk.spatial.pool(x, window=(2, 2, 2), strides=(2, 2, 2), mesh=mesh, spatial_axes=("space", None, None))

x is `[batch, *spatial, channels]` (1 to 3 spatial dimensions), w `[*kernel, C_in, C_out]`, both global arrays;
`padding`, `strides` and `rhs_dilation` mean what they mean in `lax.conv_general_dilated` / `lax.reduce_window`.
The same kernels fill the `conv` and `pool` slots (`sk.layers.conv_fn` / `sk.layers.pool`, shardkit/layers.py)
under the name "halo", where the spatial mesh axes come from the strategy's rules for `depth`, `height`, `width`.
Every shape problem (a split that does not divide the volume at some layer, a halo larger than the local
extent, ...) is a `ShardkitError` naming the layer, before XLA sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardkit import kernels
from shardkit.errors import ShardkitError

Pads = tuple[tuple[int, int], ...]
SpatialAxes = tuple[str | None, ...]
#: Logical names of a volume's spatial dimensions, in the order of `[batch, depth, height, width, channels]`.
SPATIAL_NAMES = ("depth", "height", "width")


def halo(kernel: int, stride: int, pad_low: int, dilation: int = 1) -> tuple[int, int]:
    """(low, high) planes one shard needs from its neighbours for a window of `kernel` (DistConv's rule)."""
    kd = dilation * (kernel - 1) + 1
    return pad_low, max(0, kd - stride - pad_low)


def _tuple(v: int | Sequence[int] | None, n: int, what: str, default: int = 1) -> tuple[int, ...]:
    if v is None:
        return (default,) * n
    if isinstance(v, int):
        return (v,) * n
    v = tuple(int(a) for a in v)
    if len(v) != n:
        raise ShardkitError(f"{what}={v} has {len(v)} entries for {n} spatial dimensions")
    return v


def resolve_padding(
    padding: str | Sequence[tuple[int, int]], extents: Sequence[int], window: Sequence[int], strides: Sequence[int],
    dilation: Sequence[int],
) -> Pads:  # fmt: skip
    """'SAME' / 'VALID' / explicit pairs -> one (low, high) pair per spatial dimension, as lax computes them."""
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise ShardkitError(f"padding={padding!r}: use 'SAME', 'VALID' or one (low, high) pair per dimension")
        kd = [d * (k - 1) + 1 for k, d in zip(window, dilation, strict=True)]
        return tuple(tuple(p) for p in lax.padtype_to_pads(tuple(extents), kd, tuple(strides), padding.upper()))
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    if len(pads) != len(extents):
        raise ShardkitError(f"padding={padding} has {len(pads)} pairs for {len(extents)} spatial dimensions")
    return pads


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layer's split, checked: per spatial dimension the mesh axis (or None), its degree, pads and halo."""

    name: str
    axes: SpatialAxes
    degrees: tuple[int, ...]
    window: tuple[int, ...]
    strides: tuple[int, ...]
    dilation: tuple[int, ...]
    pads: Pads  # global padding per dimension
    halos: Pads  # (low, high) exchanged planes per dimension ((0, 0) where not split)

    def local_pads(self) -> Pads:
        """Padding the local op applies: none on split dimensions (the halo took its place), the global elsewhere."""
        return tuple((0, 0) if n > 1 else p for n, p in zip(self.degrees, self.pads, strict=True))


def plan_layer(
    name: str, shape: Sequence[int], window: Sequence[int], strides: Sequence[int], dilation: Sequence[int],
    padding: str | Sequence[tuple[int, int]], axes: SpatialAxes, mesh: Mesh, *, op: str = "conv",
) -> Plan:  # fmt: skip
    """Checks one layer's split against DistConv's constraints; ShardkitError naming the layer otherwise.

    `shape` is the global input `[batch, *spatial, channels]`. Per split dimension (extent n over d devices):
    n divisible by d; the local extent n/d divisible by the stride; an even window only with stride = window;
    padding 0 or the window's radius on each side; the output extent exactly n/stride (so the shards' outputs
    tile the output: "VALID" with a window larger than its stride shrinks the volume and cannot be split evenly);
    "SAME" is accepted whatever pads it computes (k=5, s=2 pads (1, 2): the halo rule holds for them too);
    and each halo no larger than the local extent (halos come from direct neighbours only).
    """
    nsp = len(shape) - 2
    if nsp < 1 or len(axes) != nsp:
        raise ShardkitError(
            f"{name}: input of shape {tuple(shape)} with spatial_axes={tuple(axes)}: x must be [batch, *spatial, "
            f"channels] with one entry of spatial_axes (a mesh axis or None) per spatial dimension"
        )
    window, strides, dilation = (_tuple(v, nsp, w) for v, w in ((window, "window"), (strides, "strides"),
                                                                 (dilation, "rhs_dilation")))  # fmt: skip
    pads = resolve_padding(padding, shape[1:-1], window, strides, dilation)
    degrees, halos = [], []
    for dim, axis in enumerate(axes):
        what = f"{name} ({op} window {window[dim]}, stride {strides[dim]}, padding {pads[dim]}) on spatial dim {dim}"
        if axis is None:
            degrees.append(1)
            halos.append((0, 0))
            continue
        if axis not in mesh.shape:
            raise ShardkitError(f"{what}: mesh axis {axis!r} is not in the mesh {dict(mesh.shape)}")
        d, n, k, s, (lo, hi) = mesh.shape[axis], shape[1 + dim], window[dim], strides[dim], pads[dim]
        kd = dilation[dim] * (k - 1) + 1
        degrees.append(d)
        if d == 1:
            halos.append((0, 0))
            continue
        if n % d:
            raise ShardkitError(
                f"{what}: the volume's extent there is {n}, not divisible by mesh axis {axis!r} of size {d}; "
                f"use an input extent that stays divisible by {d} down to this layer, a smaller {axis!r}, or stop "
                "splitting spatially before this layer (LBANN does so once the extent reaches the group size)"
            )
        local = n // d
        if local % s:
            raise ShardkitError(
                f"{what}: local extent {local} (= {n} / {d}) is not divisible by the stride {s}; shards would start "
                "their windows at different phases. Use extents divisible by stride x degree"
            )
        if k % 2 == 0 and s != k:
            raise ShardkitError(
                f"{what}: an even window ({k}) splits only with stride = window (non-overlapping, as 2^3 pooling); "
                "use an odd window or stride = window"
            )
        radius = (kd - 1) // 2
        if not isinstance(padding, str) and (lo not in (0, radius) or hi not in (0, radius)):
            raise ShardkitError(
                f"{what}: padding {pads[dim]} on a split dimension must be 0 or the window's radius {radius} on "
                "each side (DistConv's rule); use 'SAME'"
            )
        out = (n + lo + hi - kd) // s + 1
        if out != n // s:
            raise ShardkitError(
                f"{what}: the output extent {out} is not extent / stride = {n // s}, so the shards' outputs would not "
                "tile it evenly; use 'SAME' padding on split dimensions"
            )
        h = halo(k, s, lo, dilation[dim])
        if max(h) > local:
            raise ShardkitError(
                f"{what}: the halo {h} is larger than the local extent {local} (= {n} / {d}); halos come from "
                f"direct neighbours only. Use a smaller {axis!r} degree or a larger volume"
            )
        halos.append(h)
    return Plan(name, tuple(axes), tuple(degrees), window, strides, dilation, pads, tuple(halos))


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One traced layer's halo exchange (forward): what `recording()` collects."""

    name: str
    op: str
    plan: Plan
    sends: tuple[tuple[str, int], ...]  # (mesh axis, bytes) per collective-permute, per device (halo_bytes)
    backward: bool = True  # the input's gradient is computed (not for a network's first layer: its input is data)

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.sends)


@contextlib.contextmanager
def recording() -> Iterator[list[Exchange]]:
    """Collects an `Exchange` for every halo conv / pool traced in this block: the cost model's halo bytes (the
    halo kernels' part of what `sk.kernels.recording()` collects for `sk.explain`).

    with sk.spatial.recording() as layers:
        step.lower(state, batch)
    forward = sum(e.bytes for e in layers)   # per device; the backward pass sends the same again
    """
    found: list[Exchange] = []
    with kernels.recording() as calls:
        try:
            yield found
        finally:
            found += [c.detail for c in calls if isinstance(c.detail, Exchange)]


def _differentiated(x: Any) -> bool:
    """Whether `x` is being differentiated (a JVP tracer): only then does the backward pass exchange its halos."""
    try:  # internal, present in jax 0.10-0.12: forward-mode and linearize (what grad uses) tracers
        from jax._src.interpreters.ad import JVPTracer, LinearizeTracer
    except ImportError:  # pragma: no cover - a future jax: assume the gradient is needed
        return True
    return isinstance(x, JVPTracer | LinearizeTracer)


def _record(op: str, plan: Plan, x: jax.Array, batch_degree: int) -> None:
    """Reports the exchange to `sk.kernels.recording()` (what `sk.explain` and `recording()` read)."""
    if kernels.is_recording():
        sends = tuple(halo_bytes(plan, x.shape, batch_degree, x.dtype.itemsize))
        exchange = Exchange(plan.name, op, plan, sends, _differentiated(x))
        kernels.record(kernels.Traced(op, plan.name, "collective-permute", sends, exchange.backward,
                                      "shardkit.parallel.spatial.halo_bytes", exchange))  # fmt: skip


def _exchange(x: jax.Array, dim: int, axis: str, size: int, low: int, high: int, fill: float) -> jax.Array:
    """[.., n, ..] -> [.., low + n + high, ..] along `dim`: the previous shard's last `low` planes in front, the
    next one's first `high` behind; the edge shards get `fill` (the padding value) where no neighbour is."""
    parts = []
    if low:
        tail = lax.slice_in_dim(x, x.shape[dim] - low, x.shape[dim], axis=dim)
        recv = lax.ppermute(tail, axis, [(i, i + 1) for i in range(size - 1)])  # shard 0 receives zeros
        if fill != 0:
            recv = jnp.where(lax.axis_index(axis) == 0, jnp.asarray(fill, x.dtype), recv)
        parts.append(recv)
    parts.append(x)
    if high:
        head = lax.slice_in_dim(x, 0, high, axis=dim)
        recv = lax.ppermute(head, axis, [(i + 1, i) for i in range(size - 1)])  # the last shard receives zeros
        if fill != 0:
            recv = jnp.where(lax.axis_index(axis) == size - 1, jnp.asarray(fill, x.dtype), recv)
        parts.append(recv)
    return lax.concatenate(parts, dim) if len(parts) > 1 else x


def _with_halos(x: jax.Array, plan: Plan, fill: float) -> jax.Array:
    for dim, (axis, d, (lo, hi)) in enumerate(zip(plan.axes, plan.degrees, plan.halos, strict=True)):
        if d > 1 and (lo or hi):
            x = _exchange(x, 1 + dim, axis, d, lo, hi, fill)
    return x


def _batch_axes(mesh: Mesh, axes: SpatialAxes, batch_axes: Sequence[str] | str | None, batch: int) -> tuple[str, ...]:
    if batch_axes is None:
        batch_axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape and a not in axes)
    elif isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    batch_axes = tuple(batch_axes)
    clash = [a for a in batch_axes if a in axes or a not in mesh.shape]
    if clash:
        raise ShardkitError(
            f"batch_axes={batch_axes}: {clash[0]!r} is a spatial axis or not in the mesh {dict(mesh.shape)}"
        )
    degree = math.prod(mesh.shape[a] for a in batch_axes)
    if batch % degree:
        raise ShardkitError(
            f"batch {batch} is not divisible by the batch mesh axes {batch_axes} (size {degree}); pass batch_axes=() "
            "to keep the batch whole, or a batch divisible by them"
        )
    return batch_axes


def _spec(batch_axes: tuple[str, ...], axes: SpatialAxes) -> P:
    b = None if not batch_axes else batch_axes[0] if len(batch_axes) == 1 else batch_axes
    return P(b, *axes, None)


def _dims(nsp: int) -> tuple[str, str, str]:
    s = "DHW"[3 - nsp :] if nsp <= 3 else None
    if s is None:
        raise ShardkitError(f"{nsp} spatial dimensions: sk.spatial supports 1 to 3")
    return f"N{s}C", f"{s}IO", f"N{s}C"


def conv(
    x: jax.Array, w: jax.Array, *, mesh: Mesh, spatial_axes: Sequence[str | None],
    strides: int | Sequence[int] = 1, padding: str | Sequence[tuple[int, int]] = "SAME",
    rhs_dilation: int | Sequence[int] | None = None, batch_axes: Sequence[str] | str | None = None,
    feature_group_count: int = 1, precision: Any = None, name: str = "conv",
) -> jax.Array:  # fmt: skip
    """[B, *S, Cin] x [*K, Cin, Cout] -> [B, *S/stride, Cout]: the conv with halos exchanged over `spatial_axes`.

    Equals `lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=...)` (NDHWC / DHWIO) on one device.
    `batch_axes` (default: `data` / `fsdp` when in the mesh and not spatial) shard the batch; channels are whole.
    """
    nsp = x.ndim - 2
    if w.ndim != x.ndim or w.shape[-2] * feature_group_count != x.shape[-1]:
        raise ShardkitError(f"{name}: kernel {w.shape} does not fit input {x.shape} ([*kernel, C_in, C_out] expected)")
    axes = tuple(spatial_axes)
    plan = plan_layer(name, x.shape, w.shape[:nsp], _tuple(strides, nsp, "strides"),
                      _tuple(rhs_dilation, nsp, "rhs_dilation"), padding, axes, mesh)  # fmt: skip
    baxes = _batch_axes(mesh, axes, batch_axes, x.shape[0])
    _record("conv", plan, x, math.prod(mesh.shape[a] for a in baxes))
    dn = _dims(nsp)

    def body(x: jax.Array, w: jax.Array) -> jax.Array:
        x = _with_halos(x, plan, 0.0)
        return lax.conv_general_dilated(
            x, w, plan.strides, plan.local_pads(), rhs_dilation=plan.dilation, dimension_numbers=dn,
            feature_group_count=feature_group_count, precision=precision,
        )  # fmt: skip

    spec = _spec(baxes, axes)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False)(x, w)


def pool(
    x: jax.Array, *, window: int | Sequence[int], strides: int | Sequence[int] | None = None, mesh: Mesh,
    spatial_axes: Sequence[str | None], reduce: str = "max", padding: str | Sequence[tuple[int, int]] = "VALID",
    batch_axes: Sequence[str] | str | None = None, name: str = "pool",
) -> jax.Array:  # fmt: skip
    """[B, *S, C] -> [B, *S/stride, C]: max or mean pooling with halos exchanged over `spatial_axes`.

    Equals `lax.reduce_window` on one device; "mean" divides each window's sum by the window's size (padding
    counts as zeros, Flax's `avg_pool` default `count_include_pad=True`). `strides` default to the window.
    """
    nsp = x.ndim - 2
    if reduce not in ("max", "mean"):
        raise ShardkitError(f"{name}: reduce={reduce!r}; use 'max' or 'mean'")
    window = _tuple(window, nsp, "window")
    strides = window if strides is None else _tuple(strides, nsp, "strides")
    axes = tuple(spatial_axes)
    plan = plan_layer(name, x.shape, window, strides, (1,) * nsp, padding, axes, mesh, op=f"{reduce} pool")
    baxes = _batch_axes(mesh, axes, batch_axes, x.shape[0])
    _record(f"{reduce} pool", plan, x, math.prod(mesh.shape[a] for a in baxes))
    fill = -jnp.inf if reduce == "max" else 0.0

    def body(x: jax.Array) -> jax.Array:
        return _reduce_window(_with_halos(x, plan, fill), plan.window, plan.strides, plan.local_pads(), reduce)

    spec = _spec(baxes, axes)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)(x)


def _reduce_window(x: jax.Array, window: Sequence[int], strides: Sequence[int], pads: Pads, reduce: str) -> jax.Array:
    """The one-device pooling both kernels and the default `pool` slot share."""
    dims, strides, pads = (1, *window, 1), (1, *strides, 1), ((0, 0), *pads, (0, 0))
    if reduce == "max":
        return lax.reduce_window(x, -jnp.inf, lax.max, dims, strides, pads)
    return lax.reduce_window(x, 0.0, lax.add, dims, strides, pads) / math.prod(window)


def halo_bytes(plan: Plan, shape: Sequence[int], batch_degree: int, itemsize: int) -> list[tuple[str, int]]:
    """Per device, one entry per collective-permute the forward exchange issues: (mesh axis, bytes sent).

    The face of dimension `dim` after the earlier dimensions' exchanges has the others' local extents, the
    already-exchanged ones grown by their halos (the corners travel with the later exchange)."""
    local = [n // d for n, d in zip(shape[1:-1], plan.degrees, strict=True)]
    out = []
    for dim, (axis, d, (lo, hi)) in enumerate(zip(plan.axes, plan.degrees, plan.halos, strict=True)):
        if d <= 1:
            continue
        face = (shape[0] // batch_degree) * math.prod(e for i, e in enumerate(local) if i != dim) * shape[-1] * itemsize
        out += [(axis, lo * face)] * bool(lo) + [(axis, hi * face)] * bool(hi)
        local[dim] += lo + hi
    return out


__all__ = ["SPATIAL_NAMES", "Exchange", "Plan", "conv", "halo", "halo_bytes", "plan_layer", "pool", "recording",
           "resolve_padding"]  # fmt: skip
