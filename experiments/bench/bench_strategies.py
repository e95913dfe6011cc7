"""Benchmark every built-in strategy on 8 CPU devices: state memory, temp memory, collective bytes, step time.

    python -m experiments.bench.bench_strategies [--out experiments/bench/results/bench_strategies.json] [--steps N]

One GPT (~8M parameters, AdamW, fp32), batch 16 x 128 tokens, on 8 virtual CPU devices, under each strategy on
its usual mesh, plus the same model on one device (mesh data=1, dp) as the reference. Per strategy:

1. state/dev: bytes of parameters + optimizer state on one device (`addressable_shards[0]`), against the ideal
   params_total / param_degree + opt_total / opt_degree with the degree the strategy intends (DEGREES). The
   measured value is slightly above it because a few tiny leaves stay replicated: the Adam step count always,
   and under tp / tp_sp the RMSNorm scales (they have only an `embed` dimension, which tp does not shard).
2. temp / arg: `compiled.memory_analysis()` per device (XLA's scratch and argument buffers).
3. comm: ring bytes sent per device per step, summed over the collectives of the compiled HLO (shardkit.hlo),
   against the cost model's prediction (`models.gpt_cost.strategy_comms`, docs/algorithms.md §1): `ideal` counts a
   reduce-scatter where the algorithm has one, `cpu` counts it as the all-reduce (+ dynamic-slice) that XLA's
   CPU backend emits instead (it has no reduce-scatter creation pass), i.e. twice the bytes.
4. step time: median of `--steps` timed steps after one warm-up, `jax.block_until_ready`, and its speed-up
   over the one-device reference (t_1dev / t). The 8 "devices" share the host's cores, so this measures
   partitioning overhead, not scaling. tokens/s and model FLOP/s (§9: 6N + 12·L·h·s per token, causal half
   not subtracted) go to the JSON.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import time
from typing import Any

import jax
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, gpt_batch, save_json, time_steps
from models import gpt_cost
from models.gpt import GPT, GPTConfig
from shardkit import hlo

CFG = GPTConfig(
    num_layers=8, d_model=256, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=1024, vocab_size=384, max_seq_len=128
)
BATCH, SEQ = 16, 128
#: (strategy, mesh) in table order.
RUNS = [
    ("dp", "data=8"),
    ("zero1", "data=8"),
    ("fsdp", "fsdp=8"),
    ("tp", "data=2,tensor=4"),
    ("tp_sp", "data=2,tensor=4"),
    ("fsdp_tp", "fsdp=2,tensor=4"),
    ("dp_fsdp_tp", "data=2,fsdp=2,tensor=2"),
]
#: The strategy's intended (parameter, optimizer-state) shard degree on its mesh above.
DEGREES = {
    "dp": (1, 1),
    "zero1": (1, 8),
    "fsdp": (8, 8),
    "tp": (4, 4),
    "tp_sp": (4, 4),
    "fsdp_tp": (8, 8),
    "dp_fsdp_tp": (4, 4),
}
MiB, KiB = 2.0**20, 2.0**10


def tree_bytes(tree: Any, per_device: bool) -> int:
    """Bytes of every array leaf: one device's shard (`addressable_shards[0]`) or the full global array."""
    leaves = jax.tree.leaves(tree)
    return sum(x.addressable_shards[0].data.nbytes if per_device else x.nbytes for x in leaves)


def comm_formula(name: str, shape: dict[str, int]) -> list[dict]:
    """The cost model's per-device bytes per step (`models.gpt_cost.strategy_comms`, docs/algorithms.md §1), as terms
    {what, ideal, cpu}: `ideal` models reduce-scatters as reduce-scatters (backend "gpu"), `cpu` as the all-reduce
    + dynamic-slice XLA:CPU emits (backend "cpu"). Not in the model (seen in the HLO, KiB or less): the loss and
    grad-norm scalars, the vocab-parallel cross-entropy's all-reduces of [b, s] floats (tp family), the
    RMSNorm-scale gradient all-reduces over tensor under tp_sp."""
    terms = []
    for backend in ("gpu", "cpu"):
        for c in gpt_cost.strategy_comms(name, CFG, shape, BATCH, SEQ, nbytes=4, backend=backend):
            terms.append({"what": f"{c.kind} over {c.axis}: {c.what}", "backend": backend, "bytes": c.bytes})
    return terms


def run(name: str, spec: str, steps: int, devices: list[Any] | None = None) -> dict[str, Any]:
    """Builds, compiles, measures and times one (strategy, mesh)."""
    t0 = time.perf_counter()
    mesh = sk.make_mesh(spec, devices)
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, name)
    step = sk.make_train_step(model, optax.adamw(1e-3), mesh, name)
    state = step.init_state()
    del model
    batch = gpt_batch(CFG.vocab_size, BATCH, SEQ, step.batch_sharding)
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0

    psi, opt_total = tree_bytes(state.params, False), tree_bytes(state.opt_state, False)
    psi_dev, opt_dev = tree_bytes(state.params, True), tree_bytes(state.opt_state, True)
    pdeg, odeg = DEGREES.get(name, (1, 1)) if mesh.size > 1 else (1, 1)
    ideal_state = psi / pdeg + opt_total / odeg
    mem = compiled.memory_analysis()

    colls = hlo.collectives(compiled, mesh)
    measured = sum(c.bytes_sent for c in colls)
    terms = comm_formula(name, dict(mesh.shape)) if mesh.size > 1 else []
    ideal_comm, cpu_comm = (sum(x["bytes"] for x in terms if x["backend"] == b) for b in ("gpu", "cpu"))

    timing, state, metrics = time_steps(compiled, state, batch, steps)  # after one warm-up step
    step_s = timing.median
    tokens_s = BATCH * SEQ / step_s
    return {
        "strategy": name,
        "mesh": spec,
        "devices": mesh.size,
        "compile_s": compile_s,
        "state_bytes_per_device": psi_dev + opt_dev,
        "param_bytes_per_device": psi_dev,
        "opt_bytes_per_device": opt_dev,
        "param_bytes_total": psi,
        "opt_bytes_total": opt_total,
        "shard_degree": {"params": pdeg, "opt": odeg},
        "ideal_state_bytes_per_device": ideal_state,
        "state_ratio": (psi_dev + opt_dev) / ideal_state,
        "temp_bytes_per_device": mem.temp_size_in_bytes,
        "argument_bytes_per_device": mem.argument_size_in_bytes,
        "output_bytes_per_device": mem.output_size_in_bytes,
        "comm_bytes_sent_per_device": measured,
        "comm_formula_ideal": ideal_comm,
        "comm_formula_cpu": cpu_comm,
        "comm_ratio_ideal": measured / ideal_comm if ideal_comm else None,
        "comm_ratio_cpu": measured / cpu_comm if cpu_comm else None,
        "comm_formula_terms": terms,
        "comm_by_kind_axes": [
            {"kind": k, "axes": list(a), **v} for (k, a), v in sorted(hlo.summarize(colls).items(), key=str)
        ],
        "collectives": [{**dataclasses.asdict(c), "axes": list(c.axes)} for c in colls],
        "step_times_s": timing.times,
        "step_s": step_s,
        "tokens_per_s": tokens_s,
        "model_flops_per_s": tokens_s * CFG.flops_per_token(SEQ),
        "final_loss": float(metrics["loss"]),
    }


def fmt_ratio(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "-"


def table(rows: list[dict], ref: dict) -> str:
    head = (
        f"{'strategy':<11} {'mesh':<23} {'state MiB':>9} {'ideal':>7} {'ratio':>6} {'temp MiB':>8} {'arg MiB':>7} "
        f"{'comm KiB':>9} {'ideal KiB':>9} {'ratio':>6} {'cpu KiB':>9} {'ratio':>6} {'step ms':>8} {'vs 1dev':>7} "
        f"{'tok/s':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy'] + ('*' if r['devices'] == 1 else ''):<11} {r['mesh']:<23} "
            f"{r['state_bytes_per_device'] / MiB:>9.2f} {r['ideal_state_bytes_per_device'] / MiB:>7.2f} "
            f"{r['state_ratio']:>6.3f} {r['temp_bytes_per_device'] / MiB:>8.1f} "
            f"{r['argument_bytes_per_device'] / MiB:>7.1f} {r['comm_bytes_sent_per_device'] / KiB:>9.0f} "
            f"{r['comm_formula_ideal'] / KiB:>9.0f} {fmt_ratio(r['comm_ratio_ideal']):>6} "
            f"{r['comm_formula_cpu'] / KiB:>9.0f} {fmt_ratio(r['comm_ratio_cpu']):>6} {r['step_s'] * 1e3:>8.0f} "
            f"{ref['step_s'] / r['step_s']:>7.2f} {r['tokens_per_s']:>7.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=f"{RESULTS}/bench_strategies.json")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per strategy (after one warm-up)")
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()}: set XLA_FLAGS before jax is imported")
    t0, load0 = time.perf_counter(), os.getloadavg()
    ref = run("dp", "data=1", args.steps, jax.devices()[:1])
    rows = [ref]
    for name, spec in RUNS:
        rows.append(run(name, spec, args.steps))
        print(f"  {name:<11} {spec:<23} compile {rows[-1]['compile_s']:.1f}s, step {rows[-1]['step_s'] * 1e3:.0f} ms",
              flush=True)  # fmt: skip
    total_s, load1 = time.perf_counter() - t0, os.getloadavg()
    print(f"\nGPT {CFG.num_params() / 1e6:.2f}M params, batch {BATCH}x{SEQ}, AdamW fp32, jax {jax.__version__}, "
          f"{jax.device_count()} {jax.default_backend()} devices on {os.cpu_count()} cores, "
          f"load avg {load0[0]:.2f} -> {load1[0]:.2f}, {total_s:.0f}s total\n")  # fmt: skip
    print(table(rows, ref))
    print(
        "\n* one-device reference (mesh data=1 on jax.devices()[:1]). state = params + AdamW state per device; "
        "ideal = params/deg_p + opt/deg_o with the intended degrees\n  "
        + ", ".join(f"{k} {p}/{o}" for k, (p, o) in DEGREES.items())
        + ". comm = ring bytes sent per device per step (HLO); ideal counts reduce-scatters as reduce-scatters, "
        "cpu as the all-reduces XLA:CPU emits.\n  vs 1dev = t(1 device) / t; the 8 CPU devices share the host cores."
    )
    result = {
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "load_average_start_end": [load0[0], load1[0]],
        "total_s": total_s,
        "model_config": {**vars(CFG), "num_params": CFG.num_params(), "flops_per_token": CFG.flops_per_token(SEQ)},
        "batch": BATCH,
        "seq": SEQ,
        "optimizer": "adamw(1e-3), fp32",
        "steps_timed": args.steps,
        "reference_one_device": ref,
        "strategies": rows[1:],
    }
    save_json(result, args.out)


if __name__ == "__main__":
    main()
