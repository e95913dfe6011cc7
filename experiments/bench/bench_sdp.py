"""Subnetwork Data Parallelism (Singh et al., arXiv 2507.09029; shardkit/parallel/sdp/) against dp and fsdp.

    python -m experiments.bench.bench_sdp [--steps N] [--resnet_steps N] [--flop_cap 4] [--out ...json] [--quick]

One process, 8 CPU devices. Two models, each trained from the same initialisation (seed 0) on the same batches with
the same optimizer (clip_by_global_norm(1.0) -> adamw(lr), fixed lr):
- GPT (8 layers, d_model 64, ~0.5M parameters) on the stdlib byte corpus (experiments/data/text.py), global batch
  32 x 64 tokens; validation loss on fixed held-out windows (`text.val_batches`).
- ResNet (widths 16, 32; 9 + 9 blocks: each stage's 8 identity blocks stacked under `layers`) on scikit-learn's
  digits (experiments/data/images.py), global batch 64; validation loss and accuracy on the 320 held-out images.
Runs: dp (data=8), fsdp (`sk.strategy("fsdp").default_mesh(8)` = data=2,fsdp=4), and SDP on data=8: block-level
{forward, backward} masking x coverage {0.25, 0.5}, plus neuron-level forward masking at 0.5 for the GPT (its
`mlp` units; the ResNet has no `mlp` dimension, so neuron-level SDP does not apply: the step's error is printed).

Budgets. (a) equal steps N. (b) equal FLOPs, forward masking only: a worker runs k = c x L of the L blocks (or c of
each MLP's units), so ~c of DP's block FLOPs per step; it gets N / c steps (capped at --flop_cap x N). The
embedding / head / stem / first blocks are not split, so an equal-FLOP run does somewhat more than DP's FLOPs.
Batches are a pure function of the step index and the lr is constant, so the first N steps of an N / c run are the
N-step run: one training per variant, evaluated at N and at N / c.

Measured per run: per-device bytes of params + optimizer state (`addressable_shards[0]`), `memory_analysis()`
argument + temp bytes of the compiled step, collective bytes sent per device per step from the compiled HLO
(`shardkit.hlo.collectives`; for SDP also `step.bytes_per_step()`'s formula, gradients + BatchNorm statistics +
metrics), median step time after --warmup steps, validation loss (+ accuracy) every
--eval_every steps, and the training-loss curve. The table gives ratios to dp. Validation is of the full network
("val": `step.evaluate` of a step built with eval="full", the model one would deploy) and, for forward masking,
also SDP's default evaluation ("sub": each worker's subnetwork on its 1/8 of the held-out set, averaged: what was
trained). SDP's training loss, likewise, is the mean of the subnetworks' losses. A ResNet block's BatchNorm
statistics are estimated on subnetwork activations, which the full network does not reproduce (sdp.py docstring).
The 8 devices share this host's cores, so step times measure total work (which forward masking cuts), not a real
cluster's critical path; another busy process on the host skews them.

Defaults (N = 150 GPT, 120 ResNet steps): ~6-7 minutes on 2 cores, ~1.5 more while the persistent compile cache
(--jax_cache_dir, as experiments/train.py) is cold. Writes experiments/bench/results/bench_sdp.json (config and all raw
numbers) and bench_sdp.png (loss curves). --quick: 3 steps per budget, a 1-2 minute smoke test of every code path
(mostly compiling; its numbers mean nothing), written to bench_sdp_quick.{json,png}.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, Timing, save_json, timed
from experiments.data import images, text
from models.gpt import GPT, GPTConfig
from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss
from shardkit import hlo

GPT_CFG = GPTConfig(num_layers=8, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=256,
                    vocab_size=text.PADDED_VOCAB, max_seq_len=64)  # fmt: skip
RESNET_CFG = ResNetConfig(widths=(16, 32), blocks=(9, 9), num_classes=10, in_channels=1, dropout=0.0)
SEQ, GPT_BATCH, RESNET_BATCH, GPT_VAL_WINDOWS = 64, 32, 64, 256
#: (run name, sk.sdp.make_strategy kwargs; None: the named strategy) in table order.
VARIANTS: list[tuple[str, dict | None]] = [("dp", None), ("fsdp", None)] + [
    (f"sdp-block-{m[:3]}-{c:g}", dict(granularity="block", masking=m, coverage=c))
    for m in ("forward", "backward")
    for c in (0.25, 0.5)
] + [("sdp-neuron-fwd-0.5", dict(granularity="neuron", masking="forward", coverage=0.5))]  # fmt: skip


@dataclasses.dataclass
class Task:
    name: str
    build: Callable[[Any], Any]  # rngs -> model
    batch: Callable[[int], dict[str, np.ndarray]]  # step -> host batch
    val: dict[str, np.ndarray]  # the whole held-out set, evaluated as one batch
    lr: float
    steps: int
    loss_fn: Any = None
    batch_axes: Any = None


def tasks(args: argparse.Namespace) -> list[Task]:
    ds = text.load_dataset()
    assert ds.padded_vocab_size <= GPT_CFG.vocab_size, ds
    it = text.BatchIterator(ds, GPT_BATCH, SEQ)
    vals = text.val_batches(ds, args.val_windows // GPT_BATCH, GPT_BATCH, SEQ)
    gpt_val = {k: np.concatenate([v[k] for v in vals]) for k in vals[0]}
    digits = images.load_digits()
    return [
        Task("gpt", lambda rngs: GPT(GPT_CFG, rngs=rngs), it.batch, gpt_val, args.lr, args.steps),
        Task("resnet", lambda rngs: ResNet(RESNET_CFG, rngs=rngs), lambda i: images.host_batch(digits, i, RESNET_BATCH),
             images.val_batches(digits, 1)[0], args.resnet_lr, args.resnet_steps, classification_loss, BATCH_AXES),
    ]  # fmt: skip


def tree_bytes(tree: Any) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def build(task: Task, name: str, kw: dict | None) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(mesh, step, state, evaluators): "val" evaluates the full network; "sub", under forward masking, the
    subnetworks (SDP's default `eval`), by a second step on the same state layout built with eval="full"."""
    strategy = sk.sdp.make_strategy(**kw) if kw else name
    mesh = sk.make_mesh({"data": 8} if name != "fsdp" else sk.strategy("fsdp").default_mesh(8))
    model = sk.sharded_init(task.build, mesh, strategy, seed=0)
    tx = optax.chain(sk.clip_by_global_norm(1.0), optax.adamw(task.lr))
    make = lambda s: sk.make_train_step(model, tx, mesh, s, loss_fn=task.loss_fn, batch_axes=task.batch_axes)
    step = make(strategy)
    evals = {"val": step}
    if kw and kw["masking"] == "forward":
        evals = {"val": make(sk.sdp.make_strategy(**kw, eval="full")), "sub": step}
    return mesh, step, step.init_state(), evals


def run(task: Task, name: str, kw: dict | None, args: argparse.Namespace) -> dict[str, Any]:
    """Trains one variant to its longest budget; evaluates every --eval_every steps and at each budget's end."""
    t0 = time.perf_counter()
    mesh, step, state, evals = build(task, name, kw)
    coverage = kw["coverage"] if kw else 1.0
    budgets = {"steps": task.steps}
    if kw and kw["masking"] == "forward":
        budgets["flops"] = min(round(task.steps / coverage), int(args.flop_cap * task.steps))
    total = max(budgets.values())
    state_bytes = tree_bytes(state.params) + tree_bytes(state.opt_state)
    place = lambda b: jax.device_put(b, step.batch_shardings(b))
    compiled = step.lower(state, place(task.batch(0))).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    colls = hlo.collectives(compiled, mesh)
    formula = step.bytes_per_step() if kw else None

    def evaluate() -> dict[str, float]:
        out = {}
        for tag, s in evals.items():
            loss, metrics = s.evaluate(state, task.val)
            out |= {f"{tag}_loss": float(loss), **{f"{tag}_{k}": float(v) for k, v in metrics.items()}}
        return out

    times, train_curve, val_curve, at = [], [], [(0, evaluate())], {}
    for i in range(1, total + 1):
        (state, metrics), seconds = timed(compiled, state, place(task.batch(i - 1)))  # the batch placed first
        times.append(seconds)
        train_curve.append(float(metrics["loss"]))
        if i % args.eval_every == 0 or i in budgets.values():
            val_curve.append((i, evaluate()))
            at.update({b: val_curve[-1][1] for b, n in budgets.items() if n == i})
    timing = Timing(times[min(args.warmup, len(times) - 1) :])
    out = dict(model=task.name, run=name, strategy=kw or name, mesh=dict(mesh.shape), coverage=coverage,
               block_flop_fraction=coverage if kw and kw["masking"] == "forward" else 1.0, budgets=budgets,
               at_budget=at, compile_s=compile_s, wall_s=time.perf_counter() - t0,
               state_bytes_per_device=state_bytes, param_bytes_per_device=tree_bytes(state.params),
               argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
               output_bytes=mem.output_size_in_bytes,
               bytes_sent_per_device=sum(c.bytes_sent for c in colls),
               collectives=[{**dataclasses.asdict(c), "axes": list(c.axes)} for c in colls],
               sdp_formula=formula, step_s=timing.median, step_min_s=timing.best, step_times_s=times,
               train_loss=train_curve, val_curve=[{"step": s, **v} for s, v in val_curve])  # fmt: skip
    if formula:
        out["sdp_formula_bytes"] = formula["permute_bytes"] + formula["ring_all_reduce_bytes"]
    last = val_curve[-1][1]
    sub = f"  sub {last['sub_loss']:.3f}" if "sub_loss" in last else ""
    print(f"  {task.name:<6} {name:<20} compile {compile_s:5.1f}s  {total:>4} steps  {out['step_s'] * 1e3:6.1f} "
          f"ms/step  val {last['val_loss']:.3f}{sub}  ({out['wall_s']:.0f}s)", flush=True)  # fmt: skip
    return out


def rows_of(runs: list[dict]) -> list[dict]:
    """One table row per (run, budget), with the ratios to the model's dp run."""
    rows = []
    for r in runs:
        dp = next(d for d in runs if d["model"] == r["model"] and d["run"] == "dp")
        ref = dp["at_budget"]["steps"]
        for budget, steps in r["budgets"].items():
            v = r["at_budget"][budget]
            rows.append(dict(model=r["model"], run=r["run"] + ("  =FLOPs" if budget == "flops" else ""), steps=steps,
                             state=r["state_bytes_per_device"] / dp["state_bytes_per_device"],
                             mem=(r["argument_bytes"] + r["temp_bytes"]) / (dp["argument_bytes"] + dp["temp_bytes"]),
                             bytes=r["bytes_sent_per_device"] / dp["bytes_sent_per_device"],
                             time=r["step_s"] / dp["step_s"], val_loss=v["val_loss"],
                             delta=v["val_loss"] - ref["val_loss"], acc=v.get("val_accuracy"),
                             sub=v.get("sub_loss"), sub_acc=v.get("sub_accuracy")))  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'model':<7}{'run':<27}{'steps':>6}{'state/DP':>9}{'mem/DP':>8}{'bytes/DP':>9}{'time/DP':>8}"
            f"{'val loss':>9}{'- DP':>9}{'acc':>7}{'sub loss':>9}{'sub acc':>8}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        num = lambda x, w: f"{x:{w}.3f}" if x is not None else " " * w
        acc = num(r["acc"], 7) + num(r["sub"], 9) + num(r["sub_acc"], 8)
        lines.append(f"{r['model']:<7}{r['run']:<27}{r['steps']:>6}{r['state']:>9.3f}{r['mem']:>8.3f}"
                     f"{r['bytes']:>9.3f}{r['time']:>8.2f}{r['val_loss']:>9.4f}{r['delta']:>+9.4f}{acc}")  # fmt: skip
    return "\n".join(lines)


def plot(runs: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(len(models), 3, figsize=(17, 4.6 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        for r in (r for r in runs if r["model"] == model):
            loss = np.asarray(r["train_loss"])
            ema = [loss[0]]
            for x in loss[1:]:
                ema.append(0.9 * ema[-1] + 0.1 * x)
            steps = [v["step"] for v in r["val_curve"]]
            val = [v["val_loss"] for v in r["val_curve"]]
            row[0].plot(np.arange(1, len(loss) + 1), ema, label=r["run"], lw=1)
            flops = np.asarray(steps) * r["block_flop_fraction"]
            (line,) = row[1].plot(steps, val, label=r["run"], marker=".", lw=1)
            row[2].plot(flops, val, label=r["run"], marker=".", lw=1, color=line.get_color())
            if "sub_loss" in r["val_curve"][0]:
                sub = [v["sub_loss"] for v in r["val_curve"]]
                row[1].plot(steps, sub, ls="--", lw=0.8, color=line.get_color(), label=f"{r['run']} (subnetworks)")
                row[2].plot(flops, sub, ls="--", lw=0.8, color=line.get_color())
        titles = ("training loss (EMA 0.9; SDP: subnetworks)", "validation loss (full; dashed: subnetworks)",
                  "validation loss vs block FLOPs")  # fmt: skip
        for ax, title, x in zip(row, titles, ("step", "step", "DP-step equivalents (steps x c)"), strict=True):
            ax.set(title=f"{model}: {title}", xlabel=x, ylabel="loss (nats)", yscale="log")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(json_path: str, png_path: str) -> None:
    """The PNG again from a results JSON (no training)."""
    plot(json.loads(pathlib.Path(json_path).read_text())["runs"], pathlib.Path(png_path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=f"{RESULTS}/bench_sdp.json")
    parser.add_argument("--steps", type=int, default=150, help="equal-steps budget N of the GPT")
    parser.add_argument("--resnet_steps", type=int, default=120, help="equal-steps budget N of the ResNet")
    parser.add_argument("--flop_cap", type=float, default=4.0, help="equal-FLOP runs: at most this x N steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="GPT adamw lr")
    parser.add_argument("--resnet_lr", type=float, default=3e-3, help="ResNet adamw lr")
    parser.add_argument("--eval_every", type=int, default=15, help="validation-curve interval (steps)")
    parser.add_argument("--val_windows", type=int, default=GPT_VAL_WINDOWS, help="GPT held-out windows")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median step time")
    parser.add_argument("--models", default="gpt,resnet")
    parser.add_argument("--jax_cache_dir", default="~/.cache/shardkit/jax", help="persistent compile cache ('': off)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 steps per budget, small eval set")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = args.resnet_steps = args.eval_every = 3
        args.val_windows, args.warmup = GPT_BATCH, 1
        args.out = args.out.replace(".json", "_quick.json")
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()}: set XLA_FLAGS before jax is imported")
    if args.jax_cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(args.jax_cache_dir).expanduser()))
    t0, load0 = time.perf_counter(), os.getloadavg()
    runs, skipped = [], {}
    for task in (t for t in tasks(args) if t.name in args.models.split(",")):
        for name, kw in VARIANTS:
            try:
                runs.append(run(task, name, kw, args))
            except sk.ShardkitError as e:  # the ResNet has no `mlp` units for neuron-level SDP
                skipped[f"{task.name} {name}"] = str(e)
                print(f"  {task.name:<6} {name:<20} not applicable (see below)", flush=True)
    total_s, load1 = time.perf_counter() - t0, os.getloadavg()
    rows = rows_of(runs)
    print(f"\n{jax.device_count()} {jax.default_backend()} devices on {os.cpu_count()} cores, jax {jax.__version__}, "
          f"load {load0[0]:.2f} -> {load1[0]:.2f}, {total_s:.0f}s total; GPT {GPT_CFG.num_params() / 1e6:.2f}M params "
          f"N={args.steps}, ResNet {RESNET_CFG.num_params() / 1e6:.2f}M params N={args.resnet_steps}; equal-FLOP "
          f"runs: N / c steps, capped at {args.flop_cap:g} N\n")  # fmt: skip
    print(table(rows))
    print("\nstate = params + adamw state per device; mem = memory_analysis() argument + temp; bytes = collective "
          "bytes sent per device per step (HLO);\ntime = median step time (8 CPU devices share the cores: total "
          "work, not a cluster's critical path); val = full network, '- DP' = minus dp's val loss at N steps; sub = "
          "SDP's subnetwork evaluation.")  # fmt: skip
    for key, why in skipped.items():
        print(f"{key}: not applicable ({why.split(';')[0]})")
    for r in (r for r in runs if r["sdp_formula"]):
        print(f"  {r['model']:<6} {r['run']:<20} HLO {r['bytes_sent_per_device'] / 1024:9.1f} KiB, bytes_per_step() "
              f"{r['sdp_formula_bytes'] / 1024:9.1f} KiB ({r['sdp_formula']['permutes']} permutes)")  # fmt: skip
    config = dict(gpt=vars(GPT_CFG), resnet=dataclasses.asdict(RESNET_CFG), seq=SEQ, gpt_batch=GPT_BATCH,
                  resnet_batch=RESNET_BATCH, optimizer="chain(clip_by_global_norm(1.0), adamw(lr)), fp32, seed 0",
                  args=vars(args))  # fmt: skip
    report = dict(config=config, jax=jax.__version__, backend=jax.default_backend(), devices=jax.device_count(),
                  cpu_count=os.cpu_count(), load_average_start_end=[load0[0], load1[0]], total_s=total_s,
                  table=rows, not_applicable=skipped, runs=runs)  # fmt: skip
    out = save_json(report, args.out)
    plot(runs, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
