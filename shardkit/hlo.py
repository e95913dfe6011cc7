"""Collectives and the bytes they move, read from a compiled XLA executable's per-device HLO text.

    c = jax.jit(step).lower(*args).compile()
    print(format_table(collectives(c, mesh)))

Replica-group ids are logical partition ids; for a `Compiled` they are mapped to devices through the
executable's device assignment, for bare text partition `i` is taken to be `mesh.devices.flat[i]`.
Collectives inside while loops are multiplied by the trip count; conditional branches count as taken.
XLA's TPU compiler (libtpu) writes forms XLA:CPU does not; each is read where its comment shows it: reduce-scatter
fusions, async collective fusions, loops without known_trip_count, windowed-einsum rings, megascale (DCN) transfers,
dots as convolutions.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from shardkit.errors import ShardkitError
from shardkit.hlo_module import (  # noqa: F401  (shape_bytes, _parse_module, _multipliers: their home was here)
    _KIND,
    _SHAPE,
    KINDS,
    _callees,
    _Instr,
    _ints,
    _Module,
    _multipliers,
    _parse_module,
    _split_top,
    _through,
    shape_bytes,
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: per-occurrence buffer sizes and per-step totals on one device."""

    kind: str  # one of KINDS
    axes: tuple[str, ...]  # mesh axes the groups span (size-1 axes never listed); () trivial; ("?",) no match
    group_size: int  # devices per replica group (collective-permute: the size of the axes it moves along)
    count: int  # occurrences per step, loop bodies multiplied by their trip counts
    result_bytes: int  # result buffer of one occurrence on one device
    operand_bytes: int  # operand buffers of one occurrence on one device
    bytes_sent: float  # per device, all occurrences, ring (alpha-beta) volume
    in_loop: bool  # inside a while loop (an unknown trip count is taken as 1)


def _iota(reshape: list[int], perm: list[int]) -> np.ndarray:
    """The flat device list of `[reshape]T(perm)`: iota reshaped, transposed (perm may be empty), flattened."""
    return np.arange(math.prod(reshape)).reshape(reshape).transpose(perm or range(len(reshape))).ravel()


def _rg_explicit(m: re.Match, n: int) -> list[list[int]]:
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", m.group(0)[1:-1])]
    return groups or [list(range(n))]  # `{}`: one group of all devices


def _rg_iota(m: re.Match, n: int) -> list[list[int]]:
    return _iota(_ints(m.group(2)), _ints(m.group(3))).reshape(_ints(m.group(1))[0], -1).tolist()


def _rg_mesh(m: re.Match, n: int) -> list[list[int]]:
    """`mesh['a'=2,'b'=4], device_ids=(...) {'b'}` (sub-axes as `'b':(pre)size`)."""
    axes = re.findall(r"'?([^',=\[\]]+)'?=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = m.group(2) or f"[{math.prod(sizes)}]"  # device_ids=([4,16]T(1,0)) | (0,2,1,3) | absent: iota
    im = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids)
    dev = _iota(_ints(im.group(1)), _ints(im.group(2))) if im else np.array(_ints(ids))
    refs = [
        (names.index(a), int(p) if p else None, int(s) if s else None)
        for a, p, s in re.findall(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?", m.group(3))
    ]
    shape, offset, cuts = [], [], []
    for d, size in enumerate(sizes):  # split each mesh axis into the factors its sub-axes need
        cuts.append(sorted({1, size} | {c for i, p, s in refs if i == d and p for c in (p, p * s)}))
        offset.append(len(shape))
        shape += [b // a for a, b in itertools.pairwise(cuts[d])] or [1]  # a size-1 axis keeps its dimension
    grouped = [offset[i] + (cuts[i].index(p) if p else 0) for i, p, _ in refs]
    rest = [i for i in range(len(shape)) if i not in grouped]
    gsize = math.prod(shape[g] for g in grouped)
    return dev.reshape(shape).transpose(rest + grouped).reshape(-1, gsize).tolist()


_MESH_RG = r"mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:\[[\d,]+\](?:T\([\d,]+\))?)|[\d,]+)\))?\s*\{([^}]*)\}"
#: (pattern, parser) per replica-group format; a parser gets the match and the device count. Add formats here.
_RG_FORMATS: list[tuple[re.Pattern, Callable[[re.Match, int], list[list[int]]]]] = [
    (re.compile(r"\{(?:\{[\d,\s]*\},?\s*)*\}"), _rg_explicit),  # {{0,1},{2,3}}; {} = all devices
    (re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"), _rg_iota),  # [4,2]<=[2,4]T(1,0)
    (re.compile(_MESH_RG), _rg_mesh),  # mesh['a'=2,'b'=4] {'b'}
]


def parse_replica_groups(value: str, num_devices: int) -> list[list[int]]:
    """Expand a `replica_groups=` value (explicit, iota or mesh-axes form) into lists of partition ids."""
    for pattern, parse in _RG_FORMATS:
        if m := pattern.match(value.strip()):
            return parse(m, num_devices)
    raise ShardkitError(f"unknown replica_groups format {value[:80]!r}; add a parser to shardkit.hlo._RG_FORMATS")


def _coords(compiled: Any, mesh: jax.sharding.Mesh) -> np.ndarray:
    """Row i: the mesh coordinates of partition id i, which runs on the executable's i-th device: its runtime's, or
    for compile-only TPU devices (no runtime) the devices it was compiled for; for text, mesh.devices.flat[i]."""
    ids, order = {d.id: pos for pos, d in enumerate(mesh.devices.flat)}, []
    runtime = lambda: compiled.runtime_executable().local_devices()
    compiled_for = lambda: compiled._executable._unloaded_executable.device_list
    for devices in (runtime, compiled_for):
        with contextlib.suppress(Exception):  # text input, or a device outside the mesh
            order = order or [ids[d.id] for d in devices()]
    order = order if len(order) == mesh.devices.size else list(range(mesh.devices.size))
    return np.array(np.unravel_index(order, mesh.devices.shape)).T.reshape(-1, mesh.devices.ndim)


def _axes(groups: list[list[int]], coords: np.ndarray, mesh: jax.sharding.Mesh, exact: bool) -> tuple[tuple, int]:
    """(mesh axes the groups vary along, devices per group). With `exact`, each group must be a whole fibre of
    those axes, else ("?",); without (collective-permute pairs), the axes any pair moves along."""
    if any(max(g, default=0) >= len(coords) for g in groups):
        return ("?",), max(map(len, groups))
    vary = sorted({a for g in groups for a in range(coords.shape[1]) if len(set(coords[g, a])) > 1})
    size = math.prod(mesh.devices.shape[a] for a in vary)
    fibre = lambda i: tuple(np.delete(coords[i], vary))
    if exact and any(len(g) != size or len({fibre(i) for i in g}) != 1 for g in groups):
        return ("?",), max(map(len, groups))
    return tuple(mesh.axis_names[a] for a in vary), size


def _async_role(mod: _Module, cname: str) -> str:
    """The role, "start" or "done", of the body of an XLA:TPU async collective fusion, whose ROOT is the custom-call
    `custom-call(%all-gather.97), custom_call_target="AsyncCollectiveStart"` (resp. "...Done"); else ""."""
    root = mod.roots.get(cname)
    target = re.search(r'custom_call_target="AsyncCollective(Start|Done)"', root.attrs) if root is not None else None
    return target.group(1).lower() if target and root.opcode == "custom-call" else ""


def _windowed_rings(mod: _Module) -> list[tuple[str, str, list[_Instr]]]:
    """(computation, kind, ring permutes) of each windowed-einsum loop (XLA:TPU's collective matmul). SPMD
    partitioning writes an all-gather (or reduce-scatter) feeding a large dot as a while loop whose body,
    `windowed_dot_general_body_ag` (`_rs`), passes blocks around a bidirectional ring of collective-permutes
    (`collective-permute-start(%gte), source_target_pairs={{0,1},{1,2},...,{7,0}}`) while it multiplies; one more
    permute before (`ag`: feeding the loop's initial tuple) or after the loop (`rs`: of its result). On v5e: 2 trips
    x 4 permutes + 1 = 9 block transfers for an 8-way gather, 9/8 of the gathered bytes. The rule: each run of the
    loop is one all-gather (reduce-scatter) over the axes the ring moves along, of p blocks of the permutes' buffer
    size, sent as the ring formula says ((p-1)/p of the gathered bytes), like any other all-gather."""
    rings = []
    for cname, instrs in mod.comps.items():
        for w in instrs:
            body = re.search(r"body=%?([\w.\-]*windowed_dot_general_body_(ag|rs)[\w.\-]*)", w.attrs)
            if w.opcode != "while" or not body:
                continue
            inner, todo = set(), [body.group(1)]
            while todo:  # the body and what it calls
                inner.add(c := todo.pop())
                todo += [k for i in mod.comps.get(c, []) for k in _callees(i) if k in mod.comps and k not in inner]
            perms = [i for c in inner for i in mod.comps[c] if _KIND.get(i.opcode) == "collective-permute"]
            init = mod.by_name.get(w.operands[0]) if w.operands else None
            before = [_through(mod, o) for o in (init.operands if init is not None and init.opcode == "tuple" else ())]
            before = [mod.by_name.get(i.operands[0]) if i.opcode.endswith("-done") else i for i in before if i]
            gtes = {i.name for i in instrs if i.opcode == "get-tuple-element" and i.operands[:1] == (w.name,)}
            after = [i for i in instrs if i.operands[:1] and i.operands[0] in gtes]
            perms += [i for i in before + after if i is not None and _KIND.get(i.opcode) == "collective-permute"]
            rings.append((cname, {"ag": "all-gather", "rs": "reduce-scatter"}[body.group(2)], perms))
    return rings


def _slice_axes(mesh: jax.sharding.Mesh) -> tuple[tuple[str, ...], int]:
    """(mesh axes along which the devices' TPU slice changes, number of slices)."""
    slices = np.vectorize(lambda d: getattr(d, "slice_index", 0) or 0, otypes=[int])(mesh.devices)
    vary = [a for a in range(slices.ndim) if slices.shape[a] > 1 and (np.diff(slices, axis=a) != 0).any()]
    return tuple(mesh.axis_names[a] for a in vary), len(np.unique(slices))


def _pairs(ins: _Instr) -> list[list[int]]:
    pm = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", ins.attrs)
    return [_ints(g) for g in re.findall(r"\{([\d,\s]+)", pm.group(1))] if pm else []


def collectives(compiled_or_hlo_text: Any, mesh: jax.sharding.Mesh) -> list[Collective]:
    """The collectives of one step of a compiled executable (a jax `Compiled` or its `as_text()`).

    Rows with equal (kind, axes, result_bytes, operand_bytes, in_loop) are merged with summed counts;
    sorted by bytes_sent, largest first. Async `-start`/`-done` pairs count once.
    """
    src = compiled_or_hlo_text
    text = src if isinstance(src, str) else getattr(src, "as_text", lambda: None)()
    if not isinstance(text, str) or "ENTRY" not in text:
        raise ShardkitError("collectives() needs a jax Compiled (jax.jit(f).lower(...).compile()) or its as_text()")
    mod = _parse_module(text)
    coords = _coords(compiled_or_hlo_text, mesh)
    head = re.search(r"num_partitions=(\d+)", text), re.search(r"replica_count=(\d+)", text)
    n_dev = math.prod(int(h.group(1)) for h in head if h) if any(head) else mesh.devices.size
    types = {name: i.type for name, i in mod.by_name.items()}
    done = {i.operands[0]: i.type for i in mod.by_name.values() if i.opcode.endswith("-done") and i.operands}
    mults = _multipliers(mod)
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0])

    def record(kind: str, axes: tuple, p: int, result: int, operand: int, cname: str) -> None:
        mult, in_loop = mults[cname]
        if not mult:  # unreachable from ENTRY
            return
        row = rows[kind, axes, p, result, operand, in_loop]
        factor = {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(kind, (p - 1) / p)  # ring
        row[0], row[1] = row[0] + mult, row[1] + mult * factor * (result if kind == "all-gather" else operand)

    absorbed = set()  # a windowed-einsum ring counts as the one all-gather (reduce-scatter) it implements
    for cname, kind, perms in _windowed_rings(mod):
        absorbed |= {i.name for i in perms}
        axes, p = _axes([pr for i in perms for pr in _pairs(i)], coords, mesh, exact=False) if perms else ((), 1)
        block = max((shape_bytes(types.get(o, "")) for i in perms for o in i.operands), default=0)
        record(kind, axes, p, *((p * block, block) if kind == "all-gather" else (block, p * block)), cname)
    # An async collective fusion repeats its collective (same frontend_attributes={chain_id="0"}) in the start,
    # in each fusion it overlaps with (`async_collective_fusion.N`, ROOT a tuple) and in the done: count the start's.
    chain = lambda i: m.group(1) if (m := re.search(r'\bchain_id="([^"]*)"', i.attrs)) else None
    started = {chain(i) for c in mod.comps if _async_role(mod, c) == "start" for i in mod.comps[c]} - {None}
    # A reduce-scatter on TPU: `fusion(%a, %b), kind=kCustom, calls=%all-reduce-scatter.4` whose body all-reduces
    # its inputs and dynamic-slices this device's part: one reduce-scatter, the fusion's inputs to its output.
    fusions = {c: i for i in mod.by_name.values() if i.opcode == "fusion" for c in _callees(i)}  # body -> caller
    for cname in mults:
        role = _async_role(mod, cname)
        for ins in mod.comps[cname]:
            kind = _KIND.get(ins.opcode)
            if ins.opcode == "send" and (dcn := re.search(r'_xla_megascale_transfer_type="(\w+)"', ins.attrs)):
                # Across slices XLA:TPU hands a collective to the megascale (DCN) runtime as a host-transfer pair
                # `send(%x, %token), is_host_transfer=true, frontend_attributes={..._xla_megascale_transfer_type=
                # "ALL_REDUCE"}` + `recv`: one collective, over the mesh axes along which devices change slice.
                (axes, p), size, dcn_kind = _slice_axes(mesh), shape_bytes(types.get(ins.operands[0], "")), dcn.group(1)
                result = {"ALL_GATHER": size * p, "REDUCE_SCATTER": size // p}.get(dcn_kind, size)
                record(dcn_kind.lower().replace("_", "-"), axes, p, result, size, cname)
            repeat = role == "done" or (role != "start" and chain(ins) in started)  # a start's copy, counted there
            if kind is None or ins.name in absorbed or repeat:
                continue
            ops = ins.operands[:1] if "slice_sizes=" in ins.attrs else ins.operands
            operand = sum(shape_bytes(types.get(o, "")) for o in ops)
            result_type = done.get(ins.name, ins.type)
            if result_type.startswith("(") and ins.opcode.endswith("-start") and ins.name not in done:
                elems = _split_top(result_type[1:-1])  # (operands, results, context...) of an async start
                result_type = elems[1] if len(elems) > 1 and shape_bytes(elems[0]) == operand else result_type
            result = shape_bytes(result_type)
            if kind == "all-reduce" and cname.startswith("all-reduce-scatter") and (fusion := fusions.get(cname)):
                kind, result = "reduce-scatter", shape_bytes(fusion.type)
                operand = sum(shape_bytes(types.get(o, "")) for o in fusion.operands)
            if kind == "collective-permute":
                pairs = _pairs(ins)
                axes, p = _axes(pairs, coords, mesh, exact=False) if pairs else ((), 1)
            else:
                rg = re.search(r"replica_groups=(.*)", ins.attrs)
                groups = parse_replica_groups(rg.group(1), n_dev) if rg else [list(range(n_dev))]
                axes, p = _axes(groups, coords, mesh, exact=True) if max(map(len, groups)) > 1 else ((), 1)
            record(kind, axes, p, result, operand, cname)
    out = [Collective(k, a, p, c, r, o, s, lp) for (k, a, p, r, o, lp), (c, s) in rows.items()]
    return sorted(out, key=lambda c: (-c.bytes_sent, c.kind, c.axes, c.in_loop))


def _taps(n_in: int, n_out: int, size: int, stride=1, pad=0, lhs_dilate=1, rhs_dilate=1, **_: int) -> int:
    """(output, window) position pairs of one spatial dimension that multiply-add. Padding counts, as a dense kernel
    computes it, where the window fits the input (a SAME convolution's borders); where it does not, only pairs that
    read an input element count: XLA:TPU writes a dot's free and batch dimensions as windows wider than their input
    (`window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}` over size 1) or over a dilated input (`lhs_dilate=2x4`)."""
    if lhs_dilate == 1 and size <= n_in:
        return n_out * size
    q = np.arange(size) * rhs_dilate - pad  # the input position each tap reads for output 0
    if lhs_dilate == 1:  # per tap, the outputs o with 0 <= o * stride + q < n_in
        last, first = np.minimum(n_out - 1, (n_in - 1 - q) // stride), np.maximum(0, -(q // stride))
        return int(np.maximum(0, last - first + 1).sum())
    pos = np.arange(n_out)[:, None] * stride + q[None, :]
    return int(np.count_nonzero((pos >= 0) & (pos <= (n_in - 1) * lhs_dilate) & (pos % lhs_dilate == 0)))


#: XLA:GPU's gemm library calls: `custom-call(%lhs, %rhs), custom_call_target="__cublas$lt$matmul"`, the dot's
#: dimension numbers in backend_config (`"lhs_contracting_dimensions":["1"]`), the result first in a tuple with the
#: workspace (`(bf16[512,384], s8[4194304])`). Triton gemms are fusions whose body holds the dot: read as dots.
_GEMM_CALLS = re.compile(r'custom_call_target="__cublas\$(?:lt\$)?(?:matmul|gemm)[^"]*"')


def _gemm_call_flops(ins: _Instr, types: dict[str, str]) -> int:
    """2 x multiply-adds of one cuBLAS gemm custom call (0 if its dimension numbers cannot be read)."""
    res, lhs = _SHAPE.search(ins.type), _SHAPE.search(types.get(ins.operands[0], "")) if ins.operands else None
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    if not (res and lhs and contracting):
        return 0
    dims = _ints(lhs.group(2))
    k = math.prod(dims[int(i)] for i in re.findall(r"\d+", contracting.group(1)) if int(i) < len(dims))
    return 2 * math.prod(_ints(res.group(2))) * k


def _dot_flops(ins: _Instr, types: dict[str, str]) -> int:
    """2 x multiply-adds of one dot, convolution or cuBLAS gemm call (0 for other ops)."""
    if ins.opcode == "custom-call":
        return _gemm_call_flops(ins, types) if _GEMM_CALLS.search(ins.attrs) else 0
    out = sum(math.prod(_ints(d)) for _, d in _SHAPE.findall(ins.type.split("{")[0])) if ins.type else 0
    if ins.opcode == "dot" and ins.operands:
        lhs = _SHAPE.search(types.get(ins.operands[0], ""))
        dims = _ints(lhs.group(2)) if lhs else []
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        return 2 * out * math.prod(dims[i] for i in _ints(contracting.group(1)) if i < len(dims)) if contracting else 0
    if ins.opcode != "convolution" or len(ins.operands) < 2:
        return 0
    shapes = [_SHAPE.search(t) for t in (types.get(ins.operands[0], ""), types.get(ins.operands[1], ""), ins.type)]
    if not all(shapes) or not (labels := re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)):
        return 0
    (lhs, rhs, res), (ll, rl, ol) = [_ints(m.group(2)) for m in shapes], labels.groups()
    win = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(re.findall(r"(\w+)=([-\d_x]+)", win.group(1))) if win else {}  # size=3x3 stride=1x1 pad=1_1x1_1
    dim = lambda i: {k: int(v.split("x")[i].split("_")[0]) for k, v in fields.items()}  # pad: the low side's
    spatial = sorted(c for c in rl if c.isdigit())  # window entry i is spatial dimension "i" of the labels
    taps = math.prod(
        _taps(lhs[ll.index(d)], res[ol.index(d)], **{"size": rhs[rl.index(d)], **dim(i)}) for i, d in enumerate(spatial)
    )
    return 2 * res[ol.index("b")] * res[ol.index("f")] * rhs[rl.index("i")] * taps  # batch x out x in/groups x taps


def matmul_flops(compiled_or_hlo_text: Any) -> int:
    """FLOPs of one step's dots and convolutions (2 x multiply-adds), per device, each loop body counted as many
    times as its loop runs. XLA's `cost_analysis()["flops"]` counts a while loop's body once (a `lax.scan` over L
    layers as one layer), so the recomputation of a scanned layer stack shows there at 1/L of its size."""
    src = compiled_or_hlo_text
    text = src if isinstance(src, str) else src.as_text()
    mod = _parse_module(text)
    types = {name: i.type for name, i in mod.by_name.items()}
    return sum(m * sum(_dot_flops(ins, types) for ins in mod.comps[c]) for c, (m, _) in _multipliers(mod).items() if m)


def _gpu_kernel(ins: _Instr) -> str:
    """The name of an XLA:GPU fused-kernel call, '' for other instructions: a Pallas GPU (Triton) kernel
    (`custom_call_target="__gpu$xla.gpu.triton"`, its name in backend_config: `name = "mha_forward"`) or a cuDNN
    one (`__cudnn$fmhaSoftmax`, `...Backward`: "cudnn:fmhaSoftmax")."""
    target = re.search(r'custom_call_target="([^"]*)"', ins.attrs) if ins.opcode == "custom-call" else None
    if target and target.group(1) == "__gpu$xla.gpu.triton":
        name = re.search(r'\bname = "([^"]*)"', ins.attrs)
        return name.group(1) if name else re.sub(r"\.\d+$", "", ins.name)
    return f"cudnn:{target.group(1)[8:]}" if target and target.group(1).startswith("__cudnn$") else ""


def kernel_calls(compiled_or_hlo_text: Any, target: str = "tpu_custom_call") -> list[tuple[str, int]]:
    """(kernel, executions per step) of each custom call to `target` in a compiled step: which fused kernels run
    ("tpu_custom_call": Mosaic, Pallas's TPU kernels, named after the kernel, e.g. `splash_mqa_fwd_residuals`;
    "gpu": Pallas's GPU (Triton) kernels by their name, e.g. `mha_forward`, and cuDNN's, e.g. `cudnn:fmhaSoftmax`)
    and how often, loop trip counts included (a kernel inside the ring's loop runs once per ring step; each branch
    of a conditional counts as run). Their FLOPs are inside the kernels: `matmul_flops` does not see them."""
    src = compiled_or_hlo_text
    mod = _parse_module(src if isinstance(src, str) else src.as_text())
    mult = _multipliers(mod)
    mosaic = lambda ins: ins.opcode == "custom-call" and f'custom_call_target="{target}"' in ins.attrs
    name = _gpu_kernel if target == "gpu" else lambda ins: re.sub(r"\.\d+$", "", ins.name) if mosaic(ins) else ""
    return [(n, mult.get(cname, (0, False))[0])
            for cname, instrs in mod.comps.items() for ins in instrs if (n := name(ins))]  # fmt: skip


def summarize(colls: Iterable[Collective]) -> dict[tuple[str, tuple[str, ...]], dict]:
    """(kind, axes) -> {"count": occurrences per step, "bytes_sent": per-device bytes per step}."""
    out: dict = collections.defaultdict(lambda: {"count": 0, "bytes_sent": 0.0})
    for c in colls:
        out[c.kind, c.axes]["count"] += c.count
        out[c.kind, c.axes]["bytes_sent"] += c.bytes_sent
    return dict(out)


def format_table(colls: Iterable[Collective]) -> str:
    """A plain-text table: one row per Collective, then the per-device total sent per step."""
    colls, units = list(colls), ((3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "B"))
    h = lambda n: next(f"{n / 1024**i:.4g} {u}" for i, u in units if abs(n) >= 1024**i or i == 0)
    head = f"{'kind':<18} {'axes':<12} {'p':>4} {'count':>6} {'result':>10} {'operand':>10} {'sent/step':>10}  loop"
    lines = [head, "-" * len(head)]
    for c in colls:
        axes, sizes = ",".join(c.axes) or "-", f"{h(c.result_bytes):>10} {h(c.operand_bytes):>10} {h(c.bytes_sent):>10}"
        lines.append(f"{c.kind:<18} {axes:<12} {c.group_size:>4} {c.count:>6} {sizes}  {'yes' * c.in_loop}".rstrip())
    total = f"{'total':<18} {'':<12} {'':>4} {sum(c.count for c in colls):>6} {'':>10} {'':>10}"
    return "\n".join([*lines, f"{total} {h(sum(c.bytes_sent for c in colls)):>10}"])
