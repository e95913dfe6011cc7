"""Where every part of a train step's state lives: the sharding tables a step computes once from its strategy.

`TrainStep` (step.py) builds one `StepLayout` from the model's parameters and state, the bound strategy and the
optimizer; the SDP step, whose parameters are stored `[workers, k, ...]`, replaces the optimizer-state and
resting layouts with its own.

    names           each parameter's logical names (its metadata, or the strategy's path rules)
    params          the parameters' shardings in the compute (the parameter rules)
    updates         the gradients' and updates' shardings (the optimizer-state rules: ZeRO-1 differs here)
    opt_state       the optimizer state's, leaf by leaf (optax's params-like leaves take `updates`)
    model_state     BatchNorm statistics, RNG counters: the parameter rules where named, else replicated
    state           where a TrainState rests between steps: host memory for what the strategy offloads
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit import offload
from shardkit.init import state_logical_axes, state_shardings, unnamed_parameters, unnamed_splits
from shardkit.strategies import BoundStrategy


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: dict[str, Any]  # pure dict of the nnx.Param values, the structure of nnx.to_pure_dict
    opt_state: Any
    model_state: dict[str, Any] = flax.struct.field(default_factory=dict)  # BatchStat, RNG counters / key data


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """The sharding tables of one step (module docstring)."""

    names: Any
    unnamed: list[Any]  # (path, shape, bytes) of parameters without logical names: listed by explain
    unnamed_splits: Any  # how those are split over the ZeRO axes (init.unnamed_splits)
    params: Any
    updates: Any
    opt_state: Any
    model_state: Any
    replicated: NamedSharding
    offload: tuple[str, ...]
    state: TrainState

    @classmethod
    def of(
        cls, params: nnx.State, rest: nnx.State, bound: BoundStrategy, optimizer: optax.GradientTransformation,
        mesh: Mesh, step_name: str,
    ) -> StepLayout:  # fmt: skip
        """The layout of a model's `params` and other state `rest` under `bound` on `mesh` (the step's own mesh,
        Auto or Explicit as it runs), for `optimizer`'s state; `step_name` names the step in offload's errors."""
        s = bound.strategy
        strict, paths, floor, scopes = s.strict_names, s.path_rules, s.unnamed_min_bytes, bound.scopes
        names = state_logical_axes(params, strict=strict, path_rules=paths)
        common = dict(scopes=scopes, strict=strict, unnamed_min_bytes=floor, path_rules=paths)
        param_shardings = state_shardings(params, bound.param_rules, mesh, **common)
        updates = state_shardings(params, bound.opt_rules, mesh, **common)
        replicated = NamedSharding(mesh, PartitionSpec())
        abs_params = jax.eval_shape(lambda: nnx.to_pure_dict(params))
        opt = optax.tree_utils.tree_map_params(
            optimizer, lambda _, u: u, jax.eval_shape(optimizer.init, abs_params), updates,
            transform_non_params=lambda _: replicated,
        )  # fmt: skip
        model_state = state_shardings(rest, bound.param_rules, mesh, require=False, scopes=scopes)
        # what the strategy offloads rests in host memory between steps (shardkit/offload.py); `params` and
        # `opt_state` stay the device shardings the step computes in, `state` says where each part rests
        moved = offload.check(s.offload, mesh, step_name)
        host = lambda part, shardings: offload.host_shardings(shardings) if part in moved else shardings
        state = TrainState(step=replicated, params=host("params", param_shardings),
                           opt_state=host("opt_state", opt), model_state=model_state)  # fmt: skip
        return cls(
            names=names, unnamed=unnamed_parameters(params, paths),
            unnamed_splits=unnamed_splits(params, bound.param_rules, mesh, floor, scopes, paths),
            params=param_shardings, updates=updates, opt_state=opt, model_state=model_state, replicated=replicated,
            offload=moved, state=state,
        )  # fmt: skip


__all__ = ["StepLayout", "TrainState"]
