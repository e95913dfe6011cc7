"""Collectives and the bytes they move, read from a compiled XLA executable's per-device HLO text.

    c = jax.jit(step).lower(*args).compile()
    print(format_table(collectives(c, mesh)))

Replica-group ids are logical partition ids; for a `Compiled` they are mapped to devices through the
executable's device assignment, for bare text partition `i` is taken to be `mesh.devices.flat[i]`.
Collectives inside while loops are multiplied by the trip count; conditional branches count as taken.
"""

from __future__ import annotations

import collections
import dataclasses
import graphlib
import itertools
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from shardkit.errors import ShardkitError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_KIND = {k + suffix: k for k in KINDS for suffix in ("", "-start")}  # opcode -> kind; `-done` halves are skipped


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


_Instr = collections.namedtuple("_Instr", "name type opcode operands attrs")  # attrs: text after the operands
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def shape_bytes(type_str: str) -> int:
    """Bytes of an HLO type such as `f32[4,8]{1,0}` or `(bf16[2], s32[])` (tuples summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(type_str):
        n = math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        bits = 8 if dtype == "pred" else int(re.match(r"[a-z]+(\d*)", dtype).group(1) or 0)  # token[]: 0
        total += -(-n * bits // 8)
    return total


def _matching(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i]."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] in "([{") - (s[j] in ")]}")
        if depth == 0:
            return j + 1
    return len(s)


def _split_top(s: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:j].strip())
            start = j + 1
    parts.append(s[start:].strip())
    return [p for p in parts if p]


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    rest = m.group(2) if m else ""
    end = _matching(rest, 0) if rest.startswith("(") else rest.find(" ")
    type_str, rest = rest[: max(end, 0)], rest[end:].lstrip()
    if end < 0 or not (op := re.match(r"([\w\-]+)\(", rest)):
        return None
    close = _matching(rest, op.end() - 1)
    operands = tuple(p.split()[-1].lstrip("%") for p in _split_top(rest[op.end() : close - 1]))
    return _Instr(m.group(1), type_str, op.group(1), operands, _METADATA.sub("", rest[close:]))


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
    text = re.sub(r"/\*.*?\*/", "", text)
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if " = " not in line and (h := _HEADER.match(line)):
            current = comps.setdefault(h.group(2), [])
            entry = h.group(2) if h.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (ins := _parse_instr(line)):
            current.append(ins)
    if not entry:
        raise ShardkitError("no ENTRY computation found: pass a jax Compiled or the text of Compiled.as_text()")
    return comps, entry


_ints = lambda s: [int(x) for x in re.findall(r"\d+", s or "")]


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
    """Row i: the mesh coordinates of partition id i (via the executable's device assignment if known)."""
    ids = {d.id: pos for pos, d in enumerate(mesh.devices.flat)}
    try:  # partition i runs on the executable's i-th device
        order = [ids[d.id] for d in compiled.runtime_executable().local_devices()]
    except Exception:  # text input, or a device outside the mesh: partition i is mesh.devices.flat[i]
        order = []
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


def _callees(ins: _Instr) -> list[str]:
    pattern = r"\b(?:calls|to_apply|body|condition|branch_computations|\w+_computation)=(\{[^}]*\}|%?[\w.\-]+)"
    return [n.lstrip("%") for m in re.finditer(pattern, ins.attrs) for n in re.findall(r"%?[\w.\-]+", m.group(1))]


def _trip_count(ins: _Instr, comps: dict[str, list[_Instr]]) -> int:
    """XLA's `known_trip_count`, else `N` from a lone integer constant in the condition, else 1 (unknown)."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs):
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", ins.attrs)
    cond_instrs = comps.get(cond.group(1) if cond else "", [])
    consts = [i.operands[0] for i in cond_instrs if i.opcode == "constant" and re.fullmatch(r"[su]\d+\[\]", i.type)]
    if len(consts) == 1 and consts[0].lstrip("-").isdigit():  # `i < N` with the induction variable
        init = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(\d+)"', ins.attrs)
        lo, step = (int(init.group(1)), int(init.group(2))) if init else (0, 1)
        return max(0, -(-(int(consts[0]) - lo) // step))
    return 1


def _multipliers(comps: dict[str, list[_Instr]], entry: str) -> dict[str, tuple[int, bool]]:
    """Computation -> (executions per step, inside a loop), over the computations reachable from ENTRY."""
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for cname, instrs in comps.items():
        for ins in instrs:
            if _KIND.get(ins.opcode) or ins.opcode.endswith(("-done", "-update")):
                continue  # reduction bodies hold no collectives; async done/update re-name their start's callee
            body = re.search(r"body=%?([\w.\-]+)", ins.attrs) if ins.opcode == "while" else None
            trip = _trip_count(ins, comps) if body else 1
            edges.setdefault(cname, []).extend((c, trip, bool(body)) for c in _callees(ins) if c in comps)
    graph: dict[str, set[str]] = {c: set() for c in comps}
    for caller, es in edges.items():
        graph.update({callee: graph[callee] | {caller} for callee, _, _ in es})
    mult = {c: (int(c == entry), False) for c in comps}
    for c in graphlib.TopologicalSorter(graph).static_order():  # callers before callees; HLO calls are acyclic
        for callee, trip, is_loop in edges.get(c, []):
            m, loop = mult[callee]
            mult[callee] = (m + mult[c][0] * trip, loop or (mult[c][0] > 0 and (mult[c][1] or is_loop)))
    return mult


def collectives(compiled_or_hlo_text: Any, mesh: jax.sharding.Mesh) -> list[Collective]:
    """The collectives of one step of a compiled executable (a jax `Compiled` or its `as_text()`).

    Rows with equal (kind, axes, result_bytes, operand_bytes, in_loop) are merged with summed counts;
    sorted by bytes_sent, largest first. Async `-start`/`-done` pairs count once.
    """
    src = compiled_or_hlo_text
    text = src if isinstance(src, str) else getattr(src, "as_text", lambda: None)()
    if not isinstance(text, str) or "ENTRY" not in text:
        raise ShardkitError("collectives() needs a jax Compiled (jax.jit(f).lower(...).compile()) or its as_text()")
    comps, entry = _parse_module(text)
    coords = _coords(compiled_or_hlo_text, mesh)
    head = re.search(r"num_partitions=(\d+)", text), re.search(r"replica_count=(\d+)", text)
    n_dev = math.prod(int(h.group(1)) for h in head if h) if any(head) else mesh.devices.size
    types = {i.name: i.type for instrs in comps.values() for i in instrs}
    done = {i.operands[0]: i.type for c in comps.values() for i in c if i.opcode.endswith("-done") and i.operands}
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0, 0.0])
    for cname, (mult, in_loop) in _multipliers(comps, entry).items():
        for ins in comps[cname]:
            kind = _KIND.get(ins.opcode)
            if kind is None or mult == 0:
                continue
            ops = ins.operands[:1] if "slice_sizes=" in ins.attrs else ins.operands
            operand = sum(shape_bytes(types.get(o, "")) for o in ops)
            result_type = done.get(ins.name, ins.type)
            if result_type.startswith("(") and ins.opcode.endswith("-start") and ins.name not in done:
                elems = _split_top(result_type[1:-1])  # (operands, results, context...) of an async start
                result_type = elems[1] if len(elems) > 1 and shape_bytes(elems[0]) == operand else result_type
            result = shape_bytes(result_type)
            if kind == "collective-permute":
                pm = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}", ins.attrs)
                pairs = [_ints(g) for g in re.findall(r"\{([\d,\s]+)", pm.group(1))] if pm else []
                axes, p = _axes(pairs, coords, mesh, exact=False) if pairs else ((), 1)
            else:
                rg = re.search(r"replica_groups=(.*)", ins.attrs)
                groups = parse_replica_groups(rg.group(1), n_dev) if rg else [list(range(n_dev))]
                axes, p = _axes(groups, coords, mesh, exact=True) if max(map(len, groups)) > 1 else ((), 1)
            key = (kind, axes, p, result, operand, in_loop)
            rows[key][0] += mult
            factor = {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(kind, (p - 1) / p)  # ring
            rows[key][1] += mult * factor * (result if kind == "all-gather" else operand)
    out = [Collective(k, a, p, c, r, o, s, lp) for (k, a, p, r, o, lp), (c, s) in rows.items()]
    return sorted(out, key=lambda c: (-c.bytes_sent, c.kind, c.axes, c.in_loop))


def _dot_flops(ins: _Instr, types: dict[str, str]) -> int:
    """2 x multiply-adds of one dot or convolution instruction (0 for other ops)."""
    out = sum(math.prod(_ints(d)) for _, d in _SHAPE.findall(ins.type.split("{")[0])) if ins.type else 0
    if ins.opcode == "dot" and ins.operands:
        lhs = _SHAPE.search(types.get(ins.operands[0], ""))
        dims = _ints(lhs.group(2)) if lhs else []
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        return 2 * out * math.prod(dims[i] for i in _ints(contracting.group(1)) if i < len(dims)) if contracting else 0
    if ins.opcode == "convolution" and len(ins.operands) > 1:
        rhs = _SHAPE.search(types.get(ins.operands[1], ""))
        labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
        if not rhs or not labels or "o" not in labels.group(1):
            return 0
        dims = _ints(rhs.group(2))
        return 2 * out * math.prod(dims) // max(dims[labels.group(1).index("o")], 1)  # out x window x in / groups
    return 0


def matmul_flops(compiled_or_hlo_text: Any) -> int:
    """FLOPs of one step's dots and convolutions (2 x multiply-adds), per device, each loop body counted as many
    times as its loop runs. XLA's `cost_analysis()["flops"]` counts a while loop's body once (a `lax.scan` over L
    layers as one layer), so the recomputation of a scanned layer stack shows there at 1/L of its size."""
    src = compiled_or_hlo_text
    text = src if isinstance(src, str) else src.as_text()
    comps, entry = _parse_module(text)
    types = {i.name: i.type for instrs in comps.values() for i in instrs}  # HLO names are unique per module
    mult = _multipliers(comps, entry)
    return sum(m * sum(_dot_flops(ins, types) for ins in comps[c]) for c, (m, _) in mult.items() if m)


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
