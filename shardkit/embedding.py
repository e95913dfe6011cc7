"""The token embedding lookup as a kernel slot, `embed`: GSPMD's gather, or each device's own columns of the table.

    x = sk.embedding.lookup(table, tokens, ("vocab", "embed"), dtype)   # [batch, seq] ids -> [batch, seq, embed]

- `gather`: `jnp.take` on the table laid out by the compute rules, partitioned by GSPMD. Under FSDP (the table's
  `embed` columns split over `fsdp`, the activations' not) XLA all-gathers the whole table in the compute dtype for
  the lookup and, in the backward, builds the whole table's gradient in fp32 and reduce-scatters it: for a
  32000 x 1024 vocabulary on a v5e-8, 57 MB gathered, 115 MB reduce-scattered and 131 MB of temporaries a step.
- `local`: as MaxText looks tokens up under FSDP. Where the mesh axes that split the table's columns also split
  the batch (FSDP's `fsdp`), each device all-gathers the token ids of its group over those axes (int32: a few
  KB), looks them up in its own columns, and one all-to-all over the same axes hands every device the full rows
  of its own tokens, in the compute dtype. The backward is the reverse all-to-all and a scatter-add into the
  device's own columns: no table-sized collective or gradient (the data-parallel replicas of a column slice are
  summed by the `shard_map`'s transpose, a psum over the other batch axes, as for any parameter).
- `auto` (the default): `local` where it applies and the program is for a TPU (chosen from the mesh's devices,
  `rules.compile_platform`), else `gather`: CPU programs are unchanged, GPUs are not measured.

`local` needs the parameter rules of the table (which columns each device holds): the train step puts them in
the tracing context (`rules.use_rules(..., param_rules=...)`); where they are missing, or the table's vocabulary is
split, or its columns are split over an axis that does not split the batch, `auto` takes `gather` and an explicit
`local` is a ShardkitError saying which.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardkit import kernels
from shardkit.errors import ShardkitError
from shardkit.rules import compile_platform, constrain


def lookup(table: jax.Array, tokens: jax.Array, names: Sequence[str], dtype: Any) -> jax.Array:
    """Rows of `table` [vocab, embed] (logical `names`) for `tokens` [batch, seq], cast to `dtype`, by the active
    `embed` kernel."""
    kernel, _, ctx = kernels.active("embed")
    return kernel.fn(table, tokens, tuple(names), jnp.dtype(dtype), context=ctx)


def _axes(rules: Any, name: str, sizes: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in (rules.get(name) or ()) if sizes.get(a, 1) > 1)


def local_plan(context: Any, names: Sequence[str], tokens_shape: Sequence[int]) -> tuple[tuple, tuple, tuple] | str:
    """(the axes splitting the table's columns, the batch's axes, the sequence's axes) for `local`, or why not."""
    if context is None or getattr(context, "param_rules", None) is None:
        return "it runs inside a train step, which knows how the table is laid out"
    return plan_of(context.mesh.shape, context.param_rules, context.rules, names, tokens_shape[0])


def plan_of(mesh: Any, params: Any, compute: Any, names: Sequence[str], batch: int) -> tuple[tuple, tuple, tuple] | str:
    """`local_plan` from a mesh's axis sizes and the parameter and compute rules (no trace needed)."""
    mesh = dict(mesh)
    vocab, embed = names
    cols, batch_axes, seq = _axes(params, embed, mesh), _axes(compute, "batch", mesh), _axes(compute, "seq", mesh)
    if _axes(params, vocab, mesh):
        return f"the table's {vocab!r} rows are split over {_axes(params, vocab, mesh)}"
    if not cols:
        return f"the table's {embed!r} columns are not split (nothing to gather)"
    if not set(cols) <= set(batch_axes) or set(cols) & set(seq):
        return f"the table's columns are split over {cols}, which do not all split the batch ({batch_axes})"
    if batch % math.prod(mesh[a] for a in batch_axes):
        return f"{batch} sequences do not split over the batch axes {batch_axes}"
    return cols, batch_axes, seq


def _gather(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    return jnp.take(constrain(table, names), tokens, axis=0).astype(dtype)


def _local(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    plan = local_plan(context, names, tokens.shape)
    if isinstance(plan, str):
        raise ShardkitError(f"embed kernel 'local': {plan}; use embed=gather (or auto, which falls back)")
    cols, batch, seq = plan

    def body(columns: jax.Array, ids: jax.Array) -> jax.Array:
        group = jax.lax.all_gather(ids, cols, axis=0, tiled=True)  # the ids of every device sharing my columns
        rows = jnp.take(columns, group, axis=0).astype(dtype)  # [group batch, seq, my columns]
        return jax.lax.all_to_all(rows, cols, 0, 2, tiled=True)  # my tokens, every column

    manual = set(batch) | set(seq)  # other axes (tensor, ...) stay GSPMD's inside
    rows, out = P(batch, seq or None), P(batch, seq or None, None)
    return jax.shard_map(body, mesh=context.mesh, in_specs=(P(None, cols), rows), out_specs=out,
                         axis_names=manual)(table, tokens)  # fmt: skip


def _auto(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    mesh = getattr(context, "mesh", None)
    use_local = compile_platform(mesh) == "tpu" and not isinstance(local_plan(context, names, tokens.shape), str)
    return (_local if use_local else _gather)(table, tokens, names, dtype, context=context)


def planned(strategy: Any, mesh: dict[str, int], batch: int, platform: str) -> str:
    """The kernel `strategy`'s `embed` slot runs on a mesh of these axis sizes for a batch of `batch` sequences
    ("local" or "gather"): what the cost models price, without tracing (models/gpt.py's cost hook)."""
    from shardkit.strategies import strategy as get_strategy

    s = get_strategy(strategy)
    name = s.kernels.get("embed", kernels.DEFAULTS["embed"])
    if name == "gather" or (name == "auto" and platform != "tpu"):
        return "gather"
    plan = plan_of(mesh, s.param_rules, s.compute_rules, ("vocab", "embed"), batch)
    return "gather" if isinstance(plan, str) else "local"


kernels.register("embed", "gather", _gather, description="jnp.take under GSPMD (the table gathered where split)")
kernels.register("embed", "local", _local, description="each device's own columns + one all-to-all (MaxText's)")
kernels.register("embed", "auto", _auto, description="local on TPU where it applies, else gather")
kernels.DEFAULTS["embed"] = "auto"

__all__ = ["local_plan", "lookup", "planned"]
