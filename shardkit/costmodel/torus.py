"""A reduce-scatter over every chip of a TPU torus slice is compiled as an all-reduce: [n] -> [n] (then a slice).

XLA's SPMD partitioner writes a gradient's reduce-scatter as an all-reduce and a dynamic-slice; libtpu's pass
`tpu-all-reduce-scatter-fusion` fuses the pair into one reduce-scatter, except over a group that is a whole v4 / v5p
slice with wraparound links (v5p-128 = 4x4x4 and up, `shardkit.targets.wraparound`): there it leaves the
all-reduce, twice the reduce-scatter's bytes, whatever the buffer's size, dtype or scattered dimension (one-weight
programs compiled by libtpu 0.0.42.1 for v5p-128, v5p-256 and v4-128; an open v5p-64 keeps its reduce-scatters;
docs/targets.md §6). A cost model predicts reduce-scatters; `as_compiled` writes its rows as the TPU compiler
emits them on such a slice: `sk.plan` and `sk.explain` apply it for a TPU target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from shardkit.costmodel.comms import Comm, merge_comms, ring_factor

#: generations whose slices of 4 x 4 x 4 chips and up close every ICI dimension into a ring (targets.wraparound)
TORUS_GENERATIONS = ("v4", "v5p")


def torus_chips(where: Any) -> int:
    """Chips of one slice when it is a v4 / v5p torus (every side >= 4 chips), else 0. `where`: an `sk.target`, a
    HardwarePreset named for one (`Target.preset()`, what `sk.plan` gets), or a mesh of TPU devices."""
    from shardkit import targets

    if hasattr(where, "axis_names") and getattr(where, "devices", None) is not None:  # a jax Mesh: its own devices
        return _mesh_torus_chips(where)
    name = getattr(where, "name", where)
    if not isinstance(name, str) or getattr(where, "platform", "tpu") != "tpu":
        return 0
    try:
        t = targets.target(name)
    except Exception:  # a preset that names no target (meshes/*.toml): its slice is not known
        return 0
    if getattr(t, "generation", "") not in TORUS_GENERATIONS:
        return 0
    return t.chips_per_slice if targets.wraparound(t.topology) == (True, True, True) else 0


def _mesh_torus_chips(mesh: Any) -> int:
    from shardkit.targets import _KINDS

    devices = list(mesh.devices.flat)
    if not devices or devices[0].platform != "tpu" or _KINDS.get(devices[0].device_kind) not in TORUS_GENERATIONS:
        return 0
    first = [d for d in devices if getattr(d, "slice_index", 0) == getattr(devices[0], "slice_index", 0)]
    coords = [tuple(getattr(d, "coords", ())) for d in first]
    if not coords or len(coords[0]) != 3:
        return 0
    sides = [max(c[i] for c in coords) + 1 for i in range(3)]
    whole = math.prod(sides) == len(set(coords))  # the mesh holds the whole slice
    return len(first) if whole and min(sides) >= 4 else 0


def as_compiled(comms: Iterable[Comm], chips: int) -> list[Comm]:
    """`comms` as the TPU compiler emits them on a torus slice of `chips` chips: each reduce-scatter whose group is
    the whole slice becomes the all-reduce of the same buffer (its bytes x 2(p-1)/p over (p-1)/p); `chips` = 0: as
    they are."""
    rows = list(comms)
    if not chips:
        return rows
    out = []
    for c in rows:
        if c.kind == "reduce-scatter" and c.group == chips:
            scale = ring_factor("all-reduce", c.group) / ring_factor("reduce-scatter", c.group)
            c = dataclasses.replace(c, kind="all-reduce", bytes=c.bytes * scale,
                                    what=c.what + " (TPU torus: all-reduce + slice)")  # fmt: skip
        out.append(c)
    return merge_comms(out)


__all__ = ["TORUS_GENERATIONS", "as_compiled", "torus_chips"]
