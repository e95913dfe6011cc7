"""Predicts, before compiling, what a plan costs: communication time per step and memory, and ranks plans.

    plans = sk.plan(model_cfg, devices=1024, hardware="perlmutter", global_batch=512, seq_len=2048)
    print(format_plans(plans[:5]))

The model-specific terms — which collectives one step of *this* model issues under a strategy, and its memory —
come from the model config's hook, `model_cfg.cost_model(strategy, mesh, batch_shapes, nbytes, backend) ->
(comms, memory, source) | None` (models/gpt_cost.py for the GPT; `model_cfg.indivisible(strategy, mesh,
global_batch) -> reason` drops plans whose shapes do not divide). This module owns the rest: the ring volumes,
the time of a collective on a preset's links, AxoNN's fitted model, the AxoNN 3D linear's own collectives
(`tp3d_layer_comms`), the candidate meshes (every power-of-two mesh over the axes a strategy's tables use) and
the ranking; a hook writes its rows with the public `CommBuilder`, and `register_plan_hook` refines every plan
(the heterogeneous balance, shardkit/parallel/hetero/uneven.py). For any model's parameter traffic under any rules
table, see `shardkit.costmodel_rules`.

Bytes are per device per step, ring volumes (docs/algorithms.md §1; what `shardkit.hlo` counts from compiled HLO):
all-gather / reduce-scatter (p-1)/p·n, all-reduce 2(p-1)/p·n, n the full buffer. Time is alpha-beta per
collective, `count·steps·α + bytes/bandwidth` (steps: p-1, all-reduce 2(p-1)), with the link of each mesh axis
chosen by nesting: an axis whose group, times the sizes of the axes nested inside it, fits in one node uses
the preset's ICI link, else its DCN link. `variant="axonn"` uses AxoNN's published model instead (Singh et
al. 2305.13525 §5 and their public performance-model script; tables in meshes/perlmutter.toml, frontier.toml).

Backend: `backend="gpu"` (or "tpu") models reduce-scatters as reduce-scatters. `backend="cpu"` models what
XLA:CPU compiles: GSPMD's reduce-scatters (FSDP gradients, Megatron-SP's g) become a full all-reduce plus a
dynamic-slice (tests/test_structure.py); explicit `lax.psum_scatter` in shard_map kernels (tensor3d) stays
a reduce-scatter.

A plan whose predicted memory (the hook's "total") is over `memory_fraction` of the device memory is rejected
with the reason. Each (strategy, mesh) is tried under the remat policies `plan(remat=...)` (set as the strategy's
`remat` kernel): the fastest that fits is kept, ranked by comm time + its recompute time (`rank_key`, `RANKING`;
the model's `recompute_flops(strategy, mesh, batch_shapes)` hook gives the FLOPs per device), so a plan that fits
only with remat is ranked with its cost instead of dropped (Korthikanti et al. 2205.05198 §5).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.layers import REMAT_POLICIES  # the policies `plan` tries per (strategy, mesh) by default
from shardkit.presets import HardwarePreset, Link, load_preset, preset_dirs

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


@dataclasses.dataclass(frozen=True)
class Plan:
    """One (strategy, mesh) with its predicted communication, time and memory per device."""

    strategy: str
    mesh: dict[str, int]
    comms: tuple[Comm, ...]
    comm_time_s: float
    memory: dict[str, float]  # params, grads, optimizer, activations, total (bytes per device)
    fits: bool
    reason: str = ""
    #: heterogeneous presets (meshes/*.toml with [[groups]]): predicted compute time per step, even vs balanced
    #: (attached by a plan hook: shardkit/parallel/hetero/uneven.py `plan_on_groups`); None on uniform hardware
    hetero: Any = None
    #: the remat policy the memory is predicted under (the strategy's `remat` kernel slot), and the FLOPs per
    #: device the backward re-runs under it, with their time at the preset's peak x `plan(efficiency=)`
    remat: str = "none"
    recompute_flops: float = 0.0
    recompute_time_s: float = 0.0

    @property
    def step_time_s(self) -> float:
        """The ranking's predicted time per step: communication (no overlap) + recompute (RANKING)."""
        return self.comm_time_s + self.recompute_time_s

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.comms)

    def bytes_by(self) -> dict[tuple[str, str], float]:
        """(kind, axis) -> bytes sent per device per step."""
        out: dict[tuple[str, str], float] = {}
        for c in self.comms:
            out[c.kind, c.axis] = out.get((c.kind, c.axis), 0.0) + c.bytes
        return out

    @property
    def grid(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"


def ring_factor(kind: str, p: int) -> float:
    """Bytes sent per device as a fraction of the full buffer n (docs/algorithms.md §1)."""
    if p <= 1:
        return 0.0
    return {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(kind, (p - 1) / p)


def _steps(kind: str, p: int) -> int:
    return {"all-reduce": 2 * (p - 1), "collective-permute": 1}.get(kind, p - 1)


class CommBuilder:
    """The public builder a model's cost hook writes its collectives with: `add` one row per collective (axes of
    size 1 skipped; on the CPU backend a GSPMD reduce-scatter becomes the all-reduce XLA:CPU compiles), then
    `comms()` the rows merged per (kind, axis), what `sk.explain` compares with the compiled HLO.

        b = sk.costmodel.CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)   # innermost axis first
        b.add("all-reduce", "data", grad_bytes, 1, "gradients")
        rows = b.comms()
    """

    def __init__(self, mesh: dict[str, int], order: Sequence[str], backend: str):
        self.mesh, self.order, self.backend, self.rows = mesh, list(order), backend, []

    def add(self, kind: str, axis: str, n: float, count: int = 1, what: str = "", gspmd: bool = False) -> None:
        """`axis` may name several axes, "data,depth": one collective over their product (size-1 ones dropped;
        the row's axis lists the rest outermost first, as `shardkit.hlo` names them)."""
        names = sorted((a for a in axis.split(",") if self.mesh.get(a, 1) > 1), key=self.order.index, reverse=True)
        p = math.prod(self.mesh[a] for a in names)
        if p <= 1 or n <= 0:
            return
        if kind == "reduce-scatter" and gspmd and self.backend == "cpu":
            kind, what = "all-reduce", what + " (CPU: all-reduce + dynamic-slice)"
        axis = ",".join(names)
        i = self.order.index(names[-1])  # the innermost of the group's axes
        inner = math.prod(self.mesh.get(a, 1) for a in self.order[:i])
        self.rows.append(Comm(kind, axis, p, inner, count, ring_factor(kind, p) * n, what))

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
    b.add("reduce-scatter", "depth", block, 1, f"{what}: dW RS over depth", gspmd=gspmd)
    b.add("all-reduce", "data", block / gz, 1, f"{what}: dW shard AR over data")


def merge_comms(rows: Iterable[Comm]) -> list[Comm]:
    """Rows of the same (kind, axis) summed into one: counts and bytes added, the first row's description kept."""
    out: dict[tuple[str, str], Comm] = {}
    for r in rows:
        k = (r.kind, r.axis)
        out[k] = dataclasses.replace(r, count=out[k].count + r.count, bytes=out[k].bytes + r.bytes) if k in out else r
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


def _pow2(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if n % 2**i == 0]


def candidates(devices: int, strategies: Sequence[Any]) -> list[tuple[Any, dict[str, int]]]:
    """Every power-of-two mesh of `devices` over the mesh axes each strategy's tables use, each of its required
    axes of size > 1 (`Strategy.required_axes`): dp -> data=8; fsdp -> data x fsdp (FSDP and hybrid FSDP);
    tp3d -> every (data, depth, row, col). Read from the registered strategy, never its name."""
    from shardkit.strategies import strategy  # strategies imports nothing from here

    out: list[tuple[Any, dict[str, int]]] = []
    for name in strategies:
        s = strategy(name)  # a ShardkitError naming the registered ones if it is unknown
        axes = sorted(s.mesh_axes() | set(s.required_axes), key=_axis_order)
        if not axes:
            raise ShardkitError(f"plan: strategy {name!r} shards over no mesh axis; nothing to plan")
        for sizes in itertools.product(_pow2(devices), repeat=len(axes)):
            mesh = dict(zip(axes, sizes, strict=True))
            if math.prod(sizes) == devices and all(mesh[a] > 1 for a in s.required_axes):
                out.append((name, mesh))
    return out


def _axis_order(axis: str) -> tuple[int, str]:
    """The order candidate meshes list their axes in (data-like first, as the presets write them)."""
    known = ("data", "fsdp", "expert", "tensor", "stage", "seq", "seq_u", "seq_r", "space", "space_h", "space_w",
             "depth", "row", "col")  # fmt: skip
    return (known.index(axis) if axis in known else len(known), axis)


#: Refinements of every plan on presets with device groups (`register_plan_hook`): (plan, model config, hardware,
#: global batch, seq_len, memory fraction) -> the plan, e.g. with a heterogeneous cluster's balanced batch attached.
PLAN_HOOKS: list[Callable[..., Plan]] = []


def register_plan_hook(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    """Adds `fn(plan, model_cfg, hw, global_batch, seq_len, memory_fraction) -> Plan` to every `plan()` call's
    refinements (shardkit/parallel/hetero/uneven.py adds the balanced batch on heterogeneous presets)."""
    if fn not in PLAN_HOOKS:
        PLAN_HOOKS.append(fn)
    return fn


#: How `plan` ranks, printed under `format_plans`' table.
RANKING = ("ranked by: fits first, then predicted step time = comm ms + recompute ms, recompute ms = recompute "
           "FLOPs / (peak x efficiency {eff:.0%}); ties: fewer recompute FLOPs")  # fmt: skip


def rank_key(p: Plan) -> tuple[bool, float, float]:
    """`plan`'s sort key: (does not fit, step_time_s, recompute_flops): fitting plans first, fastest first."""
    return (not p.fits, p.step_time_s, p.recompute_flops)


#: The strategies `plan` tries for a model config without `plan_strategies` (the dense GPT's formulas cover them).
DEFAULT_STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "tp3d")


def plan(
    model_cfg: Any,
    devices: int,
    hardware: str | HardwarePreset,
    global_batch: int,
    seq_len: int | None = None,
    *,
    strategies: Sequence[Any] | None = None,
    variant: str = "alpha-beta",
    backend: str | None = None,
    nbytes: int = 2,
    memory_fraction: float = 0.9,
    include_rejected: bool = False,
    remat: Sequence[str] | None = REMAT_POLICIES,
    efficiency: float = 0.5,
) -> list[Plan]:
    """Ranks every power-of-two (strategy, mesh, remat policy) plan by predicted step time (fitting plans first).

    `remat`: the policies tried for each (strategy, mesh), set as the strategy's `remat` kernel; the plan kept
    is the fastest that fits (`rank_key`: comm time + recompute FLOPs / (the preset's peak x `efficiency`)),
    else the one that needs the least memory, rejected. A plan that fits only with remat is so ranked with its
    recompute cost instead of dropped. The model's `recompute_flops(strategy, mesh, batch_shapes)` hook gives
    the FLOPs; a model without it is planned with "none" only. `remat=None`: the old behaviour, the strategy's
    own slot (or the model's) decides and nothing is recomputed in the ranking.

    `strategies`: those tried; None = the model config's `plan_strategies` (what its formulas cover: the MoE GPT's
    ep family, CosmoFlow's dp and spatial), else `DEFAULT_STRATEGIES`.

    `model_cfg` brings the model's terms (`cost_model`, `indivisible`; module docstring). Plans with indivisible
    shapes are dropped; plans over `memory_fraction` of HBM are rejected (kept, last, with the reason, when
    `include_rejected`). `backend` defaults to the preset's platform. The hook gets the batch as
    `{"inputs": (global_batch, seq_len)}` (a transformer's), or `{"batch": (global_batch,)}` without `seq_len`
    (a model that knows its own input shape, e.g. CosmoFlow: `strategies=("dp", "spatial_dp_halo")`).
    """
    hook = getattr(model_cfg, "cost_model", None)
    if hook is None:
        raise ShardkitError(
            f"plan: {type(model_cfg).__name__} has no cost_model(strategy, mesh, batch_shapes, nbytes, backend) "
            "hook; give a model config that has one (the GPT's in models/ does)"
        )
    indivisible = getattr(model_cfg, "indivisible", lambda *_: "")
    if strategies is None:
        strategies = tuple(getattr(model_cfg, "plan_strategies", None) or DEFAULT_STRATEGIES)
    if devices < 1 or devices & (devices - 1):
        raise ShardkitError(f"plan: devices={devices} must be a power of two")
    if variant not in ("alpha-beta", "axonn"):
        raise ShardkitError(f"plan: variant={variant!r}; choose 'alpha-beta' or 'axonn'")
    if not 0 < efficiency <= 1:
        raise ShardkitError(f"plan: efficiency={efficiency} must be in (0, 1] (the fraction of peak recompute runs at)")
    hw = load_preset(hardware) if isinstance(hardware, str) else hardware
    backend = backend or hw.platform
    recompute = getattr(model_cfg, "recompute_flops", None)
    policies: Sequence[str | None] = [None] if remat is None else (list(remat) if recompute else ["none"])
    if not policies:
        raise ShardkitError("plan: remat=() tries no policy; give e.g. ('none', 'dots', 'full') or None")
    from shardkit.strategies import strategy as named

    plans, variants = [], {}
    for s, mesh in candidates(devices, strategies):
        if indivisible(s, mesh, global_batch):
            continue
        shapes = {"inputs": (global_batch, seq_len)} if seq_len else {"batch": (global_batch,)}
        options = []
        for policy in policies:
            key = (s if isinstance(s, str) else id(s), policy)  # a Strategy object (its tables) is unhashable
            if policy is not None and key not in variants:
                variants[key] = named(s).replace(kernels={"remat": policy})
            strat = s if policy is None else variants[key]
            terms = hook(strat, mesh, shapes, nbytes, backend)
            if terms is None:
                raise ShardkitError(f"plan: the model's cost model does not cover strategy {s!r}; leave it out")
            comms, mem, _ = terms
            flops = recompute(strat, mesh, shapes) if recompute and policy not in (None, "none") else 0.0
            cap = memory_fraction * hw.hbm_bytes
            over = f"needs {mem['total'] / 2**30:.1f} GiB > {cap / 2**30:.1f} GiB usable"
            reason = "" if mem["total"] <= cap else over
            rt = flops / (hw.peak_flops * efficiency) if hw.peak_flops else 0.0
            options.append(Plan(_label(s), mesh, tuple(comms), comm_time(comms, hw, variant), mem, not reason, reason,
                                remat=policy or "none", recompute_flops=flops, recompute_time_s=rt))  # fmt: skip
            if policy == "none" and not reason:  # fits recomputing nothing: no other policy can rank above it
                break
        fitting = [p for p in options if p.fits]
        best = min(fitting, key=rank_key) if fitting else min(options, key=lambda p: p.memory["total"])
        if not fitting and best.remat != "none":  # (a model whose memory ignores the policy: "none", said plainly)
            best = dataclasses.replace(best, reason=best.reason + f" even with remat {best.remat}")
        plans.append(best)
    for refine in PLAN_HOOKS:
        plans = [refine(p, model_cfg, hw, global_batch, seq_len, memory_fraction) for p in plans]
    plans.sort(key=rank_key)
    return plans if include_rejected else [p for p in plans if p.fits]


def _label(s: Any) -> str:
    """A plan's strategy column: the name, or for a Strategy object its options' `tag` (e.g. a coverage)."""
    if isinstance(s, str):
        return s
    return str(getattr(s.options, "tag", None) or s.name)


def format_plans(plans: Sequence[Plan], efficiency: float | None = None) -> str:
    """A plain-text table of ranked plans: remat policy, recompute TFLOP per device and ms, comm ms, step ms
    (the ranking's key); with `efficiency` (what `plan` was given), the RANKING line under it."""
    head = (f"{'#':>3} {'strategy':<8} {'mesh':<30} {'remat':<13} {'recomp TF':>9} {'recomp ms':>9} "
            f"{'comm ms':>9} {'step ms':>9} {'GiB sent':>9} {'mem GiB':>8}  note")  # fmt: skip
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        lines.append(
            f"{i:>3} {p.strategy:<8} {p.grid:<30} {p.remat:<13} {p.recompute_flops / 1e12:>9.2f} "
            f"{p.recompute_time_s * 1e3:>9.2f} {p.comm_time_s * 1e3:>9.2f} {p.step_time_s * 1e3:>9.2f} "
            f"{p.comm_bytes / 2**30:>9.3f} {p.memory['total'] / 2**30:>8.2f}  {p.reason}".rstrip()
        )
    if efficiency is not None:
        lines.append(RANKING.format(eff=efficiency))
    return "\n".join(lines)


__all__ = ["DEFAULT_STRATEGIES", "PLAN_HOOKS", "RANKING", "REMAT_POLICIES", "Comm", "CommBuilder", "Plan",
           "candidates", "comm_time", "format_plans", "merge_comms", "plan", "rank_key", "register_plan_hook",
           "ring_factor", "tp3d_layer_comms"]  # fmt: skip
