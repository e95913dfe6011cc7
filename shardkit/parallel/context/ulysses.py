"""DeepSpeed-Ulysses sequence parallelism (Jacobs et al. 2309.14509) as a `shard_map` kernel.

Each of P devices holds S/P tokens of every head. One all-to-all per tensor trades the sequence split for a
head split, [b, S/P, a, d] -> [b, S, a/P, d]; every device then runs exact attention over the full sequence
for its a/P heads (the chunked online-softmax kernel of ring.py with a ring of one, so no [S, S] score
matrix), and one inverse all-to-all returns [b, S/P, a, d]. Per-device traffic per layer: 4 S h / P elements
(docs/algorithms.md §4). Needs heads % P == 0; with kv_heads < P (or not divisible) the kv heads are repeated
just enough, since each device must own whole kv groups.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from shardkit import kernels
from shardkit.attention import blocks
from shardkit.attention.checks import check_axis, check_qkv, context_axes, match_kv_heads, spec_entry
from shardkit.attention.dense import register_attention
from shardkit.errors import ShardkitError
from shardkit.parallel.context.chunking import chunk_option, resolve_chunk
from shardkit.parallel.context.ring import CHECK_VMA, DEFAULT_CHUNK, RingConfig, ring_block, ring_local
from shardkit.rules import ShardingContext, platform_family


def seq_to_heads(x: jax.Array, axis: str) -> jax.Array:
    """[b, s/P, a, d] -> [b, s, a/P, d] (all-to-all over `axis`)."""
    return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_seq(x: jax.Array, axis: str) -> jax.Array:
    """[b, s, a/P, d] -> [b, s/P, a, d] (all-to-all over `axis`)."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def kv_repeats(kv_heads: int, p: int) -> int:
    """How often each kv head is repeated so that P devices each own whole kv heads: P / gcd(kv_heads, P)."""
    return p // math.gcd(kv_heads, p)


def repeat_kv(x: jax.Array, times: int) -> jax.Array:
    """[b, s, a_kv, d] -> [b, s, a_kv * times, d], each kv head repeated in place (GQA groups preserved)."""
    return x if times == 1 else jnp.repeat(x, times, axis=2)


def all_to_all_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: Any, *, axis: str, p: int, ring: RingConfig
) -> jax.Array:
    """Per-device body: [b, s/P, a, d] blocks -> all-to-all -> attention (`ring` over its own axis) -> back."""
    k, v = (repeat_kv(x, kv_repeats(k.shape[2], p)) for x in (k, v))
    q, k, v = (seq_to_heads(x, axis) for x in (q, k, v))  # q_blk: f32[b, s, a/P, d]
    if seg is not None:
        seg = lax.all_gather(seg, axis, axis=1, tiled=True)  # [b, s/P] -> [b, s]: ids travel whole
    return heads_to_seq(ring_local(ring, q, k, v, seg), axis)


def check_heads(heads: int, kv_heads: int, p: int, head_degree: int, what: str) -> None:
    """Ulysses splits the (already `head_degree`-sharded) heads P ways; GQA groups stay whole (kv repeated)."""
    if heads % head_degree or kv_heads % head_degree:
        raise ShardkitError(
            f"{what}: {heads} query / {kv_heads} kv heads are not divisible by their head sharding degree "
            f"{head_degree}; shard heads over fewer devices or replicate them"
        )
    local = heads // head_degree
    if local % p:
        raise ShardkitError(
            f"{what}: {heads} query heads ({local} per device after head sharding of degree {head_degree}) are not "
            f"divisible by the Ulysses degree {p}; use a number of heads divisible by {p * head_degree}, a smaller "
            "Ulysses axis, or ring attention (any head count)"
        )


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str = "seq",
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    batch_axes: Any = None,
    head_axes: Any = None,
    block: str | None = None,
) -> jax.Array:
    """[b, S, heads, d], [b, S, kv_heads, d] x 2 sharded on S over `axis` (contiguous) -> [b, S, heads, d].

    `block`: the local attention's kernel (blocks.py: xla, splash, flash, cudnn; None = auto, from the mesh's
    devices)."""
    check_qkv(q, k, v, segment_ids, "ulysses_attention")
    p = check_axis(mesh, axis, "ulysses_attention")
    head_degree = math.prod(mesh.shape[a] for a in ((head_axes,) if isinstance(head_axes, str) else head_axes or ()))
    check_heads(q.shape[2], k.shape[2], p, head_degree, "ulysses_attention")
    if q.shape[1] % p:
        raise ShardkitError(
            f"ulysses_attention: sequence length {q.shape[1]} is not divisible by the Ulysses degree {p} "
            f"(mesh axis {axis!r}); pad it to a multiple of {p}"
        )
    platform = platform_family(mesh)
    cq = resolve_chunk(chunk, q.shape[1], "contiguous", 1, platform, "ulysses_attention")
    kernel = ring_block(block, platform, q.shape[1], "contiguous", 1, q.dtype, segment_ids is not None,
                        "ulysses_attention", mesh.size)  # fmt: skip
    ring = RingConfig(None, 1, "contiguous", causal, cq, cq, kernel, platform)
    spec = PartitionSpec(spec_entry(batch_axes), axis, spec_entry(head_axes))
    seg_spec = None if segment_ids is None else PartitionSpec(spec_entry(batch_axes), axis)
    body = functools.partial(all_to_all_attention, axis=axis, p=p, ring=ring)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec, check_vma=CHECK_VMA)(
        q, k, v, segment_ids
    )


def _ulysses_from_context(q, k, v, *, causal: bool, segment_ids: Any, context: ShardingContext | None) -> jax.Array:
    mesh, batch_axes, head_axes = context_axes(context, ("seq",), "ulysses")
    k, v = match_kv_heads(k, v, q.shape[2], context)
    chunk = chunk_option(kernels.active("attention")[1], "ulysses")  # ulysses:256 -> 256
    return ulysses_attention(
        q, k, v, mesh=mesh, axis="seq", causal=causal, segment_ids=segment_ids, chunk=chunk,
        batch_axes=batch_axes, head_axes=head_axes, block=blocks.named(),
    )  # fmt: skip


register_attention("ulysses", _ulysses_from_context, check=lambda name: chunk_option(name, "ulysses"))
