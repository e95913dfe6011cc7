"""4D (AxoNN) benchmark on 8 CPU devices: predicted vs compiled collective bytes, step time, planner picks.

    python -m experiments.bench.bench_4d [--out experiments/bench/results/bench_4d.json] [--steps N]

For all 20 factorisations (G_x, G_y, G_z, G_d) of 8 devices (mesh data, depth, row, col; col innermost):
1. stack: fwd + bwd of the GPT blocks' four projections as `sk.tensor3d.linear` layers (shard_map kernels);
   bytes per device predicted by `gpt_cost.strategy_comms("tp3d")` vs counted by `shardkit.hlo`.
2. gpt: one SGD train step of a small GPT under the `tp3d` strategy (GSPMD rules); predicted =
   `strategy_comms("tp3d", gspmd=True)`: the four projections (CPU: GSPMD's depth reduce-scatter counted as
   all-reduce, weights re-gathered in the scan's backward) + embedding, RMSNorms, head, vocab-parallel
   cross-entropy and loss / grad-norm scalars (`models/gpt_cost/comms.py`) vs the HLO; median step time over --steps.
3. Spearman rank correlation (numpy, average ranks for ties) of predicted bytes vs measured GPT step time.
4. The planner's top three plans for a 7.2B GPT (LLaMA-3-8B-like shape) on 64 and 1024 Perlmutter GPUs.
Writes the JSON and a scatter PNG (predicted vs HLO bytes) next to it. On CPU the 8 "devices" share the host's
cores: step time measures partitioning overhead and memcpy "communication", not a network.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import itertools
import pathlib
import time

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding

import shardkit as sk
from experiments.bench.timing import RESULTS, gpt_batch, save_json, time_steps
from models import gpt_cost
from models.gpt import GPT, GPTConfig
from shardkit import costmodel, hlo, tensor3d

CFG = GPTConfig(num_layers=2, d_model=64, num_heads=8, num_kv_heads=8, head_dim=8, mlp_dim=128, vocab_size=128,
                max_seq_len=32)  # fmt: skip
BIG = GPTConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                vocab_size=32768, max_seq_len=2048, dtype="bfloat16")  # fmt: skip
BATCH, SEQ = 16, 32
FACTS = [f for f in itertools.product((1, 2, 4, 8), repeat=4) if np.prod(f) == 8]


def spearman(a: list[float], b: list[float]) -> float:
    """Pearson correlation of average ranks (ties share their mean rank)."""

    def ranks(v: list[float]) -> np.ndarray:
        v = np.asarray(v, float)
        order = v.argsort()
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for x in np.unique(v):
            r[v == x] = r[v == x].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def stack_bytes(mesh: jax.sharding.Mesh) -> float:
    layers = [(h1, h2, tr) for _ in range(CFG.num_layers) for _, h1, h2, tr in gpt_cost.fc_layers(CFG)]

    def fwd(xs, ws):
        return [tensor3d.linear(x, w, mesh=mesh, transpose=t[2]) for x, w, t in zip(xs, ws, layers, strict=True)]

    def step(xs, ws, cots):
        ys, vjp = jax.vjp(fwd, xs, ws)
        return ys, vjp(cots)

    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))
    args = [[], [], []]
    for h1, h2, tr in layers:
        xs, ws, ys = tensor3d.specs(mesh, tr, ndim=3)
        for lst, shape, spec in zip(args, ((BATCH, SEQ, h1), (h1, h2), (BATCH, SEQ, h2)), (xs, ws, ys), strict=True):
            lst.append(sds(shape, spec))
    compiled = jax.jit(step).lower(*args).compile()
    return sum(c.bytes_sent for c in hlo.collectives(compiled, mesh))


def run(grid: tuple[int, int, int, int], steps: int) -> dict:
    gx, gy, gz, gd = grid
    spec = f"data={gd},depth={gz},row={gy},col={gx}"
    mesh = sk.make_mesh(spec)
    predicted = gpt_cost.strategy_comms("tp3d", CFG, dict(mesh.shape), BATCH, SEQ, nbytes=4, backend="cpu")
    pred_gspmd = gpt_cost.strategy_comms("tp3d", CFG, dict(mesh.shape), BATCH, SEQ, 4, "cpu", gspmd=True)
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, "tp3d")
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, "tp3d")
    state = step.init_state()
    batch = gpt_batch(CFG.vocab_size, BATCH, SEQ, step.batch_sharding)
    compiled = step.lower(state, batch).compile()
    colls = hlo.collectives(compiled, mesh)
    timing, state, metrics = time_steps(compiled, state, batch, steps)
    by = lambda rows: {f"{c.kind} {c.axis}": c.bytes for c in rows}
    return {
        "grid": {"G_x": gx, "G_y": gy, "G_z": gz, "G_d": gd},
        "mesh": spec,
        "stack_predicted": sum(c.bytes for c in predicted),
        "stack_hlo": stack_bytes(mesh),
        "gpt_predicted": sum(c.bytes for c in pred_gspmd),
        "gpt_hlo": sum(c.bytes_sent for c in colls),
        "gpt_predicted_by": by(pred_gspmd),
        "gpt_hlo_by": {f"{k} {','.join(a)}": v["bytes_sent"] for (k, a), v in hlo.summarize(colls).items()},
        "step_s": timing.median,
        "loss": float(metrics["loss"]),
    }


def scatter(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for key, label in (("stack", "tensor3d layer stack (shard_map)"), ("gpt", "GPT train step (tp3d rules)")):
        ax.scatter([r[f"{key}_predicted"] / 1024 for r in rows], [r[f"{key}_hlo"] / 1024 for r in rows], label=label)
    lim = [min(r["stack_hlo"] for r in rows) / 1024 / 1.5, max(r["gpt_hlo"] for r in rows) / 1024 * 1.5]
    ax.plot(lim, lim, "k--", lw=0.8, label="prediction = compilation")
    ax.set(xscale="log", yscale="log", xlabel="predicted KiB sent per device per step", ylabel="HLO-counted KiB",
           title="20 factorisations of 8 CPU devices (G_x, G_y, G_z, G_d)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=f"{RESULTS}/bench_4d.json")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    t0, rows = time.perf_counter(), []
    for grid in FACTS:
        rows.append(run(grid, args.steps))
        r = rows[-1]
        print(f"  {r['mesh']:<30} stack {r['stack_hlo'] / r['stack_predicted']:.3f}  gpt "
              f"{r['gpt_hlo'] / r['gpt_predicted']:.3f}  step {r['step_s'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    rho = spearman([r["gpt_predicted"] for r in rows], [r["step_s"] for r in rows])
    rho_hlo = spearman([r["gpt_hlo"] for r in rows], [r["step_s"] for r in rows])
    head = f"{'mesh':<30} {'stack pred KiB':>14} {'hlo':>8} {'gpt pred KiB':>12} {'hlo':>8} {'ratio':>6} {'step ms':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mesh']:<30} {r['stack_predicted'] / 1024:>14.1f} {r['stack_hlo'] / 1024:>8.1f} "
                     f"{r['gpt_predicted'] / 1024:>12.1f} {r['gpt_hlo'] / 1024:>8.1f} "
                     f"{r['gpt_hlo'] / r['gpt_predicted']:>6.3f} {r['step_s'] * 1e3:>8.1f}")  # fmt: skip
    print("\n".join(lines))
    print(f"Spearman(predicted bytes, step time) = {rho:.3f}; Spearman(HLO bytes, step time) = {rho_hlo:.3f}")
    picks = {}
    for n in (64, 1024):
        plans = costmodel.plan(BIG, n, "perlmutter", global_batch=max(64, n // 4), seq_len=2048)[:3]
        picks[n] = [
            {"strategy": p.strategy, "mesh": p.mesh, "comm_ms": p.comm_time_s * 1e3, "GiB_sent": p.comm_bytes / 2**30}
            | {"mem_GiB": p.memory["total"] / 2**30}
            for p in plans
        ]
        print(f"top 3 plans, {BIG.num_params() / 1e9:.2f}B GPT, {n} Perlmutter GPUs, batch {max(64, n // 4)} x 2048:")
        print(costmodel.format_plans(plans))
    summary = {"spearman_pred_bytes_vs_step_time": rho, "spearman_hlo_bytes_vs_step_time": rho_hlo,
               "planner_top3_perlmutter": picks, "model": str(CFG), "batch": BATCH, "seq": SEQ,
               "total_s": time.perf_counter() - t0, "loadavg": os.getloadavg(), "rows": rows}  # fmt: skip
    out = save_json(summary, args.out)
    scatter(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}; {summary['total_s']:.0f} s in all")


if __name__ == "__main__":
    main()
