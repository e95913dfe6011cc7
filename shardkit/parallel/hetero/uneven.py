"""Uneven per-device work for heterogeneous devices (Whale: Jia et al., USENIX ATC'22, arXiv 2011.09208).

One XLA program cannot mix GPU models in one process (jax #1509, #13203), so the balancing is SPMD-honest: every
device runs the same compiled program, with a different amount of work.

- **Data-parallel balancing** (`split_batch`, `HeteroTrainStep`): the global batch is cut into equal micro-batches
  and device d runs `counts[d]` of them, a per-device trip count of a `lax.fori_loop` inside `shard_map`. Each
  device sums its micro-batches' gradients locally (the parameters are marked varying first: otherwise `grad`
  would put its reduction inside the loop, and devices with fewer iterations would deadlock waiting for the
  others); one all-reduce after the loop gives the exact global-batch mean. `counts` is proportional to each
  device's throughput within its memory cap (largest remainders).
- **Pipeline balancing** (`partition_stages`): layers cut into contiguous stages so that the slowest stage
  (sum of its layer costs / its speed) is as fast as possible, within each stage's memory: an exact min-max
  dynamic program over cut points (EPL's partitioner minimises the same objective on op costs).
- `simulated_step_time`: the slowest device's work / its speed; a plan's predicted time, not a measurement.

    counts = sk.hetero.split_batch(global_batch=40, speeds=[2, 2, 1.5, 1.5, 1, 1, .5, .5], caps=[9] * 8)
    step = sk.make_train_step(model, tx, mesh, sk.hetero.make_strategy(counts, microbatch=4))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardkit import costmodel
from shardkit.deprecation import renamed
from shardkit.errors import ShardkitError
from shardkit.strategies import register_strategy
from shardkit.strategies import strategy as named
from shardkit.traits import Traits


def _positive(name: str, values: Sequence[float], n: int | None = None) -> list[float]:
    vals = [float(v) for v in values]
    if n is not None and len(vals) != n:
        raise ShardkitError(f"{name}: {len(vals)} values for {n} devices; give one per device")
    bad = [v for v in vals if not (v > 0 and math.isfinite(v))]
    if bad:
        raise ShardkitError(f"{name}={vals}: every value must be a finite number > 0 (found {bad[0]})")
    return vals


def split_batch(global_batch: int, speeds: Sequence[float], caps: Sequence[int] | None = None) -> list[int]:
    """Micro-batches per device: proportional to `speeds` within the memory `caps`, summing to `global_batch`.

    Water-filling: a device whose proportional share exceeds its cap gets the cap and the rest is shared among the
    others in proportion to their speeds, until no share exceeds a cap; then the fractional shares are rounded by
    largest remainders (ties to the faster, then the lower index) without passing a cap. Every count is within 1
    of its (capped) proportional share."""
    n = len(speeds)
    if n < 1:
        raise ShardkitError("split_batch: speeds is empty; give one relative throughput per device")
    speeds = _positive("speeds", speeds)
    if int(global_batch) != global_batch or global_batch < 1:
        raise ShardkitError(f"global_batch={global_batch} must be a positive whole number of micro-batches")
    global_batch = int(global_batch)
    if caps is None:
        caps = [global_batch] * n
    if len(caps) != n:
        raise ShardkitError(f"caps: {len(caps)} values for {n} devices (len(speeds)); give one per device")
    caps = [int(c) for c in caps]
    small = [i for i, c in enumerate(caps) if c < 1]
    if small:
        raise ShardkitError(
            f"device {small[0]}'s memory cap {caps[small[0]]} cannot hold one micro-batch: use smaller micro-batches "
            "(more of them), or leave the device out of the mesh"
        )
    if sum(caps) < global_batch:
        raise ShardkitError(
            f"global_batch={global_batch} micro-batches exceed the devices' caps (sum {sum(caps)}): lower the batch, "
            "or use smaller micro-batches"
        )
    share = [0.0] * n
    free, left = set(range(n)), float(global_batch)
    while free:
        total = sum(speeds[i] for i in free)
        trial = {i: left * speeds[i] / total for i in free}
        over = [i for i in free if trial[i] > caps[i]]
        if not over:
            for i in free:
                share[i] = trial[i]
            break
        for i in over:
            share[i] = float(caps[i])
            left -= caps[i]
            free.discard(i)
    counts = [min(math.floor(s + 1e-9), caps[i]) for i, s in enumerate(share)]
    order = sorted(range(n), key=lambda i: (-(share[i] - counts[i]), -speeds[i], i))
    rest = global_batch - sum(counts)
    for i in order * 2:  # at most n increments are needed; a capped device is skipped
        if rest == 0:
            break
        if counts[i] < caps[i] and share[i] - counts[i] > 0:
            counts[i] += 1
            rest -= 1
    for i in order:  # only when rounding met caps everywhere else
        if rest == 0:
            break
        add = min(caps[i] - counts[i], rest)
        counts[i] += add
        rest -= add
    return counts


def simulated_step_time(counts: Sequence[int], speeds: Sequence[float]) -> float:
    """The step time of a split in units of one micro-batch on a speed-1 device: max over devices of work / speed
    (data parallelism waits for the slowest before its all-reduce). Simulated, not measured."""
    return max(c / s for c, s in zip(counts, speeds, strict=True))


def even_split(global_batch: int, devices: int) -> list[int]:
    """What plain data parallelism does: the same count everywhere (the remainder to the first devices)."""
    q, r = divmod(int(global_batch), devices)
    return [q + (i < r) for i in range(devices)]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Contiguous stages: stage s holds layers bounds[s] .. bounds[s + 1] - 1."""

    bounds: tuple[int, ...]  # len = stages + 1, bounds[0] = 0, bounds[-1] = layers
    times: tuple[float, ...]  # per stage: sum of its layer costs / its speed
    step_time: float  # the slowest stage: what a pipeline's steady state runs at

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage: what `pipeline.stage_layers` / the kernel name's "@3,5" takes."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False))


def partition_stages(
    layer_costs: Sequence[float], stage_speeds: Sequence[float], layer_memory: Sequence[float] | None = None,
    stage_memory: Sequence[float] | None = None,
) -> StagePlan:  # fmt: skip
    """The contiguous cut of layers into len(stage_speeds) non-empty stages (in order) minimising the slowest
    stage's time sum(cost) / speed, each stage's layers fitting its memory: exact, by dynamic programming over
    (layers placed, stages used) in O(L^2 S)."""
    costs = [float(c) for c in layer_costs]
    speeds = _positive("stage_speeds", stage_speeds)
    n_layers, n_stages = len(costs), len(speeds)
    if n_stages < 1 or n_layers < n_stages:
        raise ShardkitError(f"{n_layers} layers cannot fill {n_stages} stages (each needs >= 1 layer)")
    if any(c < 0 or not math.isfinite(c) for c in costs):
        raise ShardkitError(f"layer_costs={costs}: costs must be finite and >= 0")
    mem = [0.0] * n_layers if layer_memory is None else [float(m) for m in layer_memory]
    caps = [math.inf] * n_stages if stage_memory is None else [float(m) for m in stage_memory]
    if len(mem) != n_layers or len(caps) != n_stages:
        raise ShardkitError("layer_memory needs one value per layer and stage_memory one per stage")
    prefix, mprefix = np.concatenate([[0.0], np.cumsum(costs)]), np.concatenate([[0.0], np.cumsum(mem)])
    inf = math.inf
    best = np.full((n_stages + 1, n_layers + 1), inf)  # best[s][i]: slowest of stages < s holding layers < i
    cut = np.zeros((n_stages + 1, n_layers + 1), int)
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n_layers - (n_stages - s) + 1):
            for j in range(s - 1, i):  # stage s - 1 holds layers j .. i - 1
                if mprefix[i] - mprefix[j] > caps[s - 1] or best[s - 1][j] == inf:
                    continue
                t = max(best[s - 1][j], (prefix[i] - prefix[j]) / speeds[s - 1])
                if t < best[s][i]:
                    best[s][i], cut[s][i] = t, j
    if best[n_stages][n_layers] == inf:
        raise ShardkitError(
            f"no contiguous split of {n_layers} layers (memory {mem}) into stages with memory {caps} exists: "
            "a stage's memory cannot hold its layers; use more stages or smaller layers"
        )
    bounds, i = [n_layers], n_layers
    for s in range(n_stages, 0, -1):
        i = int(cut[s][i])
        bounds.append(i)
    bounds = tuple(reversed(bounds))
    times = tuple(float(prefix[bounds[s + 1]] - prefix[bounds[s]]) / speeds[s] for s in range(n_stages))
    return StagePlan(bounds, times, max(times))


def plan_of(
    counts: Sequence[int], stage_speeds: Sequence[float], layer_costs: Sequence[float] | None = None
) -> StagePlan:
    """A given cut (layers per stage) as a StagePlan: its stage times and slowest stage (equal layers by default).
    Simulated: sum of the stage's layer costs / its speed."""
    counts, speeds = [int(n) for n in counts], _positive("stage_speeds", stage_speeds, len(counts))
    costs = [1.0] * sum(counts) if layer_costs is None else [float(c) for c in layer_costs]
    if len(costs) != sum(counts) or min(counts, default=0) < 1:
        raise ShardkitError(
            f"plan_of: counts {counts} (each >= 1) must hold the {len(costs)} layers of layer_costs one each"
        )
    bounds = tuple(int(b) for b in np.cumsum([0, *counts]))
    times = tuple(sum(costs[bounds[s] : bounds[s + 1]]) / speeds[s] for s in range(len(counts)))
    return StagePlan(bounds, times, max(times))


def stage_speeds(device_speeds: Sequence[float], mesh_axes: dict[str, int], axis: str = "stage") -> list[float]:
    """Per pipeline stage, the speed of its slowest device (a stage runs at the pace of its slowest member).

    Devices are taken in the preset's [[groups]] order (= jax.devices() order) and laid out row-major over
    `mesh_axes`, as `sk.make_mesh` lays them: stage s holds the devices at index s of `axis`. hetero_v100_p100
    (4 V100 then 4 P100) on stage=2,data=4: stage 0 the V100s (1.0), stage 1 the P100s (0.59); on data=4,stage=2
    every stage mixes both kinds: [0.59, 0.59]."""
    shape = tuple(int(n) for n in mesh_axes.values())
    speeds = _positive("device speeds", device_speeds)
    if axis not in mesh_axes:
        raise ShardkitError(f"mesh {dict(mesh_axes)} has no {axis!r} axis: a pipeline cut needs one stage per index")
    if math.prod(shape) != len(speeds):
        raise ShardkitError(
            f"{len(speeds)} device speeds for a mesh {dict(mesh_axes)} of {math.prod(shape)} devices: the preset "
            "must describe the mesh's devices (one [[groups]] entry per kind, counts summing to the mesh size)"
        )
    grid = np.moveaxis(np.asarray(speeds).reshape(shape), list(mesh_axes).index(axis), 0)
    return [float(v) for v in grid.reshape(shape[list(mesh_axes).index(axis)], -1).min(axis=1)]


def hetero_stage_plan(
    device_speeds: Sequence[float], mesh_axes: dict[str, int], num_layers: int, axis: str = "stage"
) -> StagePlan:
    """The min-max cut of `num_layers` equal layers (a GPT's identical blocks) over the stages of `mesh_axes`,
    each stage as fast as `stage_speeds` says: `partition_stages` on what the devices' placement implies."""
    return partition_stages([1.0] * int(num_layers), stage_speeds(device_speeds, mesh_axes, axis))


@dataclasses.dataclass(frozen=True)
class Balance:
    """Predicted compute time per step on devices of different speeds: even vs balanced, data vs pipeline."""

    dp_even_s: float  # every device global_batch / W examples; the slowest sets the step
    dp_balanced_s: float  # split_batch by speed within each device's memory cap
    counts: tuple[int, ...]  # the balanced examples per device
    pp_even_s: float  # layers in W equal stages (one per device), steady state (no bubble)
    pp_balanced_s: float  # partition_stages' min-max cut
    stage_bounds: tuple[int, ...]

    @property
    def best(self) -> str:
        times = {"dp balanced": self.dp_balanced_s, "pipeline min-max": self.pp_balanced_s}
        return min(times, key=times.get)


def balance(
    speeds: Sequence[float], memory: Sequence[float], global_batch: int, flops_per_example: float,
    peak_flops: float, *, layers: int = 0, state_bytes: float = 0.0, bytes_per_example: float = 0.0,
) -> Balance:  # fmt: skip
    """Compute time of one step (FLOPs / (peak x speed), the slowest device) for data parallelism split evenly and
    by `split_batch` (caps: (memory - state_bytes) / bytes_per_example), and for a pipeline of `layers` equal layers
    over the devices in order, cut evenly and by `partition_stages`. A model, not a measurement."""
    n = len(speeds)
    speeds = _positive("speeds", speeds, n)
    caps = None
    if bytes_per_example > 0:
        caps = [max(0, int((m - state_bytes) // bytes_per_example)) for m in memory]
    counts = split_batch(global_batch, speeds, caps)
    unit = flops_per_example / peak_flops  # seconds per example on a speed-1 device
    even = even_split(global_batch, n)
    dp_even, dp_bal = simulated_step_time(even, speeds) * unit, simulated_step_time(counts, speeds) * unit
    if layers >= n:
        per_layer = global_batch * unit / layers
        cut = [layers * s // n for s in range(n + 1)]
        pp_even = max((cut[s + 1] - cut[s]) * per_layer / speeds[s] for s in range(n))
        stages = partition_stages([per_layer] * layers, speeds)
        pp_bal, bounds = stages.step_time, stages.bounds
    else:
        pp_even = pp_bal = math.inf
        bounds = ()
    return Balance(dp_even, dp_bal, tuple(counts), pp_even, pp_bal, bounds)


@dataclasses.dataclass(frozen=True)
class HeteroConfig:
    """`Strategy.options` of the hetero step (hetero_step.py): micro-batches per device along `axis`, their size."""

    counts: tuple[int, ...]
    microbatch: int = 1  # examples per micro-batch
    axis: str = "data"
    mode: str = "loop"  # "loop": per-device trip counts; "pad": every device runs max(counts), padding masked
    speeds: tuple[float, ...] = ()  # the devices' relative throughputs the counts came from (for the report)

    def __post_init__(self) -> None:
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))
        object.__setattr__(self, "speeds", tuple(float(v) for v in self.speeds))
        if not self.counts or min(self.counts) < 1:
            raise ShardkitError(f"hetero counts={self.counts}: every device needs >= 1 micro-batch")
        if self.microbatch < 1:
            raise ShardkitError(f"hetero microbatch={self.microbatch} must be >= 1 example")
        if self.mode not in ("loop", "pad"):
            raise ShardkitError(f"hetero mode={self.mode!r}: choose 'loop' or 'pad'")

    @property
    def global_batch(self) -> int:
        return sum(self.counts) * self.microbatch


def make_strategy(
    counts: Sequence[int] = (1,), microbatch: int = 1, *, axis: str = "data", mode: str = "loop",
    speeds: Sequence[float] = (),
) -> Any:  # fmt: skip
    """Data parallelism with `counts[d]` micro-batches of `microbatch` examples on device d (`hetero_dp`);
    `speeds` (optional) are the throughputs the counts were balanced for, for the step's report."""
    cfg = HeteroConfig(tuple(counts), int(microbatch), axis, mode, tuple(speeds))
    return named("dp").replace(
        name="hetero_dp", step="hetero", options=cfg,
        description=f"data parallelism with per-device micro-batch counts {list(cfg.counts)} x {cfg.microbatch} "
        f"examples ({mode})",
        collectives="one all-reduce of the gradients after every device's loop (none inside it)",
    )  # fmt: skip


def plan_on_groups(p: Any, model_cfg: Any, hw: Any, batch: int, seq_len: int | None, frac: float) -> Any:
    """`sk.plan`'s hook (costmodel.PLAN_HOOKS): on a preset with device groups of different speeds, a plan that
    only splits the batch (no parameter sharded, the GSPMD step, every mesh axis a batch axis) gets its even vs
    balanced compute time and the pipeline's min-max cut attached, and is refused if no split fits in memory."""
    if not hw.groups or not hasattr(model_cfg, "flops_per_token" if seq_len else "flops_per_example"):
        return p
    t = Traits.of(p.strategy)
    devices = math.prod(p.mesh.values())
    if t.step != "gspmd" or t.params or set(p.mesh) - set(t.batch) or len(hw.device_speeds()) != devices:
        return p
    fpe = model_cfg.flops_per_token(seq_len) * seq_len if seq_len else model_cfg.flops_per_example()
    state = p.memory["params"] + p.memory["grads"] + p.memory["optimizer"]
    try:
        b = balance(
            hw.device_speeds(), [frac * m for m in hw.device_memory()], batch, fpe, hw.peak_flops,
            layers=int(getattr(model_cfg, "num_layers", 0)), state_bytes=state,
            bytes_per_example=p.memory.get("activations", 0.0) / (batch / devices),
        )  # fmt: skip
    except ShardkitError as e:  # the devices' memory cannot hold the batch, however it is split
        return dataclasses.replace(p, fits=False, reason=f"hetero: {e}")
    note = (f"hetero: dp even {b.dp_even_s * 1e3:.1f} ms vs balanced {b.dp_balanced_s * 1e3:.1f} ms compute "
            f"(x{b.dp_even_s / b.dp_balanced_s:.2f}, counts {list(b.counts)}); pipeline min-max "
            f"{b.pp_balanced_s * 1e3:.1f} ms; best: {b.best} (predicted)")  # fmt: skip
    return dataclasses.replace(p, hetero=b, reason=(p.reason + "; " if p.reason else "") + note)


#: the name `make_strategy` had until it was named as a builder (it returns a new Strategy)
strategy = renamed(make_strategy, "sk.hetero.strategy", "sk.hetero.make_strategy")

__all__ = [
    "Balance",
    "HeteroConfig",
    "StagePlan",
    "balance",
    "even_split",
    "hetero_stage_plan",
    "make_strategy",
    "partition_stages",
    "plan_of",
    "plan_on_groups",
    "simulated_step_time",
    "split_batch",
    "stage_speeds",
    "strategy",
]

register_strategy(make_strategy())
costmodel.register_plan_hook(plan_on_groups)
