"""Parameter traffic and state memory of any model's train step, predicted from the strategy's rules tables.

Works for any model and any strategy, registered ones included: what moves is decided by three layouts of each
parameter, all read from the tables: where it rests (parameter rules, S), where the forward needs it (its
logical names under the compute rules, C) and where the optimizer updates it (optimizer-state rules, O), plus
the mesh axes the batch is split over (B = the compute rule of `batch`). Per parameter of n bytes:

- forward: all-gather over S - C of the n/|C| compute shard (ZeRO-3's gather); parameters with a `layers`
  dimension are gathered again in the backward (a scanned stack does not keep gathered weights as residuals).
  XLA may re-gather other parameters in the backward too: it does for every convolution kernel of
  models/resnet.py under fsdp (compiled all-gathers 2x the prediction), not for the GPT's embedding and head;
- backward: its gradient, a partial sum over the batch shards, is reduce-scattered over (B ∩ O) - C (ZeRO's
  reduce-scatter; on XLA:CPU an all-reduce of the whole buffer, see JAX_NOTES.md) and all-reduced over the
  rest of B - C (data parallelism);
- update: all-gather over O - S when the optimizer state is sharded finer than the parameters (ZeRO-1).

Bytes are ring volumes per device (ALGORITHMS.md §1), counts are one per (kind, axes): XLA combines the
per-parameter collectives. Activation collectives (Megatron's all-reduces, ring attention's permutes, the halo
exchange of a spatial convolution) depend on the model's computation, not on its parameters: they come from a
model-side hook (`explain` asks the model config's `cost_model`) or are reported as not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardkit.costmodel import Comm, _Builder, _merge
from shardkit.rules import logical_to_spec


def spec_axes(spec: Any) -> set[str]:
    """Every mesh axis a PartitionSpec shards over."""
    return {a for e in tuple(spec) if e is not None for a in ((e,) if isinstance(e, str) else e)}


def _deg(axes: set[str], mesh: Mapping[str, int]) -> int:
    return math.prod(mesh.get(a, 1) for a in axes)


def state_comms(step: Any, backend: str) -> list[Comm]:
    """The parameter traffic of one train step of `step` (a TrainStep), by the rules (module docstring)."""
    mesh = dict(step.mesh.shape)
    b = _Builder(mesh, list(step.mesh.axis_names)[::-1], backend)
    rules = step.bound.compute_rules
    batch = {a for a in (rules.get("batch") or ()) if mesh.get(a, 1) > 1}
    names = jax.tree.leaves(step.param_names, is_leaf=lambda x: isinstance(x, tuple))
    shapes = jax.tree.leaves(step.abstract_state().params)
    stored = jax.tree.leaves(step.param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    updated = jax.tree.leaves(step.update_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    order = lambda axes: ",".join(a for a in step.mesh.axis_names if a in axes)
    for n, sds, s, o in zip(names, shapes, stored, updated, strict=True):
        full = math.prod(sds.shape) * np.dtype(sds.dtype).itemsize
        # the docstring's S, C, O: where it rests, where the forward uses it, where it is updated
        rest, use, upd = spec_axes(s.spec), spec_axes(logical_to_spec(n, rules, step.mesh)), spec_axes(o.spec)
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
        if upd - rest:
            b.add("all-gather", order(upd - rest), full / _deg(rest, mesh), 0, "updated parameters, optimizer shards")
    return [Comm(**{**c.__dict__, "count": 1}) for c in _merge(b.rows)]


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
