"""A training run's per-step records: metrics.jsonl (process 0), the progress bar or lines, and the NaN check."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from experiments.dashboard import Board
from shardkit.checkpoint import NonFiniteError


def step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class Log:
    """Per-step records to metrics.jsonl (process 0; lines past `start` left by a killed run are dropped), progress
    bar or lines, and the NaN check. Throughput is counted on the host: the task's units (tokens, examples) per step."""

    def __init__(self, config: ml_collections.ConfigDict, run: Any, start: int, peak: float, say: Callable, bar: bool,
                 t_start: float) -> None:  # fmt: skip
        self.config, self.say, self.records, self.t_last = config, say, [], time.perf_counter()
        task = run.task
        self.unit, self.short, self.units = task.unit, task.short, task.units_per_step
        self.flops = task.flops_per_unit / (peak * run.mesh.devices.size) if peak else 0.0
        self.lrs = np.asarray(run.schedule(np.arange(config.steps + 1)))
        self.bar = tqdm(total=config.steps, initial=start, unit="step", dynamic_ncols=True) if bar else None
        self.file, self.t_start, self.first_step_s = None, t_start, None
        self.evaluated = False  # the first evaluation compiles its step (the watchdog pauses for it)
        if jax.process_index() == 0:
            path = run.dir / "metrics.jsonl"
            if path.exists():  # a line cut short by a kill fails to parse and is dropped too
                keep = [ln for ln in path.read_text().splitlines() if step_of(ln) <= start]
                path.with_suffix(".tmp").write_text("".join(ln + "\n" for ln in keep))
                os.replace(path.with_suffix(".tmp"), path)
            self.file = path.open("a", buffering=1)
        # the same records as TensorBoard events in <run>/tb (a failing writer warns once, training goes on)
        self.board = Board(run.dir, config.get("tensorboard", True), say) if jax.process_index() == 0 else None

    def record(self, k: int, metrics: dict[str, jax.Array], last_good: str) -> dict[str, Any]:
        """Blocks on step k's metrics; a non-finite loss or gradient norm raises NonFiniteError."""
        m, now = jax.device_get(metrics), time.perf_counter()
        loss, gnorm, dt = float(m.pop("loss")), float(m.pop("grad_norm")), now - self.t_last
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            raise NonFiniteError(
                f"step {k}: loss {loss}, grad_norm {gnorm} is not finite; stopped without saving. The last good "
                f"checkpoint is {last_good}: lower optimizer.lr or raise warmup_steps, then rerun to resume from it"
            )
        if not self.records:  # start-up cost: imports, data, compile (or the cache), init
            self.first_step_s = now - self.t_start
            self.say(f"first step done {self.first_step_s:.1f} s after start")
        self.t_last = now
        rec = dict(step=k, loss=loss, **{key: float(v) for key, v in m.items()}, grad_norm=gnorm)
        rec.update({"lr": float(self.lrs[k - 1]), self.unit: self.units, "step_time": dt})
        rate = self.units / dt
        rec.update({f"{self.unit}_per_s": rate, "mfu": rate * self.flops if self.flops else None})
        used = memory_in_use()
        if used is not None:  # where the backend reports it (GPU, TPU; not CPU)
            rec["memory_bytes"] = used
        self.records.append(rec)
        return rec

    def emit(self, rec: dict[str, Any]) -> None:
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
        if self.board is not None:
            self.board.record(rec)
        text = f"loss {rec['loss']:.3f}" + (f" | acc {rec['accuracy']:.1%}" if "accuracy" in rec else "")
        text += f" | {rec[f'{self.unit}_per_s']:,.0f} {self.short}/s"
        text += f" | MFU {rec['mfu']:.1%}" if rec["mfu"] is not None else ""
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)  # shown by the update's refresh
            self.bar.update(rec["step"] - self.bar.n)
        elif rec["step"] % self.config.log_every == 0 or "val_loss" in rec:
            self.say(f"step {rec['step']:>6}/{self.config.steps} | {text}")
        if "val_loss" in rec:
            self.say(f"step {rec['step']}: {val_text(rec)}")

    def close(self) -> None:
        for f in (self.bar, self.file, self.board):
            if f is not None:
                f.close()


def memory_in_use() -> int | None:
    """The most device memory in use on one of this process's devices, in bytes; None where the backend does not
    report it (`Device.memory_stats()` is None on CPU)."""
    try:
        used = [s.get("bytes_in_use") for s in (d.memory_stats() for d in jax.local_devices()) if s]
    except Exception:  # a backend without the call
        return None
    used = [u for u in used if u is not None]
    return max(used) if used else None


def val_text(rec: dict[str, Any]) -> str:
    acc = f" | val_accuracy {rec['val_accuracy']:.2%}" if rec.get("val_accuracy") is not None else ""
    more = "".join(f" | val_{k} {rec['val_' + k]:.4f}" for k in ("dice", "mae") if rec.get("val_" + k) is not None)
    return f"val_loss {rec['val_loss']:.4f}{acc}{more}"
