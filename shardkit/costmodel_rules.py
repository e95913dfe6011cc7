"""Parameter traffic and state memory of any model's train step, predicted from the strategy's rules tables.

Works for any model and any strategy, registered ones included: what moves is decided by three layouts of each
parameter, all read from the tables: where it rests (parameter rules, S), where the forward needs it (its
logical names under the compute rules, C) and where the optimizer updates it (optimizer-state rules, O), plus
the mesh axes the batch is split over (B = the compute rule of `batch`; the data's other split dimensions, a
sequence over `seq`, reduce gradients in an all-reduce of their own, as XLA emits it). A layer-stack kernel
other than the scan (a pipeline) uses the stacked parameters where they rest: their `layers` axes count as C.
Checked against the compiled HLO (tests/test_explain.py; `python -m experiments.explain`): exact per row for
the GPT under a registered fsdp_mlp, cp_zigzag (data, seq) and pp_dp (data). Per parameter of n bytes:

- forward: all-gather over S - C of the n/|C| compute shard (ZeRO-3's gather); parameters with a `layers`
  dimension are gathered again in the backward (a scanned stack does not keep gathered weights as residuals).
  XLA may re-gather other parameters in the backward too: it does for every convolution kernel of
  models/resnet.py under fsdp (compiled all-gathers 2x the prediction), not for the GPT's embedding and head;
- backward: its gradient, a partial sum over the batch shards, is reduce-scattered over (B ∩ O) - C (ZeRO's
  reduce-scatter; on XLA:CPU an all-reduce of the whole buffer, see docs/jax_pitfalls.md §3) and all-reduced over the
  rest of B - C (data parallelism);
- update: all-gather over O - S when the optimizer state is sharded finer than the parameters (ZeRO-1).

Bytes are ring volumes per device (docs/algorithms.md §1), counts are one per (kind, axes): XLA combines the
per-parameter collectives. Activation collectives (Megatron's all-reduces, ring attention's permutes, the halo
exchange of a spatial convolution) depend on the model's computation, not on its parameters: they come from a
model's cost model (`explain` asks `sk.costmodel.for_config(model_cfg)`) or are reported as not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardkit.costmodel import Comm, CommBuilder
from shardkit.rules import logical_to_spec


def spec_axes(spec: Any) -> set[str]:
    """Every mesh axis a PartitionSpec shards over."""
    return {a for e in tuple(spec) if e is not None for a in ((e,) if isinstance(e, str) else e)}


def _deg(axes: set[str], mesh: Mapping[str, int]) -> int:
    return math.prod(mesh.get(a, 1) for a in axes)


def _data_axes(step: Any) -> list[set[str]]:
    """Mesh axes that split the data, one group per logical name of the batch (`batch` first, then e.g. `seq`)."""
    axes = step.batch_axes
    leaves = [axes] if isinstance(axes, tuple) and all(n is None or isinstance(n, str) for n in axes) else (
        jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)))  # fmt: skip
    names = dict.fromkeys(["batch", *(n for t in leaves for n in t if n is not None)])
    rules, mesh = step.bound.compute_rules, dict(step.mesh.shape)
    groups = [{a for a in (rules.get(n) or ()) if mesh.get(a, 1) > 1} for n in names]
    return [g for g in groups if g]


def state_comms(step: Any, backend: str) -> list[Comm]:
    """The parameter traffic of one train step of `step` (a TrainStep), by the rules (module docstring)."""
    mesh = dict(step.mesh.shape)
    b = CommBuilder(mesh, list(step.mesh.axis_names)[::-1], backend)
    rules = step.bound.compute_rules
    groups = _data_axes(step)
    batch = (
        groups[0] if groups and groups[0] == {a for a in (rules.get("batch") or ()) if mesh.get(a, 1) > 1} else set()
    )
    others = [g for g in groups if g is not batch]
    # a layer-stack kernel other than the scan (a pipeline) runs each stage's layers where they rest
    kernel_keeps_layers = step.strategy.kernels.get("layers", "scan") != "scan"
    stage_axes = set(step.bound.param_rules.get("layers") or ())
    names = jax.tree.leaves(step.param_names, is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(step.abstract_state().params)
    stored = jax.tree.leaves(step.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    updated = jax.tree.leaves(step.update_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    order = lambda axes: ",".join(a for a in step.mesh.axis_names if a in axes)
    for n, sds, s, o in zip(names, shapes, stored, updated, strict=True):
        full = math.prod(sds.shape) * np.dtype(sds.dtype).itemsize
        # the docstring's S, C, O: where it rests, where the forward uses it, where it is updated
        rest, use, upd = spec_axes(s.spec), spec_axes(logical_to_spec(n, rules, step.mesh)), spec_axes(o.spec)
        if kernel_keeps_layers and "layers" in n:
            use |= stage_axes & rest
        shard = full / _deg(use, mesh)
        if rest - use:
            b.add("all-gather", order(rest - use), shard, 0, "parameters gathered for the forward")
            if "layers" in n:
                b.add("all-gather", order(rest - use), shard, 0, "stacked layers' parameters gathered again in bwd")
        rs, ar = (batch & upd) - use, batch - upd - use
        if rs:
            b.add("reduce-scatter", order(rs), shard, 0, "gradients onto their shards", gspmd=True)
        if ar:
            b.add("all-reduce", order(ar), shard / _deg(rs, mesh), 0, "gradients over the batch axes")
        for g in others:  # the data's other split dimensions (sequence): their own all-reduce, as XLA emits it
            if g - use:
                b.add("all-reduce", order(g - use), shard / _deg(rs, mesh), 0, "gradients over a split data dim")
        if upd - rest:
            b.add("all-gather", order(upd - rest), full / _deg(rest, mesh), 0, "updated parameters, optimizer shards")
    return [Comm(**{**c.__dict__, "count": 1}) for c in b.comms()]


def state_memory(step: Any, state: Any) -> dict[str, float]:
    """Bytes per device of parameters, gradients (in the optimizer's layout) and optimizer state: exact, from
    the shardings. Activations are not modelled here."""
    sizes = dict(step.mesh.shape)

    def tree_bytes(tree: Any, shardings: Any) -> float:
        total = 0.0
        for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
            total += math.prod(x.shape) * np.dtype(x.dtype).itemsize / _deg(spec_axes(sh.spec), sizes)
        return total

    return {
        "params": tree_bytes(state.params, step.param_shardings),
        "grads": tree_bytes(state.params, step.update_shardings),
        "optimizer": tree_bytes(state.opt_state, step.opt_shardings),
    }


__all__ = ["spec_axes", "state_comms", "state_memory"]
