"""A jax.profiler trace of a few training steps, and one line of the ops that took the time.

`--config.profile.steps=N` (0 = off, the default) traces steps S+1 .. S+N, S = `--config.profile.start_step`, into
`<run>/profile/p<K>/plugins/profile/<time>/` (an `.xplane.pb` for TensorBoard's profile plugin or XProf, and a
`.trace.json.gz` that Perfetto opens), from process 0, or from every process with `profile.all_processes`. When
the last traced step has finished, the run prints the top ops by time, summed over the trace:

    profile: steps 11-13 in runs/x/profile/p0 | top ops: fusion.12 41% (3.10 ms), ... of 7.60 ms of op time, ...

The ops are the XLA ops of the trace (`jax.profiler.ProfileData`, in jax 0.10 and 0.12): on GPU and TPU the
device planes' "XLA Ops" lines, on CPU the events carrying an `hlo_op` stat. Without ProfileData the `.trace.json.gz`
is read instead (its events with an `hlo_op` argument). Op times are summed over the devices (and, on CPU, a loop
op holds its body's ops too). A profile directory that cannot be written is one ShardkitError before the run
starts; a trace that cannot be written or read when it stops is a warning, and training goes on.
"""

from __future__ import annotations

import collections
import gzip
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax

import shardkit as sk


class Profiler:
    """Starts and stops the trace around the configured steps (`at(k)` before step k+1 is dispatched)."""

    def __init__(self, config: Any, run_dir: Path, say: Callable[[str], None]) -> None:
        section = config.get("profile", {}) or {}
        self.start, self.steps = int(section.get("start_step", 0)), int(section.get("steps", 0))
        if self.steps < 0 or self.start < 0:
            raise sk.ShardkitError(f"profile.steps={self.steps}, profile.start_step={self.start}: give counts >= 0")
        every = bool(section.get("all_processes", False))
        self.on = self.steps > 0 and (every or jax.process_index() == 0)
        self.dir = Path(run_dir) / "profile" / f"p{jax.process_index()}"
        self.say, self.active = say, False
        if self.on:
            _writable(self.dir)

    def at(self, k: int, state: Any = None) -> None:
        """Call with the number of steps done, before the next is dispatched (and once after the loop)."""
        if not self.on:
            return
        if not self.active and k == self.start:
            jax.profiler.start_trace(str(self.dir))
            self.active = True
        elif self.active and k >= self.start + self.steps:
            self.stop(state)

    def stop(self, state: Any = None) -> None:
        """Ends the trace (after the traced steps' work has finished) and prints the top ops."""
        if not self.active:
            return
        if state is not None:
            jax.block_until_ready(state)
        self.active = False
        try:  # mid-run, a trace that cannot be written or read is a warning: training goes on
            jax.profiler.stop_trace()
            top, total = top_ops(self.dir)
        except Exception as e:  # disk full, permissions changed, a trace jax wrote in another form
            self.say(f"warning: profile: the trace in {self.dir} could not be written or read ({e}); training goes on")
            return
        ops = ", ".join(f"{name} {t / total:.0%} ({t * 1e3:.2f} ms)" for name, t in top) if total else "none found"
        self.say(f"profile: steps {self.start + 1}-{self.start + self.steps} in {self.dir} | top ops: {ops}"
                 f"{f' of {total * 1e3:.2f} ms of op time, summed over devices' if total else ''}")  # fmt: skip


def _writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise sk.ShardkitError(
            f"profile directory {folder} cannot be written ({e.strerror or e}): fix its permissions or choose "
            "another --config.run_dir, or turn the trace off with --config.profile.steps=0"
        ) from e


def latest_trace(folder: Path, suffix: str) -> Path | None:
    """The newest `*<suffix>` file the profiler wrote under `folder` (plugins/profile/<time>/<host><suffix>)."""
    found = sorted(Path(folder).glob(f"plugins/profile/*/*{suffix}"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _op_events_xplane(path: Path) -> Iterable[tuple[str, float]]:
    data = jax.profiler.ProfileData.from_file(str(path))
    planes = list(data.planes)
    device = [ln for p in planes if p.name.startswith("/device:") for ln in p.lines if ln.name == "XLA Ops"]
    if device:
        return [(e.name, e.duration_ns * 1e-9) for ln in device for e in ln.events]
    return [(e.name, e.duration_ns * 1e-9) for p in planes for ln in p.lines for e in ln.events
            if any(k == "hlo_op" for k, _ in e.stats)]  # fmt: skip


def _op_events_json(path: Path) -> Iterable[tuple[str, float]]:
    with gzip.open(path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    return [(e["name"], e.get("dur", 0) * 1e-6) for e in events if "hlo_op" in (e.get("args") or {})]


def top_ops(folder: Path, n: int = 5) -> tuple[list[tuple[str, float]], float]:
    """([(op, seconds)] of the n ops with the most time, total seconds of all ops) in the newest trace in `folder`;
    a ShardkitError when no trace is there or it cannot be read."""
    xplane, chrome = latest_trace(folder, ".xplane.pb"), latest_trace(folder, ".trace.json.gz")
    if xplane is None and chrome is None:
        raise sk.ShardkitError(f"profile: no trace was written under {folder}")
    readers = [(_op_events_xplane, xplane)] if xplane is not None and hasattr(jax.profiler, "ProfileData") else []
    readers += [(_op_events_json, chrome)] if chrome is not None else []
    problems = []
    for read, path in readers:  # the xplane through ProfileData, else (another jaxlib, a damaged file) the JSON
        try:
            events = read(path)
            break
        except Exception as e:  # protobuf, jaxlib or JSON errors
            problems.append(f"{path.name}: {e}")
    else:
        raise sk.ShardkitError(f"profile: the trace in {folder} cannot be read: {'; '.join(problems) or 'no reader'}")
    times: collections.Counter[str] = collections.Counter()
    for name, seconds in events:
        times[name] += seconds
    return times.most_common(n), sum(times.values())


__all__ = ["Profiler", "latest_trace", "top_ops"]
