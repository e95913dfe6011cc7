"""A training batch is any pytree of arrays; its leaves' logical names decide their layout and are checked here.

`batch_axes` names each leaf's dimensions: one tuple for every leaf (a leaf with fewer dimensions takes its
prefix, one with more leaves the rest replicated) or a pytree of tuples matching the batch. Everything is checked
before XLA sees the batch, with the leaf's path in the message: the structure, the names (each must have a
rule), divisibility by the mesh axes (the leading dimension also by the microbatches), and that every leaf
whose leading dimension is `batch` has the same number of examples.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from shardkit.errors import ShardkitError
from shardkit.rules import Rules, logical_to_spec

Batch = Any  # a pytree of arrays
BatchAxes = tuple[str | None, ...] | Any  # one tuple for every leaf, or a pytree of tuples matching the batch


def is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _where(path: Any) -> str:
    return f"batch{jax.tree_util.keystr(path)}"


def leaf_names(batch: Batch, batch_axes: BatchAxes) -> Any:
    """Each batch leaf's logical names (padded with None to its rank), as a pytree like the batch."""

    def names(path: Any, leaf: Any, given: tuple) -> tuple:
        ndim = len(getattr(leaf, "shape", ()))
        if not is_names(given):
            raise ShardkitError(f"batch_axes for {_where(path)} must be a tuple of names, got {given!r}")
        if len(given) > ndim and not is_names(batch_axes):
            raise ShardkitError(
                f"{_where(path)} has shape {tuple(leaf.shape)} but batch_axes gives {len(given)} names {given}; "
                "give at most one name per dimension"
            )
        return tuple(given[:ndim]) + (None,) * (ndim - len(given))

    if is_names(batch_axes):
        return jax.tree_util.tree_map_with_path(lambda p, x: names(p, x, batch_axes), batch)
    try:
        return jax.tree_util.tree_map_with_path(names, batch, batch_axes)
    except ShardkitError:
        raise
    except ValueError as e:
        structure = jax.tree.map(lambda x: tuple(x.shape), batch)
        raise ShardkitError(
            f"batch_axes {batch_axes} does not match the batch's structure {structure}: give one tuple of logical "
            "names per batch entry, or one tuple for all of them"
        ) from e


def shardings(batch: Batch, names: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for every batch leaf under the compute rules."""
    spec = lambda p, n: logical_to_spec(n, rules, mesh, None, _where(p))
    return jax.tree_util.tree_map_with_path(lambda p, x, n: NamedSharding(mesh, spec(p, n)), batch, names)


def check(batch: Batch, names: Any, rules: Rules, mesh: Mesh, microbatches: int) -> None:
    """The batch fits the mesh and the microbatches (module docstring); ShardkitError naming the leaf otherwise."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ShardkitError("the batch has no arrays")
    examples: dict[int, str] = {}
    for (path, leaf), leaf_axes in zip(leaves, jax.tree.leaves(names, is_leaf=is_names), strict=True):
        if not hasattr(leaf, "shape") or len(leaf.shape) == 0:
            what = f"{_where(path)} is {type(leaf).__name__} {getattr(leaf, 'shape', leaf)!r}"
            raise ShardkitError(f"{what}: every batch entry must be an array with a batch dimension")
        if leaf_axes and leaf_axes[0] == "batch":
            examples.setdefault(leaf.shape[0], _where(path))
        for dim, (size, name) in enumerate(zip(leaf.shape, leaf_axes, strict=True)):
            if name is not None and name not in rules:
                logical_to_spec(leaf_axes, rules, mesh, None, _where(path))  # raises, naming the missing rule
            axes = (rules.get(name) or ()) if name is not None else ()
            degree = math.prod(mesh.shape[a] for a in axes) * (microbatches if dim == 0 else 1)
            if size % degree:
                what = "batch" if dim == 0 else "sequence length" if name == "seq" else f"{name!r} dimension"
                micro = f" x {microbatches} microbatches" if dim == 0 and microbatches > 1 else ""
                raise ShardkitError(
                    f"{what} {size} is not divisible by {degree} (mesh axes {axes or '()'}{micro}; {_where(path)} "
                    f"of shape {tuple(leaf.shape)}); use a {what} that is a multiple of {degree}"
                )
    if len(examples) > 1:
        raise ShardkitError(
            "batch entries disagree on the number of examples: "
            + ", ".join(f"{where} has {n}" for n, where in examples.items())
        )


def place(batch: Batch, shardings: Any) -> Batch:
    """The batch on the mesh as `shardings` say: numpy arrays, or arrays committed elsewhere, are moved."""
    moved = lambda x, sh: x if getattr(x, "sharding", None) == sh else jax.device_put(x, sh)
    return jax.tree.map(moved, batch, shardings)


__all__ = ["Batch", "BatchAxes", "check", "is_names", "leaf_names", "place", "shardings"]
