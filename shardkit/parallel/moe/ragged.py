"""Dropless mixture of experts over grouped tokens: the `moe` kernel `ragged` and `grouped_dot` (MegaBlocks, Gale et
al., MLSys 2023, arXiv 2211.15841).

The routed (token, choice) pairs are sorted by expert, each expert's MLP runs on its contiguous group through the
model's `grouped_fn(params, xs, sizes)` (the GPT's calls `grouped_dot`), and the pairs are unsorted and combined
with the gates: no capacity, no drop. `shardkit/parallel/moe/routing.py` routes (`route(..., cap=None)`) and dispatches
to this kernel through `apply`; under expert parallelism the pairs are exchanged in a fixed buffer (`_ragged`
states the bound).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardkit import kernels
from shardkit.errors import ShardkitError
from shardkit.rules import platform_family

#: (expert params with a leading E dim, tokens [N, M] sorted by expert, group sizes int32[E]) -> [N, M]; rows past
#: sum(sizes) are padding (their output is not read)
GroupedFn = Callable[[Any, jax.Array, jax.Array], jax.Array]
#: the ragged kernel's default bound on the expert-parallel exchange buffer (`_ragged`)
RAGGED_PADDING = 2.0


def _ragged_padding(name: str) -> float:
    """The padding factor of `ragged:<factor>` (RAGGED_PADDING for plain `ragged`)."""
    opts = name.split(":")[1:]
    if not opts:
        return RAGGED_PADDING
    try:
        factor = float(opts[0])
    except ValueError:
        factor = 0.0
    if len(opts) > 1 or not factor > 0:
        raise ShardkitError(f"moe kernel {name!r}: ragged or ragged:<padding factor > 0>, e.g. ragged:2")
    return factor


#: grouped_dot's default tile on the tiled path (rows per batched-matmul tile; module doc of `grouped_dot`)
TILE = 16


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiles_dot(xt: jax.Array, w: jax.Array, tile_group: jax.Array, preferred_element_type: Any) -> jax.Array:
    """Tiles [T, tile, K] times their experts' weights w[tile_group] [T, K, F] -> [T, tile, F]. A custom VJP, so
    that the backward regathers w instead of saving the gathered [T, K, F] as a residual, and sums the per-tile
    weight gradients by expert with a sorted segment sum."""
    wt = jnp.take(w, tile_group, axis=0)
    return jnp.einsum("tik,tkf->tif", xt, wt, preferred_element_type=preferred_element_type)


def _tiles_dot_fwd(xt: jax.Array, w: jax.Array, tile_group: jax.Array, preferred_element_type: Any) -> tuple:
    return _tiles_dot(xt, w, tile_group, preferred_element_type), (xt, w, tile_group)


def _tiles_dot_bwd(preferred_element_type: Any, res: tuple, dy: jax.Array) -> tuple:
    xt, w, tile_group = res
    dxt = jnp.einsum("tif,tkf->tik", dy, jnp.take(w, tile_group, axis=0).astype(dy.dtype)).astype(xt.dtype)
    dwt = jnp.einsum("tik,tif->tkf", xt.astype(dy.dtype), dy)
    dw = jax.ops.segment_sum(dwt, tile_group, num_segments=w.shape[0], indices_are_sorted=True)
    return dxt, dw.astype(w.dtype), None


_tiles_dot.defvjp(_tiles_dot_fwd, _tiles_dot_bwd)


def grouped_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int | None = None,
                method: str | None = None, preferred_element_type: Any = None) -> jax.Array:  # fmt: skip
    """x [N, K] (rows sorted by group), w [E, K, F], group_sizes int32[E] -> [N, F]: row i of group e is x_i @ w_e,
    as `jax.lax.ragged_dot(x, w, group_sizes)`. sum(group_sizes) <= N; the rows past the sum are padding, and
    their output is 0.

    method "ragged_dot": `jax.lax.ragged_dot`, a grouped matmul on XLA:GPU / TPU, but in jax 0.10 lowered on CPU
    to a masked dense dot over all E groups (E x the routed FLOPs). method "tiled" (MegaBlocks' block-sparse
    matmul, Gale et al. 2211.15841, with gathers instead of a kernel): each group is padded to a multiple of
    `tile` rows in a static buffer of T = (N + E (tile - 1)) // tile tiles (the padding is at most E (tile - 1)
    rows, so T tiles always hold it: sum_e ceil(s_e / tile) <= (N + E (tile - 1)) / tile), each tile's expert
    taken from the cumulative padded sizes, and one batched matmul [T, tile, K] x [T, K, F]. Its compiled FLOPs
    are 2 T tile K F <= 2 (N + E (tile - 1)) K F: the N rows' plus at most E (tile - 1) rows of padding (within
    10% when N >= 10 E (tile - 1)); XLA's cost analysis adds about one per gathered element, T K F for the
    weights (1 / (2 tile) of the matmul). Default: "tiled" when the mesh's devices are CPUs (or `tile` is given),
    else "ragged_dot" (`rules.platform_family`: a TPU target compiled from a CPU host gets ragged_dot).

    The trade: the tiles' weights are gathered into [T, K, F], about (N / tile + E) K F elements, F / tile x the
    activations' N K (and the weight gradient forms as many per-tile products before their scatter-add into [E, K,
    F]), where a grouped-matmul kernel reads each expert's weights once. A larger tile divides those bytes and
    allows more padding. TILE = 16: at most 15 E padding rows (within 10% once N >= 150 E). Measured on 2 shared CPU
    cores, forward + backward: at N 512, K 64, F 128, E 8 tiles of 8 / 16 / 32 / 64 took 2.1 / 1.9 / 2.7 / 1.9 ms
    (ragged_dot 5.6 ms, 7x the FLOPs); at N 4096, K 128, F 256, E 8 147 / 81 / 55 / 40 ms and 0.43 / 0.26 / 0.18 /
    0.14 GB accessed (ragged_dot 144 ms): pass a larger tile when N >> E tile. A `lax.scan` over the tiles reading
    w[e] in place avoids the forward's gather, but autodiff saves every tile's weight slice as a residual (the same
    T K F), XLA's cost analysis counts a loop body once, and it measured no faster. The tiles' matmul has a custom
    VJP (reverse mode only, as used by training) that regathers the weights rather than keep [T, K, F] for the
    backward, and sums the per-tile weight gradients by expert (a sorted segment sum); the gradient of x flows
    through the row gathers (scatter-adds)."""
    if method is None:
        method = "tiled" if tile is not None or platform_family() == "cpu" else "ragged_dot"  # the mesh's devices
    if method == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type)
    if method != "tiled":
        raise ShardkitError(f"grouped_dot method {method!r}: 'tiled' or 'ragged_dot'")
    t = TILE if tile is None else tile
    if t < 1:
        raise ShardkitError(f"grouped_dot tile {t}: at least 1 row")
    (n, k), (e, _, f) = x.shape, w.shape
    n_tiles = max(1, (n + e * (t - 1)) // t)
    sizes = group_sizes.astype(jnp.int32)
    per = (sizes + t - 1) // t  # tiles of each group
    tile_end = jnp.cumsum(per)
    pad_start = (tile_end - per) * t  # first buffer row of each group
    end = jnp.cumsum(sizes)
    start = end - sizes  # first row of x of each group
    # tile j's group: the groups whose tiles end at or before j (empty groups end where the previous one does);
    # tiles past the last group's are padding (group E, clipped: their rows are all masked below)
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), e - 1)
    row_group = jnp.repeat(tile_group, t, total_repeat_length=n_tiles * t)
    offset = jnp.arange(n_tiles * t) - jnp.take(pad_start, row_group)
    valid = offset < jnp.take(sizes, row_group)
    src = jnp.where(valid, jnp.take(start, row_group) + offset, 0)
    xt = jnp.where(valid[:, None], jnp.take(x, src, axis=0), 0)  # [T tile, K]: groups padded to whole tiles
    yt = _tiles_dot(xt.reshape(n_tiles, t, k), w, tile_group, preferred_element_type).reshape(n_tiles * t, f)
    group = jnp.sum(jnp.arange(n)[:, None] >= end, axis=1)  # each row's group; E past sum(sizes)
    routed = group < e
    group = jnp.minimum(group, e - 1)
    dest = jnp.where(routed, jnp.take(pad_start, group) + jnp.arange(n) - jnp.take(start, group), 0)
    return jnp.where(routed[:, None], jnp.take(yt, dest, axis=0), 0)


def _grouped_local(xt: jax.Array, experts: jax.Array, gates: jax.Array, grouped_fn: GroupedFn, params: Any,
                   n_experts: int, exchange: Callable | None = None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Tokens [T, M] with their experts / gates [T, k] -> ([T, M], dropped pairs): sort the T k (token, choice)
    pairs by expert, the experts on their contiguous groups, unsort, combine with the gates. `exchange(xs,
    sorted experts, counts)` replaces the local `grouped_fn` under expert parallelism (`_ragged`)."""
    t, k = experts.shape
    flat = experts.reshape(t * k)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert, token order inside a group
    xs = jnp.take(xt, order // k, axis=0)  # [T k, M]
    counts = jnp.sum(jax.nn.one_hot(flat, n_experts, dtype=jnp.int32), axis=0)  # [E] tokens routed per expert
    if exchange is None:
        ys, dropped = grouped_fn(params, xs, counts), jnp.zeros((), jnp.int32)
    else:
        ys, dropped = exchange(xs, jnp.take(flat, order), counts)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)  # back to (token, choice) order
    return jnp.einsum("tkm,tk->tm", y.reshape(t, k, -1), gates.astype(y.dtype)), dropped


def _ragged(x: jax.Array, experts: jax.Array, gates: jax.Array, grouped_fn: GroupedFn, params: Any, *,
            context: Any = None, name: str = "ragged") -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """[G, S, M] -> ([G, S, M], the fraction of (token, choice) pairs dropped): dropless grouped experts.

    Without expert parallelism every device sorts its own groups' pairs (a `shard_map` over the batch mesh axes,
    so no global sort) and runs all E experts on them: no capacity, no drop, no padding. With `grouped_dot` as
    the grouped matmul (the GPT's) the expert MLP's FLOPs are the routed pairs' (`ragged_dot` on XLA:GPU / TPU),
    plus at most E (tile - 1) rows of tile padding on CPU, where `ragged_dot` itself is a masked dense dot over all
    E groups (E x the routed FLOPs; docs/moe.md).

    Under expert parallelism (`experts` on one mesh axis X of size n_x that also shards `batch`) the pairs are
    exchanged with a fixed-size buffer per (source, destination) device pair, because XLA:CPU has no
    `ragged-all-to-all` ("HLO opcode ragged-all-to-all is not supported by XLA:CPU ThunkEmitter", jax 0.10.2):
    each device sends every destination at most B = min(N, ceil(N f / n_x)) rows, N = G_l S k its (token,
    choice) pairs and f the padding factor (`ragged:<f>`, default RAGGED_PADDING = 2). Buffers: n_x B M elements
    per device per direction, about f N M (the capacity kernels' dropless buffer is E G_l S M = (E / k) N M).
    Pairs past B for one destination are dropped (output 0 for that choice, counted in the returned fraction,
    which the GPT reports as `moe_dropped`); f >= n_x can never drop (B = N)."""
    n_exp = params_experts(params)
    axes = _ragged_axes(context, n_exp)
    factor = _ragged_padding(name)
    if axes is None:  # one device, or no mesh: sort all the groups' pairs together
        g, s, m = x.shape
        y, _ = _grouped_local(x.reshape(g * s, m), experts.reshape(g * s, -1), gates.reshape(g * s, -1), grouped_fn,
                              params, n_exp)  # fmt: skip
        return y.reshape(g, s, m), jnp.zeros((), x.dtype)
    mesh, batch, axis = axes
    groups = math.prod(mesh.shape[a] for a in batch)
    if x.shape[0] % groups:
        raise ShardkitError(f"{x.shape[0]} token groups do not split over the batch mesh axes {batch} ({groups})")
    n_x = mesh.shape[axis] if axis else 1
    _record_path(name, axis, factor, n_x)

    def body(x: jax.Array, experts: jax.Array, gates: jax.Array, params: Any) -> tuple[jax.Array, jax.Array]:
        g, s, m = x.shape
        k = experts.shape[-1]
        exchange = None
        if axis is not None:
            n = g * s * k
            exchange = functools.partial(_exchange, grouped_fn=grouped_fn, params=params, axis=axis, n_x=n_x,
                                         n_exp=n_exp, rows=min(n, math.ceil(n * factor / n_x)))  # fmt: skip
        y, dropped = _grouped_local(x.reshape(g * s, m), experts.reshape(g * s, k), gates.reshape(g * s, k),
                                    grouped_fn, params, n_exp, exchange)  # fmt: skip
        frac = jax.lax.pmean(dropped.astype(x.dtype) / (g * s * k), batch)
        return y.reshape(g, s, m), frac

    rows = P(batch)
    spec = jax.tree.map(lambda _: P(axis), params)  # the experts' leading dim over X (or replicated over batch)
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, spec), out_specs=(rows, P()),
                         axis_names=set(batch), check_vma=False)(x, experts, gates, params)  # fmt: skip


def params_experts(params: Any) -> int:
    """E: the leading dimension every expert parameter shares."""
    sizes = {leaf.shape[0] for leaf in jax.tree.leaves(params)}
    if len(sizes) != 1:
        raise ShardkitError(f"expert parameters must share one leading experts dimension, got {sorted(sizes)}")
    return sizes.pop()


def _exchange(xs: jax.Array, ids: jax.Array, counts: jax.Array, *, grouped_fn: GroupedFn, params: Any, axis: str,
              n_x: int, n_exp: int, rows: int) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Inside the ep shard_map: pairs [N, M] sorted by expert (`ids`, global) -> their experts' outputs [N, M] and
    the number of pairs dropped, through one fixed-buffer all_to_all each way over `axis` (`_ragged`'s bound)."""
    n, m = xs.shape
    per = n_exp // n_x  # experts per device
    dest = ids // per  # destination device of each sorted pair (contiguous runs: the pairs are sorted)
    start = jnp.cumsum(counts.reshape(n_x, per).sum(axis=1)) - counts.reshape(n_x, per).sum(axis=1)
    slot = jnp.arange(n) - jnp.take(start, dest)  # position in the destination's buffer
    keep = slot < rows
    where = jnp.where(keep, dest * rows + slot, n_x * rows)  # out of range: dropped by the scatter
    send = jnp.zeros((n_x * rows, m), xs.dtype).at[where].set(xs, mode="drop", unique_indices=True)
    local = jnp.full((n_x * rows,), per, jnp.int32).at[where].set(ids % per, mode="drop", unique_indices=True)
    recv = jax.lax.all_to_all(send.reshape(n_x, rows, m), axis, 0, 0, tiled=True).reshape(n_x * rows, m)
    rid = jax.lax.all_to_all(local.reshape(n_x, rows), axis, 0, 0, tiled=True).reshape(n_x * rows)
    order = jnp.argsort(rid, stable=True)  # received rows grouped by local expert, padding (id = per) last
    sizes = jnp.sum(jax.nn.one_hot(rid, per, dtype=jnp.int32), axis=0)
    ye = grouped_fn(params, jnp.take(recv, order, axis=0), sizes)
    ye = ye * (jnp.arange(n_x * rows) < jnp.sum(sizes))[:, None].astype(ye.dtype)  # padding rows: 0
    back = jnp.zeros_like(ye).at[order].set(ye, unique_indices=True)
    back = jax.lax.all_to_all(back.reshape(n_x, rows, m), axis, 0, 0, tiled=True).reshape(n_x * rows, m)
    ys = jnp.take(back, jnp.minimum(where, n_x * rows - 1), axis=0) * keep[:, None].astype(back.dtype)
    return ys, jnp.sum(~keep)


def _ragged_axes(context: Any, n_exp: int) -> tuple[Any, tuple[str, ...], str | None] | None:
    """(mesh, the batch mesh axes, the experts' mesh axis or None) for the ragged kernel's shard_map; None when the
    batch is not sharded (or outside a train step). ShardkitError for a layout it cannot run."""
    if context is None:
        return None
    mesh, rules = context.mesh, context.rules
    on = lambda n: tuple(a for a in (rules.get(n) or ()) if a in mesh.shape and mesh.shape[a] > 1)
    batch, expert = on("batch"), on("experts")
    if not batch and not expert:
        return None
    if expert and (len(expert) != 1 or expert[0] not in batch):
        raise ShardkitError(
            f"moe kernel ragged: `experts` must map to one mesh axis that also shards `batch` (expert parallelism, "
            f"e.g. batch -> (data, expert), experts -> expert) or to none; the rules give batch {batch}, "
            f"experts {expert}"
        )
    axis = expert[0] if expert else None
    if axis is not None and n_exp % mesh.shape[axis]:
        raise ShardkitError(f"{n_exp} experts do not split over mesh axis {axis!r} of size {mesh.shape[axis]}")
    return mesh, batch, axis


#: (kernel name, the exchange chosen) of each ragged layout traced in this process, for a report or a test
RAGGED_PATHS: dict[tuple[str, str | None, int], str] = {}


def _record_path(name: str, axis: str | None, factor: float, n_x: int) -> None:
    """Records (in RAGGED_PATHS) which exchange the ragged kernel uses; prints it once per expert-parallel layout."""
    if axis is None:
        path = "local: each device sorts its own groups, all experts on every device (no exchange)"
    else:
        rows = "never drops" if factor >= n_x else "pairs past the buffer are dropped and counted"
        path = (f"padded all_to_all fallback over {axis!r} (jax.lax.ragged_all_to_all: unimplemented by XLA:CPU "
                f"in jax 0.10.2, not wired here for other backends): "
                f"a buffer of ceil({factor:g} x local pairs / {n_x}) rows per destination; {rows}")  # fmt: skip
    key = (name, axis, n_x)
    if key not in RAGGED_PATHS:
        RAGGED_PATHS[key] = path
        if axis is not None:
            print(f"shardkit moe kernel {name}: {path}")


kernels.register("moe", "ragged", _ragged, description="dropless: tokens sorted by expert, grouped matmuls "
                 "(grouped_dot); ragged:<f> bounds the expert-parallel buffer (MegaBlocks, 2211.15841)",
                 check=_ragged_padding)  # fmt: skip

__all__ = ["RAGGED_PADDING", "RAGGED_PATHS", "TILE", "GroupedFn", "grouped_dot", "params_experts"]
