"""Loss and throughput curves of one or more runs, overlaid, to compare strategies at a glance.

    python -m experiments.plot runs/gpt_tiny-fsdp runs/gpt_tiny-tp [--out compare.png] [--smooth 20]

Left: training loss (thin; a moving average over `--smooth` steps drawn on top) and validation loss (dots joined
by a dashed line) against the step, with the corpus's unigram entropy as the baseline to beat. Right: tokens/s per
step (moving average), with each run's median tokens/s and MFU in the legend. Reads `metrics.jsonl` and
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


def plot(run_dirs: Sequence[str | Path], out: str | Path | None = None, smooth: int = 10) -> Path:
    """Draws the runs into one PNG and returns its path."""
    if not run_dirs:
        raise ValueError("give at least one run directory")
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(13, 4.8))
    baseline = None
    for i, run_dir in enumerate(run_dirs):
        recs, config = read_run(run_dir)
        color = f"C{i % 10}"
        info = config.get("info", {})
        where = info.get("where", "").replace("strategy ", "").replace(" on mesh ", " @ ")
        label = f"{Path(run_dir).name} ({where})" if where else Path(run_dir).name
        baseline = info.get("unigram_entropy", baseline)
        steps = np.array([r["step"] for r in recs])
        loss = np.array([r["loss"] for r in recs])
        ax_loss.plot(steps, loss, color=color, alpha=0.25, lw=0.8)
        ax_loss.plot(steps, moving_average(loss, smooth), color=color, lw=1.6, label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if val:
            vs, vl = zip(*val, strict=True)
            ax_loss.plot(vs, vl, "o--", color=color, ms=4, lw=1, label=f"{label} val ({vl[-1]:.3f})")
        tps = np.array([r["tokens_per_s"] for r in recs])
        mfus = [r["mfu"] for r in recs[1:] if r.get("mfu") is not None]
        med = statistics.median(tps[1:]) if len(tps) > 1 else (tps[0] if len(tps) else 0.0)
        mfu = f", MFU {statistics.median(mfus):.1%}" if mfus else ""
        ax_tps.plot(steps, moving_average(tps, smooth), color=color, lw=1.4, label=f"{label}: {med:,.0f} tok/s{mfu}")
    if baseline is not None:
        ax_loss.axhline(baseline, color="gray", ls=":", lw=1, label=f"unigram entropy {baseline:.3f}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    ax_tps.set(xlabel="step", ylabel="tokens / s", title=f"throughput (moving average over {smooth} steps)")
    ax_tps.set_ylim(bottom=0)
    for ax in (ax_loss, ax_tps):
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
