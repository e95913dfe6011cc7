"""Ring attention over a fused block kernel (Pallas splash attention on TPU): blocks merged by their log-sum-exp.

ring.py's scan computes each [local query block, travelling key block] pair chunk by chunk in plain XLA. Here each
pair is one call of a fused kernel (blocks.py) that returns the pair's output O_i and log-sum-exp lse_i; the ring
merges them online (Liu, Zaharia, Abbeel 2310.01889; the merge is FlashAttention's rescaling, Dao et al. 2205.14135):

    lse = log(e^lse_acc + e^lse_i),   O = e^(lse_acc - lse) O_acc + e^(lse_i - lse) O_i

The backward needs no merge: with the merged O and lse, splash's own backward kernel run on a block pair gives
that pair's exact share of dQ, dK, dV (it recomputes P = exp(S - lse) and dS = P (dP - rowsum(dO O)), both of
which are per-pair once lse and O are the merged ones). K, V and their dK, dV accumulators travel as in ring.py.

A fused kernel takes a static mask, and the ring's masks are static too: in all three layouts, which keys of the
block from rank r' a query of rank r sees depends only on whether r' is before, at or after r (`plans`, checked
against the layout's positions for every rank pair in the tests). Contiguous: all / causal / none. Zigzag (rank r
holds chunks r and 2N-1-r): the first half of the keys for every query / causal / every key for the second half of
the queries, so a zigzag pair does half the work with no mask at all. Striped: causal (k <= q) / causal / strictly
causal (k < q).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shardkit.attention import blocks
from shardkit.parallel.context.ring_loop import lse_vjp, prepare, ring_loop


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a query block computes against one key block: the kernel's mask over rows x cols of the pair."""

    mask: str  # blocks.MASKS
    rows: slice  # the queries that see any key of the block
    cols: slice  # the keys any query sees


ALL = slice(None)


def plans(layout: str, n: int, c: int, causal: bool) -> tuple[Plan | None, Plan | None, Plan | None]:
    """The plan for a key block from a rank before / at / after the query's rank (None: nothing visible)."""
    if not causal:
        full = Plan("full", ALL, ALL)
        return full, full, full
    same = Plan("causal", ALL, ALL)
    if layout == "contiguous":
        return Plan("full", ALL, ALL), same, None
    if layout == "zigzag":
        h = c // 2
        return Plan("full", ALL, slice(0, h)), same, Plan("full", slice(h, c), ALL)
    return same, same, Plan("strict", ALL, ALL)  # striped


def _by_plan(cfg: Any, c: int, rank: Any, t: Any, fn: Any, carry: Any, *block: Any) -> Any:
    """fn(carry, plan, *block) for ring step t's block (from rank (rank - t) mod N), under the plan of its relation to
    this rank (before, at, after: `plans`); the carry unchanged where the plan is None (nothing visible)."""
    relation = (jnp.sign((rank - t) % cfg.n - rank) + 1).astype(jnp.int32)
    branches = [(lambda a: a) if p is None else functools.partial(lambda a, p: fn(a, p, *block), p=p)
                for p in plans(cfg.layout, cfg.n, c, cfg.causal)]  # fmt: skip
    return lax.switch(relation, branches, carry)


def _heads(q: jax.Array, kv: int) -> jax.Array:
    """[b, c, h, d] -> [b, kv, h/kv, c, d]."""
    b, c, h, d = q.shape
    return jnp.moveaxis(q.reshape(b, c, kv, h // kv, d), 1, 3)


def _heads_back(x: jax.Array) -> jax.Array:
    """[b, kv, g, c, d] -> [b, c, kv g, d]."""
    b, kv, g, c, d = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, c, kv * g, d)


def _kv(x: jax.Array) -> jax.Array:
    return jnp.moveaxis(x, 1, 2)  # [b, c, kv, d] <-> [b, kv, c, d]


def _rows(x: Any, rows: slice, axis: int) -> Any:
    return None if x is None else x[(slice(None),) * (axis % x.ndim) + (rows,)]


def _put(x: jax.Array, rows: slice, axis: int, y: jax.Array, add: bool = False) -> jax.Array:
    """`x` with its `rows` along `axis` set to `y` (with `add`: `y` added), by static slices. Not `x.at[rows].set`:
    its index arrays (int32[0] constants for a slice) are lifted into the ring's shard_map as zero-sized operands,
    and XLA's Shardy pass refuses a shard_map whose operands are all such constants (it finds none produced by a
    GlobalToLocalShape; met under the GPU kernel, issue 50)."""
    axis = axis % x.ndim
    start, stop, _ = rows.indices(x.shape[axis])
    if add:
        y = lax.slice_in_dim(x, start, stop, axis=axis) + y
    if (start, stop) == (0, x.shape[axis]):
        return y.astype(x.dtype)
    return lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), start, axis)


def _forward(cfg: Any, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any) -> tuple:
    rank, _, scale = prepare(cfg, q)
    kv, c = k.shape[2], q.shape[1]
    qh = _heads(q * jnp.asarray(scale, q.dtype), kv)
    interpret = blocks.interpreting(cfg.platform, cfg.block)
    acc = (lax.full_like(qh, 0, jnp.float32), lax.full_like(qh[..., 0], -jnp.inf, jnp.float32))

    def merge(acc: tuple, plan: Plan, k: jax.Array, v: jax.Array, kseg: Any) -> tuple:
        o_acc, lse_acc = acc
        qr, qs = _rows(qh, plan.rows, -2), _rows(seg, plan.rows, 1)
        o, lse = blocks.block_forward(cfg.block, plan.mask, qr, _rows(k, plan.cols, 2), _rows(v, plan.cols, 2), qs,
                                      _rows(kseg, plan.cols, 1), interpret)  # fmt: skip
        old, old_o = _rows(lse_acc, plan.rows, -1), _rows(o_acc, plan.rows, -2)
        new = jnp.logaddexp(old, lse)
        o = jnp.exp(old - new)[..., None] * old_o + jnp.exp(lse - new)[..., None] * o
        return _put(o_acc, plan.rows, -2, o), _put(lse_acc, plan.rows, -1, new)

    def step(t: jax.Array, travelling: tuple, acc: tuple) -> tuple:
        return (), _by_plan(cfg, c, rank, t, merge, acc, *travelling)

    _, (o, lse) = ring_loop(cfg, step, (_kv(k), _kv(v), seg), acc)
    return _heads_back(o).astype(q.dtype), lse


def _fused_bwd(cfg: Any, res: tuple, do: jax.Array) -> tuple:
    q, k, v, seg, o, lse = res
    rank, _, scale = prepare(cfg, q)
    kv, c = k.shape[2], q.shape[1]
    qh, oh, doh = _heads(q * jnp.asarray(scale, q.dtype), kv), _heads(o, kv), _heads(do, kv)
    interpret = blocks.interpreting(cfg.platform, cfg.block)

    def grads(carry: tuple, plan: Plan, k: jax.Array, v: jax.Array, kseg: Any) -> tuple:
        dq, dk, dv = carry
        r, cols = plan.rows, plan.cols
        gq, gk, gv = blocks.block_backward(
            cfg.block, plan.mask, _rows(qh, r, -2), _rows(k, cols, 2), _rows(v, cols, 2), _rows(seg, r, 1),
            _rows(kseg, cols, 1), _rows(oh, r, -2), _rows(lse, r, -1), _rows(doh, r, -2), interpret,
        )  # fmt: skip
        f32 = lambda x: x.astype(jnp.float32)
        return _put(dq, r, -2, f32(gq), True), _put(dk, cols, -2, f32(gk), True), _put(dv, cols, -2, f32(gv), True)

    def step(t: jax.Array, travelling: tuple, dq: jax.Array) -> tuple:
        k, v, kseg, dk, dv = travelling
        dq, dk, dv = _by_plan(cfg, c, rank, t, grads, (dq, dk, dv), k, v, kseg)
        return (dk, dv), dq

    zeros_kv = lax.full_like(_kv(k), 0, jnp.float32)
    travelling = (_kv(k), _kv(v), seg, zeros_kv, zeros_kv)
    (dk, dv), dq = ring_loop(cfg, step, travelling, lax.full_like(qh, 0, jnp.float32), returning=2)
    dq = (_heads_back(dq) * scale).astype(q.dtype)
    return dq, _kv(dk).astype(k.dtype), _kv(dv).astype(v.dtype), None


#: per-device body under a fused block kernel: q [b, c, heads, d], k, v [b, c, kv, d], seg [b, c] | None
fused_ring_local = lse_vjp(_forward, _fused_bwd)
