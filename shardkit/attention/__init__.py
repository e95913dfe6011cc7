"""Attention kernels behind one entry point, `attend`, which the active strategy dispatches.

Models call `attend(q, k, v, causal=..., segment_ids=...)`; the strategy's `attention` field (set by the train
step via `shardkit.rules.use_rules`) picks the kernel. Today: "dense". The context-parallel kernels (ring,
Ulysses, USP) register here under their names.
"""

from shardkit.attention.dense import attend, dense_attention, register_attention

__all__ = ["attend", "dense_attention", "register_attention"]
