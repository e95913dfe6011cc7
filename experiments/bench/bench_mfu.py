"""The GPT train step against the machine's peak: model FLOP utilisation and where a step's time goes.

    python -m experiments.bench.bench_mfu [--models gpt_tiny,gpt_mid,gpt_small] [--steps 5]
        [--out experiments/bench/results/bench_mfu.json]

Shapes from `experiments/configs` (gpt_tiny, gpt_small) plus `gpt_mid` between them, in fp32 (the CPU has no fast
bf16), AdamW, on one CPU device and on 8 virtual ones (dp on data=8, fsdp on data=2,fsdp=4), the layers run by
the `scan` kernel (the default: one compiled layer) and, on one device, by `unrolled` (L inlined layers). Per run:

1. MFU: model FLOPs per step (`GPTConfig.flops_per_token`, 6N + 12·L·d·s, PaLM's convention) / step time / the
   host's calibrated fp32 matmul peak (`experiments.runtime.calibrate_peak_flops`, best of 3 calibrations of
   20). The 8 virtual devices share the host's cores, so the peak of a mesh of them is the host's: the larger of
   one device's peak (one device's matmul already runs on every core) and N x the per-device peak with all N
   multiplying at once. The all-at-once figure alone is not a stable denominator: on this 2-core host it came
   out at 24-44 GFLOP/s per device from run to run (x 8 = 190-350 against one device's 338), and an MFU
   divided by its low end read 52-63% for a step that had not got faster. The per-device figure stays in the
   JSON (`peak_flops_per_device`).
2. Breakdown: a `jax.profiler` trace of `--steps` steps, read back with `jax.profiler.ProfileData`. Every XLA
   operation that ran is an event named after its HLO instruction; each is put in one class by its instruction
   in the compiled module: `matmul` (dot / convolution fusions: what the peak is about), `collective`
   (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute), `elementwise` (every other fusion
   and op: norms, softmax, the optimizer update, copies). Shares are of the summed busy time of all devices's
   operations; `cores busy` is that busy time over step time × the host's cores (XLA runs independent
   operations of one device on several threads, so a lone device can keep both cores busy); the rest is
   time no operation ran: the host dispatching, devices waiting for each other in collectives, loop overhead.
3. Matmul efficiency: the model FLOPs (all of them matmuls) over the time the matmul class took, against the
   peak: what the matmuls themselves reach, apart from everything around them (one device only). (XLA's
   `cost_analysis` counts a while loop's body once, so its FLOPs, kept in the JSON, are one layer's under the
   scan.)

All figures are measured here and printed as ratios; nothing is asserted.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import collections
import dataclasses
import functools
import pathlib
import re
import tempfile
from typing import Any

import jax
import numpy as np
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, gpt_batch, save_json, time_steps
from experiments.configs import gpt_small, gpt_tiny
from experiments.runtime import calibrate_peak_flops
from models.gpt import GPT, GPTConfig

VOCAB = 384  # the byte-level corpus's 256 symbols + specials, padded to 128


def model_configs() -> dict[str, tuple[GPTConfig, int, int]]:
    """name -> (fp32 GPTConfig, batch, seq): the configs' shapes at batches that take seconds per step on a CPU."""
    out = {}
    for name, mod, batch, seq in (("gpt_tiny", gpt_tiny, 32, 128), ("gpt_small", gpt_small, 8, 256)):
        fields = {**mod.get_config().model.to_dict(), "dtype": "float32", "vocab_size": VOCAB, "max_seq_len": seq}
        out[name] = (GPTConfig(**fields), batch, seq)
    mid = dataclasses.replace(out["gpt_tiny"][0], num_layers=6, d_model=384, num_heads=6, num_kv_heads=6,
                              head_dim=64, mlp_dim=1024, max_seq_len=256)  # fmt: skip
    out = {"gpt_tiny": out["gpt_tiny"], "gpt_mid": (mid, 8, 256), "gpt_small": out["gpt_small"]}
    return out


#: (label, mesh, strategy, layers kernel): the scan over layers (default) and, on one device, the layers inlined
RUNS = (
    ("1 device", "data=1", "dp", "scan"),
    ("1 device", "data=1", "dp", "unrolled"),
    ("8 devices", "data=8", "dp", "scan"),
    ("8 devices", "data=2,fsdp=4", "fsdp", "scan"),
)
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def runs_of(spec: str) -> tuple[tuple[str, str, str, str], ...]:
    """RUNS, or the runs `--runs` names ("strategy/mesh/layers;..."), labelled by their device count."""
    if not spec:
        return RUNS
    out = []
    for item in filter(None, spec.split(";")):
        strategy, mesh, layers = item.split("/")
        n = int(np.prod([int(a.split("=")[1]) for a in mesh.split(",")]))
        out.append((f"{n} device{'s' * (n > 1)}", mesh, strategy, layers))
    return tuple(out)


def classify(hlo_text: str) -> tuple[dict[str, str], dict[str, str]]:
    """HLO instruction name -> matmul | collective | elementwise | container, and -> the JAX op it came from
    (its `op_name` metadata), from the compiled module's text."""
    fused_with_dot = set()
    current = None
    for line in hlo_text.splitlines():
        head = re.match(r"^%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
        elif current and re.search(r"= \S+ (dot|convolution)\(", line):
            fused_with_dot.add(current)
    kinds, sources = {}, {}
    for m in re.finditer(r"^\s+(?:ROOT )?%?([\w.\-]+) = .*? ([a-z\-]+)\((.*)$", hlo_text, re.M):
        name, op, rest = m.groups()
        src = re.search(r'op_name="([^"]*)"', rest)
        sources[name] = f"{op}: " + (re.sub(r"^jit\([^)]*\)/", "", src.group(1)) if src else "?")
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        if op in ("dot", "convolution") or (op == "fusion" and calls and calls.group(1) in fused_with_dot):
            kinds[name] = "matmul"
        elif any(op.startswith(c) for c in COLLECTIVES):
            kinds[name] = "collective"
        elif op in ("while", "conditional", "call", "parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
            kinds[name] = "container"
        else:
            kinds[name] = "elementwise"
    return kinds, sources


def profile(compiled: Any, state: Any, batch: Any, steps: int) -> tuple[Any, dict[str, float], list, int]:
    """Runs `steps` steps under the profiler: (state, busy seconds per step and class summed over devices, the
    costliest operations outside the matmuls [(source, class, seconds per step)], events seen)."""
    kinds, sources = classify(compiled.as_text())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
        path = next(pathlib.Path(tmp).rglob("*.xplane.pb"))
        data = jax.profiler.ProfileData.from_file(str(path))
    busy: dict[str, float] = collections.defaultdict(float)
    by_source: dict[tuple[str, str], float] = collections.defaultdict(float)
    seen = 0
    for plane in data.planes:
        for line in plane.lines:
            for ev in line.events:
                kind = kinds.get(ev.name)
                if kind in (None, "container"):
                    continue
                busy[kind] += ev.duration_ns * 1e-9 / steps
                by_source[sources.get(ev.name, ev.name), kind] += ev.duration_ns * 1e-9 / steps
                seen += 1
    top = sorted(((src, kind, t) for (src, kind), t in by_source.items() if kind != "matmul"), key=lambda x: -x[2])
    return state, dict(busy), top[:8], seen


@functools.cache
def peak_of(devices: int) -> float:
    """The per-device matmul peak with `devices` devices multiplying at once: calibrated once per count (and
    the best of 3 calibrations, each a best of 20), so that every run with that count divides by the same."""
    return max(calibrate_peak_flops(jax.devices()[:devices], reps=20) for _ in range(3))


def host_peak(devices: int) -> float:
    """The FLOP/s of the host the `devices` virtual devices share (module docstring, 1.): the larger of one
    device's calibrated peak and `devices` x the per-device peak of all of them at once."""
    return max(peak_of(1), devices * peak_of(devices))


def run(cfg: GPTConfig, batch_size: int, seq: int, spec: str, name: str, layers: str, steps: int) -> dict[str, Any]:
    mesh = sk.make_mesh(spec, jax.devices()[: int(np.prod([int(a.split("=")[1]) for a in spec.split(",")]))])
    strategy = sk.strategies.strategy(name).replace(layers=layers)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy)
    step = sk.make_train_step(model, optax.adamw(1e-4), mesh, strategy)
    state = step.init_state()
    del model
    batch = gpt_batch(VOCAB, batch_size, seq, step.batch_sharding)
    compiled = step.lower(state, batch).compile()
    peak = peak_of(mesh.size)
    timing, state, _ = time_steps(compiled, state, batch, steps)
    step_s = timing.median
    state, busy, top, events = profile(compiled, state, batch, steps)
    model_flops = cfg.flops_per_token(seq) * batch_size * seq
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float(cost.get("flops", 0.0)) * mesh.size  # per device in SPMD: the whole step's is N times
    total = sum(busy.values()) or 1.0
    shares = {k: busy.get(k, 0.0) / total for k in ("matmul", "collective", "elementwise")}
    cores_busy = total / (step_s * (os.cpu_count() or 1))
    return {
        "mesh": spec, "strategy": name, "layers": layers, "devices": mesh.size, "step_s": step_s,
        "tokens_per_s": batch_size * seq / step_s, "model_flops_per_step": model_flops,
        "xla_flops_per_step": xla_flops, "peak_flops_per_device": peak, "host_peak_flops": host_peak(mesh.size),
        "mfu": model_flops / step_s / host_peak(mesh.size),
        # the model's FLOPs are its matmuls' (XLA's cost analysis counts a while body once, not per layer)
        # one device only: on 8 sharing the cores a matmul running beside others' elementwise work gets more
        # than the all-at-once peak, and the ratio stops meaning anything (it came out above 100%)
        "matmul_efficiency": model_flops / busy["matmul"] / peak if busy.get("matmul") and mesh.size == 1 else None,
        "busy_s_per_step": busy, "shares": shares, "cores_busy": cores_busy, "profile_events": events,
        "top_non_matmul": [{"op": src, "class": kind, "s_per_step": t} for src, kind, t in top],
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    lines = ["train step vs the host's calibrated fp32 matmul peak (CPU; shares of the operations' busy time)"]
    lines.append(f"{'model':<10} {'run':<30} {'step s':>8} {'tok/s':>9} {'MFU':>6} {'mm eff':>7} "
                 f"{'matmul':>7} {'coll':>6} {'elem':>6} {'cores busy':>10}")  # fmt: skip
    for name, runs in result["models"].items():
        for r in runs["runs"]:
            s, eff, what = r["shares"], r["matmul_efficiency"], f"{r['strategy']} {r['mesh']} {r['layers']}"
            eff = "      -" if eff is None else f"{eff:7.1%}"
            lines.append(
                f"{name:<10} {what:<30} {r['step_s']:8.3f} {r['tokens_per_s']:9,.0f} "
                f"{r['mfu']:6.1%} {eff} {s['matmul']:7.1%} {s['collective']:6.1%} "
                f"{s['elementwise']:6.1%} {r['cores_busy']:10.1%}"
            )
    lines.append("")
    lines.append("costliest operations outside the matmuls (summed over devices, share of all operations' time):")
    for name, runs in result["models"].items():
        for r in runs["runs"]:
            total = sum(r["busy_s_per_step"].values())
            ops = "; ".join(f"{t['op'][:60]} {t['s_per_step'] / total:.0%}" for t in r["top_non_matmul"][:4])
            lines.append(f"  {name} {r['strategy']} {r['mesh']} {r['layers']}: {ops}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt_tiny,gpt_mid,gpt_small")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--runs",
        default="",
        help="only these runs, each strategy/mesh/layers separated by ';', "
        "e.g. 'fsdp/data=2,fsdp=4/scan;fsdp/data=2,fsdp=4/scan:gather' (default: RUNS)",
    )
    parser.add_argument("--out", default=f"{RESULTS}/bench_mfu.json")
    args = parser.parse_args(argv)
    configs = model_configs()
    result: dict[str, Any] = {"jax": jax.__version__, "models": {}}
    for name in args.models.split(","):
        cfg, batch_size, seq = configs[name]
        runs = []
        for label, spec, strategy, layers in runs_of(args.runs):
            r = run(cfg, batch_size, seq, spec, strategy, layers, args.steps)
            print(f"{name} {label} {strategy} {spec} layers={layers}: {r['step_s']:.3f} s/step, MFU {r['mfu']:.1%}",
                  flush=True)  # fmt: skip
            runs.append(r)
        result["models"][name] = {
            "config": dataclasses.asdict(cfg), "batch": batch_size, "seq": seq,
            "params": cfg.num_params(include_embedding=True), "runs": runs,
        }  # fmt: skip
    print(table(result))
    save_json(result, args.out)


if __name__ == "__main__":
    main()
