"""Device meshes from a short spec, a dict or a hardware preset, validated before JAX sees them.

    sk.make_mesh("data=2,fsdp=2,tensor=2")     # degrees in order, outermost (slowest links) first
    sk.make_mesh({"data": -1, "tensor": 2})     # one axis may be -1: it takes the remaining devices
    sk.make_mesh("cpu8")                        # a preset from meshes/: hardware described as data

Meshes use Auto axis types (the GSPMD path): shardings are given by rules tables and XLA inserts the
collectives. Presets are TOML files in `meshes/` (see `meshes/README.md` for the fields and sources).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.errors import ShardkitError
from shardkit.presets import (  # noqa: F401  (re-exported: their home was this module)
    KNOWN_AXES,
    DeviceGroup,
    HardwarePreset,
    Link,
    available_presets,
    check_axes,
    load_preset,
    preset_dirs,
)
from shardkit.targets import target as get_target


def parse_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """'data=2,fsdp=4' or {'data': 2, 'fsdp': 4} -> {'data': 2, 'fsdp': 4} (order kept, not yet resolved)."""
    if isinstance(spec, Mapping):
        return {str(k): v for k, v in spec.items()}
    axes: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, degree = part.partition("=")
        name = name.strip()
        try:
            if not eq:
                raise ValueError
            value = int(degree)
        except ValueError:
            raise ShardkitError(
                f"cannot read mesh spec {spec!r} at {part!r}: write axis=degree pairs, e.g. 'data=2,fsdp=4' "
                "(one degree may be -1), or give a preset name"
            ) from None
        if name in axes:
            raise ShardkitError(f"mesh spec {spec!r} names axis {name!r} twice; give each axis once")
        axes[name] = value
    return axes


def resolve_axes(spec: str | Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Validates a spec against a device count and fills the one -1 axis."""
    axes = parse_spec(spec)
    if not axes:
        raise ShardkitError(f"empty mesh spec {spec!r}; e.g. 'data={num_devices}'")
    check_axes(axes)
    fill = [a for a, d in axes.items() if d == -1]
    if len(fill) > 1:
        raise ShardkitError(f"mesh spec {spec!r} has -1 on {fill}: only one axis can take the remaining devices")
    known = math.prod(d for d in axes.values() if d != -1)
    if fill:
        if num_devices % known:
            raise ShardkitError(
                f"mesh spec {spec!r}: the fixed axes use {known} devices, which does not divide the "
                f"{num_devices} devices available; choose degrees whose product divides {num_devices}"
            )
        axes[fill[0]] = num_devices // known
    total = math.prod(axes.values())
    if total != num_devices:
        shape = "x".join(f"{a}={d}" for a, d in axes.items())
        raise ShardkitError(
            f"mesh {shape} needs {total} devices but {num_devices} are available; make the degrees multiply "
            f"to {num_devices} (or put -1 on one axis), or on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={total} before importing jax"
        )
    return axes


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | None = None, *, target: Any = None) -> Mesh:
    """A Mesh with Auto axes from 'data=2,fsdp=4', a dict, or a preset name; validates everything first.

    `target`: a TPU slice or GPU nodes that need not be present (`sk.target("v5p-128")`, `"h100-8x4"` or the name):
    the mesh is built on its compile-only devices (shardkit/targets.py), for lowering, compiling and `sk.explain`;
    nothing runs on them. On a multi-slice (multi-host GPU) target the first axis spans the slices (hosts: DCN /
    InfiniBand, the slowest links) and must be a multiple of their number."""
    if target is not None:
        if devices is not None:
            raise ShardkitError("make_mesh: give devices= or target=, not both (a target brings its own devices)")
        tgt = get_target(target)
        axes = resolve_axes(spec, tgt.num_devices)
        if tgt.platform == "gpu":
            return _host_major_mesh(axes, tgt)
        if tgt.num_slices > 1:
            return _multislice_mesh(axes, tgt)
        grid = mesh_utils.create_device_mesh(tuple(axes.values()), tgt.devices, allow_split_physical_axes=True)
        return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))  # split: fsdp=8 on a 4x4x4 torus
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(spec, str) and spec.strip().replace("-", "_").isidentifier():
        preset = load_preset(spec.strip())
        if preset.num_devices != len(devices):
            raise ShardkitError(
                f"mesh preset {preset.name!r} describes {preset.num_devices} devices ({preset.device_kind}) but "
                f"{len(devices)} are available; pick a preset for this machine or give an explicit spec"
            )
        spec = preset.axes
    axes = resolve_axes(spec, len(devices))
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes), devices=devices)


_SAID_AUTO: set[tuple] = set()


def auto_axes(mesh: Mesh, what: str = "shardkit") -> Mesh:
    """`mesh` as shardkit runs it: the same devices and axis names, every axis `AxisType.Auto`.

    `jax.make_mesh` gives Explicit axes by default (jax 0.10-0.12), under which a sharding constraint asserts the
    layout an array already has instead of choosing it. shardkit's strategies choose every layout through their
    rules (GSPMD: `with_sharding_constraint` and jit's shardings), so a mesh with Explicit axes is taken with Auto
    ones, said once per mesh shape. Arrays placed on the user's mesh keep their devices and partitioning; only the
    axis type differs. A mesh inside a `shard_map` (Manual axes) is refused: build the step outside it."""
    types = tuple(getattr(mesh, "axis_types", None) or ())
    if all(t == AxisType.Auto for t in types):
        return mesh
    if any(t == AxisType.Manual for t in types):
        raise ShardkitError(
            f"{what}: mesh axes {dict(zip(mesh.axis_names, types, strict=True))} include Manual ones (a mesh from "
            "inside a shard_map); build the train step outside the shard_map, on the concrete mesh"
        )
    key = (tuple(mesh.axis_names), types)
    if key not in _SAID_AUTO:
        _SAID_AUTO.add(key)
        explicit = [n for n, t in zip(mesh.axis_names, types, strict=True) if t != AxisType.Auto]
        warnings.warn(
            f"{what}: mesh axes {explicit} are Explicit (jax.make_mesh's default); shardkit's strategies choose "
            "every layout through their sharding rules, so this mesh's devices and axis names are used with Auto "
            "axes. To say so yourself: sk.make_mesh('data=2,fsdp=4') or jax.make_mesh(..., "
            "axis_types=(jax.sharding.AxisType.Auto,) * n); a model written in explicit mode (out_sharding=, "
            "reshard) trains on Explicit axes under strategy 'annotated'",
            UserWarning,
            stacklevel=3,
        )
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def has_explicit_axes(mesh: Any) -> bool:
    """Whether any of `mesh`'s axes is `AxisType.Explicit` (a step on it runs in JAX's explicit sharding mode)."""
    return any(t == AxisType.Explicit for t in (getattr(mesh, "axis_types", None) or ()))


def step_mesh(mesh: Mesh, explicit_axes: bool, what: str = "shardkit") -> Mesh:
    """The mesh a step runs on: `mesh` itself where the strategy runs in explicit mode (`explicit_axes`, the
    `annotated` strategy: the model's own `out_sharding=` and `reshard` calls decide), else `auto_axes(mesh)`."""
    if not explicit_axes:
        return auto_axes(mesh, what)
    types = tuple(getattr(mesh, "axis_types", None) or ())
    if any(t == AxisType.Manual for t in types):
        auto_axes(mesh, what)  # refuses it, with the fix
    return mesh


def _multislice_mesh(axes: dict[str, int], tgt: Any) -> Mesh:
    """The slices along the first axis (DCN), each slice's devices laid out by its ICI topology."""
    first, degree = next(iter(axes.items()))
    if degree % tgt.num_slices:
        raise ShardkitError(
            f"target {tgt.name} has {tgt.num_slices} slices joined by DCN, which the mesh's first axis "
            f"{first}={degree} must span: make it a multiple of {tgt.num_slices} (e.g. data={tgt.num_slices},...)"
        )
    ici = (degree // tgt.num_slices, *list(axes.values())[1:])
    dcn = (tgt.num_slices,) + (1,) * (len(axes) - 1)
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, tgt.devices, allow_split_physical_axes=True)
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def _host_major_mesh(axes: dict[str, int], tgt: Any) -> Mesh:
    """GPU nodes: the devices host by host (NVSwitch joins a host's GPUs all to all, so their order within a host
    does not matter), reshaped so that the first axis is outermost: with it a multiple of the hosts, every other axis
    stays inside one host."""
    first, degree = next(iter(axes.items()))
    if degree % tgt.num_slices:
        raise ShardkitError(
            f"target {tgt.name} has {tgt.num_slices} hosts joined by InfiniBand, which the mesh's first axis "
            f"{first}={degree} must span: make it a multiple of {tgt.num_slices} (e.g. data={tgt.num_slices},...)"
        )
    grid = np.array(tgt.devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def mesh_shape_str(mesh: Mesh) -> str:
    """'data=2,fsdp=4' for a mesh (the inverse of parse_spec)."""
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items())
