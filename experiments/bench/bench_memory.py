"""What each remat policy trades: compiled temporary memory, recomputed FLOPs and step time, relative to `none`.

    python -m experiments.bench.bench_memory [--reps 2] [--models gpt_small,cosmoflow_tiny]
        [--out experiments/bench/results/bench_memory.json]
    python -m experiments.bench.bench_memory --models gpt_small --gpt-seq 512 --reps 0 \
        --out experiments/bench/results/bench_memory_seq512.json        # compiled figures only, no steps run

On 8 CPU devices, for each model and each remat policy (docs/memory.md: none, full, dots, dots_no_batch, and
`names:` of the model's tags) the train step (AdamW) is compiled and then run: per device, the compiled temporary
memory (`memory_analysis().temp_size_in_bytes`), the matmul / convolution FLOPs with loop bodies counted per trip
and the recomputed part of them against `none` (`shardkit.explain.remat_figures`), and the
median of `reps` step times after one warm-up step.

- gpt_small (experiments/configs/gpt_small.py: 12 layers, width 768, fp32 here) at batch 8 x seq 128, fsdp on
  data=2,fsdp=4: the policies apply to its scanned stack of 12 layers.
- cosmoflow_tiny (experiments/configs/cosmoflow_tiny.py: 5 conv3d blocks, 32^3, BatchNorm) at batch 16,
  spatial_dp on data=2,space=2,space_h=2: its blocks differ in shape (no stack); each runs under the policy through
  `sk.layers.checkpoint_module`.

Also writes a PNG next to the JSON (three panels: memory, FLOPs, time, each as a ratio to `none`).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import shardkit as sk
from experiments.bench.bench_mfu import VOCAB, model_configs
from experiments.bench.timing import RESULTS, compile_timed, gpt_batch, save_json, time_steps
from experiments.configs import cosmoflow_tiny
from models.cosmoflow import CosmoFlow, CosmoFlowConfig
from models.gpt import GPT
from shardkit.remat_figures import figures

GPT_BATCH, GPT_SEQ = 8, 64
POLICIES = sk.layers.REMAT_POLICIES
NAMES = {"gpt_small": "names:attn_out", "cosmoflow_tiny": "names:conv0,conv1"}  # each model's tags (docs/memory.md)


def gpt_small(batch: int = GPT_BATCH, seq: int = GPT_SEQ) -> tuple[Callable[[Any], Any], str, str, dict[str, Any]]:
    cfg = dataclasses.replace(model_configs()["gpt_small"][0], max_seq_len=seq)
    return (lambda rngs: GPT(cfg, rngs=rngs)), "data=2,fsdp=4", "fsdp", gpt_batch(VOCAB, batch, seq)


def cosmoflow(**_: int) -> tuple[Callable[[Any], Any], str, str, dict[str, Any]]:
    config = cosmoflow_tiny.get_config()
    cfg = CosmoFlowConfig(size=config.data.size, **config.model.to_dict())
    rng = np.random.default_rng(0)
    batch = {"volume": rng.normal(size=(config.batch_size, cfg.size, cfg.size, cfg.size, 1)).astype(np.float32),
             "target": rng.uniform(-1, 1, (config.batch_size, cfg.num_outputs)).astype(np.float32)}  # fmt: skip
    return (lambda rngs: CosmoFlow(cfg, rngs=rngs)), config.mesh, config.strategy, batch


MODELS = {"gpt_small": gpt_small, "cosmoflow_tiny": cosmoflow}


def measure(name: str, reps: int, **shape: int) -> list[dict[str, Any]]:
    """One row per policy; `reps=0`: compiled figures only (no step is run)."""
    make, spec, strategy_name, host_batch = MODELS[name](**shape)
    mesh = sk.make_mesh(spec)
    model = sk.sharded_init(make, mesh, strategy_name, seed=0)  # the policies share the parameters' layout
    rows, base = [], None
    for policy in (*POLICIES, NAMES[name]):
        strategy = sk.strategy(strategy_name).replace(kernels={"remat": policy})
        step = sk.make_train_step(model, optax.adamw(1e-4), mesh, strategy, donate=False)
        batch = jax.device_put(host_batch, step.batch_shardings(host_batch))
        state = step.init_state()
        compiled = compile_timed(step, state, batch)
        fig = figures(compiled.program, policy, None if base is None else base.matmul_flops)
        base = base or fig
        row = dict(dataclasses.asdict(fig), compile_s=compiled.compile_s, step_s=None, loss=None)  # reps=0: not run
        if reps:
            timing, _, metrics = time_steps(compiled.program, state, batch, reps)
            row.update(step_s=timing.median, step_spread_s=timing.spread, loss=float(metrics["loss"]))
        rows.append(row)
        b = rows[0]
        print(f"{name:<15} {policy:<18} temp {fig.temp_bytes / 2**20:8.1f} MiB "
              f"({fig.temp_bytes / b['temp_bytes']:.2f}x)"
              f"  matmul {fig.matmul_flops / 1e9:7.2f} GF ({fig.matmul_flops / b['matmul_flops']:.2f}x, recomputed "
              f"{fig.recomputed_flops / 1e9:.2f} GF)"
              + (f"  step {row['step_s']:6.3f} s ({row['step_s'] / b['step_s']:.2f}x)  loss {row['loss']:.6f}"
                 if reps else ""), flush=True)  # fmt: skip
    return rows


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("temp_bytes", "compiled temp memory / none"), ("matmul_flops", "matmul FLOPs / none")]
    if result["reps"]:
        panels.append(("step_s", "step time / none (busy host)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.7 * len(panels), 4))
    models = list(result["models"])
    w = 0.8 / max(len(models), 1)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for k, name in enumerate(models):
            rows = result["models"][name]
            x = np.arange(len(rows))
            ax.bar(x + (k - (len(models) - 1) / 2) * w, [r[key] / rows[0][key] for r in rows], w, label=name)
            ax.set_xticks(x, [r["policy"].partition(":")[0] for r in rows], fontsize=7)  # names: the model's tags
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"remat policies on 8 CPU devices (jax {result['jax']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--models", default="gpt_small,cosmoflow_tiny")
    parser.add_argument("--gpt-batch", type=int, default=GPT_BATCH)
    parser.add_argument("--gpt-seq", type=int, default=GPT_SEQ)
    parser.add_argument("--out", default=f"{RESULTS}/bench_memory.json")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"jax": jax.__version__, "gpt_batch": [args.gpt_batch, args.gpt_seq], "reps": args.reps,
                              "models": {}}  # fmt: skip
    for name in args.models.split(","):
        shape = {"batch": args.gpt_batch, "seq": args.gpt_seq} if name == "gpt_small" else {}
        result["models"][name] = measure(name, args.reps, **shape)
    save_json(result, args.out)
    plot(result, str(args.out).removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
