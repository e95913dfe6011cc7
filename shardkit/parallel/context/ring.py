"""Ring attention (Liu, Zaharia, Abbeel 2310.01889) as a `shard_map` kernel with a flash-style custom VJP.

Rank r of the ring holds the query, key and value block of c = S/N tokens in a layout (layouts.py). Step t
attends its queries to the key/value block that started on rank (r - t) mod N while that block travels on
with `ppermute` (docs/algorithms.md §3). Scores are never materialised beyond one [chunk_q, chunk_k] pair: the
per-device work is a scan over query chunks and key chunks with the online softmax (Milakov & Gimelshein
1805.02867; FlashAttention, Dao et al. 2205.14135):

    m' = max(m, rowmax S),  P = exp(S - m'),  l <- e^(m-m') l + rowsum P,  O <- e^(m-m') O + P V

A chunk pair whose every key lies after every query (causal) is skipped by `lax.switch`: the compiled program
branches around it, so the contiguous layout really idles and zigzag / striped really balance; a pair whose
every key precedes every query runs without the mask. The backward
pass recomputes P = exp(S - lse) from the saved log-sum-exp (only the lse is saved per query row), key-major
(`_block_bwd`: Sᵀ, dSᵀ, so that no score tile is ever transposed), rotates K, V with their dK, dV accumulators
(N rotations bring dK, dV home) and keeps dQᵀ local. Every product is a plain batched [m, k] x [k, n] (`_bmm`)
of operands laid out once per block or ring step, never per chunk pair. Grouped-query attention: only the kv
heads travel. Segment ids (packed documents) travel with their keys. Positions for the causal mask come from the layout
formula, never from the data.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from shardkit import kernels
from shardkit.attention import blocks
from shardkit.attention.checks import CHECK_VMA as CHECK_VMA  # re-exported: ulysses, usp, tests
from shardkit.attention.checks import check_axis, check_qkv, context_axes, match_kv_heads, spec_entry
from shardkit.attention.dense import register_attention
from shardkit.parallel.context.chunking import chunk_option, resolve_chunk
from shardkit.parallel.context.chunking import chunk_size as chunk_size  # re-exported: bench_attention, older callers
from shardkit.parallel.context.layouts import LAYOUTS, block_positions, check_layout
from shardkit.parallel.context.ring_fused import fused_ring_local
from shardkit.parallel.context.ring_loop import RingConfig, lse_vjp, prepare, ring_loop
from shardkit.rules import ShardingContext, platform_family

#: `chunk=None` (the default): chosen per backend and block by `chunking.default_chunk` (128 on CPU, 512 on
#: accelerators). Kept under its old name (it was 512 before the per-backend choice) as the kernels' default.
DEFAULT_CHUNK = None


def _chunks(x: Any, size: int) -> Any:
    """[b, c, ...] -> [c/size, b, size, ...] (None passes through)."""
    if x is None:
        return None
    b, c = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, c // size, size, *x.shape[2:]), 1, 0)


def _unchunk(x: jax.Array) -> jax.Array:
    """[c/size, b, size, ...] -> [b, c, ...]."""
    return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


def _q_major(x: jax.Array, kv: int, size: int) -> jax.Array:
    """[b, c, heads, d] -> [c/size, b, kv, heads/kv, size, d]: chunks, heads-major so no dot transposes them."""
    return jnp.moveaxis(_chunks(_group(x, kv), size), 2, 4)


def _q_back(x: jax.Array) -> jax.Array:
    """[c/size, b, kv, g, size, d] -> [b, c, kv * g, d]."""
    x = _unchunk(jnp.moveaxis(x, 4, 2))
    return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], x.shape[4])


def _transposed(x: jax.Array) -> jax.Array:
    """[c/size, b, kv, g, size, d] -> [c/size, b, kv, d, g, size] (the query side of the key-major backward)."""
    return jnp.moveaxis(x, 5, 3)


def _kv_major(x: jax.Array, size: int) -> jax.Array:
    """[b, c, kv, d] -> [c/size, b, kv, size, d]."""
    return jnp.moveaxis(_chunks(x, size), 2, 3)


def _kv_back(x: jax.Array) -> jax.Array:
    """[c/size, b, kv, size, d] -> [b, c, kv, d]."""
    return _unchunk(jnp.moveaxis(x, 3, 2))


def _mask(qpos: jax.Array, kpos: jax.Array, qseg: Any, kseg: Any, causal: bool, keys_first: bool = False) -> Any:
    """bool[b or 1, 1, 1, cq, ck] (keys_first: [b or 1, 1, ck, 1, cq], for the backward's key-major scores):
    which scores of one chunk pair are kept (None: all)."""
    mask = (qpos[:, None] >= kpos[None, :])[None] if causal else None
    if qseg is not None:
        seg = qseg[:, :, None] == kseg[:, None, :]
        mask = seg if mask is None else mask & seg
    if mask is None:
        return None
    return jnp.swapaxes(mask, 1, 2)[:, None, :, None] if keys_first else mask[:, None, None]


def _dispatch(cfg: RingConfig, qpos: jax.Array, kpos: jax.Array, fn: Any, carry: Any, *args: Any) -> Any:
    """fn(carry, *args, causal=...) for one chunk pair (or one whole block), doing only the work the mask leaves.

    Fully masked (every key after every query): skipped, the carry passes through. Fully visible: computed
    without the causal mask (no per-score compare and select). Otherwise: computed with it. The ring steps
    dispatch each block first, then its chunk pairs only where the block straddles the diagonal.
    """
    if not cfg.causal:
        return fn(carry, *args, causal=False)
    case = (qpos.max() >= kpos.min()).astype(jnp.int32) + (qpos.min() >= kpos.max()).astype(jnp.int32)
    branches = [lambda c, *_: c, functools.partial(fn, causal=True), functools.partial(fn, causal=False)]
    return lax.switch(case, branches, carry, *args)


def _pairwise(cfg: RingConfig, causal: bool) -> RingConfig:
    """The config the chunk pairs of one block run with: a block `_dispatch` found fully visible needs no per-pair
    causal test (nor a `lax.switch` per pair); a fully masked block never gets here."""
    return cfg if causal else dataclasses.replace(cfg, causal=False)


def _bmm(x: jax.Array, y: jax.Array) -> jax.Array:
    """[n, i, j] x [n, j, k] -> fp32 [n, i, k], the only product form in these kernels.

    Written with three dimensions and the contraction last-of-x / first-of-y, XLA's CPU dot (XNNPACK) takes
    the operands as they are. Five-dimensional einsums with a size-1 group axis made it copy the [cq, ck] score
    tile once more before the row max, at every chunk pair."""
    return jnp.einsum("nij,njk->nik", x, y, preferred_element_type=jnp.float32)


def _block_fwd(cfg: RingConfig, state: tuple, qc: tuple, kc: tuple) -> tuple:
    """One query block x one key block, chunk by chunk: state (o, m, l) stacked over query chunks."""

    def pair(carry: tuple, q, qpos, qseg, kt, v, kpos, kseg, *, causal: bool) -> tuple:
        o, m, ell = carry
        b, kv, g, cq, d = q.shape
        flat = lambda x: x.reshape(b * kv, *x.shape[2:])  # [b, kv, m, n] -> [b kv, m, n]
        s = _bmm(q.reshape(b * kv, g * cq, d), flat(kt)).reshape(b, kv, g, cq, -1)
        mask = _mask(qpos, kpos, qseg, kseg, causal)
        s = s if mask is None else jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # rows with nothing visible yet stay at 0
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        pv = _bmm(p.astype(v.dtype).reshape(b * kv, g * cq, -1), flat(v)).reshape(o.shape)
        return alpha[..., None] * o + pv, m_new, alpha * ell + p.sum(-1)

    def over_q(_: None, xs: tuple) -> tuple:
        q, qpos, qseg, o, m, ell = xs

        def over_k(carry: tuple, ys: tuple) -> tuple:
            k, v, kpos, kseg = ys
            return _dispatch(cfg, qpos, kpos, pair, carry, q, qpos, qseg, k, v, kpos, kseg), None

        return None, lax.scan(over_k, (o, m, ell), kc)[0]

    return lax.scan(over_q, None, (*qc, *state))[1]


def _block_bwd(cfg: RingConfig, dqt: jax.Array, dkv: tuple, qc: tuple, kc: tuple) -> tuple:
    """Gradient contributions of one query block x one key block; dQᵀ stacked over query chunks, dK, dV over keys.

    Key-major (FlashAttention-2's backward, Dao 2307.08691, with the scores transposed): Sᵀ = K Qᵀ, so that
    dV = Pᵀ dO, dK = dSᵀ Q and dQᵀ = Kᵀ dSᵀ are all plain [m, k] x [k, n] products of operands laid out once
    per block. XLA's CPU dot wants exactly that form and would otherwise copy the [ck, cq] tiles P and dS into
    a transposed layout for every chunk pair: four passes over the tile per pair become two (P, dSᵀ).
    """

    def pair(carry: tuple, q, qt, do, dot, lse, delta, qpos, qseg, k, kt, v, kpos, kseg, *, causal: bool) -> tuple:
        dk, dv, dqt_i = carry
        b, kv, g, cq, d = q.shape
        rows = lambda x: x.reshape(b * kv, g * cq, d)  # [b, kv, g, cq, d] -> [b kv, g cq, d]
        cols = lambda x: x.reshape(b * kv, d, g * cq)  # [b, kv, d, g, cq] -> [b kv, d, g cq]
        flat = lambda x: x.reshape(b * kv, *x.shape[2:])  # [b, kv, m, n] -> [b kv, m, n]
        st = _bmm(flat(k), cols(qt)).reshape(b, kv, -1, g, cq)
        mask = _mask(qpos, kpos, qseg, kseg, causal, keys_first=True)
        pt = jnp.exp((st if mask is None else jnp.where(mask, st, -jnp.inf)) - lse[:, :, None])
        pt_flat = pt.reshape(b * kv, -1, g * cq)
        # P and dS enter the products in the inputs' dtype (bf16 under mixed precision, as in FlashAttention):
        # fp32 only inside the softmax, the accumulators fp32 through preferred_element_type
        dv = dv + _bmm(pt_flat.astype(do.dtype), rows(do)).reshape(dv.shape)
        dpt = _bmm(flat(v), cols(dot)).reshape(pt.shape)
        dst = (pt * (dpt - delta[:, :, None])).reshape(pt_flat.shape).astype(q.dtype)
        dk = dk + _bmm(dst, rows(q)).reshape(dk.shape)
        dqt_i = dqt_i + _bmm(flat(kt), dst).reshape(dqt_i.shape)
        return dk, dv, dqt_i

    def over_k(dqt: jax.Array, ys: tuple) -> tuple:
        k, kt, v, kpos, kseg, dk, dv = ys

        def over_q(carry: tuple, xs: tuple) -> tuple:
            *qs, qpos, qseg, dqt_i = xs
            args = (*qs, qpos, qseg, k, kt, v, kpos, kseg)
            dk, dv, dqt_i = _dispatch(cfg, qpos, kpos, pair, (*carry, dqt_i), *args)
            return (dk, dv), dqt_i

        (dk, dv), dqt = lax.scan(over_q, (dk, dv), (*qc, dqt))
        return dqt, (dk, dv)

    return lax.scan(over_k, dqt, (*kc, *dkv))


def _group(x: jax.Array, kv: int) -> jax.Array:
    """[b, c, heads, d] -> [b, c, kv, heads/kv, d] (query heads of one kv head side by side)."""
    return x.reshape(*x.shape[:2], kv, x.shape[2] // kv, x.shape[3])


def _forward(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any) -> tuple:
    rank, qpos, scale = prepare(cfg, q)
    b, c, h, d = q.shape
    kv, cq, ck = k.shape[2], cfg.chunk_q, cfg.chunk_k
    qc = (_q_major(q * jnp.asarray(scale, q.dtype), kv, cq), _chunks(qpos[None], cq)[:, 0], _chunks(seg, cq))
    stat = lax.full_like(q, 0, jnp.float32, (c // cq, b, kv, h // kv, cq))  # keeps q's varying mesh axes
    state = (lax.full_like(q, 0, jnp.float32, (*stat.shape, d)), stat - jnp.inf, stat)

    def step(t: jax.Array, travelling: tuple, state: tuple) -> tuple:
        kpos = _chunks(block_positions(cfg.layout, cfg.n, (rank - t) % cfg.n, c)[None], ck)[:, 0]
        k, v, kseg = travelling

        def block(state: tuple, causal: bool) -> tuple:
            kt = jnp.swapaxes(k, -1, -2)  # [c/ck, b, kv, d, ck]: Q Kᵀ a plain product; once per computed block
            return _block_fwd(_pairwise(cfg, causal), state, qc, (kt, v, kpos, kseg))

        return (), _dispatch(cfg, qpos, kpos, block, state)

    # K, V travel chunked and heads-major ([c/ck, b, kv, ck, d]): laid out once, never transposed per pair.
    _, (o, m, ell) = ring_loop(cfg, step, (_kv_major(k, ck), _kv_major(v, ck), _chunks(seg, ck)), state)
    return _q_back(o / ell[..., None]).astype(q.dtype), m + jnp.log(ell)


def ring_local(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any) -> jax.Array:
    """Per-device body: q [b, c, heads, d], k, v [b, c, kv_heads, d], seg [b, c] | None -> [b, c, heads, d].

    By the block kernel `cfg.block`: this file's scan (xla), a fused kernel over the whole local sequence when there
    is no ring (Ulysses' heads), or the ring over a fused kernel merged by its lse (ring_fused.py)."""
    if cfg.block == "xla":
        return scan_local(cfg, q, k, v, seg)
    if cfg.axis is None or cfg.n == 1:
        return blocks.local_attention(cfg.block, q, k, v, seg, cfg.causal, cfg.platform)
    return fused_ring_local(cfg, q, k, v, seg)


def _ring_bwd(cfg: RingConfig, res: tuple, do: jax.Array) -> tuple:
    q, k, v, seg, o, lse = res
    rank, qpos, scale = prepare(cfg, q)
    c, kv, cq, ck = q.shape[1], k.shape[2], cfg.chunk_q, cfg.chunk_k
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1, keepdims=True)  # D = rowsum(dO * O)
    qh, doh = _q_major(q * jnp.asarray(scale, q.dtype), kv, cq), _q_major(do, kv, cq)
    qt, dot = _transposed(qh), _transposed(doh)  # [c/cq, b, kv, d, g, cq]: the right operands of Sᵀ and dPᵀ
    qc = (qh, qt, doh, dot, lse, _q_major(delta, kv, cq)[..., 0], _chunks(qpos[None], cq)[:, 0], _chunks(seg, cq))
    kh, vh = _kv_major(k, ck), _kv_major(v, ck)
    zeros_kv = lax.full_like(kh, 0, jnp.float32)

    def step(t: jax.Array, travelling: tuple, dqt: jax.Array) -> tuple:
        kpos = _chunks(block_positions(cfg.layout, cfg.n, (rank - t) % cfg.n, c)[None], ck)[:, 0]
        k, v, kseg, dk, dv = travelling

        def block(carry: tuple, causal: bool) -> tuple:
            kt = jnp.swapaxes(k, -1, -2)  # [c/ck, b, kv, d, ck], once per computed block, not per chunk pair
            dqt, (dk, dv) = _block_bwd(_pairwise(cfg, causal), carry[0], carry[1:], qc, (k, kt, v, kpos, kseg))
            return dqt, dk, dv

        dqt, dk, dv = _dispatch(cfg, qpos, kpos, block, (dqt, dk, dv))
        return (dk, dv), dqt

    dqt0 = lax.full_like(q, 0, jnp.float32, qt.shape)
    (dk, dv), dqt = ring_loop(cfg, step, (kh, vh, _chunks(seg, ck), zeros_kv, zeros_kv), dqt0, returning=2)
    dq = (_q_back(jnp.moveaxis(dqt, 3, -1)) * scale).astype(q.dtype)
    return dq, _kv_back(dk).astype(k.dtype), _kv_back(dv).astype(v.dtype), None  # dk has the scale via q


#: `ring_local` by the chunked scan (attention_block=xla)
scan_local = lse_vjp(_forward, _ring_bwd)


def ring_block(block: str | None, platform: str, c: int, layout: str, n: int, dtype: Any, segments: bool,
               what: str, devices: int = 1) -> str:  # fmt: skip
    """The block kernel a ring of `n` ranks holding `c` tokens each runs (`blocks.resolve`; a ring of one is local
    attention, no lse merge)."""
    lengths, strict = blocks.ring_blocks(c, layout, n)
    return blocks.resolve(block, platform, lengths=lengths, ring=n > 1, dtype=dtype, segment_ids=segments,
                          what=what, devices=devices, strict=strict)  # fmt: skip


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "seq",
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: jax.Array | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    batch_axes: Any = None,
    head_axes: Any = None,
    block: str | None = None,
) -> jax.Array:
    """[b, S, heads, d], [b, S, kv_heads, d] x 2 sharded on S over `axis`, in `layout` -> [b, S, heads, d].

    `batch_axes` / `head_axes` (optional) are mesh axes already sharding the batch / heads dimensions (set by
    `attend` from the strategy's compute rules); K, V heads then shard like the query heads. `chunk`: the
    query/key chunk of the inner loop (None: chosen for the mesh's backend and the block, chunking.py).
    `block`: the block kernel (blocks.py: xla, splash; None = auto, from the mesh's devices).
    """
    check_qkv(q, k, v, segment_ids, "ring_attention")
    n = check_axis(mesh, axis, "ring_attention")
    check_layout(layout, q.shape[1], n)
    c = q.shape[1] // n
    platform = platform_family(mesh)
    cq = resolve_chunk(chunk, c, layout, n, platform, "ring_attention")
    kernel = ring_block(block, platform, c, layout, n, q.dtype, segment_ids is not None, "ring_attention", mesh.size)
    cfg = RingConfig(axis, n, layout, causal, cq, cq, kernel, platform)
    spec = PartitionSpec(spec_entry(batch_axes), axis, spec_entry(head_axes))
    seg_spec = PartitionSpec(spec_entry(batch_axes), axis)
    fn = jax.shard_map(
        functools.partial(ring_local, cfg),
        mesh=mesh,
        in_specs=(spec, spec, spec, None if segment_ids is None else seg_spec),
        out_specs=spec,
        check_vma=CHECK_VMA,
    )
    return fn(q, k, v, segment_ids)


def _ring_from_context(layout: str) -> Any:
    def kernel(q, k, v, *, causal: bool, segment_ids: Any, context: ShardingContext | None) -> jax.Array:
        mesh, batch_axes, head_axes = context_axes(context, ("seq",), f"ring:{layout}")
        k, v = match_kv_heads(k, v, q.shape[2], context)
        chunk = chunk_option(kernels.active("attention")[1], f"ring:{layout}")  # ring:zigzag:256 -> 256
        return ring_attention(
            q, k, v, mesh=mesh, axis="seq", causal=causal, layout=layout, segment_ids=segment_ids,
            chunk=chunk, batch_axes=batch_axes, head_axes=head_axes, block=blocks.named(),
        )  # fmt: skip

    return kernel


for _layout in LAYOUTS:
    # the ring needs the data in its layout: declared, so the loader applies it (sk.kernels.batch_layout)
    _declared = lambda _, mesh, lay=_layout: (lay, mesh.shape.get("seq", 1))
    _check = lambda name, lay=_layout: chunk_option(name, f"ring:{lay}")  # ring:<layout>[:<chunk>]
    register_attention(f"ring:{_layout}", _ring_from_context(_layout), layout=_declared, check=_check)
