"""Heterogeneous devices (Whale: Jia et al., USENIX ATC'22, arXiv 2011.09208): uneven per-device work.

    uneven    the batch split by throughput within memory caps, uneven pipeline stages, `make_strategy`
    step      the balanced data-parallel train step (registered as "hetero")

`sk.hetero` is this package.
"""

from shardkit.parallel.hetero import step, uneven
from shardkit.parallel.hetero.uneven import (
    Balance,
    HeteroConfig,
    StagePlan,
    balance,
    even_split,
    hetero_stage_plan,
    make_strategy,
    partition_stages,
    plan_of,
    plan_on_groups,
    simulated_step_time,
    split_batch,
    stage_speeds,
    strategy,
)

__all__ = [
    "Balance",
    "HeteroConfig",
    "StagePlan",
    "balance",
    "even_split",
    "hetero_stage_plan",
    "make_strategy",
    "partition_stages",
    "plan_of",
    "plan_on_groups",
    "simulated_step_time",
    "split_batch",
    "stage_speeds",
    "step",
    "strategy",
    "uneven",
]
