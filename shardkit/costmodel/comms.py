"""A train step's collectives as rows, and their time on a hardware preset's links.

A cost model (shardkit/costmodel/protocol.py) writes one `Comm` row per kind of collective and mesh axis with the
public `CommBuilder`; `comm_time` prices the rows; the AxoNN 3D linear's own collectives are `tp3d_layer_comms`.

Bytes are per device per step, ring volumes (docs/algorithms.md §1; what `shardkit.hlo` counts from compiled HLO):
all-gather / reduce-scatter (p-1)/p·n, all-reduce 2(p-1)/p·n, n the full buffer. Time is alpha-beta per
collective, `count·steps·α + bytes/bandwidth` (steps: p-1, all-reduce 2(p-1)), with the link of each mesh axis
chosen by nesting: an axis whose group, times the sizes of the axes nested inside it, fits in one node uses
the preset's ICI link, else its DCN link. `variant="axonn"` uses AxoNN's published model instead (Singh et
al. 2305.13525 §5 and their public performance-model script; tables in meshes/perlmutter.toml, frontier.toml).

Backend: `backend="gpu"` (or "tpu") models reduce-scatters as reduce-scatters. `backend="cpu"` models what
XLA:CPU compiles: GSPMD's reduce-scatters (FSDP gradients, Megatron-SP's g) become a full all-reduce plus a
dynamic-slice (tests/test_structure.py); explicit `lax.psum_scatter` in shard_map kernels (tensor3d) stays
a reduce-scatter. On a v4 / v5p torus slice the TPU compiler keeps some GSPMD reduce-scatters as all-reduces
(shardkit/costmodel/torus.py `as_compiled`, which `sk.plan` and `sk.explain` apply to these rows).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.presets import HardwarePreset, Link, preset_dirs

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: AxoNN's nesting order, innermost first: col (x) -> row (y) -> depth (z) -> data.
TP3D_ORDER = ("col", "row", "depth", "data")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One kind of collective over one mesh axis in a step: bytes sent per device, summed over `count` calls."""

    kind: str
    axis: str
    group: int  # devices per group (the axis size)
    inner: int  # product of the sizes of the axes nested inside this one
    count: int
    bytes: float
    what: str = ""
    #: (count, bytes) of this row's reduce-scatters that scatter their buffer's last dimension (a TPU torus may
    #: compile those as all-reduces: shardkit/costmodel/torus.py)
    last_dim: tuple[int, float] = (0, 0.0)


def ring_factor(kind: str, p: int) -> float:
    """Bytes sent per device as a fraction of the full buffer n (docs/algorithms.md §1)."""
    if p <= 1:
        return 0.0
    return {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(kind, (p - 1) / p)


def _steps(kind: str, p: int) -> int:
    return {"all-reduce": 2 * (p - 1), "collective-permute": 1}.get(kind, p - 1)


class CommBuilder:
    """The public builder a model's cost model writes its collectives with: `add` one row per collective (axes of
    size 1 skipped; on the CPU backend a GSPMD reduce-scatter becomes the all-reduce XLA:CPU compiles), then
    `comms()` the rows merged per (kind, axis), what `sk.explain` compares with the compiled HLO.

        b = sk.costmodel.CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)   # innermost axis first
        b.add("all-reduce", "data", grad_bytes, 1, "gradients")
        rows = b.comms()
    """

    def __init__(self, mesh: dict[str, int], order: Sequence[str], backend: str):
        self.mesh, self.order, self.backend, self.rows = mesh, list(order), backend, []

    def add(
        self, kind: str, axis: str, n: float, count: int = 1, what: str = "", gspmd: bool = False,
        last_dim: bool = False,
    ) -> None:  # fmt: skip
        """`axis` may name several axes, "data,depth": one collective over their product (size-1 ones dropped;
        the row's axis lists the rest outermost first, as `shardkit.hlo` names them). `last_dim`: a reduce-scatter
        of buffers scattered along their last dimension (`Comm.last_dim`)."""
        names = sorted((a for a in axis.split(",") if self.mesh.get(a, 1) > 1), key=self.order.index, reverse=True)
        p = math.prod(self.mesh[a] for a in names)
        if p <= 1 or n <= 0:
            return
        if kind == "reduce-scatter" and gspmd and self.backend == "cpu":
            kind, what = "all-reduce", what + " (CPU: all-reduce + dynamic-slice)"
        axis = ",".join(names)
        i = self.order.index(names[-1])  # the innermost of the group's axes
        inner = math.prod(self.mesh.get(a, 1) for a in self.order[:i])
        sent = ring_factor(kind, p) * n
        last = (count, sent) if last_dim and kind == "reduce-scatter" else (0, 0.0)
        self.rows.append(Comm(kind, axis, p, inner, count, sent, what, last))

    def comms(self) -> list[Comm]:
        """The rows added so far, merged per (kind, axis) (counts and bytes summed)."""
        return merge_comms(self.rows)


def tp3d_layer_comms(
    b: CommBuilder, h1: int, h2: int, tokens: int, transpose: bool, nbytes: int, what: str, gspmd: bool = False
) -> None:
    """One `tensor3d.linear` fwd + bwd (docs/algorithms.md §5): AR of y over G_in, AR of dx over G_out, AG / AG / RS
    of the weight block over depth, AR of the weight shard's gradient over data. `tokens` = global m."""
    gx, gy, gz, gd = (b.mesh.get(a, 1) for a in TP3D_ORDER)
    (ain, gin), (aout, gout) = (("row", gy), ("col", gx)) if transpose else (("col", gx), ("row", gy))
    rows = tokens / (gd * gz)
    b.add("all-reduce", ain, rows * h2 / gout * nbytes, 1, f"{what}: y = AR_{ain}(x w) fwd")
    b.add("all-reduce", aout, rows * h1 / gin * nbytes, 1, f"{what}: dx = AR_{aout}(dy wᵀ) bwd")
    block = h1 * h2 / (gin * gout) * nbytes
    if gspmd:  # inside the GPT's layer scan the backward gathers the block again (not saved as a residual)
        b.add("all-gather", "depth", 2 * block, 2, f"{what}: weight AG over depth, fwd and again bwd")
    else:  # a `tensor3d.linear` stack: the backward reuses the forward's gathered block (bytes counted once)
        b.add("all-gather", "depth", block, 2, f"{what}: weight AG over depth, fwd and bwd")
    b.add("reduce-scatter", "depth", block, 1, f"{what}: dW RS over depth", gspmd=gspmd,
          last_dim=transpose and gspmd)  # fmt: skip
    b.add("all-reduce", "data", block / gz, 1, f"{what}: dW shard AR over data")


def merge_comms(rows: Iterable[Comm]) -> list[Comm]:
    """Rows of the same (kind, axis) summed into one: counts and bytes added, the first row's description kept."""
    out: dict[tuple[str, str], Comm] = {}
    for r in rows:
        k = (r.kind, r.axis)
        if k in out:
            last = (out[k].last_dim[0] + r.last_dim[0], out[k].last_dim[1] + r.last_dim[1])
            r = dataclasses.replace(r, count=out[k].count + r.count, bytes=out[k].bytes + r.bytes, last_dim=last)
        out[k] = r
    return list(out.values())


def _node_size(hw: HardwarePreset) -> int:
    return math.prod(hw.ici.values()) if hw.ici else 1


def comm_time(comms: Iterable[Comm], hw: HardwarePreset, variant: str = "alpha-beta") -> float:
    """Seconds of communication per step (no overlap): alpha-beta per link, or AxoNN's fitted model."""
    node, total = _node_size(hw), 0.0
    axonn = _axonn_tables(hw) if variant == "axonn" else None
    for c in comms:
        if axonn is not None:
            v = c.bytes * (2 if c.axis == "data" and c.kind == "all-reduce" else 1)  # their 2x data volume
            total += axonn["alpha"] * c.group / 1000 * c.count + v / 2**30 / _axonn_beta(axonn, c.inner, c.group)
            continue
        link: Link = hw.links["dcn"] if c.inner * c.group > node and "dcn" in hw.links else hw.links["ici"]
        total += c.count * _steps(c.kind, c.group) * link.latency + c.bytes / link.bandwidth
    return total


def _axonn_tables(hw: HardwarePreset) -> dict[str, Any]:
    import tomllib

    for d in preset_dirs():
        path = d / f"{hw.name}.toml"
        if path.is_file():
            with path.open("rb") as fh:
                raw = tomllib.load(fh)
            if "axonn" in raw:
                return raw["axonn"]
    raise ShardkitError(f"variant='axonn' needs an [axonn] table in meshes/{hw.name}.toml (see perlmutter.toml)")


def _axonn_beta(t: dict[str, Any], inner: int, g: int) -> float:
    """GB/s for a group of g nested inside `inner` devices: measured table, else inter-node bandwidth."""
    if inner * g <= t["node_size"]:
        return float(t["beta_intra"].get(f"{inner},{g}", t["beta_inter"]))
    return t["beta_inter"] / min(t["node_size"], inner)


__all__ = ["KINDS", "TP3D_ORDER", "Comm", "CommBuilder", "comm_time", "merge_comms", "ring_factor",
           "tp3d_layer_comms"]  # fmt: skip
