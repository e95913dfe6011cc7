"""Collective decompositions, called inside `jax.shard_map`: hierarchical all-reduce and collective matmul.

    y = hierarchical_psum(x, inner="tensor", outer="data")       # RS(inner) -> AR(outer) -> AG(inner)
    y = reduce_scatter_2d(x, inner="tensor", outer="data")       # RS(inner) -> RS(outer), big bytes inner
    x = all_gather_2d(y, inner="tensor", outer="data")           # AG(outer) -> AG(inner), its inverse
    y = all_gather_matmul(x, w, axis="tensor")                   # all_gather(x) @ w as a ppermute loop
    y = matmul_reduce_scatter(x, w, axis="tensor")               # psum_scatter(x @ w) as a ppermute loop

Hierarchical all-reduce (docs/algorithms.md §1; Thakur et al. 2005): the full-size reduce-scatter / all-gather pair
runs over the fast `inner` axis and only 1/p_inner of the data crosses the slow `outer` axis.

Collective matmul (Wang et al., ASPLOS'23, "Overlap communication with dependent computation via
decomposition in large deep learning models", §3): the all-gather (reduce-scatter) is split into p - 1
collective-permutes of one block each, and every permute is issued before the partial matmul that does not
depend on it, so XLA's scheduler can overlap them. `bidirectional=True` moves two half blocks in opposite
directions, halving the bytes per step on each link direction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from shardkit.errors import ShardkitError

AxisName = str | Sequence[str]


def _size(axis: AxisName) -> int:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    return math.prod(lax.axis_size(a) for a in names)


def _shift(x: jax.Array, axis: str, step: int) -> jax.Array:
    """x on device i moves to device (i + step) mod p along `axis`."""
    p = lax.axis_size(axis)
    return lax.ppermute(x, axis, [(i, (i + step) % p) for i in range(p)])


def hierarchical_psum(x: jax.Array, inner: AxisName, outer: AxisName) -> jax.Array:
    """[...] -> [...] summed over inner x outer: reduce-scatter(inner) -> psum(outer) -> all-gather(inner).

    Any size works: x is flattened and zero-padded to a multiple of the inner size. Ring volume per device
    2(p1-1)/p1 * n on inner, 2(p2-1)/p2 * n/p1 on outer (docs/algorithms.md §1).
    """
    p = _size(inner)
    flat = x.reshape(-1)
    pad = -flat.size % p
    if pad:
        flat = jnp.pad(flat, (0, pad))
    part = lax.psum_scatter(flat, inner, scatter_dimension=0, tiled=True)  # [(n+pad)/p1]
    part = lax.psum(part, outer)
    full = lax.all_gather(part, inner, axis=0, tiled=True)  # [n+pad]
    return full[: x.size].reshape(x.shape)


def _check_divisible(x: jax.Array, dim: int, p: int, what: str) -> None:
    if x.shape[dim] % p:
        raise ShardkitError(
            f"{what}: dimension {dim} of shape {x.shape} is {x.shape[dim]}, not divisible by the {p} devices it is "
            f"split over; pad it to a multiple of {p} or use hierarchical_psum (which pads)"
        )


def reduce_scatter_2d(x: jax.Array, inner: str, outer: str, scatter_dimension: int = 0) -> jax.Array:
    """[n, ...] -> [n/(p_outer p_inner), ...] summed: reduce-scatter over inner, then over outer.

    Same result as `psum_scatter(x, (outer, inner), tiled=True)` (block outer_idx * p_inner + inner_idx), but
    the full-size step runs on `inner`; `outer` carries only n/p_inner.
    """
    po, pi = lax.axis_size(outer), lax.axis_size(inner)
    d = scatter_dimension % x.ndim
    _check_divisible(x, d, po * pi, "reduce_scatter_2d")
    blocks = x.reshape(*x.shape[:d], po, pi, x.shape[d] // (po * pi), *x.shape[d + 1 :])
    blocks = lax.psum_scatter(blocks, inner, scatter_dimension=d + 1, tiled=True)  # [.., po, 1, c, ..]
    blocks = lax.psum_scatter(blocks, outer, scatter_dimension=d, tiled=True)  # [.., 1, 1, c, ..]
    return blocks.reshape(*x.shape[:d], x.shape[d] // (po * pi), *x.shape[d + 1 :])


def all_gather_2d(x: jax.Array, inner: str, outer: str, axis: int = 0) -> jax.Array:
    """[c, ...] -> [p_outer p_inner c, ...]: all-gather over outer (small), then over inner (full size).

    Inverse of `reduce_scatter_2d`'s layout, equal to `all_gather(x, (outer, inner), tiled=True)`.
    """
    d = axis % x.ndim
    g = lax.all_gather(x, outer, axis=d, tiled=False)  # [.., po, c, ..]
    g = lax.all_gather(g, inner, axis=d + 1, tiled=False)  # [.., po, pi, c, ..]
    return g.reshape(*x.shape[:d], -1, *x.shape[d + 1 :])


def _check_matmul(x: jax.Array, w: jax.Array, what: str) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ShardkitError(f"{what}: needs x [m, k] and w [k, n] local blocks, got x {x.shape} and w {w.shape}")


def all_gather_matmul(x: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False) -> jax.Array:
    """x [m/p, k] (rows split over `axis`), w [k, n] -> all_gather(x) @ w [m, n], p - 1 permutes of x blocks.

    Step i computes the block that started on device (idx - i) mod p while the next block is in flight.
    """
    _check_matmul(x, w, "all_gather_matmul")
    p, idx = lax.axis_size(axis), lax.axis_index(axis)
    if p == 1:
        return x @ w
    if bidirectional:
        if x.shape[0] % 2:
            raise ShardkitError(f"all_gather_matmul(bidirectional=True): local rows {x.shape[0]} must be even")
        h = x.shape[0] // 2
        fwd, bwd = x[:h], x[h:]  # first halves travel i -> i+1, second halves i -> i-1
        out = jnp.zeros((p, 2, h, w.shape[1]), jnp.result_type(x, w))
        for i in range(p):
            if i < p - 1:
                nxt_f, nxt_b = _shift(fwd, axis, 1), _shift(bwd, axis, -1)  # issued before the matmuls
            out = lax.dynamic_update_slice(out, (fwd @ w)[None, None], ((idx - i) % p, 0, 0, 0))
            out = lax.dynamic_update_slice(out, (bwd @ w)[None, None], ((idx + i) % p, 1, 0, 0))
            if i < p - 1:
                fwd, bwd = nxt_f, nxt_b
        return out.reshape(p * x.shape[0], w.shape[1])
    out = jnp.zeros((p, *x.shape[:1], w.shape[1]), jnp.result_type(x, w))
    cur = x
    for i in range(p):
        nxt = _shift(cur, axis, 1) if i < p - 1 else None  # the permute does not wait for this matmul
        out = lax.dynamic_update_slice(out, (cur @ w)[None], ((idx - i) % p, 0, 0))
        cur = nxt
    return out.reshape(p * x.shape[0], w.shape[1])


def matmul_reduce_scatter(x: jax.Array, w: jax.Array, axis: str, bidirectional: bool = False) -> jax.Array:
    """x [m, k/p], w [k/p, n] (contraction split over `axis`) -> psum_scatter(x @ w) [m/p, n], p - 1 permutes.

    Device idx at step s adds its partial product for row block (idx - 1 - s) mod p to the accumulator it has
    just received; after p - 1 shifts every accumulator has reached the block's owner (Wang et al. Fig. 5).
    """
    _check_matmul(x, w, "matmul_reduce_scatter")
    p, idx = lax.axis_size(axis), lax.axis_index(axis)
    if p == 1:
        return x @ w
    _check_divisible(x, 0, p * (2 if bidirectional else 1), "matmul_reduce_scatter")
    c = x.shape[0] // p
    blocks = x.reshape(p, c, x.shape[1])

    def block(j: jax.Array, lo: int, size: int) -> jax.Array:
        return lax.dynamic_slice(blocks, (j % p, lo, 0), (1, size, x.shape[1]))[0] @ w

    if not bidirectional:
        acc = block(idx - 1, 0, c)
        for s in range(1, p):
            recv = _shift(acc, axis, 1)  # issued before the matmul that does not depend on it
            acc = recv + block(idx - 1 - s, 0, c)
        return acc
    h = c // 2
    fwd, bwd = block(idx - 1, 0, h), block(idx + 1, h, h)  # first halves travel i -> i+1, second i -> i-1
    for s in range(1, p):
        recv_f, recv_b = _shift(fwd, axis, 1), _shift(bwd, axis, -1)
        fwd, bwd = recv_f + block(idx - 1 - s, 0, h), recv_b + block(idx + 1 + s, h, h)
    return jnp.concatenate([fwd, bwd], axis=0)


__all__ = [
    "all_gather_2d",
    "all_gather_matmul",
    "hierarchical_psum",
    "matmul_reduce_scatter",
    "reduce_scatter_2d",
]
