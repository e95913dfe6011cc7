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
- `vocab`: Megatron's vocabulary-parallel embedding (Shoeybi et al. 2019, "Megatron-LM", section 3). Where the
  table's vocabulary rows are split over axes that do not split the tokens (tensor parallelism's `tensor`), each
  device looks its tokens up in its own rows (a token outside them gives zeros) and the rows are summed over those
  axes (one all-reduce of the activations). The backward scatter-adds into the device's own rows: no table-sized
  gradient, where GSPMD's gather builds the whole table's gradient on every device and all-reduces it.
- `auto` (the default): `local`, else `vocab`, where it applies and the program is for a TPU or a GPU (chosen from
  the mesh's devices, `rules.platform_family`), else `gather`: CPU programs are unchanged. Measured on both
  compilers (docs/performance.md): on an 8 x H100 node under fsdp, 214.6 MB less sent a step than the gather.

`local` and `vocab` need the parameter rules of the table (which columns or rows each device holds): the train
step puts them in the tracing context (`rules.use_rules(..., param_rules=...)`). Each has a plan (`local_plan`,
`vocab_plan`) that says from the mesh's axis sizes and the rules whether it applies; `choose` resolves `auto` from
them, for the traced step and for the cost models (`planned`) alike. Where neither applies `auto` takes `gather`,
and an explicit kernel that does not apply is a ShardkitError saying why.
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
from shardkit.rules import constrain, platform_family
from shardkit.strategies import BoundStrategy, Strategy
from shardkit.strategies import strategy as get_strategy


def lookup(table: jax.Array, tokens: jax.Array, names: Sequence[str], dtype: Any) -> jax.Array:
    """Rows of `table` [vocab, embed] (logical `names`) for `tokens` [batch, seq], cast to `dtype`, by the active
    `embed` kernel."""
    kernel, _, ctx = kernels.active("embed")
    return kernel.fn(table, tokens, tuple(names), jnp.dtype(dtype), context=ctx)


def _axes(rules: Any, name: str, sizes: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in (rules.get(name) or ()) if sizes.get(a, 1) > 1)


def local_plan(mesh: Any, params: Any, compute: Any, names: Sequence[str], batch: int) -> tuple | str:
    """(the axes splitting the table's columns, the batch's axes, the sequence's axes) for `local`, or why not,
    from a mesh's axis sizes, the parameter and compute rules, the table's logical names and the batch size."""
    mesh, (vocab, embed), n = dict(mesh), names, batch
    cols, batch, seq = _axes(params, embed, mesh), _axes(compute, "batch", mesh), _axes(compute, "seq", mesh)
    if _axes(params, vocab, mesh):
        return f"the table's {vocab!r} rows are split over {_axes(params, vocab, mesh)}"
    if not cols:
        return f"the table's {embed!r} columns are not split (nothing to gather)"
    if not set(cols) <= set(batch) or set(cols) & set(seq):
        return f"the table's columns are split over {cols}, which do not all split the batch ({batch})"
    if n % math.prod(mesh[a] for a in batch):
        return f"{n} sequences do not split over the batch axes {batch}"
    return cols, batch, seq


def vocab_plan(mesh: Any, params: Any, compute: Any, names: Sequence[str], batch: int) -> tuple | str:
    """(the axes splitting the table's rows, the batch's axes, the sequence's axes) for `vocab`, or why not (the
    arguments as `local_plan`'s)."""
    mesh, (vocab, embed), n = dict(mesh), names, batch
    rows, batch, seq = _axes(params, vocab, mesh), _axes(compute, "batch", mesh), _axes(compute, "seq", mesh)
    if not rows:
        return f"the table's {vocab!r} rows are not split"
    if _axes(params, embed, mesh) or set(rows) & (set(batch) | set(seq)):
        return f"the table is split over more than its rows' {rows}, or they also split the tokens"
    if n % math.prod(mesh[a] for a in batch):
        return f"{n} sequences do not split over the batch axes {batch}"
    return rows, batch, seq


#: the kernels that need a plan, in `auto`'s order of preference
PLANS = {"local": local_plan, "vocab": vocab_plan}


def choose(name: str, platform: str, mesh: Any, params: Any, compute: Any, names: Sequence[str], batch: int) -> str:
    """The kernel the `embed` slot set to `name` runs: `auto` is the first of PLANS whose plan applies on a TPU or
    GPU, else `gather`; any other name is itself. The traced step and the cost models (`planned`) both ask this."""
    if name != "auto":
        return name
    for kernel, plan in PLANS.items() if platform in ("tpu", "gpu") else ():
        if not isinstance(plan(mesh, params, compute, names, batch), str):
            return kernel
    return "gather"


def _laid_out(context: Any) -> bool:
    """Whether the traced train step says how its parameters are laid out (the plans need it)."""
    return context is not None and getattr(context, "param_rules", None) is not None


def _gather(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    return jnp.take(constrain(table, names), tokens, axis=0).astype(dtype)


def _planned(kernel: str, context: Any, names: Sequence[str], tokens: jax.Array) -> tuple:
    """PLANS[kernel] for the train step being traced, or a ShardkitError saying why it does not apply."""
    plan = "it runs inside a train step, which knows how the table is laid out"
    if _laid_out(context):
        plan = PLANS[kernel](context.mesh.shape, context.param_rules, context.rules, names, tokens.shape[0])
    if isinstance(plan, str):
        raise ShardkitError(f"embed kernel {kernel!r}: {plan}; use embed=gather (or auto, which falls back)")
    return plan


def _local(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    cols, batch, seq = _planned("local", context, names, tokens)

    def body(columns: jax.Array, ids: jax.Array) -> jax.Array:
        group = jax.lax.all_gather(ids, cols, axis=0, tiled=True)  # the ids of every device sharing my columns
        rows = jnp.take(columns, group, axis=0).astype(dtype)  # [group batch, seq, my columns]
        return jax.lax.all_to_all(rows, cols, 0, 2, tiled=True)  # my tokens, every column

    manual = set(batch) | set(seq)  # other axes (tensor, ...) stay GSPMD's inside
    rows, out = P(batch, seq or None), P(batch, seq or None, None)
    return jax.shard_map(body, mesh=context.mesh, in_specs=(P(None, cols), rows), out_specs=out,
                         axis_names=manual)(table, tokens)  # fmt: skip


def _vocab(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    rows, batch, seq = _planned("vocab", context, names, tokens)

    def body(mine: jax.Array, ids: jax.Array) -> jax.Array:
        first = jax.lax.axis_index(rows) * mine.shape[0]  # my rows are [first, first + len)
        local = ids - first
        inside = (local >= 0) & (local < mine.shape[0])
        found = jnp.take(mine, jnp.where(inside, local, 0), axis=0) * inside[..., None].astype(mine.dtype)
        return jax.lax.psum(found.astype(dtype), rows)  # each token's row is on exactly one device

    ids = P(batch or None, seq or None)
    return jax.shard_map(body, mesh=context.mesh, in_specs=(P(rows, None), ids), out_specs=P(*ids, None),
                         axis_names=set(rows) | set(batch) | set(seq))(table, tokens)  # fmt: skip


def _auto(table: jax.Array, tokens: jax.Array, names: tuple, dtype: Any, *, context: Any = None) -> jax.Array:
    kernel = "gather"
    if _laid_out(context):
        args = (context.mesh.shape, context.param_rules, context.rules, names, tokens.shape[0])
        kernel = choose("auto", platform_family(context.mesh), *args)
    return KERNELS[kernel](table, tokens, names, dtype, context=context)


def planned(strategy: str | Strategy | BoundStrategy, mesh: dict[str, int], batch: int, platform: str) -> str:
    """The kernel `strategy`'s `embed` slot runs on a mesh of these axis sizes for a batch of `batch` sequences
    ("local", "vocab" or "gather"): what the cost models price, without tracing (models/gpt.py's cost hook)."""
    s = get_strategy(strategy)  # a Strategy or BoundStrategy as it is (a name is looked up)
    name = s.kernels.get("embed", kernels.DEFAULTS["embed"])
    return choose(name, platform, mesh, s.param_rules, s.compute_rules, ("vocab", "embed"), batch)


KERNELS = {"gather": _gather, "local": _local, "vocab": _vocab}
kernels.register("embed", "gather", _gather, description="jnp.take under GSPMD (the table gathered where split)")
kernels.register("embed", "local", _local, description="each device's own columns + one all-to-all (MaxText's)")
kernels.register("embed", "vocab", _vocab, description="each device's own rows + one all-reduce (Megatron's)")
kernels.register("embed", "auto", _auto, description="local, else vocab, on TPU / GPU where they apply, else gather")
kernels.DEFAULTS["embed"] = "auto"

__all__ = ["PLANS", "choose", "local_plan", "lookup", "planned", "vocab_plan"]
