"""The GSPMD parallelisms as tables: data parallelism, ZeRO-1, FSDP (ZeRO-3; Rajbhandari et al. 1910.02054), Megatron
tensor (+ sequence) parallelism (Shoeybi et al. 1909.08053; Korthikanti et al. 2205.05198), their compositions,
Whale's replicate + split (Jia et al. 2011.09208), CNN channels over tensor, and a model's own annotations.

A strategy here is nothing but its tables: XLA's GSPMD partitioner does the rest (step.py beside this file). FSDP
is parameter rules that differ from the compute rules (Levanter's `parameter_axis_mapping` vs
`compute_axis_mapping`): parameters rest sharded over `fsdp` and XLA gathers them where the compute rules want them
replicated; ZeRO-1 differs from data parallelism only in the optimizer-state rules.
"""

from __future__ import annotations

from shardkit.rules import MESH_AXES
from shardkit.strategies import DATA_FSDP, FSDP_RULES, STRATEGIES, TENSOR_RULES, Strategy, register_strategy, table

register_strategy(
    Strategy(
        "dp",
        table(),
        table(batch="data"),
        required_axes=("data",),
        description="batch over data; parameters and optimizer state replicated",
        collectives="all-reduce of gradients over data, once per step",
    )
)
register_strategy(
    STRATEGIES["dp"].replace(
        name="dp_split_head",
        scopes={"head": {"classes": "data", "vocab": "data", "batch": None}},
        description="Whale's replicate + split: the network data-parallel, its classifier / output projection "
        "(module `head`) split over the same devices by classes / vocab, the batch gathered into it",
        collectives="gradient all-reduce of the replicated part; an all-gather of the features into the head; the "
        "head's weight gradient stays local (its classes are split, its batch whole)",
    )
)
register_strategy(
    Strategy(
        "zero1",
        table(),
        table(batch="data"),
        opt_rules=table(embed="data", channels="data"),
        required_axes=("data",),
        description="as dp, but optimizer state sharded over data (ZeRO-1)",
        collectives="all-reduce of gradients; all-gather of updated parameters over data",
    )
)
register_strategy(
    Strategy(
        "fsdp",
        table(**FSDP_RULES),
        table(batch=DATA_FSDP),
        required_axes=("fsdp",),
        description="batch over data x fsdp; parameters, gradients, optimizer state on embed / channels over fsdp"
        " (ZeRO-3)",
        collectives="all-gather of parameters (fwd and bwd), reduce-scatter of gradients over fsdp",
    )
)
register_strategy(
    Strategy(
        "tp",
        table(**TENSOR_RULES),
        table(batch="data", **TENSOR_RULES),
        required_axes=("tensor",),
        description="Megatron: QKV / MLP-in column-parallel, out / MLP-out row-parallel, vocab-parallel head",
        collectives="2 all-reduces of activations per layer forward, 2 backward, over tensor",
    )
)
register_strategy(
    Strategy(
        "tp_sp",
        table(**TENSOR_RULES),
        table(batch="data", res_seq="tensor", **TENSOR_RULES),
        required_axes=("tensor",),
        description="tp + norms and residual stream sharded on sequence (Korthikanti et al.)",
        collectives="all-gather / reduce-scatter pairs over tensor instead of tp's all-reduces",
    )
)
register_strategy(
    Strategy(
        "fsdp_tp",
        table(**FSDP_RULES, **TENSOR_RULES),
        table(batch=DATA_FSDP, **TENSOR_RULES),
        required_axes=("fsdp", "tensor"),
        description="fsdp over fsdp x Megatron tp over tensor (data, if present, is plain data parallel)",
        collectives="fsdp's all-gather / reduce-scatter over fsdp + tp's all-reduces over tensor",
    )
)
register_strategy(
    Strategy(
        "dp_fsdp_tp",
        table(**FSDP_RULES, **TENSOR_RULES),
        table(batch=DATA_FSDP, **TENSOR_RULES),
        required_axes=("data", "fsdp", "tensor"),
        description="3D: replicas over data (HSDP), fsdp within, Megatron tp innermost",
        collectives="gradient all-reduce over data + fsdp's all-gather / reduce-scatter + tp's all-reduces",
    )
)


register_strategy(
    Strategy(
        "tp_channels",
        table(channels="tensor"),
        table(batch="data", channels="tensor"),
        required_axes=("tensor",),
        description="CNNs: output channels of every convolution over tensor (parameters and activations), batch "
        "over data",
        collectives="activation all-gathers / all-reduces over tensor around each convolution (XLA picks them; "
        "explain lists them); gradient all-reduce over data",
    )
)


# The model's own layout: a model annotated with mesh-axis names (nnx.with_partitioning(init, ("fsdp", "tensor")),
# a PartitionSpec of data / fsdp / tensor, as Flax's guide writes it) keeps exactly those shardings; the batch goes
# over data x fsdp unless the model's batch_axes name mesh axes themselves.
IDENTITY = {a: a for a in MESH_AXES}
register_strategy(
    Strategy(
        "annotated",
        table(**IDENTITY),
        table(batch=DATA_FSDP, **IDENTITY),
        explicit_axes=True,  # an explicit-mode model (out_sharding=, reshard) on jax.make_mesh's mesh runs as written
        description="the model's own annotations: a name that is a mesh axis shards over that axis, no rules table; "
        "on a mesh with Explicit axes, JAX's explicit sharding mode (the model's out_sharding= and reshard calls)",
        collectives="what the annotations imply, partitioned by GSPMD (see explain)",
    )
)
