"""An XLA HLO module's text, read: computations and instructions, buffer sizes, and how many times each
computation runs per step (while loops' trip counts multiplied through the call graph). `shardkit/hlo.py` reads
collectives and FLOPs on top of it.
"""

from __future__ import annotations

import collections
import graphlib
import math
import re

from shardkit.errors import ShardkitError

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_KIND = {k + suffix: k for k in KINDS for suffix in ("", "-start")}  # opcode -> kind; `-done` halves are skipped

_ints = lambda s: [int(x) for x in re.findall(r"\d+", s or "")]


_Instr = collections.namedtuple("_Instr", "name type opcode operands attrs")  # attrs: text after the operands
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_METADATA = re.compile(r'metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\)\s*->.*)?\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def shape_bytes(type_str: str) -> int:
    """Bytes of an HLO type such as `f32[4,8]{1,0}` or `(bf16[2], s32[])` (tuples summed): the logical shape's, as
    TPU's tiles and memory spaces in a layout (`bf16[1,512,128]{1,0,2:T(2,128)(2,1)S(1)}`) pad no logical byte."""
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


#: comps: computation -> its instructions; roots: computation -> its ROOT; by_name: HLO names are unique per module
_Module = collections.namedtuple("_Module", "comps entry roots by_name")


def _parse_module(text: str) -> _Module:
    text = re.sub(r"/\*.*?\*/", "", text)
    mod, entry, cname = _Module({}, "", {}, {}), "", None
    for line in text.splitlines():
        if " = " not in line and (h := _HEADER.match(line)):
            cname, entry = h.group(2), h.group(2) if h.group(1) else entry
            mod.comps.setdefault(cname, [])
        elif line.strip() == "}":
            cname = None
        elif cname is not None and (ins := _parse_instr(line)):
            mod.comps[cname].append(ins)
            mod.by_name[ins.name] = ins
            mod.roots.update({cname: ins} if line.lstrip().startswith("ROOT ") else {})
    if not entry:
        raise ShardkitError("no ENTRY computation found: pass a jax Compiled or the text of Compiled.as_text()")
    return mod._replace(entry=entry)


def _callees(ins: _Instr) -> list[str]:
    pattern = r"\b(?:calls|to_apply|body|condition|branch_computations|\w+_computation)=(\{[^}]*\}|%?[\w.\-]+)"
    return [n.lstrip("%") for m in re.finditer(pattern, ins.attrs) for n in re.findall(r"%?[\w.\-]+", m.group(1))]


def _through(mod: _Module, name: str) -> _Instr | None:
    """The instruction `name`, looking through copies, bitcasts and converts."""
    ins = mod.by_name.get(name)
    while ins is not None and ins.opcode in ("copy", "bitcast", "convert") and ins.operands:
        ins = mod.by_name.get(ins.operands[0])
    return ins


def _const(mod: _Module, name: str) -> int | None:
    ins = _through(mod, name)
    value = ins.operands[0] if ins is not None and ins.opcode == "constant" and ins.operands else ""
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def _unfused(mod: _Module, ins: _Instr | None) -> _Instr | None:
    """`ins` itself, or, where it is a fusion wrapping one instruction of its parameters (XLA:CPU in jax 0.12 wraps a
    loop's `i < N` and `i + 1` as `wrapped_compare` / `wrapped_add` fusions), that instruction on the fusion's
    operands."""
    if ins is None or ins.opcode != "fusion" or not (callee := re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)):
        return ins
    root, params = mod.roots.get(callee.group(1)), {}
    for p in mod.comps.get(callee.group(1), []):
        if (
            p.opcode == "parameter"
            and p.operands
            and p.operands[0].isdigit()
            and int(p.operands[0]) < len(ins.operands)
        ):
            params[p.name] = ins.operands[int(p.operands[0])]
    if root is None or not root.operands or any(o not in params for o in root.operands):
        return ins
    return root._replace(name=ins.name, operands=tuple(params[o] for o in root.operands))


def _tuple_index(mod: _Module, name: str) -> int | None:
    """k when `name` is `get-tuple-element(parameter), index=k`: a value a loop carries."""
    ins = _through(mod, name)
    src = mod.by_name.get(ins.operands[0]) if ins is not None and ins.opcode == "get-tuple-element" else None
    return _ints(re.search(r"\bindex=\d+", ins.attrs).group(0))[0] if src and src.opcode == "parameter" else None


def _trip_count(ins: _Instr, mod: _Module) -> int:
    """XLA's `known_trip_count`, else read off the induction variable: the condition's `i < N` (<=, >, >=, !=) with
    N constant (`ROOT compare(%get-tuple-element.24, %constant.67), direction=LT`), the body's `i + step`, the
    constant `i` starts from in the initial tuple; else 1 (unknown). XLA:TPU's loops carry no known_trip_count, and
    its windowed-einsum loops step by 2."""
    if m := re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs):
        return int(m.group(1))
    cond, body = (re.search(rf"{k}=%?([\w.\-]+)", ins.attrs) for k in ("condition", "body"))
    cmp, lo, step = _unfused(mod, mod.roots.get(cond.group(1) if cond else "")), 0, 1
    if cmp is None or cmp.opcode != "compare" or len(cmp.operands) != 2:
        return 1
    (a, b), d = cmp.operands, re.search(r"direction=(\w+)", cmp.attrs).group(1)
    if _tuple_index(mod, a) is None:  # `N > i`: read as `i < N`
        a, b, d = b, a, {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(d, d)
    k, n, root = _tuple_index(mod, a), _const(mod, b), mod.roots.get(body.group(1) if body else "")
    init = mod.by_name.get(ins.operands[0])
    if None in (n, k, root, init) or root.opcode != "tuple" or k >= len(root.operands) or d == "EQ":
        return 1
    nxt = _unfused(mod, _through(mod, root.operands[k]))
    if nxt is not None and nxt.opcode in ("add", "subtract") and _tuple_index(mod, nxt.operands[0]) == k:
        step = step if (c := _const(mod, nxt.operands[1])) is None else (c if nxt.opcode == "add" else -c)
    if init.opcode == "tuple" and k < len(init.operands) and (c := _const(mod, init.operands[k])) is not None:
        lo = c
    end = n + (d in ("LE", "GE")) * (1 if step > 0 else -1)
    return max(0, -(-(end - lo) // step)) if step else 1


def _multipliers(mod: _Module) -> dict[str, tuple[int, bool]]:
    """Computation -> (executions per step, inside a loop), over the computations reachable from ENTRY."""
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for cname, instrs in mod.comps.items():
        for ins in instrs:
            if _KIND.get(ins.opcode) or ins.opcode.endswith(("-done", "-update")):
                continue  # reduction bodies hold no collectives; async done/update re-name their start's callee
            body = re.search(r"body=%?([\w.\-]+)", ins.attrs) if ins.opcode == "while" else None
            trip = _trip_count(ins, mod) if body else 1
            edges.setdefault(cname, []).extend((c, trip, bool(body)) for c in _callees(ins) if c in mod.comps)
    graph: dict[str, set[str]] = {c: set() for c in mod.comps}
    for caller, es in edges.items():
        graph.update({callee: graph[callee] | {caller} for callee, _, _ in es})
    mult = {c: (int(c == mod.entry), False) for c in mod.comps}
    for c in graphlib.TopologicalSorter(graph).static_order():  # callers before callees; HLO calls are acyclic
        for callee, trip, is_loop in edges.get(c, []):
            m, loop = mult[callee]
            mult[callee] = (m + mult[c][0] * trip, loop or (mult[c][0] > 0 and (mult[c][1] or is_loop)))
    return mult
