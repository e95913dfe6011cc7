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
import re
from typing import Any

import flax.struct
import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit import offload
from shardkit.errors import ShardkitError
from shardkit.init import state_logical_axes, state_shardings, unnamed_parameters, unnamed_splits
from shardkit.strategies import BoundStrategy, Strategy


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
    abstract_params: Any  # the parameters' ShapeDtypeStructs, as a pure dict
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
        mesh: Mesh, step_name: str, *, batch_axes: Any = ("batch",), model_name: str = "the model",
    ) -> StepLayout:  # fmt: skip
        """The layout of a model's `params` and other state `rest` under `bound` on `mesh` (the step's own mesh,
        Auto or Explicit as it runs), for `optimizer`'s state; `step_name` names the step in offload's errors. A mesh
        axis that none of the parameters', state's and batch's (`batch_axes`) names use is refused first."""
        s = bound.strategy
        strict, paths, floor, scopes = s.strict_names, s.path_rules, s.unnamed_min_bytes, bound.scopes
        names = state_logical_axes(params, strict=strict, path_rules=paths)
        check_every_axis_shards_something(names, params, rest, batch_axes, bound, mesh, model_name)
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
            names=names, abstract_params=abs_params, unnamed=unnamed_parameters(params, paths),
            unnamed_splits=unnamed_splits(params, bound.param_rules, mesh, floor, scopes, paths),
            params=param_shardings, updates=updates, opt_state=opt, model_state=model_state, replicated=replicated,
            offload=moved, state=state,
        )  # fmt: skip


def check_every_axis_shards_something(
    names_tree: Any, params: Any, rest: Any, batch_axes: Any, bound: BoundStrategy, mesh: Mesh, model_name: str
) -> None:
    """Refuses a mesh axis (size > 1) that the strategy maps only to logical names this model's parameters,
    model state and batch never use: every device along it would compute the same thing (Strategy.bind's rule,
    per model). A ResNet under cp_ring would replicate its whole step over `seq`; under `spatial` (no `depth`)
    GSPMD's height / width splits of nnx.Conv even trained 20% off one device."""
    names: set[str] = set()

    def collect(tree: Any) -> None:
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)):
            if isinstance(leaf, tuple):
                names.update(n for n in leaf if isinstance(n, str))
            elif isinstance(leaf, str):
                names.add(leaf)

    collect(names_tree)
    collect(state_logical_axes(rest, require=False) if jax.tree.leaves(rest) else {})
    collect(batch_axes)
    b = bound
    tables = [b.param_rules, b.compute_rules, b.opt_rules, *b.scopes.values()]
    used = {a for t in tables for n, axes in t.items() if n in names for a in (axes or ())}
    for axis, size in mesh.shape.items():
        if size > 1 and axis not in used:
            mapped = sorted({n for t in tables for n, axes in t.items() if axis in (axes or ())})
            raise ShardkitError(
                f"strategy {bound.strategy.name!r} shards mesh axis {axis!r} (size {size}) over logical names "
                f"{mapped}, and {model_name}'s parameters and batch name none of them (they name "
                f"{sorted(names)}): every device along {axis!r} would compute the same thing. Use a strategy "
                f"for this model, drop {axis!r} from the mesh, or {naming_remedy(bound.strategy, mapped, params)}"
            )


def naming_remedy(strategy: Strategy, mapped: list[str], params: Any) -> str:
    """How to give the model the names an idle axis wants: its parameters' dimensions by path (path rules, with an
    example built from the model's own largest unnamed parameters), or its batch's (`batch_axes`)."""
    wanted = [n for n in mapped if n not in ("batch", "seq", "res_seq")]
    unnamed = sorted(unnamed_parameters(params, strategy.path_rules), key=lambda u: -u[2])[:2]
    if not wanted or not unnamed:
        return "name the batch's dimensions (make_train_step(..., batch_axes=...))"
    rules = ", ".join(f"(r\"{re.escape(path)}$\", {(*(None,) * (len(shape) - 1), wanted[0])!r})"
                      for path, shape, _ in unnamed)  # fmt: skip
    return (
        f"name its parameters' dimensions by path, without editing the model: "
        f"sk.strategy({strategy.name!r}).extend(path_rules=[{rules}, ...]) names the last dimension of its "
        "largest unnamed parameters (pick the names each dimension means; docs/flax_models.md)"
    )


__all__ = ["StepLayout", "TrainState", "check_every_axis_shards_something", "naming_remedy"]
