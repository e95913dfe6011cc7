"""Which gradient reduce-scatters a TPU torus slice compiles as all-reduces: [n] -> [n] (then a slice), not [n / p].

XLA's SPMD partitioner writes a gradient's reduce-scatter as an all-reduce and a dynamic-slice; libtpu's pass
`tpu-all-reduce-scatter-fusion` fuses the pair into one reduce-scatter, except on a v4 / v5p slice with wraparound
links (4 x 4 x 4 chips and up, `shardkit.targets.wraparound`), read from programs compiled by libtpu 0.0.42.1
(docs/targets.md §6, with the tables):

- over every chip of the slice (fsdp=64 on a v5p-128, fsdp=128 on a v5p-256) it keeps the all-reduce, whatever the
  buffer's size, dtype or scattered dimension (one-weight gradients, 8 shapes each on v5p-128, v5p-256, v4-128; an
  open v5p-64's 32 chips keep their reduce-scatters);
- over a group that must span all three ICI dimensions (more chips than the slice's largest face, chips / shortest
  side: 32 or 64 of a v5p-128's 4 x 4 x 4, 64 of a v5p-256's 4 x 4 x 8) the GPT's programs keep the all-reduce for
  the matrices scattered along their last dimension (wo, w_down: the embedding dimension is their output) and fuse
  the others' (gpt_7b fsdp data=2,fsdp=32; gpt_70b fsdp data=2,fsdp=64 and tp3d depth=64,row=2); within a face (16
  of 64, 32 of a v5p-256) every one is fused. (One-weight programs on such groups are fused or not by buffer shape
  beyond this rule; the rule is what the GPT's matrices at 7B and 70B compile to.)

A cost model predicts reduce-scatters (`Comm.last_dim`: those along the last dimension); `as_compiled` writes its
rows as the TPU compiler emits them on such a slice. `sk.plan` and `sk.explain` apply it for a TPU target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from shardkit.costmodel.comms import Comm, merge_comms, ring_factor

#: generations whose slices of 4 x 4 x 4 chips and up close every ICI dimension into a ring (targets.wraparound)
TORUS_GENERATIONS = ("v4", "v5p")


def torus_slice(where: Any) -> tuple[int, ...]:
    """The sides of one slice when it is a v4 / v5p torus (every side >= 4 chips), else (). `where`: an
    `sk.target`, a HardwarePreset named for one (`Target.preset()`, what `sk.plan` gets), or a mesh of TPU devices."""
    from shardkit import targets
    from shardkit.errors import ShardkitError

    if hasattr(where, "axis_names") and getattr(where, "devices", None) is not None:  # a jax Mesh: its own devices
        return _mesh_slice(where)
    name = getattr(where, "name", where)
    if not isinstance(name, str) or getattr(where, "platform", "tpu") != "tpu":
        return ()
    try:
        t = targets.target(name)
    except ShardkitError:  # a preset that names no target (meshes/*.toml): its slice is not known
        return ()
    if getattr(t, "generation", "") not in TORUS_GENERATIONS or targets.wraparound(t.topology) != (True,) * 3:
        return ()
    return tuple(int(x) for x in t.topology.partition(":")[2].split("x"))


def _mesh_slice(mesh: Any) -> tuple[int, ...]:
    from shardkit.targets import _KINDS

    devices = list(mesh.devices.flat)
    if not devices or devices[0].platform != "tpu" or _KINDS.get(devices[0].device_kind) not in TORUS_GENERATIONS:
        return ()
    first = getattr(devices[0], "slice_index", 0)
    coords = {tuple(getattr(d, "coords", ())) for d in devices if getattr(d, "slice_index", 0) == first}
    if not coords or any(len(c) != 3 for c in coords):
        return ()
    sides = tuple(max(c[i] for c in coords) + 1 for i in range(3))
    return sides if math.prod(sides) == len(coords) and min(sides) >= 4 else ()  # the whole slice, a torus


def all_reduced(group: int, last_dim: bool, sides: tuple[int, ...]) -> bool:
    """Whether the TPU compiler keeps a reduce-scatter over `group` chips of a torus slice with `sides` as an
    all-reduce (module docstring): over the whole slice, or along the buffer's last dimension over a group larger
    than the slice's largest face."""
    if not sides:
        return False
    chips = math.prod(sides)
    return group == chips or (last_dim and group > chips // min(sides))


def as_compiled(comms: Iterable[Comm], sides: tuple[int, ...]) -> list[Comm]:
    """`comms` as the TPU compiler emits them on a torus slice with `sides` (`torus_slice`; () or None: as they
    are): each reduce-scatter it keeps as an all-reduce (`all_reduced`) becomes that all-reduce of the same buffer,
    its bytes x 2 (2(p-1)/p over (p-1)/p)."""
    rows = list(comms)
    if not sides:
        return rows
    out = []
    for c in rows:
        if c.kind != "reduce-scatter":
            out.append(c)
            continue
        whole = all_reduced(c.group, False, sides)
        n, sent = (c.count, c.bytes) if whole else c.last_dim if all_reduced(c.group, True, sides) else (0, 0.0)
        if n or sent:
            scale = ring_factor("all-reduce", c.group) / ring_factor("reduce-scatter", c.group)
            out.append(dataclasses.replace(c, kind="all-reduce", count=n, bytes=sent * scale, last_dim=(0, 0.0),
                                           what=c.what + " (TPU torus: all-reduce + slice)"))  # fmt: skip
        if c.count - n or c.bytes - sent > 0:
            out.append(dataclasses.replace(c, count=c.count - n, bytes=c.bytes - sent))
    return merge_comms(out)


__all__ = ["TORUS_GENERATIONS", "all_reduced", "as_compiled", "torus_slice"]
