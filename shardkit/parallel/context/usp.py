"""Unified sequence parallelism, USP (Fang & Zhao 2405.07719): Ulysses over one mesh axis x ring over another.

With P = U x R devices on the sequence, the sequence dimension is sharded over (ring axis, Ulysses axis),
ring-major, and laid out for a ring of R ranks. Per device: all-to-all over the Ulysses axis,
[b, S/(RU), a, d] -> [b, S/R, a/U, d], which reassembles ring block r of the layout (any layout); ring attention
over the ring axis on a/U heads; the inverse all-to-all. Ulysses' traffic shrinks with U, the ring's per-step
block grows with U, so USP trades all-to-all volume against ring steps (docs/algorithms.md §4).

    x_l = sk.attention.to_layout(x, "zigzag", mesh, axis="seq_r")    # layout over the R ring ranks
    o = sk.attention.usp_attention(q, k, v, mesh=mesh, ulysses_axis="seq_u", ring_axis="seq_r", layout="zigzag")
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from shardkit import kernels
from shardkit.attention import blocks
from shardkit.attention.checks import check_axis, check_qkv, context_axes, match_kv_heads, spec_entry
from shardkit.attention.dense import register_attention
from shardkit.errors import ShardkitError
from shardkit.parallel.context.chunking import chunk_option, resolve_chunk
from shardkit.parallel.context.layouts import LAYOUTS, check_layout
from shardkit.parallel.context.ring import CHECK_VMA, DEFAULT_CHUNK, RingConfig, ring_block
from shardkit.parallel.context.ulysses import all_to_all_attention, check_heads
from shardkit.rules import ShardingContext, platform_family


def usp_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    ulysses_axis: str = "seq_u",
    ring_axis: str = "seq_r",
    causal: bool = True,
    layout: str = "contiguous",
    segment_ids: jax.Array | None = None,
    chunk: int | None = DEFAULT_CHUNK,
    batch_axes: Any = None,
    head_axes: Any = None,
    block: str | None = None,
) -> jax.Array:
    """[b, S, heads, d], [b, S, kv_heads, d] x 2 sharded on S over (ring_axis, ulysses_axis) -> [b, S, heads, d].

    The inputs are in `layout` for a ring of mesh.shape[ring_axis] ranks (`to_layout(x, layout, mesh, ring_axis)`).
    `block`: the ring's block kernel (blocks.py: xla, splash; None = auto, from the mesh's devices).
    """
    check_qkv(q, k, v, segment_ids, "usp_attention")
    u = check_axis(mesh, ulysses_axis, "usp_attention")
    r = check_axis(mesh, ring_axis, "usp_attention")
    head_degree = math.prod(mesh.shape[a] for a in ((head_axes,) if isinstance(head_axes, str) else head_axes or ()))
    check_heads(q.shape[2], k.shape[2], u, head_degree, "usp_attention")
    check_layout(layout, q.shape[1], r)
    if q.shape[1] % (r * u):
        raise ShardkitError(
            f"usp_attention: sequence length {q.shape[1]} is not divisible by {ring_axis} x {ulysses_axis} = {r} x "
            f"{u} devices; pad it to a multiple of {math.lcm(r * u, 2 * r if layout == 'zigzag' else r)}"
        )
    c = q.shape[1] // r
    platform = platform_family(mesh)
    cq = resolve_chunk(chunk, c, layout, r, platform, "usp_attention")
    kernel = ring_block(block, platform, c, layout, r, q.dtype, segment_ids is not None, "usp_attention", mesh.size)
    ring = RingConfig(ring_axis, r, layout, causal, cq, cq, kernel, platform)
    seq = (ring_axis, ulysses_axis)
    spec = PartitionSpec(spec_entry(batch_axes), seq, spec_entry(head_axes))
    seg_spec = None if segment_ids is None else PartitionSpec(spec_entry(batch_axes), seq)
    body = functools.partial(all_to_all_attention, axis=ulysses_axis, p=u, ring=ring)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec, check_vma=CHECK_VMA)(
        q, k, v, segment_ids
    )


def _usp_from_context(layout: str) -> Any:
    def kernel(q, k, v, *, causal: bool, segment_ids: Any, context: ShardingContext | None) -> jax.Array:
        mesh, batch_axes, head_axes = context_axes(context, ("seq_r", "seq_u"), f"usp:{layout}")
        k, v = match_kv_heads(k, v, q.shape[2], context)
        chunk = chunk_option(kernels.active("attention")[1], f"usp:{layout}")  # usp:zigzag:256 -> 256
        return usp_attention(
            q, k, v, mesh=mesh, causal=causal, layout=layout, segment_ids=segment_ids, chunk=chunk,
            batch_axes=batch_axes, head_axes=head_axes, block=blocks.named(),
        )  # fmt: skip

    return kernel


for _layout in LAYOUTS:
    _declared = lambda _, mesh, lay=_layout: (lay, mesh.shape.get("seq_r", 1))  # the ring part's layout
    _check = lambda name, lay=_layout: chunk_option(name, f"usp:{lay}")  # usp:<layout>[:<chunk>]
    register_attention(f"usp:{_layout}", _usp_from_context(_layout), layout=_declared, check=_check)
