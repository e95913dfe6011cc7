"""Sharded initialisation: eval_shape -> logical specs -> mesh shardings -> jit(out_shardings).

The unsharded model never exists: every device computes only its own shard of every parameter, and the
values equal a single-device initialisation from the same seed (threefry is partitionable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from shardkit.errors import ShardkitError
from shardkit.rules import Rules, named_sharding
from shardkit.strategies import Strategy
from shardkit.strategies import strategy as get_strategy


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def abstract_model(make_model: Callable[[nnx.Rngs], nnx.Module], seed: int = 0) -> nnx.Module:
    """The model with ShapeDtypeStruct leaves: shapes and metadata, no memory."""
    return nnx.eval_shape(lambda: make_model(nnx.Rngs(seed)))


def param_logical_axes(model_or_state: nnx.Module | nnx.State) -> dict[str, Any]:
    """A pure dict (the structure of `nnx.to_pure_dict(state)`) of each parameter's logical axis names.

    Raises ShardkitError for a parameter without `logical_axes` metadata (no silent replication) and for
    model state that is not an `nnx.Param` (the train step handles parameters only).
    """
    state = nnx.split(model_or_state)[1] if isinstance(model_or_state, nnx.Module) else model_or_state
    out: dict[str, Any] = {}
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, var in leaves:
        where = _path_str(path)
        if not isinstance(var, nnx.Param):
            raise ShardkitError(
                f"model state {where!r} is a {type(var).__name__}, not an nnx.Param; shardkit's train step "
                "handles parameters only — keep RNG streams and other state outside the module"
            )
        axes = var.get_metadata().get("logical_axes")
        shape = var.get_value().shape
        if axes is None or len(axes) != len(shape):
            raise ShardkitError(
                f"parameter {where!r} of shape {tuple(shape)} has logical_axes={axes!r}; give every parameter "
                f"one logical name per dimension, e.g. nnx.Param(value, logical_axes=('embed', 'mlp'))"
            )
        node = out
        for key in path[:-1]:
            node = node.setdefault(getattr(key, "key", getattr(key, "idx", key)), {})
        last = path[-1]
        node[getattr(last, "key", getattr(last, "idx", last))] = tuple(axes)
    return out


def param_shardings(abstract: nnx.Module | nnx.State, rules: Rules, mesh: Mesh) -> dict[str, Any]:
    """A pure dict of NamedShardings for the parameters, checked (path, shape, axis) against the mesh."""
    state = nnx.split(abstract)[1] if isinstance(abstract, nnx.Module) else abstract
    shapes = nnx.to_pure_dict(state)
    logical = param_logical_axes(state)
    return jax.tree_util.tree_map_with_path(
        lambda path, names, sds: named_sharding(names, rules, mesh, sds.shape, what=f"parameter {_path_str(path)!r}"),
        logical,
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def sharded_init(
    make_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh, strategy: str | Strategy, seed: int = 0
) -> nnx.Module:
    """Builds `make_model(nnx.Rngs(seed))` directly sharded by the strategy's parameter rules."""
    bound = get_strategy(strategy).bind(mesh)
    graphdef, abs_state = nnx.split(abstract_model(make_model, seed))
    shardings = param_shardings(abs_state, bound.param_rules, mesh)

    def create() -> dict[str, Any]:
        return nnx.to_pure_dict(nnx.split(make_model(nnx.Rngs(seed)))[1])

    params = jax.jit(create, out_shardings=shardings)()
    return nnx.merge(graphdef, params)
