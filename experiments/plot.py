"""Loss and throughput curves of one or more runs, overlaid, to compare strategies at a glance.

    python -m experiments.plot runs/gpt_tiny-fsdp runs/gpt_tiny-tp [--out compare.png] [--smooth 20]
    python -m experiments.plot runs/resnet_digits-dp runs/resnet_digits-fsdp

Left: training loss (thin; a moving average over `--smooth` steps drawn on top) and validation loss (dots joined
by a dashed line) against the step, with the baseline to beat: the corpus's unigram entropy (language models) or
the chance loss ln(classes) (classifiers). Middle, when a run logged accuracy (image classification): training
accuracy (moving average) and validation accuracy (dots). Right: throughput per step (moving average; tokens/s, or
examples/s for runs that count examples), with each run's median and MFU in the legend. Reads `metrics.jsonl` and
`config.json` from each run directory; writes a PNG (default `<first run>/plot.png`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np


def read_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(metrics records sorted by step, the last record of each step winning; config dict or {})."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory of experiments.train?")
    by_step = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # blank, or cut short by a killed run
            continue
        by_step[rec["step"]] = rec
    cfg_path = run_dir / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return [by_step[k] for k in sorted(by_step)], config


def moving_average(x: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over the last `n` points (fewer at the start)."""
    if n <= 1 or len(x) == 0:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - n, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def _rate_key(recs: list[dict[str, Any]]) -> str:
    """The throughput a run logged: tokens_per_s (language models) or examples_per_s (classifiers)."""
    return next((k for k in ("tokens_per_s", "examples_per_s") if recs and k in recs[0]), "tokens_per_s")


def plot(run_dirs: Sequence[str | Path], out: str | Path | None = None, smooth: int = 10) -> Path:
    """Draws the runs into one PNG and returns its path."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = [read_run(d) for d in run_dirs]
    with_acc = any(r.get("val_accuracy") is not None or "accuracy" in r for recs, _ in runs for r in recs)
    fig, axes = plt.subplots(1, 3 if with_acc else 2, figsize=(19 if with_acc else 13, 4.8))
    ax_loss, ax_tps, ax_acc = axes[0], axes[-1], axes[1] if with_acc else None
    baselines: dict[str, float] = {}
    units = set()
    for i, (run_dir, (recs, config)) in enumerate(zip(run_dirs, runs, strict=True)):
        color = f"C{i % 10}"
        info = config.get("info", {})
        where = info.get("where", "").replace("strategy ", "").replace(" on mesh ", " @ ")
        label = f"{Path(run_dir).name} ({where})" if where else Path(run_dir).name
        if "unigram_entropy" in info:
            baselines["unigram entropy"] = info["unigram_entropy"]
        if "chance_loss" in info:
            baselines["chance ln(classes)"] = info["chance_loss"]
        steps = np.array([r["step"] for r in recs])
        loss = np.array([r["loss"] for r in recs])
        ax_loss.plot(steps, loss, color=color, alpha=0.25, lw=0.8)
        ax_loss.plot(steps, moving_average(loss, smooth), color=color, lw=1.6, label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if val:
            vs, vl = zip(*val, strict=True)
            ax_loss.plot(vs, vl, "o--", color=color, ms=4, lw=1, label=f"{label} val ({vl[-1]:.3f})")
        if ax_acc is not None:
            acc = [(r["step"], r["accuracy"]) for r in recs if r.get("accuracy") is not None]
            if acc:
                a_s, a_v = (np.array(x) for x in zip(*acc, strict=True))
                ax_acc.plot(a_s, moving_average(a_v, smooth), color=color, lw=1.2, alpha=0.6, label=f"{label} train")
            val_acc = [(r["step"], r["val_accuracy"]) for r in recs if r.get("val_accuracy") is not None]
            if val_acc:
                vs, va = zip(*val_acc, strict=True)
                ax_acc.plot(vs, va, "o--", color=color, ms=4, lw=1, label=f"{label} val ({va[-1]:.2%})")
        key = _rate_key(recs)
        units.add(key.removesuffix("_per_s"))
        tps = np.array([r[key] for r in recs])
        mfus = [r["mfu"] for r in recs[1:] if r.get("mfu") is not None]
        med = statistics.median(tps[1:]) if len(tps) > 1 else (tps[0] if len(tps) else 0.0)
        mfu = f", MFU {statistics.median(mfus):.1%}" if mfus else ""
        short = "tok/s" if key == "tokens_per_s" else "ex/s"
        ax_tps.plot(steps, moving_average(tps, smooth), color=color, lw=1.4, label=f"{label}: {med:,.0f} {short}{mfu}")
    for (name, value), ls in zip(baselines.items(), (":", "-."), strict=False):
        ax_loss.axhline(value, color="gray", ls=ls, lw=1, label=f"{name} {value:.3f}")
    ylabel = "cross-entropy (nats/token)" if "unigram entropy" in baselines else "cross-entropy (nats)"
    ax_loss.set(xlabel="step", ylabel=ylabel, title="loss")
    if any(key in baselines for key in ("chance ln(classes)",)) and "unigram entropy" not in baselines:
        ax_loss.set_yscale("log")  # a classifier's loss falls by orders of magnitude
    ax_tps.set(xlabel="step", ylabel=" or ".join(f"{u} / s" for u in sorted(units)),
               title=f"throughput (moving average over {smooth} steps)")  # fmt: skip
    ax_tps.set_ylim(bottom=0)
    if ax_acc is not None:
        ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy (train: moving average; val: eval mode)")
        ax_acc.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dirs[0]) / "plot.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: `python -m experiments.plot RUN_DIR [RUN_DIR ...] [--out PNG] [--smooth N]`."""
    parser = argparse.ArgumentParser(prog="python -m experiments.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories (runs/<name>) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default: <first run>/plot.png)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window in steps")
    args = parser.parse_args(argv)
    try:
        path = plot(args.runs, args.out, args.smooth)
    except FileNotFoundError as e:
        print(f"error: {e}")
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
