"""Context parallelism: the sequence split over mesh axes, attention computed across the split.

    ring          ring attention (Liu, Zaharia, Abbeel 2310.01889) as a `shard_map` kernel with a flash-style VJP
    ring_fused    the ring over a fused block kernel (Pallas splash on TPU), blocks merged by their log-sum-exp
    ring_loop     the ring's skeleton shared by both: which blocks meet at which step
    ulysses       DeepSpeed-Ulysses (Jacobs et al. 2309.14509): all-to-all sequence <-> heads around attention
    usp           USP (Fang & Zhao 2405.07719): Ulysses over one axis x ring over another
    layouts       which tokens each rank holds: contiguous, zigzag (Brandon et al. 2311.09431), striped
    chunking      the inner loop's query/key chunk, chosen per platform family
    strategies    cp_ring, cp_zigzag, cp_striped, cp_ulysses, cp_usp, fsdp_cp_zigzag, cp_zigzag_tp

The kernels register themselves as `attention` kernels ("ring:<layout>", "ulysses", "usp:<layout>"), which the
models reach through `sk.attention.attend`; the plain functions are public as `sk.attention.ring_attention`, ….
"""

from shardkit.parallel.context import strategies  # noqa: F401  (registers the cp_* strategies)
from shardkit.parallel.context.layouts import (
    LAYOUTS,
    from_layout,
    layout_batch,
    layout_perm,
    strategy_layout,
    to_layout,
)
from shardkit.parallel.context.ring import ring_attention
from shardkit.parallel.context.ulysses import ulysses_attention
from shardkit.parallel.context.usp import usp_attention

__all__ = [
    "LAYOUTS",
    "from_layout",
    "layout_batch",
    "layout_perm",
    "ring_attention",
    "strategy_layout",
    "to_layout",
    "ulysses_attention",
    "usp_attention",
]
