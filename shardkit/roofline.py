"""A predicted step time and MFU, read off a compiled program: a roofline over its FLOPs, HBM bytes and collectives
on the links of the hardware it was compiled for. A PREDICTION, not a measurement: nothing here runs on a chip.

    r = sk.explain(step, state, batch)             # a mesh of a target's (or a preset's) devices
    r.roofline.text(); r.roofline.to_dict()        # also in r.text() / r.to_dict()
    shardkit.roofline.roofline(compiled, mesh, chip, collectives=..., model_flops=...)   # the same, by hand

Terms, per device per step (docs/explain.md, "Predicted step time"):
  flops_s   = (matmul FLOPs, loop trip counts included: `hlo.matmul_flops`; + kernels' own cost estimates) / peak
  hbm_s     = HBM bytes / HBM bandwidth; bytes = operands + result of each top-level instruction (fusions as one),
              loop bodies x trip count, buffers the layout puts outside HBM (`S(1)`: VMEM) left out
  compute_s = max(FLOPs time, HBM time) outside loops + the same inside loops (each region's roofline)
  comm_s    = sum over collectives of bytes sent / bandwidth of the link its axes ride + ring steps x latency
  no_overlap_s   = compute_s + comm_s                (upper bound)
  full_overlap_s = max(compute_s, comm_s)            (lower bound)
  step_s (what XLA's schedule allows) = compute outside loops + max(compute inside loops, async in-loop
              collectives) + every other collective (synchronous, or outside the layer scan: exposed)
  MFU = model FLOPs per device / (step_s x peak); without a model FLOP count, program FLOPs (HFU, recompute in).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit import hlo
from shardkit.errors import ShardkitError
from shardkit.hlo_module import _KIND, _callees, _multipliers, _parse_module

PREDICTION = "PREDICTED, not measured"
#: names the report gives the preset's two links, by platform family
LINK_NAMES = {"tpu": {"ici": "ICI", "dcn": "DCN"}, "gpu": {"ici": "NVLink", "dcn": "InfiniBand"}}
#: instructions that move no HBM bytes of their own (structure, aliases, host transfers, a start's `-done` half)
_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
               "replica-id", "while", "conditional", "call", "send", "recv", "send-done", "recv-done", "iota",
               "opt-barrier", "add-dependency"}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\s*\{[^}]*"flops":\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class AxisLink:
    """The link a mesh axis rides and the bandwidth a ring collective over it gets per device, one direction."""

    axis: str
    size: int
    link: str  # ICI / DCN on TPU, NVLink / InfiniBand on GPU
    bandwidth: float  # bytes/s used for the axis
    latency: float  # s per ring step
    how: str  # how the bandwidth follows from the preset's per-link figure


@dataclasses.dataclass
class Roofline:
    """The terms of a predicted step time (seconds per step, per device); see the module docstring."""

    device_kind: str
    peak_flops: float
    hbm_bandwidth: float
    matmul_flops: float
    kernel_flops: float
    hbm_bytes: float
    hbm_bytes_cost_analysis: float | None  # the compiler's `bytes accessed` (loop bodies once), when it gives one
    flops_s: float
    hbm_s: float
    comm_s: float
    comm_overlappable_s: float  # async collectives inside loops: may hide behind the loop's compute
    compute_out_of_loops_s: float  # max(FLOPs time, HBM time) of the instructions outside any loop
    compute_in_loops_s: float  # the same inside loops (the layer scan)
    step_s: float  # what XLA's schedule allows
    no_overlap_s: float
    full_overlap_s: float
    model_flops: float | None  # per device per step, from the model's FLOP count; None: not known
    links: list[AxisLink]
    collectives: list[dict[str, Any]]  # kind, axes, link, seconds, overlappable
    kernels_without_flops: list[str]
    sources: dict[str, str]
    label: str = PREDICTION

    @property
    def compute_s(self) -> float:
        """The roofline per region (outside loops, inside loops), summed: >= max(flops_s, hbm_s)."""
        return self.compute_out_of_loops_s + self.compute_in_loops_s

    @property
    def mfu(self) -> float:
        """Predicted MFU: model FLOPs (else the program's, recomputation included) over step_s x peak."""
        flops = self.model_flops if self.model_flops is not None else self.matmul_flops + self.kernel_flops
        return flops / (self.step_s * self.peak_flops) if self.step_s > 0 else 0.0

    def text(self) -> str:
        mfu_of = "model FLOPs" if self.model_flops is not None else "program FLOPs (HFU: recomputation included)"
        ms = lambda s: f"{s * 1e3:.4g} ms"
        lines = [
            f"step time ({self.label}; a roofline on {self.device_kind}: "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s, HBM {self.hbm_bandwidth / 1e9:.0f} GB/s)",
            f"  FLOPs     {(self.matmul_flops + self.kernel_flops) / 1e12:.4g} TFLOP per device -> {ms(self.flops_s)}",
            f"  HBM bytes {self.hbm_bytes / 1e9:.4g} GB per device -> "
            + (ms(self.hbm_s) if self.hbm_bandwidth else "no HBM bandwidth given: not in the time")
            + (f" (compiler's cost_analysis: {self.hbm_bytes_cost_analysis / 1e9:.4g} GB, loop bodies once)"
               if self.hbm_bytes_cost_analysis is not None else " (cost_analysis gives none here)"),
            f"  collectives {ms(self.comm_s)} on the links below, {ms(self.comm_overlappable_s)} of it async inside "
            f"loops (with {ms(self.compute_in_loops_s)} of compute to hide behind)",
            f"  no overlap {ms(self.no_overlap_s)} | full overlap {ms(self.full_overlap_s)} | XLA's schedule "
            f"{ms(self.step_s)} -> predicted MFU {self.mfu:.1%} ({mfu_of})",
        ]  # fmt: skip
        lines += ["  mesh axes and the links they ride:"]
        lines += [f"    {a.axis}={a.size}: {a.link}, {a.bandwidth / 1e9:.4g} GB/s ({a.how})" for a in self.links]
        if self.kernels_without_flops:
            missing = ", ".join(self.kernels_without_flops)
            lines += [f"  not in the FLOPs term (kernels without a cost estimate): {missing}"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(compute_s=self.compute_s, mfu=self.mfu)
        return out

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kw})


def _varying_axes(mesh: Any, value: Any) -> set[int]:
    """Indices of the mesh axes along which `value(device)` changes."""
    vals = np.vectorize(value, otypes=[int])(mesh.devices)
    return {a for a in range(vals.ndim) if vals.shape[a] > 1 and (np.diff(vals, axis=a) != 0).any()}


def _torus_dims(mesh: Any, axis: int) -> int:
    """How many physical torus dimensions the devices' coordinates change along over mesh axis `axis` (1 if the
    devices carry no coordinates)."""
    coords = [getattr(d, "coords", None) for d in mesh.devices.flat]
    if any(c is None for c in coords):
        return 1
    arr = np.array(coords).reshape(*mesh.devices.shape, -1)
    return max(1, int(sum((np.diff(arr[..., k], axis=axis) != 0).any() for k in range(arr.shape[-1]))))


def axis_links(mesh: Any, chip: Any, platform: str) -> list[AxisLink]:
    """Per mesh axis of size > 1, the link it rides. TPU: DCN along axes over which the devices' `slice_index`
    changes, else ICI: a bidirectional ring on each torus dimension the axis spans (from the devices' `coords`),
    2 x dims x the preset's one-way per-link bandwidth. GPU: InfiniBand along axes over which `process_index`
    (the host) changes, else NVLink at the preset's per-GPU one-way bandwidth."""
    links = chip.links
    names = LINK_NAMES.get(platform, {"ici": "ici", "dcn": "dcn"})
    attr = "slice_index" if platform == "tpu" else "process_index"
    across = _varying_axes(mesh, lambda d: getattr(d, attr, 0) or 0)
    out = []
    for i, (name, size) in enumerate(zip(mesh.axis_names, mesh.devices.shape, strict=True)):
        if size == 1:
            continue
        if i in across and "dcn" in links:
            lk = links["dcn"]
            where = "across slices" if platform == "tpu" else "across hosts"
            out.append(AxisLink(name, size, names["dcn"], lk.bandwidth, lk.latency, f"{where}: [links.dcn] per device"))
            continue
        lk = links["ici"]
        if platform == "tpu":
            dims = _torus_dims(mesh, i)
            how = f"2 directions x {dims} torus dim(s) x {lk.bandwidth / 1e9:.4g} GB/s per link"
            out.append(AxisLink(name, size, names["ici"], 2 * dims * lk.bandwidth, lk.latency, how))
        else:
            out.append(AxisLink(name, size, names["ici"], lk.bandwidth, lk.latency, "[links.ici] per device, one way"))
    return out


def _hbm_type_bytes(type_str: str) -> int:
    """Bytes of the arrays in an HLO type that live in HBM: a layout's `S(n)`, n > 0, names another memory space."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_str):
        if layout and (space := re.search(r"S\((\d+)\)", layout)) and space.group(1) != "0":
            continue
        total += hlo.shape_bytes(f"{dtype}[{dims}]")
    return total


def _sequential(mod: Any) -> set[str]:
    """Computations whose instructions run one by one (ENTRY, loop bodies and conditions, branches, calls): not
    fusion bodies or reducers, whose traffic is their caller's."""
    seq, todo = set(), [mod.entry]
    while todo:
        c = todo.pop()
        if c in seq or c not in mod.comps:
            continue
        seq.add(c)
        for ins in mod.comps[c]:
            if ins.opcode in ("while", "conditional", "call"):
                todo += _callees(ins)
    return seq


def program_costs(compiled_or_hlo_text: Any) -> dict[str, Any]:
    """Per device per step, split inside / outside while loops (trip counts multiplied): matmul FLOPs, kernels'
    FLOPs from their cost estimates, HBM bytes; and the collective kinds that run async inside loops."""
    src = compiled_or_hlo_text
    mod = _parse_module(src if isinstance(src, str) else src.as_text())
    types = {name: i.type for name, i in mod.by_name.items()}
    mults, seq = _multipliers(mod), _sequential(mod)
    out = dict(flops=[0.0, 0.0], kernel_flops=[0.0, 0.0], hbm=[0.0, 0.0], async_in_loops=set(), no_estimate=[])
    for cname, (m, in_loop) in mults.items():
        if not m:
            continue
        k = int(in_loop)
        for ins in mod.comps[cname]:
            out["flops"][k] += m * hlo._dot_flops(ins, types)
            if ins.opcode == "custom-call" and re.search(r'"(tpu_custom_call|__gpu\$xla\.gpu\.triton)"', ins.attrs):
                if est := _KERNEL_FLOPS.search(ins.attrs):
                    out["kernel_flops"][k] += m * float(est.group(1))
                else:
                    out["no_estimate"].append(re.sub(r"\.\d+$", "", ins.name))
            if in_loop and ins.opcode.endswith("-start") and ins.opcode in _KIND:
                out["async_in_loops"].add(_KIND[ins.opcode])
            if in_loop and "AsyncCollectiveStart" in ins.attrs:  # XLA:TPU: custom-call(%all-gather.97), ...
                inner = [mod.by_name.get(o) for o in ins.operands]
                out["async_in_loops"] |= {_KIND.get(i.opcode, "*") for i in inner if i is not None} or {"*"}
            if in_loop and "windowed_dot_general_body" in cname:
                out["async_in_loops"] |= {"all-gather", "reduce-scatter"}
            if cname in seq and ins.opcode not in _NO_TRAFFIC and not ins.opcode.endswith("-done"):
                nbytes = _hbm_type_bytes(ins.type) + sum(_hbm_type_bytes(types.get(o, "")) for o in ins.operands)
                out["hbm"][k] += m * nbytes
    return out


def _ring_steps(kind: str, p: int) -> int:
    return 1 if kind == "collective-permute" else (2 if kind == "all-reduce" else 1) * max(1, p - 1)


def has_figures(chip: Any) -> bool:
    """Whether `chip` (a HardwarePreset or a Target) has what a roofline needs: peak FLOP/s and an ICI link table
    (an HBM bandwidth adds the second roof; without one the roofline says so)."""
    preset = getattr(chip, "chip", chip)
    links = getattr(preset, "links", None) or {}
    return getattr(preset, "peak_flops", 0) > 0 and "ici" in links


def roofline(
    compiled: Any, mesh: Any, chip: Any, *, collectives: Sequence[hlo.Collective] | None = None,
    model_flops: float | None = None, platform: str | None = None,
) -> Roofline:  # fmt: skip
    """The predicted step time of `compiled` on `mesh`'s devices, with `chip`'s figures (a HardwarePreset or a
    Target: peak_flops, hbm_bandwidth, links). `collectives`: hlo.collectives(compiled, mesh) if already read;
    `model_flops`: the model's FLOPs per device per step, for MFU (else the program's FLOPs: HFU);
    `platform`: the mesh's family (default: `rules.platform_family(mesh)`)."""
    from shardkit.rules import platform_family

    preset = getattr(chip, "chip", chip)  # a Target carries its preset
    peak, bw = float(getattr(preset, "peak_flops", 0.0)), float(getattr(preset, "hbm_bandwidth", 0.0))
    if not has_figures(preset):
        raise ShardkitError(
            f"no roofline for {getattr(preset, 'name', chip)!r}: it needs peak_bf16_flops > 0 and a [links.ici] table "
            f"(peak {peak}); add them to its meshes/*.toml with their sources"
        )
    platform = platform or platform_family(mesh)
    colls = list(collectives) if collectives is not None else hlo.collectives(compiled, mesh)
    costs = program_costs(compiled)
    links = axis_links(mesh, preset, platform)
    by_axis = {a.axis: a for a in links}
    rows, comm, overlappable = [], 0.0, 0.0
    for c in colls:
        axes = [by_axis[a] for a in c.axes if a in by_axis]
        if not axes:  # groups not along whole mesh axes ("?"): the slowest link of the mesh, to be safe
            axes = list(links)
        if not axes or c.bytes_sent == 0:
            continue
        slowest = min(axes, key=lambda a: a.bandwidth)
        seconds = c.bytes_sent / slowest.bandwidth + c.count * _ring_steps(c.kind, c.group_size) * slowest.latency
        hides = c.in_loop and (c.kind in costs["async_in_loops"] or "*" in costs["async_in_loops"])
        comm += seconds
        overlappable += seconds if hides else 0.0
        rows.append(dict(kind=c.kind, axes=list(c.axes), link=slowest.link, bytes_sent=c.bytes_sent,
                         seconds=seconds, overlappable=hides, in_loop=c.in_loop))  # fmt: skip
    fl, kf, hb = costs["flops"], costs["kernel_flops"], costs["hbm"]
    hbm_time = lambda b: b / bw if bw else 0.0  # a preset without an HBM bandwidth: no second roof (the text says)
    compute = [max((fl[k] + kf[k]) / peak, hbm_time(hb[k])) for k in (0, 1)]
    flops_s, hbm_s = (sum(fl) + sum(kf)) / peak, hbm_time(sum(hb))
    compute_s = compute[0] + compute[1]
    step_s = compute[0] + max(compute[1], overlappable) + (comm - overlappable)
    ca = _cost_analysis_bytes(compiled)
    sources = {
        "peak_flops": getattr(preset, "sources", {}).get("peak_bf16_flops", ""),
        "hbm_bandwidth": getattr(preset, "sources", {}).get("hbm_bandwidth", ""),
        "links": getattr(preset, "sources", {}).get("links", ""),
        "flops": "shardkit.hlo matmul FLOPs (dots, convolutions, gemm calls; loop trip counts) + kernels' cost "
        "estimates",
        "hbm_bytes": "read from the program: operands + result of each top-level instruction, trip counts included",
    }
    return Roofline(
        device_kind=str(getattr(preset, "device_kind", "")), peak_flops=peak, hbm_bandwidth=bw,
        matmul_flops=sum(fl), kernel_flops=sum(kf), hbm_bytes=sum(hb), hbm_bytes_cost_analysis=ca,
        flops_s=flops_s, hbm_s=hbm_s, comm_s=comm, comm_overlappable_s=overlappable,
        compute_out_of_loops_s=compute[0], compute_in_loops_s=compute[1],
        step_s=step_s, no_overlap_s=compute_s + comm, full_overlap_s=max(compute_s, comm), model_flops=model_flops,
        links=links, collectives=rows, kernels_without_flops=sorted(set(costs["no_estimate"])), sources=sources,
    )  # fmt: skip


def _cost_analysis_bytes(compiled: Any) -> float | None:
    try:
        ca = compiled.cost_analysis()
    except Exception:  # text input, or a compiler without cost analysis
        return None
    ca = ca[0] if isinstance(ca, list | tuple) and ca else ca
    return float(ca["bytes accessed"]) if isinstance(ca, dict) and "bytes accessed" in ca else None


def model_flops_per_device(cfg: Any, batch_shapes: dict[str, tuple[int, ...]], num_devices: int) -> float | None:
    """The model's training FLOPs per device per step, when its config counts them (`flops_per_token(seq_len)`)
    and the batch has a 2-D `inputs` leaf (batch, sequence); else None."""
    shape = next((s for k, s in batch_shapes.items() if k.strip("[]'") == "inputs"), None)
    per_token = getattr(cfg, "flops_per_token", None)
    if per_token is None or shape is None or len(shape) != 2 or num_devices < 1:
        return None
    return float(per_token(shape[1])) * math.prod(shape) / num_devices


__all__ = ["PREDICTION", "AxisLink", "Roofline", "axis_links", "has_figures", "model_flops_per_device",
           "program_costs", "roofline"]  # fmt: skip
