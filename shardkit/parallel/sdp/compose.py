"""SDP composed with FSDP and Megatron tensor parallelism inside each worker.

Subnetwork data parallelism (Singh et al., arXiv 2507.09029) makes each `data` coordinate a worker holding k of
the G blocks (sdp.py). With a mesh `data=D, fsdp=F` (or `tensor=T`) each worker is the F (or T) devices that
share its `data` coordinate: they split the worker's batch shard and store its owned slots ZeRO-3 style
(`fsdp`: FSDP's rules on the stored `[workers, k, ...]` arrays' remaining dimensions) or Megatron style (`tensor`:
column / row splits of every block's heads and MLP units). The step's `shard_map` is manual over `data` only;
the other axes stay automatic, so GSPMD partitions each worker's subnetwork by the strategy's compute rules (with
`data` removed) exactly as it partitions the fsdp / tp strategies' whole network. Holder averaging then runs per
array on each device's shard (every fsdp / tensor coordinate averages its own slice over the holders along
`data`), so its bytes per device shrink by the array's fsdp x tensor degree.

Per-device state bytes (parameters; the optimizer state is copies of their layout), derived: an array of E
elements whose logical names map to mesh axes of total degree d (FSDP's `embed` / `channels` -> fsdp, Megatron's
`heads`, `mlp`, `vocab`, ... -> tensor) stores E / d elements per device if shared, and k / G of that if split
(a device stores its worker's k slots of G):

    bytes = itemsize x [ sum_shared E_a / d_a  +  coverage x sum_split E_a / d_a ]

`state_bytes(step)` evaluates it from the names and rules alone (not from the shardings it checks);
tests/test_sdp_compose.py compares it with the compiled step's argument bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.errors import ShardkitError
from shardkit.init import split_params
from shardkit.rules import MeshAxes, use_rules

#: mesh axes SDP composes with inside a worker, and what each does there
INNER_AXES = {"fsdp": "ZeRO-3 inside each worker", "tensor": "Megatron inside each block"}


def inner_axes(mesh: Mesh, cfg: Any, microbatches: int) -> dict[str, int]:
    """The mesh's axes (size > 1) besides the workers' axis: fsdp and / or tensor; ShardkitError for any other."""
    if microbatches < 1:
        raise ShardkitError(f"microbatches={microbatches} must be >= 1")
    if cfg.axis not in mesh.shape:
        raise ShardkitError(f"sdp runs its workers over mesh axis {cfg.axis!r}, which the mesh {dict(mesh.shape)} "
                            f"lacks: use e.g. --config.mesh={cfg.axis}=8")  # fmt: skip
    extra = {a: n for a, n in mesh.shape.items() if a != cfg.axis and n > 1}
    for a, n in extra.items():
        if a not in INNER_AXES:
            raise ShardkitError(
                f"sdp with mesh axis {a!r} (size {n}): SDP does not compose with it. It composes with "
                f"{', '.join(f'{k} ({v})' for k, v in INNER_AXES.items())}; drop {a!r} from the mesh"
            )
    if len(extra) > 1:  # XLA's SPMD partitioner aborts the process on it (jax 0.10.2): refused, not crashed
        raise ShardkitError(
            f"sdp with {extra}: a worker may span fsdp or tensor, not both at once. The step's shard_map, manual "
            f"over {cfg.axis!r} with two automatic axes, makes XLA's SPMD partitioner abort (a CHECK failure in "
            "spmd_partitioner_util.cc, jax 0.10); use data x fsdp or data x tensor"
        )
    if extra and cfg.masking == "backward":
        raise ShardkitError(f"sdp masking='backward' keeps a full replica per worker and runs on {cfg.axis!r} alone; "
                            f"the mesh has {extra}: use masking='forward' with fsdp / tensor")  # fmt: skip
    if extra.get("tensor", 1) > 1 and cfg.granularity == "neuron":
        raise ShardkitError(
            f"sdp granularity='neuron' with tensor={extra['tensor']}: SDP cuts the {cfg.units!r} units into groups "
            "per worker and Megatron would split the same units over tensor; use granularity='block' with tensor "
            "(or neuron-level SDP with fsdp)"
        )
    return extra


def inner_rules(rules: dict[str, MeshAxes], axis: str) -> dict[str, MeshAxes]:
    """Compute rules inside the `shard_map` manual over `axis`: `axis` removed (it is each worker's own)."""
    return {name: tuple(a for a in (axes or ()) if a != axis) or None for name, axes in rules.items()}


@contextmanager
def inner_tracing(rules: dict[str, MeshAxes], kernels: Any) -> Iterator[None]:
    """The worker's rules on the abstract mesh of the `shard_map` (data manual, fsdp / tensor automatic)."""
    with use_rules(jax.sharding.get_abstract_mesh(), rules, kernels=kernels):
        yield


def manual_spec(spec: P, axis: str) -> P:
    """A PartitionSpec with every mesh axis but `axis` dropped: what `shard_map(axis_names={axis})` takes."""
    out = []
    for entry in spec:
        axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        out.append(axis if axis in axes else None)
    if any(isinstance(e, tuple) and axis in e and e[0] != axis for e in spec):
        raise ShardkitError(f"sdp: the batch spec {spec} puts {axis!r} inside another axis; {axis!r} must be outer")
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def layout_shardings(split: Any, full_sharding: NamedSharding, mesh: Mesh, axis: str) -> NamedSharding:
    """A stored split array [workers, k, ...]: workers over `axis`, the rest as the full array's own dimensions."""
    if split is None:
        return full_sharding
    return NamedSharding(mesh, P(axis, None, *full_sharding.spec))


def degree(names: tuple, rules: dict[str, MeshAxes], mesh: Mesh) -> int:
    """How many devices split an array named `names` under `rules` (the product of its mapped mesh axes)."""
    return math.prod(mesh.shape[a] for n in (names or ()) if n is not None for a in (rules.get(n) or ()))


def state_bytes(step: Any) -> int:
    """Per-device parameter bytes of an SDP step by the module docstring's formula (optimizer state: the same per
    copy of the parameters it keeps)."""
    full = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(step.source_model)[1]))
    rules, mesh = step.bound.param_rules, step.mesh
    is_names = lambda x: isinstance(x, tuple)
    total = 0.0
    for names, x, s in zip(jax.tree.leaves(step.param_names, is_leaf=is_names), jax.tree.leaves(full),
                           jax.tree.leaves(step.splits, is_leaf=lambda v: v is None or hasattr(v, "groups")),
                           strict=True):  # fmt: skip
        share = 1.0 if s is None else step.cfg.coverage
        total += x.size * x.dtype.itemsize * share / degree(names, rules, mesh)
    return round(total)


__all__ = ["INNER_AXES", "inner_axes", "inner_rules", "manual_spec", "state_bytes"]
