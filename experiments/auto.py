"""`--config.strategy=auto`: the planner picks strategy, mesh and remat policy; the top candidates are compiled and
the fastest that fits is trained (docs/planner.md).

1. Candidates. A model with a cost model (`sk.costmodel.for_config`: the GPT, CosmoFlow) is planned by `sk.plan`
   (a cost model that answers for no strategy from the batch's size alone, as the U-Net's, falls to the next path)
   over the registered strategies its formulas cover, on this machine's device count with the run's hardware preset
   (links, HBM, peak), the remat policies of `plan(remat=...)` tried per plan (`auto.remat`; a cost model that
   does not price recompute, `models_remat` False, gets "none" only). A model without one (the ResNet) gets every
   registered strategy on its own auto mesh (`Strategy.default_mesh`), ranked by the parameter traffic its rules
   tables imply (`shardkit.costmodel_rules.state_comms`) at the preset's links; strategies the model does not fit
   (a missing logical name, shapes that do not divide) are skipped with their reason.
2. The first `auto.top` (3) that build are compiled exactly as `experiments.train` would build them had the user
   typed `--config.strategy=<s> --config.mesh=<mesh> --config.kernels=remat=<policy>` (`train.build`), and read:
   memory per device = arguments + outputs - aliased + temporaries (`memory_analysis()`), which must fit
   `auto.memory_fraction` of the preset's `hbm_bytes` (cpu8: a nominal 3.0 GB share of host RAM per virtual device);
   the step time is a ROOFLINE ESTIMATE, not a measurement: `shardkit.roofline`'s, as `sk.explain` reports it, with
   no overlap assumed: max(FLOPs / peak, HBM bytes / hbm_bandwidth) per region (both read from the program, loop
   trip counts included) + the compiled collectives' alpha-beta time on the links their axes ride.
3. The fitting candidate with the lowest estimate trains (its compiled step reused); the table and the reason
   are printed. The run directory is `<config_name>-auto` (`--config.name` overrides), so rerunning the same
   command resumes it even if the pick changed (a checkpoint restores onto any strategy); config.json records
   the chosen strategy, mesh and policy under `auto`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

import shardkit as sk
from shardkit import costmodel, costmodel_rules, roofline


@dataclasses.dataclass
class Candidate:
    strategy: str
    mesh: dict[str, int]
    remat: str
    predicted: str  # what ranked it before compiling
    memory: float = math.nan  # compiled bytes per device
    flops: float = math.nan
    bytes_accessed: float = math.nan
    comm_s: float = math.nan
    comm_bytes: float = math.nan  # collective bytes sent per device per step, read from the compiled program
    estimate_s: float = math.nan  # roofline + collectives
    fits: bool = False
    note: str = ""
    run: Any = None
    compiled: Any = None

    @property
    def grid(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.mesh.items())

    @property
    def short(self) -> str:
        """The mesh without its size-1 axes (as printed)."""
        return ",".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"

    def overrides(self) -> dict[str, str]:
        """The config fields a user would type for this candidate."""
        return {"strategy": self.strategy, "mesh": self.grid, "remat": self.remat}


def resolved(config: ml_collections.ConfigDict, c: Candidate) -> ml_collections.ConfigDict:
    """`config` as if the user had typed the candidate: strategy, mesh, `kernels=remat=<policy>` (the model's
    own remat alias set to "none", the planner's policy decides), run name `<config_name>-auto`."""
    out = ml_collections.ConfigDict(config.to_dict())
    out.strategy, out.mesh = c.strategy, c.grid
    if c.remat != "none":
        out.kernels = ",".join(filter(None, [config.get("kernels", ""), f"remat={c.remat}"]))
    if "model" in out and "remat" in out.model:
        out.model.remat = "none"
    out.name = config.name or f"{config.config_name}-auto"
    return out


def _nbytes(config: ml_collections.ConfigDict) -> int:
    dtype = config.model.get("dtype", "float32") if "model" in config else "float32"
    return int(jax.numpy.dtype(dtype).itemsize)


def plan_candidates(config: Any, model_cfg: Any, devices: int, preset: sk.HardwarePreset) -> list[Candidate] | None:
    """The planner's ranked (strategy, mesh, remat) plans that fit, for a model with a cost model; None when its
    cost model answers for no strategy from the batch's size alone (e.g. the U-Net's needs the volume's shape)."""
    lm = config.get("task", "lm") == "lm"
    shapes = {"inputs": (config.batch_size, config.seq_len)} if lm else {"batch": (config.batch_size,)}
    backend = "cpu" if preset.platform == "cpu" else preset.platform
    covered, model = [], costmodel.for_config(model_cfg)
    for name in sk.STRATEGIES:  # the strategies the model's formulas describe (read from their tables)
        try:
            terms = model.predict(name, sk.strategy(name).default_mesh(devices), shapes, 4, backend)
        except sk.ShardkitError:
            continue
        if terms is not None and not sk.Traits.of(name).scoped:
            covered.append(name)
    if not covered:
        return None
    remat = tuple(p.strip() for p in str(config.auto.remat).split(",") if p.strip())
    plans = costmodel.plan(model_cfg, devices, preset, config.batch_size, config.seq_len if lm else None,
                           strategies=covered, nbytes=_nbytes(config), backend=backend, remat=remat,
                           memory_fraction=config.auto.memory_fraction, efficiency=config.auto.efficiency)  # fmt: skip
    return [Candidate(p.strategy, dict(p.mesh), p.remat, f"plan: step {p.step_time_s * 1e3:.2f} ms, "
                      f"{p.memory['total'] / 2**20:.0f} MiB") for p in plans]  # fmt: skip


def rules_candidates(config: Any, devices: int, preset: sk.HardwarePreset, build: Callable) -> list[Candidate]:
    """Every registered strategy on its auto mesh, ranked by its rules tables' parameter traffic (no cost model)."""
    out = []
    for name in sk.STRATEGIES:
        c = Candidate(name, sk.strategy(name).default_mesh(devices), "none", "")
        try:
            run = build(resolved(config, c))
        except (sk.ShardkitError, ValueError, TypeError) as e:  # the model does not fit this strategy
            c.note = str(e).split("\n")[0][:80]
            continue
        comms = costmodel_rules.state_comms(run.step, preset.platform)
        t = costmodel.comm_time(comms, preset)
        c.predicted, c.run = f"rules: params/grads comm {t * 1e3:.2f} ms", run
        out.append((t, len(out), c))
    return [c for _, _, c in sorted(out, key=lambda x: x[:2])]


def compiled_estimate(c: Candidate, preset: sk.HardwarePreset, peak: float, budget: float) -> None:
    """Compiles the candidate's train step; fills memory, flops, bytes, the roofline + collectives estimate."""
    step, task = c.run.step, c.run.task
    c.compiled = step.compile(step.abstract_state(), task.batch_spec(step))
    ma = c.compiled.memory_analysis()
    get = lambda k: float(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
    c.memory = get("argument") + get("output") - get("alias") + get("temp")
    # the roofline explain reports (shardkit/roofline.py: FLOPs and HBM bytes read with loop trip counts, collectives
    # on the links their axes ride), with no overlap assumed; peak: the chip's, or the one measured on this host
    r = roofline.roofline(c.compiled, c.run.mesh, dataclasses.replace(preset, peak_flops=peak))
    c.flops, c.bytes_accessed = r.matmul_flops + r.kernel_flops, r.hbm_bytes
    c.comm_s, c.comm_bytes = r.comm_s, sum(row["bytes_sent"] for row in r.collectives)
    c.estimate_s = r.no_overlap_s
    c.fits = c.memory <= budget
    if not c.fits:
        c.note = f"needs {c.memory / 2**20:,.0f} MiB > budget {budget / 2**20:,.0f} MiB"


def table(cands: list[Candidate]) -> str:
    head = (f"{'#':>2} {'strategy':<12} {'mesh':<26} {'remat':<13} {'compiled MiB':>12} {'GFLOP':>8} "
            f"{'GB moved':>8} {'comm MiB':>8} {'comm ms':>8} {'est ms':>8}  ranked by / note")  # fmt: skip
    lines = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        lines.append(f"{i:>2} {c.strategy:<12} {c.short:<26} {c.remat:<13} {c.memory / 2**20:>12,.1f} "
                     f"{c.flops / 1e9:>8.2f} {c.bytes_accessed / 1e9:>8.3f} {c.comm_bytes / 2**20:>8.1f} "
                     f"{c.comm_s * 1e3:>8.2f} "
                     f"{c.estimate_s * 1e3:>8.2f}  {c.predicted}{'; ' + c.note if c.note else ''}")  # fmt: skip
    return "\n".join(lines)


def choose(config: ml_collections.ConfigDict, build: Callable, say: Callable[[str], None]) -> tuple[Candidate, str]:
    """(the chosen candidate, with its built run and compiled step; the printed explanation)."""
    from experiments.runtime import calibrate_peak_flops, resolve_preset
    from experiments.tasks import build_task

    tgt = sk.target(config.target) if config.get("target") else None  # compile-only devices: compiled, never run
    devices = tgt.num_devices if tgt else jax.device_count()
    if any(p.strip().startswith("remat=") for p in str(config.get("kernels", "")).split(",")):
        raise sk.ShardkitError(
            f"strategy=auto chooses the remat policy, kernels={config.kernels!r} names one: drop remat= from "
            "--config.kernels, or give the policies to try as --config.auto.remat"
        )
    policies = [p.strip() for p in str(config.auto.remat).split(",") if p.strip()]
    unknown = [p for p in policies if p.partition(":")[0] not in sk.kernels.available("remat")]
    if not policies or unknown:
        raise sk.ShardkitError(f"auto.remat={config.auto.remat!r}: give remat policies, comma-separated, from "
                               f"{', '.join(sk.kernels.available('remat'))} (docs/memory.md)")  # fmt: skip
    preset = tgt.preset() if tgt else resolve_preset(config.hardware)
    if preset is None:
        raise sk.ShardkitError("strategy=auto needs a hardware preset (links, memory, peak): give --config.hardware")
    if config.auto.top < 1 or not 0 < config.auto.memory_fraction <= 1:
        raise sk.ShardkitError(f"auto.top={config.auto.top} must be >= 1 and auto.memory_fraction="
                               f"{config.auto.memory_fraction} in (0, 1]")  # fmt: skip
    model_cfg = build_task(config).model_cfg
    cands, how = None, ""
    if costmodel.for_config(model_cfg) is not None and devices & (devices - 1) == 0:
        cands, how = plan_candidates(config, model_cfg, devices, preset), "sk.plan (the model's cost model)"
    if cands is None:
        cands, how = rules_candidates(config, devices, preset, build), "every registered strategy it fits"
    peak = config.peak_flops or preset.peak_flops or calibrate_peak_flops(jax.devices())  # a target: its chip's
    budget = config.auto.memory_fraction * preset.hbm_bytes
    compiled: list[Candidate] = []
    for c in cands:
        if len(compiled) == config.auto.top:
            break
        try:
            c.run = c.run or build(resolved(config, c))
        except sk.ShardkitError as e:  # shapes the planner's divisibility check did not see
            say(f"auto: skipped {c.strategy} {c.grid} remat {c.remat}: {e}")
            continue
        compiled_estimate(c, preset, peak, budget)
        compiled.append(c)
    fitting = [c for c in compiled if c.fits]
    if not fitting:
        raise sk.ShardkitError(
            f"strategy=auto: none of the {len(compiled)} candidates fits {budget / 2**30:.2f} GiB per device; raise "
            "auto.memory_fraction or auto.top, lower batch_size, or use more devices"
        )
    # a target's candidates are ranked by what its compiler says: fitting first (above), then the fewest collective
    # bytes sent per device (its program's, read back), then memory; a time would need the chip, never run here
    best = min(fitting, key=(lambda c: (c.comm_bytes, c.memory)) if tgt else (lambda c: c.estimate_s))
    if jax.process_count() > 1:  # one pick for every process (a measured peak differs between them): process 0's
        from jax.experimental import multihost_utils

        best = compiled[int(multihost_utils.broadcast_one_to_all(jax.numpy.int32(compiled.index(best))))]
    if config.mesh.strip() not in ("auto", ""):
        say(f"auto: --config.mesh={config.mesh} is not used: the planner picks the mesh")
    lines = [f"auto: {len(cands)} candidates from {how} on {devices} x {preset.name}; the top {len(compiled)} "
             f"compiled (memory budget {budget / 2**20:,.0f} MiB = {config.auto.memory_fraction:.0%} of "
             f"{preset.hbm_bytes / 2**20:,.0f} MiB; peak {peak / 1e9:,.1f} GFLOP/s, hbm "
             f"{preset.hbm_bandwidth / 1e9:,.0f} GB/s):", table(compiled)]  # fmt: skip
    others = ", ".join(f"{c.strategy} {c.estimate_s * 1e3:.2f} ms" for c in fitting if c is not best)
    why = (f"auto chose {best.strategy} on {best.grid}, remat {best.remat}: the fewest collective bytes per device "
           f"({best.comm_bytes / 2**20:,.1f} MiB, read from {tgt.name}'s compiled program) of the candidates that "
           f"fit ({best.memory / 2**20:,.1f} MiB <= {budget / 2**20:,.0f} MiB)") if tgt else (
           f"auto chose {best.strategy} on {best.grid}, remat {best.remat}: the lowest estimated step time "
           f"({best.estimate_s * 1e3:.2f} ms, a roofline estimate, shardkit.roofline's with no overlap)"
           f" of the candidates that fit ({best.memory / 2**20:,.1f} MiB <= {budget / 2**20:,.0f} MiB)"
           f"{'; vs ' + others if others else ''}")  # fmt: skip
    if config.compile_only and not tgt:
        why += " (compile_only: nothing trains)"
    for line in [*lines, why]:
        say(line)
    return best, "\n".join([*lines, why])


__all__ = ["Candidate", "choose", "compiled_estimate", "plan_candidates", "resolved", "rules_candidates", "table"]
