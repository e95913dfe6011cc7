"""Attention kernels behind one entry point, `attend`, which the active strategy dispatches.

Models call `attend(q, k, v, causal=..., segment_ids=...)`; the strategy's `attention` field (set by the train
step via `shardkit.rules.use_rules`) picks the kernel by name:

    "dense"                                   jax.nn.dot_product_attention (the reference)
    "cudnn"                                   the same with cuDNN's fused flash attention (NVIDIA GPUs, bf16)
    "ring:contiguous" | "ring:zigzag" | "ring:striped"    ring attention over mesh axis "seq" (ring.py)
    "ulysses"                                 DeepSpeed-Ulysses all-to-all over "seq" (ulysses.py)
    "usp:contiguous" | "usp:zigzag" | "usp:striped"       Ulysses over "seq_u" x ring over "seq_r" (usp.py)

The ring, Ulysses and USP names take the query/key chunk of their inner loop as an option ("ring:zigzag:256");
without it the chunk is chosen per backend and block (chunking.py: 128 on CPU, 512 on accelerators).

The context-parallel kernels are also plain functions (`ring_attention`, …) usable without Flax; data for a
ring must be in its layout (`to_layout`, or `layout_batch` for a training batch). The context-parallel
strategies (cp_ring, cp_zigzag, cp_striped, cp_ulysses, cp_usp, fsdp_cp_zigzag, cp_zigzag_tp) are strategies.py's.
"""

from shardkit.attention import strategies  # noqa: F401  (registers the cp_* strategies)
from shardkit.attention.dense import attend, cudnn_attention, dense_attention, register_attention
from shardkit.attention.layouts import LAYOUTS, from_layout, layout_batch, layout_perm, strategy_layout, to_layout
from shardkit.attention.ring import ring_attention
from shardkit.attention.ulysses import ulysses_attention
from shardkit.attention.usp import usp_attention

__all__ = [
    "LAYOUTS",
    "attend",
    "cudnn_attention",
    "dense_attention",
    "from_layout",
    "layout_batch",
    "layout_perm",
    "register_attention",
    "ring_attention",
    "strategy_layout",
    "to_layout",
    "ulysses_attention",
    "usp_attention",
]
