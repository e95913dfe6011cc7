"""Goodput: the fraction of a run's wall time spent in productive training steps, summed across its resumes.

The time of one attempt (one `python -m experiments.train`, from its process start to its end) is split into:

- `step`: the training loop's own time (dispatching steps, waiting for their results, logging): productive;
- `compile`: compiling the train step (a first evaluation's compile is counted in `evaluation`);
- `checkpoint`: global and emergency saves, and waiting for the last one to commit;
- `evaluation`: validation batches;
- `data`: building each step's batch on the host (it overlaps the devices' previous step where they are busy);
- `profile`: starting and stopping a trace (`--config.profile`), and reading its top ops;
- `startup`: imports, distributed start, data loading, restoring, before the first step; in an attempt that
  resumes a run it is counted as `restart` instead (time a run without interruptions would not spend), and so
  is its compile;
- `other`: the rest (closing, the summary).

`<run>/goodput.json` holds every attempt's split and their sum; `goodput` = sum of `step` / sum of wall time. It is
written by process 0 at the end of every attempt (a normal end, a stop, an error): an attempt killed outright
(SIGKILL, a lost host) writes nothing, so its time is missing from the sum (what it computed after the last
checkpoint is recomputed, and counted, by the next attempt). This is the accounting MaxText's goodput and
Levanter's metrics do, on the host's clock.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

_STARTED = False  # whether run_start() was asked before in this process


def run_start() -> float:
    """`time.perf_counter()` at this process's start (Python's start-up and imports included, from /proc) for its
    first run; now for a later run in the same process (the in-process API, tests). Now where /proc is missing."""
    global _STARTED
    first, _STARTED = not _STARTED, True
    if first:
        try:
            ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            return time.perf_counter() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            pass
    return time.perf_counter()


BUCKETS = ("step", "compile", "checkpoint", "evaluation", "data", "profile", "startup", "restart", "other")


class Goodput:
    """Timers for one attempt (module docstring). `timed(bucket)` around each non-step part of the loop;
    `loop()` around the loop itself; `write()` at the end."""

    def __init__(self, run_dir: Path, t0: float, resumed: bool = False) -> None:
        self.path = Path(run_dir) / "goodput.json"
        self.t0, self.resumed = t0, resumed
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self._loop_s = 0.0
        self._in_loop = 0.0  # timed parts inside the loop (not `step`)
        self._looping = False

    @contextlib.contextmanager
    def timed(self, bucket: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.seconds[bucket] += dt
            if self._looping:
                self._in_loop += dt

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        t = time.perf_counter()
        self.startup_end = t
        self._looping = True
        try:
            yield
        finally:
            self._looping = False
            self._loop_s += time.perf_counter() - t

    def attempt(self) -> dict[str, float]:
        """This attempt's split so far, in seconds, with its wall time."""
        now = time.perf_counter()
        out = dict(self.seconds)
        out["step"] = max(0.0, self._loop_s - self._in_loop)
        start = getattr(self, "startup_end", now)
        out["startup"] = max(0.0, start - self.t0 - out["compile"])
        if self.resumed:  # what an uninterrupted run would not have spent again
            out["restart"], out["startup"] = out["startup"] + out["compile"], 0.0
            out["compile"] = 0.0
        out["wall"] = now - self.t0
        out["other"] = max(0.0, out["wall"] - sum(out[b] for b in BUCKETS if b != "other"))
        return out

    def write(self, start_step: int, end_step: int) -> dict[str, Any]:
        """Appends this attempt to <run>/goodput.json and returns the file's content (the sum across attempts)."""
        try:
            saved = json.loads(self.path.read_text())
            attempts = list(saved.get("attempts", []))
        except (OSError, ValueError):
            attempts = []
        attempts.append({"steps": [start_step, end_step], **{k: round(v, 3) for k, v in self.attempt().items()}})
        total = {k: round(sum(a.get(k, 0.0) for a in attempts), 3) for k in (*BUCKETS, "wall")}
        out = {"goodput": total["step"] / total["wall"] if total["wall"] else None, "total": total,
               "attempts": attempts}  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, self.path)
        return out


def describe(summary: dict[str, Any]) -> str:
    """One line: the goodput and where the rest went, e.g. `goodput 71% (step 71%, compile 12%, ...)` over attempts."""
    total, wall = summary["total"], summary["total"]["wall"] or 1.0
    parts = ", ".join(f"{b} {total[b] / wall:.0%}" for b in BUCKETS if b != "step" and total[b] / wall >= 0.005)
    n = len(summary["attempts"])
    return (f"goodput {summary['goodput']:.0%} of {wall:.0f} s wall over {n} attempt{'s' * (n > 1)} (the rest: "
            f"{parts or 'none'})")  # fmt: skip


def finish(gp: Goodput, log: Any, start: int, say: Callable[[str], None]) -> None:
    """Process 0, at the end of every attempt (also a stop or an error): this attempt's split appended to
    <run>/goodput.json, the sum across attempts printed and sent to TensorBoard (`log.board`); then `log` closed."""
    try:
        if jax.process_index() == 0:
            end = log.records[-1]["step"] if log.records else start
            total = gp.write(start, end)
            say(describe(total))
            if log.board is not None:
                log.board.goodput(total, end)
    except OSError as e:
        say(f"warning: goodput not written to {gp.path} ({e.strerror or e})")
    finally:
        log.close()
