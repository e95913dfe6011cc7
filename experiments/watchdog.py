"""A step that never finishes ends the run: every thread's stack to the run directory, one `error:` line, exit 124.

A collective waiting on a peer that hung (a deadlock, a stuck data loader, a wedged device) blocks the training
loop where it reads the step's metrics; nothing else would ever stop it. The watchdog is a thread that the loop
feeds (`beat`) each time a step's metrics arrive, a checkpoint is written or an evaluation ends. When the gap since
the last beat passes the limit it writes `faulthandler`'s dump of every thread to `<run>/logs/hang-p<K>.txt`,
prints one line naming the step, the limit, that file and the last good checkpoint, and ends the process with
`EXIT_HUNG` (124, as `timeout(1)`). In a multi-process run the peers, blocked in the same collective, end the
same way (or by JAX's heartbeat, when the hung process has gone): the run stops within the limit plus a heartbeat.

The limit (`--config.watchdog`):
- "auto" (the default): `max(floor_s, multiple x the median gap)` over the gaps seen so far; `floor_s` alone
  until `warmup` gaps are known. The floor (300 s) covers a slow checkpoint; an evaluation beats after each of
  its batches, and the first one (which compiles the evaluation step) runs with the watchdog paused.
- a number of seconds: that limit from the first step on.
- "off": no watchdog.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import shardkit as sk

EXIT_HUNG = 124  #: the exit code of a process whose step passed the watchdog's limit


def parse(spec: str | float | int) -> float | None:
    """`--config.watchdog` -> a fixed limit in seconds, 0.0 for "auto", None for "off"; a ShardkitError otherwise."""
    text = str(spec).strip().lower()
    if text in ("auto", ""):
        return 0.0
    if text in ("off", "none", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise sk.ShardkitError(f"watchdog={spec!r}: give 'auto', 'off' or a limit in seconds (> 0), e.g. 600")
    return value


class Watchdog:
    """The thread that ends a process whose step hangs (module docstring). Use as a context manager around the
    training loop; `beat(step)` after each step's metrics, checkpoint and evaluation."""

    def __init__(
        self, spec: str | float, logs: Path, process: int, last_good: Callable[[], str],
        floor_s: float = 300.0, multiple: float = 20.0, warmup: int = 3,
    ) -> None:  # fmt: skip
        self.fixed = parse(spec)
        self.logs, self.process, self.last_good = Path(logs), process, last_good
        self.floor_s, self.multiple, self.warmup = floor_s, multiple, warmup
        self.gaps: list[float] = []
        self.step, self.t_last = 0, time.monotonic()
        self._stop = threading.Event()
        self._paused = False
        self._thread: threading.Thread | None = None

    @property
    def limit(self) -> float:
        """The current limit in seconds (module docstring)."""
        if self.fixed:
            return self.fixed
        if len(self.gaps) < self.warmup:
            return self.floor_s
        return max(self.floor_s, self.multiple * statistics.median(self.gaps[-100:]))

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if step > self.step:  # a step's gap; a checkpoint's or an evaluation's beat only restarts the clock
            self.gaps.append(now - self.t_last)
        self.step, self.t_last = max(step, self.step), now

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No limit inside (a first evaluation, whose compile may take minutes); the clock restarts after it."""
        self._paused = True
        try:
            yield
        finally:
            self._paused, self.t_last = False, time.monotonic()

    def __enter__(self) -> Watchdog:
        if self.fixed is not None:
            self.t_last = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="shardkit-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit / 10)):
            waited = time.monotonic() - self.t_last
            if waited > self.limit and not self._paused:
                self._fire(waited)

    def _fire(self, waited: float) -> None:
        path = self.logs / f"hang-p{self.process}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"process {self.process}: no progress for {waited:.0f} s after step {self.step}\n")
                faulthandler.dump_traceback(f, all_threads=True)
            where = f"every thread's stack is in {path}"
        except OSError as e:
            where = f"the stacks could not be written to {path} ({e.strerror})"
        how = "--config.watchdog" if self.fixed else f"auto: {self.multiple:g} x the median step, >= {self.floor_s:g} s"
        print(
            f"error: process {self.process}: no progress for {waited:.0f} s after step {self.step} (watchdog "
            f"limit {self.limit:.0f} s, {how}): a collective is probably waiting on a peer that hung; {where}. "
            f"Rerun the same command to resume from {self.last_good()}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_HUNG)
