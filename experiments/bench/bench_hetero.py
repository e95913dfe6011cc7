"""Heterogeneous devices (Whale, Jia et al. ATC'22; shardkit/parallel/hetero/): work saved and simulated speed-ups.

    python -m experiments.bench.bench_hetero [--steps 20] [--out experiments/bench/results/bench_hetero.json]

1. MEASURED, 8 CPU devices in one process: the same uneven split of one global batch run as per-device trip
   counts (`mode="loop"`: device d runs counts[d] micro-batches) and as pad-and-mask (`mode="pad"`: every device
   runs max(counts), the padding weighted 0), next to the even dp step on the same batch. The 8 virtual devices
   share this host's cores, so a step's time measures the *total* work of all devices, which is what padding
   wastes (on a real cluster the devices run in parallel and the slowest one sets the time). The GPT step of
   tests/test_hetero.py's size x 4 layers.
2. SIMULATED, from the presets' [[groups]] (meshes/hetero_*.toml): the step time of data parallelism on the mixed
   devices = max over devices of counts[d] / speed[d] (everyone waits for the slowest before the all-reduce), for the
   even split and the balanced one, and the pipeline stage time of an even layer cut vs the min-max cut
   (`partition_stages`) with one stage per device group. Labelled simulated: no mixed hardware was used.
3. The uneven pipeline, EXECUTED on 8 CPU devices (pp_dp on stage=2,data=4, 1F1B, an 8-layer GPT): the even cut
   4 + 4, the cut hetero_v100_p100 implies (`sk.hetero.hetero_stage_plan`: stage 0 on the V100s, 5 + 3) and an
   extreme 7 + 1. MEASURED: the step time, the layers each stage holds and the layers computed (the total work:
   8 for every cut, the padding slots skipped). The 8 devices share one host's cores and the ticks synchronise
   the stages, so the time is neither the slowest stage's nor purely the total: it says the cut runs and what
   padding does not cost, not what mixed GPUs would gain. Next to it, SIMULATED: the step time the cut would give
   on the preset's stage speeds (V100 1.0, P100 0.59), max over stages of layers / speed, in V100 layer times.
Prints the tables (ratios) and writes JSON.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse

import jax
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, gpt_batch, save_json, time_steps
from models.gpt import GPT, GPTConfig

CFG = GPTConfig(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=256, vocab_size=128,
                max_seq_len=64)  # fmt: skip
COUNTS, MICRO = [6, 6, 4, 4, 2, 2, 4, 4], 2  # 32 micro-batches of 2 sequences (an uneven split: max 6, mean 4)


def measured(steps: int) -> list[dict]:
    mesh = sk.make_mesh({"data": 8})
    batch = gpt_batch(CFG.vocab_size, sum(COUNTS) * MICRO, 64)  # host arrays: each step places them
    runs = {"dp (even)": "dp", "trip counts": sk.hetero.make_strategy(COUNTS, MICRO, mode="loop"),
            "pad + mask": sk.hetero.make_strategy(COUNTS, MICRO, mode="pad")}  # fmt: skip
    out = []
    for name, strategy in runs.items():
        model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, strategy, seed=0)
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy)
        timing, _, metrics = time_steps(step, step.init_state(), batch, steps)  # the warm-up step compiles
        out.append(dict(run=name, step_s=timing.median, loss=float(metrics["loss"])))
    base = next(r for r in out if r["run"] == "trip counts")["step_s"]
    work = {"trip counts": sum(COUNTS), "pad + mask": max(COUNTS) * len(COUNTS), "dp (even)": sum(COUNTS)}
    print(f"\nmeasured: GPT {CFG.num_layers} x {CFG.d_model}, counts {COUNTS} x {MICRO} sequences of 64, 8 CPU devices")
    print(f"{'run':<12} {'step ms':>8} {'time / trip counts':>19} {'micro-batches computed':>23} {'loss':>8}")
    for r in out:
        r.update(time_ratio=r["step_s"] / base, microbatches_computed=work[r["run"]])
        print(f"{r['run']:<12} {r['step_s'] * 1e3:8.1f} {r['time_ratio']:19.2f} {r['microbatches_computed']:23d} "
              f"{r['loss']:8.4f}")  # fmt: skip
    return out


def simulated() -> list[dict]:
    out = []
    print("\nsimulated (max over devices of micro-batches / speed; no mixed hardware was used):")
    print(f"{'preset':<18} {'speeds':<34} {'even':>6} {'balanced':>9} {'speed-up':>9} {'pipeline even/min-max':>22}")
    for name in ("hetero_v100_p100", "hetero_a100_h100"):
        preset = sk.load_preset(name)
        speeds = preset.device_speeds()
        for batch in (32, 64, 256):
            even, bal = sk.hetero.even_split(batch, len(speeds)), sk.hetero.split_batch(batch, speeds)
            t_even, t_bal = (sk.hetero.simulated_step_time(c, speeds) for c in (even, bal))
            # pipeline: one stage per device group (its speed), 24 equal layers, even cut vs min-max cut
            stage_speeds = [g.speed for g in preset.groups]
            layers, n = [1.0] * 24, len(stage_speeds)
            cut = [len(layers) * s // n for s in range(n + 1)]
            p_even = max(sum(layers[cut[s] : cut[s + 1]]) / stage_speeds[s] for s in range(n))
            p_bal = sk.hetero.partition_stages(layers, stage_speeds).step_time
            row = dict(preset=name, global_microbatches=batch, even=even, balanced=bal, even_time=t_even,
                       balanced_time=t_bal, speedup=t_even / t_bal, pipeline_even=p_even, pipeline_minmax=p_bal,
                       pipeline_speedup=p_even / p_bal)  # fmt: skip
            out.append(row)
            sp = ",".join(f"{s:g}" for s in speeds)
            print(f"{name:<18} {sp:<34} {t_even:6.2f} {t_bal:9.2f} {t_even / t_bal:8.2f}x {p_even / p_bal:21.2f}x"
                  f"   (batch {batch})")  # fmt: skip
    return out


def pipeline_cuts(steps: int) -> list[dict]:
    cfg = GPTConfig(**{**CFG.__dict__, "num_layers": 8})
    axes = {"stage": 2, "data": 4}
    speeds = sk.hetero.stage_speeds(sk.load_preset("hetero_v100_p100").device_speeds(), axes)
    balanced = sk.hetero.hetero_stage_plan(sk.load_preset("hetero_v100_p100").device_speeds(), axes, 8).counts
    mesh, batch = sk.make_mesh(axes), gpt_batch(cfg.vocab_size, 32, 64)
    out = []
    for label, cut in (("even", (4, 4)), ("hetero_v100_p100 min-max", balanced), ("extreme", (7, 1))):
        strategy = sk.strategy("pp_dp").replace(layers=f"pipeline:1f1b:4@{cut[0]},{cut[1]}")
        model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=0)
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy)
        timing, _, metrics = time_steps(step, step.init_state(), batch, steps)
        sim = sk.hetero.plan_of(cut, speeds).step_time
        out.append(dict(cut=label, stage_layers=list(cut), layers_computed=sum(cut), padded_slots=2 * max(cut),
                        step_s=timing.median, loss=float(metrics["loss"]), simulated_step=sim))  # fmt: skip
    even = out[0]
    print(f"\nuneven pipeline: pp_dp stage=2,data=4, 1F1B m=4, GPT 8 x {cfg.d_model}, batch 32 x 64, 8 CPU devices")
    print(f"{'cut':<26} {'stage layers':>12} {'computed':>9} {'MEASURED ms':>12} {'/ even':>7} "
          f"{'SIMULATED step':>15} {'/ even':>7}   (hetero_v100_p100 stage speeds {speeds})")  # fmt: skip
    for r in out:
        r.update(time_ratio=r["step_s"] / even["step_s"], simulated_ratio=r["simulated_step"] / even["simulated_step"])
        print(f"{r['cut']:<26} {'+'.join(map(str, r['stage_layers'])):>12} {r['layers_computed']:>9} "
              f"{r['step_s'] * 1e3:12.1f} {r['time_ratio']:7.2f} {r['simulated_step']:15.2f} "
              f"{r['simulated_ratio']:7.2f}")  # fmt: skip
    print("MEASURED on one host's cores (total work); SIMULATED = max over stages of layers / stage speed (V100 = 1),"
          " no mixed hardware was used")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=f"{RESULTS}/bench_hetero.json")
    args = parser.parse_args()
    result = dict(measured=measured(args.steps), simulated=simulated(), pipeline=pipeline_cuts(args.steps),
                  counts=COUNTS, microbatch=MICRO,
                  model=CFG.__dict__, devices=jax.device_count(),
                  whale_reported="1.2-1.4x (ATC'22 / Alibaba)")  # fmt: skip
    print()
    save_json(result, args.out)


if __name__ == "__main__":
    main()
