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
import numpy as np
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


def _is_shape_dtype(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple | list)


def structs(shapes: Any) -> Any:
    """ShapeDtypeStructs (no sharding yet) from a pytree whose leaves are (shape, dtype) pairs, ShapeDtypeStructs or
    arrays: `{"inputs": ((8, 2048), jnp.int32)}` -> `{"inputs": ShapeDtypeStruct((8, 2048), int32)}`."""

    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        if _is_shape_dtype(x) and all(isinstance(d, int | np.integer) for d in x[0]):
            return jax.ShapeDtypeStruct(tuple(int(d) for d in x[0]), np.dtype(x[1]))
        raise ShardkitError(
            f"abstract_batch: a leaf {x!r} is not (shape, dtype), a ShapeDtypeStruct or an array; write e.g. "
            '{"inputs": ((8, 2048), jnp.int32), "targets": ((8, 2048), jnp.int32)}'
        )

    return jax.tree.map(leaf, shapes, is_leaf=_is_shape_dtype)


def place(batch: Batch, shardings: Any) -> Batch:
    """The batch on the mesh as `shardings` say: numpy arrays, or arrays committed elsewhere, are moved."""
    moved = lambda x, sh: x if getattr(x, "sharding", None) == sh else jax.device_put(x, sh)
    return jax.tree.map(moved, batch, shardings)


#: dtype kinds `expect` tells apart, as numpy names them
_KINDS = {"integer": "an integer", "floating": "a floating", "number": "a numeric"}


def expect(
    batch: Batch, model: str, entries: dict[str, tuple[int, str]],
    optional: dict[str, tuple[int, str]] | None = None, same_shape: tuple[str, ...] = (),
) -> None:  # fmt: skip
    """A model's own check of the batch its loss reads, before XLA sees it (`validate_batch` hooks use this).

    `entries` / `optional`: key -> (rank, dtype kind: "integer", "floating" or "number"); a missing required key,
    another rank or dtype kind is a ShardkitError naming the key, what was found and what the model reads.
    `same_shape`: keys (those present) that must have one shape, e.g. a language model's inputs and targets.
    Works on arrays and on abstract `jax.ShapeDtypeStruct`s alike (no values are read).
    """
    if not isinstance(batch, dict):
        raise ShardkitError(
            f"{model}: the batch must be a dict with keys {sorted(entries)}, got {type(batch).__name__}"
        )
    wants = ", ".join(f"{k!r}: {_KINDS[kind]} [{rank}-D] array" for k, (rank, kind) in entries.items())
    missing = [k for k in entries if k not in batch]
    if missing:
        raise ShardkitError(f"{model}: the batch has no {missing[0]!r} (keys: {sorted(batch)}); its loss reads {wants}")
    for key, (rank, kind) in {**entries, **{k: v for k, v in (optional or {}).items() if k in batch}}.items():
        x = batch[key]
        shape, dtype = tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)
        if len(shape) != rank:
            raise ShardkitError(f"{model}: batch[{key!r}] has shape {shape} ({len(shape)}-D); it must be {rank}-D")
        if dtype is None or not jax.numpy.issubdtype(dtype, getattr(jax.numpy, kind)):
            raise ShardkitError(f"{model}: batch[{key!r}] has dtype {dtype}; it must be {_KINDS[kind]} dtype "
                                f"(e.g. {'int32' if kind == 'integer' else 'float32'})")  # fmt: skip
    present = [k for k in same_shape if k in batch]
    shapes = {k: tuple(batch[k].shape) for k in present}
    if len(set(shapes.values())) > 1:
        raise ShardkitError(f"{model}: batch entries {present} must have one shape, found {shapes}")


def expect_ids(batch: Batch, model: str, key: str, limit: int, what: str, fix: str) -> None:
    """Integer ids in `batch[key]` lie in [0, limit) (`what` names the limit, e.g. "vocab_size=384"): outside, a
    gather or a cross-entropy reads past its table silently inside jit. Only concrete arrays are read (device
    arrays are read back, so the train step calls this on a batch signature's first batch only)."""
    x = batch.get(key) if isinstance(batch, dict) else None
    if not isinstance(x, np.ndarray | jax.Array) or isinstance(x, jax.core.Tracer) or not x.size:
        return
    lo, hi = int(np.min(x)), int(np.max(x))
    if lo < 0 or hi >= limit:
        raise ShardkitError(f"{model}: batch[{key!r}] must be in [0, {what}), found {lo}..{hi}; {fix}")


__all__ = ["Batch", "BatchAxes", "check", "expect", "expect_ids", "is_names", "leaf_names", "place", "shardings"]
