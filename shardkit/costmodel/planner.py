"""Ranks plans before compiling: every (strategy, mesh, remat policy) by predicted step time, within memory.

    plans = sk.plan(model_cfg, devices=1024, hardware="perlmutter", global_batch=512, seq_len=2048)
    print(format_plans(plans[:5]))

The model-specific terms (which collectives one step of *this* model issues under a strategy, and its memory)
come from the model's cost model, found by the config's type (`for_config`, shardkit/costmodel/protocol.py):
`predict(strategy, mesh, batch_shapes, nbytes, backend) -> (comms, memory, source) | None`, and
`indivisible(strategy, mesh, global_batch) -> reason` drops plans whose shapes do not divide. This module owns
the rest: the candidate meshes (every power-of-two mesh over the axes a strategy's tables use), the time of their
collectives (`comm_time`, shardkit/costmodel/comms.py) and the ranking; `register_plan_hook` refines every plan
(the heterogeneous balance, shardkit/parallel/hetero/uneven.py). For any model's parameter traffic under any rules
table, see `shardkit.costmodel_rules`.

A plan whose predicted memory (the cost model's "total") is over `memory_fraction` of the device memory is
rejected with the reason; one that fits by less than the cost model's known error (`CostModel.memory_error`) is
`tight`, printed so, and ranked after the plans with margin. Each (strategy, mesh) is tried under the remat
policies `plan(remat=...)` (set as the strategy's `remat` kernel): the fastest that fits (with margin, where one
does) is kept, ranked by comm time + its recompute time (`rank_key`,
`RANKING`; the cost model's `recompute_flops(strategy, mesh, batch_shapes)` gives the FLOPs per device), so a
plan that fits only with remat is ranked with its cost instead of dropped (Korthikanti et al. 2205.05198 §5).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from shardkit.costmodel.comms import Comm, comm_time
from shardkit.costmodel.protocol import for_config
from shardkit.costmodel.torus import as_compiled, torus_slice
from shardkit.errors import ShardkitError
from shardkit.layers import REMAT_POLICIES  # the policies `plan` tries per (strategy, mesh) by default
from shardkit.presets import HardwarePreset, load_preset
from shardkit.strategies import strategy as resolve


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
    #: the memory per device a plan may use (`memory_fraction` x the device's), and the cost model's known error
    #: of its memory prediction on this backend (`CostModel.memory_error`: a fraction of the prediction)
    usable_bytes: float = 0.0
    memory_error: float = 0.0

    @property
    def headroom_bytes(self) -> float:
        """The usable memory left over by the prediction (negative: over)."""
        return self.usable_bytes - self.memory["total"]

    @property
    def tight(self) -> bool:
        """Predicted to fit, but by less than the cost model's known error: the compiler may refuse it."""
        return self.fits and self.memory["total"] * (1 + self.memory_error) > self.usable_bytes

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


def _pow2(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if n % 2**i == 0]


def candidates(devices: int, strategies: Sequence[Any]) -> list[tuple[Any, dict[str, int]]]:
    """Every power-of-two mesh of `devices` over the mesh axes each strategy's tables use, each of its required
    axes of size > 1 (`Strategy.required_axes`): dp -> data=8; fsdp -> data x fsdp (FSDP and hybrid FSDP);
    tp3d -> every (data, depth, row, col). Read from the registered strategy, never its name."""
    out: list[tuple[Any, dict[str, int]]] = []
    for name in strategies:
        s = resolve(name)  # a ShardkitError naming the registered ones if it is unknown
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
RANKING = ("ranked by: fits first (tight ones after the others), then predicted step time = comm ms + "
           "recompute ms, recompute ms = recompute FLOPs / (peak x efficiency {eff:.0%}); ties: fewer recompute "
           "FLOPs")  # fmt: skip


def rank_key(p: Plan) -> tuple[bool, bool, float, float]:
    """`plan`'s sort key: (does not fit, tight, step_time_s, recompute_flops): fitting plans first, those that fit
    by less than the cost model's known memory error (`Plan.tight`) after the rest, fastest first."""
    return (not p.fits, p.tight, p.step_time_s, p.recompute_flops)


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

    `model_cfg`: a model config whose type has a registered cost model (`sk.costmodel.register`), or a CostModel;
    it brings the model's terms (module docstring). Plans with indivisible shapes are dropped; plans over
    `memory_fraction` of HBM are rejected (kept, last, with the reason, when `include_rejected`). `backend`
    defaults to the preset's platform. The cost model gets the batch as `{"inputs": (global_batch, seq_len)}` (a
    transformer's), or `{"batch": (global_batch,)}` without `seq_len` (a model that knows its own input shape,
    e.g. CosmoFlow: `strategies=("dp", "spatial_dp_halo")`).

    `strategies`: those tried; None = the cost model's `plan_strategies` (what its formulas cover: the MoE GPT's
    ep family, CosmoFlow's dp and spatial; `DEFAULT_STRATEGIES` unless it says).

    `remat`: the policies tried for each (strategy, mesh), set as the strategy's `remat` kernel; the plan kept
    is the fastest that fits (`rank_key`: comm time + recompute FLOPs / (the preset's peak x `efficiency`)),
    else the one that needs the least memory, rejected. A plan that fits only with remat is so ranked with its
    recompute cost instead of dropped. The cost model's `recompute_flops(strategy, mesh, batch_shapes)` gives
    the FLOPs; a cost model whose `models_remat` is False is planned with "none" only. `remat=None`: the old
    behaviour, the strategy's own slot (or the model's) decides and nothing is recomputed in the ranking.
    """
    model = for_config(model_cfg)
    if model is None:
        raise ShardkitError(
            f"plan: {type(model_cfg).__name__} has no cost model; register one beside the model: a "
            "sk.costmodel.CostModel subclass decorated with @sk.costmodel.register(ConfigType) (docs/planner.md; "
            "the GPT's is models/gpt_cost/)"
        )
    if strategies is None:
        strategies = tuple(model.plan_strategies)
    if devices < 1 or devices & (devices - 1):
        raise ShardkitError(f"plan: devices={devices} must be a power of two")
    if variant not in ("alpha-beta", "axonn"):
        raise ShardkitError(f"plan: variant={variant!r}; choose 'alpha-beta' or 'axonn'")
    if not 0 < efficiency <= 1:
        raise ShardkitError(f"plan: efficiency={efficiency} must be in (0, 1] (the fraction of peak recompute runs at)")
    hw = load_preset(hardware) if isinstance(hardware, str) else hardware
    backend = backend or hw.platform
    torus = torus_slice(hw) if backend == "tpu" else ()  # a v4 / v5p torus: reduce-scatters it all-reduces
    error = model.memory_error(backend)
    recompute = model.models_remat
    policies: Sequence[str | None] = [None] if remat is None else (list(remat) if recompute else ["none"])
    if not policies:
        raise ShardkitError("plan: remat=() tries no policy; give e.g. ('none', 'dots', 'full') or None")
    plans, variants = [], {}
    for s, mesh in candidates(devices, strategies):
        if model.indivisible(s, mesh, global_batch):
            continue
        shapes = {"inputs": (global_batch, seq_len)} if seq_len else {"batch": (global_batch,)}
        options = []
        for policy in policies:
            key = (s if isinstance(s, str) else id(s), policy)  # a Strategy object (its tables) is unhashable
            if policy is not None and key not in variants:
                variants[key] = resolve(s).replace(kernels={"remat": policy})
            strat = s if policy is None else variants[key]
            terms = model.predict(strat, mesh, shapes, nbytes, backend)
            if terms is None:
                raise ShardkitError(f"plan: the model's cost model does not cover strategy {s!r}; leave it out")
            comms, mem = as_compiled(terms[0], torus), terms[1]  # as the TPU compiler writes them (torus.py)
            flops = model.recompute_flops(strat, mesh, shapes) if recompute and policy not in (None, "none") else 0.0
            cap = memory_fraction * hw.hbm_bytes
            over = f"needs {mem['total'] / 2**30:.1f} GiB > {cap / 2**30:.1f} GiB usable"
            reason = "" if mem["total"] <= cap else over
            rt = flops / (hw.peak_flops * efficiency) if hw.peak_flops else 0.0
            options.append(Plan(_label(s), mesh, tuple(comms), comm_time(comms, hw, variant), mem, not reason, reason,
                                remat=policy or "none", recompute_flops=flops, recompute_time_s=rt, usable_bytes=cap,
                                memory_error=error))  # fmt: skip
            if policy == "none" and not reason and not options[-1].tight:  # fits recomputing nothing, with margin:
                break  # no other policy can rank above it
        fitting = [p for p in options if p.fits]
        best = min(fitting, key=rank_key) if fitting else min(options, key=lambda p: p.memory["total"])
        if not fitting and best.remat != "none":  # (a model whose memory ignores the policy: "none", said plainly)
            best = dataclasses.replace(best, reason=best.reason + f" even with remat {best.remat}")
        plans.append(best)
    for refine in PLAN_HOOKS:
        plans = [refine(p, model.cfg, hw, global_batch, seq_len, memory_fraction) for p in plans]
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
            f"{'comm ms':>9} {'step ms':>9} {'GiB sent':>9} {'mem GiB':>8} {'spare GiB':>9}  note")  # fmt: skip
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        lines.append(
            f"{i:>3} {p.strategy:<8} {p.grid:<30} {p.remat:<13} {p.recompute_flops / 1e12:>9.2f} "
            f"{p.recompute_time_s * 1e3:>9.2f} {p.comm_time_s * 1e3:>9.2f} {p.step_time_s * 1e3:>9.2f} "
            f"{p.comm_bytes / 2**30:>9.3f} {p.memory['total'] / 2**30:>8.2f} {p.headroom_bytes / 2**30:>9.2f}  "
            f"{_note(p)}".rstrip()
        )
    if efficiency is not None:
        lines.append(RANKING.format(eff=efficiency))
    if any(p.tight for p in plans):
        err = max(p.memory_error for p in plans if p.tight)
        lines.append(f"tight: predicted to fit by less than the cost model's known memory error ({err:.0%} of the "
                     "prediction): compile it for the target before trusting it")  # fmt: skip
    return "\n".join(lines)


def _note(p: Plan) -> str:
    """The note column: why a plan is rejected, or that it may not fit (`Plan.tight`)."""
    if p.tight:
        worst = p.memory["total"] * (1 + p.memory_error) / 2**30
        return f"tight: may not fit (+{p.memory_error:.0%}: {worst:.1f} GiB)"
    return p.reason


__all__ = ["PLAN_HOOKS", "RANKING", "REMAT_POLICIES", "Plan", "candidates", "format_plans", "plan", "rank_key",
           "register_plan_hook"]  # fmt: skip
