"""Hardware described as data: the presets in meshes/ (devices, mesh degrees inside and across nodes, peak FLOP/s,
memory, links), and the mesh axis names shardkit knows.

    sk.load_preset("perlmutter")      # meshes/perlmutter.toml -> HardwarePreset
    sk.available_presets()

Presets are TOML files in `meshes/` (see `meshes/README.md` for the fields and sources); `$SHARDKIT_MESHES` adds
directories. shardkit/mesh.py builds meshes from them; shardkit/targets.py takes a TPU slice's chip figures from them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

import numpy as np

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
    check_axes(preset.axes)
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


def check_axes(axes: Mapping[str, Any]) -> None:
    for name, degree in axes.items():
        if name not in KNOWN_AXES:
            raise ShardkitError(f"unknown mesh axis {name!r}; shardkit's mesh axes are {', '.join(KNOWN_AXES)}")
        if not isinstance(degree, (int, np.integer)) or isinstance(degree, bool) or (degree < 1 and degree != -1):
            raise ShardkitError(
                f"mesh axis {name}={degree!r} must be a positive integer (or -1 for 'the remaining devices')"
            )
