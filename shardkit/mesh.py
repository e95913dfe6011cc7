"""Device meshes from a short spec, a dict or a hardware preset, validated before JAX sees them.

    sk.make_mesh("data=2,fsdp=2,tensor=2")     # degrees in order, outermost (slowest links) first
    sk.make_mesh({"data": -1, "tensor": 2})     # one axis may be -1: it takes the remaining devices
    sk.make_mesh("cpu8")                        # a preset from meshes/: hardware described as data

Meshes use Auto axis types (the GSPMD path): shardings are given by rules tables and XLA inserts the
collectives. Presets are TOML files in `meshes/` (see `meshes/README.md` for the fields and sources).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.errors import ShardkitError

#: Mesh axis names shardkit knows. Strategies map logical names onto these; anything else is a typo.
KNOWN_AXES = (
    "data",
    "fsdp",
    "tensor",
    "seq",
    "seq_u",
    "seq_r",
    "stage",
    "expert",
    "space",
    "space_h",
    "space_w",
    "row",
    "col",
    "depth",
)


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of interconnect: per-device bandwidth in one direction and per-message latency."""

    bandwidth: float  # bytes/s
    latency: float  # s


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """Devices of one kind in a heterogeneous cluster: how many, their throughput relative to the preset's
    reference device, and their memory (`[[groups]]` in a preset)."""

    name: str
    count: int
    speed: float  # relative training throughput (1.0 = the reference device)
    hbm_bytes: float


@dataclasses.dataclass(frozen=True)
class HardwarePreset:
    """A machine described as data: devices, mesh degrees inside (ICI) and across (DCN) nodes, speeds."""

    name: str
    description: str
    platform: str
    device_kind: str
    num_devices: int
    peak_flops: float  # bf16 dense FLOP/s per device; 0 means "measure at start-up" (CPU)
    hbm_bytes: float  # memory per device
    ici: dict[str, int]  # axis -> degree inside a slice / node
    dcn: dict[str, int]  # axis -> degree across slices / nodes
    links: dict[str, Link]  # "ici" / "dcn" -> Link
    sources: dict[str, str]
    groups: tuple[DeviceGroup, ...] = ()  # heterogeneous clusters: device kinds in device order; () = uniform
    hbm_bandwidth: float = 0.0  # bytes/s of device memory (the roofline's second roof); 0 = not given

    @property
    def heterogeneous(self) -> bool:
        return len({(g.speed, g.hbm_bytes) for g in self.groups}) > 1

    def device_speeds(self) -> list[float]:
        """Relative throughput of every device, in device order (all 1.0 for a uniform preset)."""
        return [g.speed for g in self.groups for _ in range(g.count)] or [1.0] * self.num_devices

    def device_memory(self) -> list[float]:
        """Memory of every device in bytes, in device order."""
        return [g.hbm_bytes for g in self.groups for _ in range(g.count)] or [self.hbm_bytes] * self.num_devices

    @property
    def axes(self) -> dict[str, int]:
        """Mesh axis degrees, DCN axes first (outermost), each = ICI degree x DCN degree."""
        names = list(self.dcn) + [a for a in self.ici if a not in self.dcn]
        return {a: self.ici.get(a, 1) * self.dcn.get(a, 1) for a in names}

    def link(self, axis: str) -> Link:
        """The slowest link a collective over `axis` crosses: DCN when the axis spans nodes, else ICI."""
        if self.dcn.get(axis, 1) > 1 and "dcn" in self.links:
            return self.links["dcn"]
        return self.links["ici"]


def preset_dirs() -> list[pathlib.Path]:
    """Where presets are looked up: $SHARDKIT_MESHES (os.pathsep list), ./meshes, the repository's meshes/."""
    dirs = [pathlib.Path(p) for p in os.environ.get("SHARDKIT_MESHES", "").split(os.pathsep) if p]
    dirs += [pathlib.Path.cwd() / "meshes", pathlib.Path(__file__).resolve().parent.parent / "meshes"]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def available_presets() -> list[str]:
    return sorted({p.stem for d in preset_dirs() for p in d.glob("*.toml")})


def load_preset(name: str) -> HardwarePreset:
    """Reads `meshes/<name>.toml` into a HardwarePreset."""
    for d in preset_dirs():
        path = d / f"{name}.toml"
        if path.is_file():
            with path.open("rb") as f:
                raw: dict[str, Any] = tomllib.load(f)
            return _preset_from_dict(name, raw)
    raise ShardkitError(
        f"unknown mesh preset {name!r}; available: {', '.join(available_presets()) or '(none found)'}. "
        "Give a spec such as 'data=2,fsdp=4', or add meshes/<name>.toml (searched: "
        f"{', '.join(map(str, preset_dirs())) or 'no meshes/ directory'}; set $SHARDKIT_MESHES to add one)."
    )


def _preset_from_dict(name: str, raw: dict[str, Any]) -> HardwarePreset:
    mesh = raw.get("mesh", {})
    links = {k: Link(float(v["bandwidth"]), float(v["latency"])) for k, v in raw.get("links", {}).items()}
    if "ici" not in links:
        raise ShardkitError(f"mesh preset {name!r} has no [links.ici] table (bandwidth, latency)")
    preset = HardwarePreset(
        name=name,
        description=raw.get("description", ""),
        platform=raw["platform"],
        device_kind=raw["device_kind"],
        num_devices=int(raw["num_devices"]),
        peak_flops=float(raw["peak_bf16_flops"]),
        hbm_bytes=float(raw["hbm_bytes"]),
        ici=dict(mesh.get("ici", {})),
        dcn=dict(mesh.get("dcn", {})),
        links=links,
        sources=dict(raw.get("sources", {})),
        hbm_bandwidth=float(raw.get("hbm_bandwidth", 0.0)),
        groups=tuple(
            DeviceGroup(str(g["name"]), int(g["count"]), float(g["relative_speed"]), float(g["hbm_bytes"]))
            for g in raw.get("groups", [])
        ),
    )
    _check_axes(preset.axes)
    if preset.groups and sum(g.count for g in preset.groups) != preset.num_devices:
        raise ShardkitError(
            f"mesh preset {name!r}: [[groups]] count {sum(g.count for g in preset.groups)} devices, not "
            f"num_devices={preset.num_devices}; fix meshes/{name}.toml"
        )
    if any(g.speed <= 0 or g.hbm_bytes <= 0 for g in preset.groups):
        raise ShardkitError(f"mesh preset {name!r}: every group needs relative_speed > 0 and hbm_bytes > 0")
    if math.prod(preset.axes.values()) != preset.num_devices:
        raise ShardkitError(
            f"mesh preset {name!r}: axis degrees {preset.axes} multiply to {math.prod(preset.axes.values())}, "
            f"not num_devices={preset.num_devices}; fix meshes/{name}.toml"
        )
    return preset


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


def _check_axes(axes: Mapping[str, Any]) -> None:
    for name, degree in axes.items():
        if name not in KNOWN_AXES:
            raise ShardkitError(f"unknown mesh axis {name!r}; shardkit's mesh axes are {', '.join(KNOWN_AXES)}")
        if not isinstance(degree, (int, np.integer)) or isinstance(degree, bool) or (degree < 1 and degree != -1):
            raise ShardkitError(
                f"mesh axis {name}={degree!r} must be a positive integer (or -1 for 'the remaining devices')"
            )


def resolve_axes(spec: str | Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Validates a spec against a device count and fills the one -1 axis."""
    axes = parse_spec(spec)
    if not axes:
        raise ShardkitError(f"empty mesh spec {spec!r}; e.g. 'data={num_devices}'")
    _check_axes(axes)
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

    `target`: a TPU slice that need not be present (`sk.target("v5p-128")` or its name): the mesh is built on its
    compile-only devices (shardkit/targets.py), for lowering, compiling and `sk.explain`; nothing runs on them. On a
    multi-slice target the first axis spans the slices (DCN, the slowest links) and must be a multiple of their
    number."""
    if target is not None:
        if devices is not None:
            raise ShardkitError("make_mesh: give devices= or target=, not both (a target brings its own devices)")
        from shardkit.targets import target as get_target  # target.py imports this module

        tgt = get_target(target)
        axes = resolve_axes(spec, tgt.num_devices)
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


def mesh_shape_str(mesh: Mesh) -> str:
    """'data=2,fsdp=4' for a mesh (the inverse of parse_spec)."""
    return ",".join(f"{a}={s}" for a, s in mesh.shape.items())
