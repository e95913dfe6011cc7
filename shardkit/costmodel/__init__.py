"""What a plan costs before compiling, and how a model brings its own terms (docs/planner.md).

- protocol.py: `CostModel`, the model-specific terms (collectives, memory, recompute, divisibility), registered
  beside the model by config type (`register`, `for_config`);
- comms.py: a step's collectives as rows (`Comm`, `CommBuilder`) and their time on a preset's links (`comm_time`);
- planner.py: `plan`, every (strategy, mesh, remat policy) ranked by predicted step time, within memory.
"""

from shardkit.costmodel.comms import (
    KINDS,
    TP3D_ORDER,
    Comm,
    CommBuilder,
    comm_time,
    merge_comms,
    ring_factor,
    tp3d_layer_comms,
)
from shardkit.costmodel.planner import (
    PLAN_HOOKS,
    RANKING,
    REMAT_POLICIES,
    Plan,
    candidates,
    format_plans,
    plan,
    rank_key,
    register_plan_hook,
)
from shardkit.costmodel.protocol import DEFAULT_STRATEGIES, CostModel, Terms, for_config, register

__all__ = ["DEFAULT_STRATEGIES", "KINDS", "PLAN_HOOKS", "RANKING", "REMAT_POLICIES", "TP3D_ORDER", "Comm",
           "CommBuilder", "CostModel", "Plan", "Terms", "candidates", "comm_time", "for_config", "format_plans",
           "merge_comms", "plan", "rank_key", "register", "register_plan_hook", "ring_factor",
           "tp3d_layer_comms"]  # fmt: skip
