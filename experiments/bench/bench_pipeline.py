"""Benchmark the pipeline schedules on 8 CPU devices: step time, bubble, compiled temp memory.

    python -m experiments.bench.bench_pipeline [--out experiments/bench/results/bench_pipeline.json] [--reps 3]

Model: the GPT of models/ with 8 layers of width 64, batch 32 x 32 tokens, fp32, SGD. Pipelines run `pp_dp` on
mesh stage=4 x data=2 for each schedule (gpipe, 1f1b, circular with v=2) and m in {4, 8, 16} pipeline
microbatches; the baseline is the non-pipelined `fsdp` step on data=2 x fsdp=4 (same model, batch, devices).

- time: fastest of `--reps` steps after a warm-up, relative to the fsdp step. The 8 virtual devices share this
  host's cores, so this is overhead (bubble ticks, ppermutes, 1F1B's extra forwards), not speed-up.
- bubble: the idle fraction of the (tick, stage) slots of the table the kernel is driven by (`schedule(...)`),
  next to the formula (p-1)/(v m+p-1). GPipe and circular compute on every tick (SPMD: an idle stage works
  on a dummy microbatch, masked out); 1F1B's idle ticks skip work (`lax.switch`).
- temp: per-device temporaries of the compiled step (`memory_analysis().temp_size_in_bytes`).
- grad_reduce: bytes sent per step by all-reduce / reduce-scatter over data or fsdp (`shardkit.hlo.collectives`);
  the pipelines reduce weight gradients once after the tick loop, so this does not grow with m.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
from typing import Any

import jax
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, compile_timed, gpt_batch, save_json, time_calls
from models.gpt import GPT, GPTConfig
from shardkit import hlo, pipeline

CFG = GPTConfig(
    num_layers=8, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=128, max_seq_len=32
)
BATCH, SEQ, STAGES = 32, 32, 4


def measure(spec: str, strategy: sk.Strategy, reps: int) -> dict[str, Any]:
    mesh = sk.make_mesh(spec)
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, strategy)
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy, donate=False)
    state = step.init_state()
    batch = gpt_batch(CFG.vocab_size, BATCH, SEQ, step.batch_sharding)
    compiled, lower_s, compile_s = compile_timed(step, state, batch)
    step_s = time_calls(lambda: compiled(state, batch), reps).best  # the same state each time (donate=False)
    temp = compiled.memory_analysis().temp_size_in_bytes
    colls = hlo.collectives(compiled, mesh)
    red = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter") and set(c.axes) & {"data", "fsdp"}]
    reduce = sum(c.bytes_sent for c in red)
    return {"step_s": step_s, "compile_s": lower_s + compile_s, "temp_bytes": int(temp), "grad_reduce_bytes": reduce}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=f"{RESULTS}/bench_pipeline.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--microbatches", default="4,8,16")
    args = parser.parse_args()
    base = measure("data=2,fsdp=4", sk.strategy("fsdp"), args.reps)
    rows = []
    for kind in pipeline.SCHEDULES:
        for m in (int(x) for x in args.microbatches.split(",")):
            v = 2 if kind == "circular" else 1
            strategy = sk.strategy("pp_dp").replace(layers=f"pipeline:{kind}:{m}:{v}")
            r = measure(f"stage={STAGES},data=2", strategy, args.reps)
            sched = pipeline.schedule(STAGES, m, v, kind)
            rows.append(
                {
                    "schedule": kind,
                    "m": m,
                    "v": v,
                    **r,
                    "time_vs_fsdp": r["step_s"] / base["step_s"],
                    "bubble_table": sched.bubble(),
                    "bubble_formula": pipeline.bubble_formula(STAGES, m, v),
                    "peak_in_flight": int(sched.peak_in_flight().max()),
                }
            )
            x = rows[-1]
            print(
                f"{kind:>8} m={m:<3} v={v} step {x['step_s'] * 1e3:7.1f} ms ({x['time_vs_fsdp']:.2f}x fsdp)  "
                f"bubble {x['bubble_table']:.3f} (formula {x['bubble_formula']:.3f})  "
                f"in flight {x['peak_in_flight']:>2}  temp {x['temp_bytes'] / 2**20:6.2f} MiB  "
                f"grad reduce {x['grad_reduce_bytes'] / 2**20:6.2f} MiB",
                flush=True,
            )
    print(f"    fsdp step {base['step_s'] * 1e3:.1f} ms, temp {base['temp_bytes'] / 2**20:.2f} MiB")
    setup = {
        "model": CFG.__dict__,
        "batch": BATCH,
        "seq": SEQ,
        "mesh": f"stage={STAGES},data=2",
        "jax": jax.__version__,
    }
    save_json({"setup": setup, "fsdp": base, "rows": rows}, args.out, indent=2)


if __name__ == "__main__":
    main()
