"""The context-parallel strategies: the sequence sharded over `seq` (or `seq_u` x `seq_r`), attention by a kernel
of this package. Each attention name picks the kernel and the data layout ("ring:<layout>", "ulysses",
"usp:<layout>"); the data loader lays batches out with
`sk.attention.layout_batch(batch, *sk.attention.strategy_layout(attention, mesh))`.
"""

from __future__ import annotations

from shardkit.strategies import DATA_FSDP, FSDP_RULES, TENSOR_RULES, Strategy, register_strategy, table

_SP = {"seq": "seq", "res_seq": "seq"}
_USP = {"seq": ("seq_r", "seq_u"), "res_seq": ("seq_r", "seq_u")}  # ring-major: a2a over seq_u rebuilds ring blocks

for _name, _attention, _what in (
    ("cp_ring", "ring:contiguous", "ring attention, contiguous layout (causal work unbalanced, ~2x at large N)"),
    ("cp_zigzag", "ring:zigzag", "ring attention, zigzag layout (rank r holds chunks r and 2N-1-r: balanced)"),
    ("cp_striped", "ring:striped", "ring attention, striped layout (token i on rank i mod N: balanced)"),
):
    register_strategy(
        Strategy(
            _name,
            table(),
            table(batch="data", **_SP),
            required_axes=("seq",),
            attention=_attention,
            description=f"sequence over seq, batch over data; {_what}",
            collectives="per layer: N-1 collective-permutes of K, V fwd; K, V, dK, dV bwd; gradient all-reduce",
        )
    )
register_strategy(
    Strategy(
        "cp_ulysses",
        table(),
        table(batch="data", **_SP),
        required_axes=("seq",),
        attention="ulysses",
        description="sequence over seq; DeepSpeed-Ulysses all-to-all sequence <-> heads around attention",
        collectives="per layer: 4 all-to-alls fwd (q, k, v, out), 4 bwd over seq; gradient all-reduce",
    )
)
register_strategy(
    Strategy(
        "cp_usp",
        table(),
        table(batch="data", **_USP),
        required_axes=("seq_u", "seq_r"),
        attention="usp:zigzag",
        description="USP: Ulysses over seq_u x zigzag ring attention over seq_r",
        collectives="all-to-alls over seq_u + collective-permutes over seq_r per layer; gradient all-reduce",
    )
)
register_strategy(
    Strategy(
        "fsdp_cp_zigzag",
        table(**FSDP_RULES),
        table(batch=DATA_FSDP, **_SP),
        required_axes=("fsdp", "seq"),
        attention="ring:zigzag",
        description="fsdp (ZeRO-3) over fsdp x zigzag ring attention over seq",
        collectives="fsdp's all-gather / reduce-scatter over fsdp + ring collective-permutes over seq",
    )
)
register_strategy(
    Strategy(
        "cp_zigzag_tp",
        table(**TENSOR_RULES),
        table(batch="data", **_SP, **TENSOR_RULES),
        required_axes=("seq", "tensor"),
        attention="ring:zigzag",
        description="zigzag ring attention over seq x Megatron tp over tensor (each rank rings its heads)",
        collectives="tp's all-reduces over tensor + ring collective-permutes of the local kv heads over seq",
    )
)
