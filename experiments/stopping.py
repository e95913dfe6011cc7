"""How a training loop stops: SIGTERM (preemption), Ctrl-C, and the injected hang of the watchdog's tests.

`Stop` turns SIGTERM and a first Ctrl-C into a request the loop honours after the current step, with a checkpoint.
With several processes SIGTERM is left to JAX's preemption notifier and `Stop.at(k)` asks
`multihost_utils.reached_preemption_sync_point(k)`, so every process stops (and checkpoints, collectively) at the
same step (docs/training.md, "When a host dies"). A Ctrl-C reaches one process (a terminal's, on one host): that
process hands it to the same notifier (it raises SIGTERM on itself), so it is synced like a preemption: every
process checkpoints the same step; the one that was interrupted says SIGINT, the others SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class Stop:
    """SIGTERM (preemption) and a first Ctrl-C ask the loop to checkpoint and stop; the stop's checkpoint commits
    before the handlers are released, so a second quick Ctrl-C only warns and a third interrupts."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._asked: int | None = None  # several processes: the signal this process handed to JAX's notifier
        self._old: dict[int, Any] = {}
        self._extra = 0  # Ctrl-C presses after the first, before its checkpoint has committed
        # several processes: SIGTERM is left to JAX's preemption notifier, so that every process stops at the same
        # step (a checkpoint is collective); `at(k)` asks it
        self.synced = jax.process_count() > 1 and preemption_manager() is not None

    def __enter__(self) -> Stop:
        with contextlib.suppress(ValueError):  # signal handlers only in the main thread
            for sig in (signal.SIGINT,) if self.synced else (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def at(self, k: int) -> bool:
        """Whether the run stops after step k: a signal here, or (several processes) a preemption every process
        agrees stops at step k (`multihost_utils.reached_preemption_sync_point`, JAX's SIGTERM sync)."""
        if self.synced and self.signal is None and multihost_utils.reached_preemption_sync_point(k):
            self.signal = self._asked or signal.SIGTERM
        return self.signal is not None

    def _handle(self, sig: int, frame: Any) -> None:
        if self.synced and self._asked is None:  # a Ctrl-C here only: JAX's notifier tells every process
            self._asked = sig
            signal.raise_signal(signal.SIGTERM)  # JAX's own SIGTERM handler (the preemption notifier) takes it
            return
        if signal.SIGINT in (self.signal, self._asked) and sig == signal.SIGINT:
            self._extra += 1
            if self._extra == 1:  # two quick Ctrl-C during the first save used to lose the whole run
                print("stopping: writing the checkpoint first; Ctrl-C once more abandons it", file=sys.stderr,
                      flush=True)  # fmt: skip
                return
            raise KeyboardInterrupt
        self.signal = sig

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def preemption_manager() -> Any:
    """JAX's preemption sync manager (set up by jax.distributed.initialize), or None."""
    from jax._src import distributed

    return getattr(distributed.global_state, "preemption_sync_manager", None)


def injected_hang() -> int | None:
    """Testing hook: SHARDKIT_INJECT_HANG="<step>[:<process>]" makes that process stop making progress before it
    dispatches step <step> (a hung peer, for the watchdog's tests: tests/test_multiprocess.py). The step, read once
    before the loop, for this process; None when not set."""
    spec = os.environ.get("SHARDKIT_INJECT_HANG", "")
    step, _, proc = spec.partition(":")
    return int(step) if step and (not proc or int(proc) == jax.process_index()) else None


def injected_kill() -> int | None:
    """Testing hook: SHARDKIT_INJECT_KILL="<step>[:<process>]" SIGKILLs that process inside the checkpoint save of
    step <step>, right after its part has been handed to orbax (the step's temporary folder made, its writes in
    flight, nothing committed): a peer dying mid-save (tests/test_multiprocess.py). None when not set."""
    spec = os.environ.get("SHARDKIT_INJECT_KILL", "")
    step, _, proc = spec.partition(":")
    return int(step) if step and (not proc or int(proc) == jax.process_index()) else None


def die() -> None:
    """SIGKILL to this process (the injected kill): no handler, no clean-up, as the OOM killer does it."""
    os.kill(os.getpid(), signal.SIGKILL)


def hang_here() -> None:
    """Stops making progress, forever: only the watchdog (or a kill) ends this process."""
    threading.Event().wait()
