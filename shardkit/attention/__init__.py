"""Attention behind one entry point, `attend`, which the active strategy dispatches.

Models call `attend(q, k, v, causal=..., segment_ids=...)`; the strategy's `attention` field (set by the train
step via `shardkit.rules.use_rules`) picks the kernel by name:

    "dense"                                   jax.nn.dot_product_attention (the reference)
    "cudnn"                                   the same with cuDNN's fused flash attention (NVIDIA GPUs, bf16)
    "ring:contiguous" | "ring:zigzag" | "ring:striped"    ring attention over mesh axis "seq"
    "ulysses"                                 DeepSpeed-Ulysses all-to-all over "seq"
    "usp:contiguous" | "usp:zigzag" | "usp:striped"       Ulysses over "seq_u" x ring over "seq_r"

This package holds `attend`, dense attention and the block kernels (blocks.py: what computes one query block
against one key block: XLA, Pallas splash on TPU, Pallas/cuDNN on GPU). The context-parallel kernels and their
strategies live in shardkit/parallel/context/; their plain functions, usable without Flax, are public here too:
`sk.attention.ring_attention`, `ulysses_attention`, `usp_attention`, and the layouts a ring's data must be in
(`to_layout`, `from_layout`, or `layout_batch` for a training batch). The ring, Ulysses and USP names take the
query/key chunk of their inner loop as an option ("ring:zigzag:256"); without it the chunk is chosen per platform
family (shardkit/parallel/context/chunking.py: 128 on CPU, 512 on accelerators).
"""

from typing import Any

from shardkit.attention.dense import attend, cudnn_attention, dense_attention, register_attention

#: context parallelism's public functions, served from shardkit/parallel/context/ when first asked for (an import
#: at the top would run the parallelisms' registrations while this package is half built)
_CONTEXT = ("LAYOUTS", "from_layout", "layout_batch", "layout_perm", "ring_attention", "strategy_layout",
            "to_layout", "ulysses_attention", "usp_attention")  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _CONTEXT:
        from shardkit.parallel import context

        return getattr(context, name)
    raise AttributeError(f"module 'shardkit.attention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CONTEXT])


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
