"""What every benchmark shares: compile once and time, the random GPT batch, the result file.

    compiled, lower_s, compile_s = compile_timed(step, state, batch)     # lower + compile, each timed (.seconds)
    t = time_calls(lambda: compiled(state, batch), reps=5)             # warm-up, then 5 timed calls
    t.median, t.best, t.spread, t.times, t.out                         # seconds; the last call's output
    t, state, metrics = time_steps(compiled, state, batch, reps=10)    # train steps, the state carried
    ts = time_interleaved({"a": fa, "b": fb}, reps=5, shuffle=0)       # runs alternate (random order)
    out, seconds = timed(fn, *args)                                    # one call, blocked until ready
    gpt_batch(vocab, batch, seq, step.batch_sharding)                  # random int32 inputs / targets
    save_json(result, f"{RESULTS}/bench_x.json")

Every timed call ends in `jax.block_until_ready` of its whole output (a train step: the new state and the
metrics, which one executable writes together), so a time is the program's, not its asynchronous dispatch's.
Warm-up calls (`warmup`, default 1: the first call of a jitted function compiles it) are run and left out. The
benchmarks pick their statistic: `median`, or `best` (the fastest run, the least disturbed one where other work
shares the host), and `spread` (max - min) says how much the runs disagreed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

#: Where each benchmark writes its results by default (relative to the repository root, where they are run).
RESULTS = "experiments/bench/results"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of each timed run of one program, and the output of its last run."""

    times: list[float]
    out: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def spread(self) -> float:
        return max(self.times) - min(self.times)


class Compiled(NamedTuple):
    program: Any  # jax.stages.Compiled
    lower_s: float
    compile_s: float

    @property
    def seconds(self) -> float:
        """Lowering and compiling together."""
        return self.lower_s + self.compile_s


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """(fn(*args) once it is ready, the seconds from the call to then)."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t


def compile_timed(fn: Any, *args: Any) -> Compiled:
    """`fn.lower(*args).compile()` (a jitted function or a shardkit train step), the two phases timed apart."""
    t = time.perf_counter()
    lowered = fn.lower(*args)
    lower_s = time.perf_counter() - t
    program = lowered.compile()
    return Compiled(program, lower_s, time.perf_counter() - t - lower_s)


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], reps: int, warmup: int = 1, shuffle: int | None = None
) -> dict[str, Timing]:
    """name -> Timing of `reps` calls of each program, after `warmup` calls of each. The calls alternate between
    the programs (a round of each, `reps` times), so that load from other work on a shared host hits all alike.
    `shuffle` (a seed): each round runs the programs in a new random order, so that no program always follows
    the same one (a program that frees gigabytes leaves the next one to fault fresh pages in: a fixed order
    charges that to one program every round)."""
    outs = {}
    for _ in range(warmup):
        for name, fn in fns.items():
            outs[name] = jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    rng = np.random.default_rng(shuffle)
    for _ in range(reps):
        order = list(fns) if shuffle is None else [list(fns)[i] for i in rng.permutation(len(fns))]
        for name in order:
            outs[name], seconds = timed(fns[name])
            times[name].append(seconds)
    return {name: Timing(times[name], outs.get(name)) for name in fns}


def time_calls(fn: Callable[[], Any], reps: int, warmup: int = 1, block_each: bool = True) -> Timing:
    """`reps` timed calls of `fn` after `warmup` untimed ones. block_each=False: the `reps` calls are dispatched
    back to back and waited for once at the end (what a training loop does); the one time is their mean."""
    if block_each:
        return time_interleaved({"": fn}, reps, warmup)[""]
    for _ in range(warmup):
        jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    out = jax.block_until_ready(out)
    return Timing([(time.perf_counter() - t) / reps], out)


def time_steps(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batch: Any,
    reps: int,
    warmup: int = 1,
    block_each: bool = True,
) -> tuple[Timing, Any, Any]:
    """Times `reps` train steps `state, metrics = step(state, batch)` after `warmup` untimed ones, each step
    continuing from the last one's state: (Timing, the final state, the final metrics). `batch` is one batch for
    every step, or a function of the step's index (0, 1, ... over the warm-up and the timed steps), called inside
    the timed region."""
    batch_of = batch if callable(batch) else lambda i: batch
    carry: list[Any] = [state, None]
    index = iter(range(warmup + reps))

    def one() -> list[Any]:
        carry[0], carry[1] = step(carry[0], batch_of(next(index)))
        return carry

    timing = time_calls(one, reps, warmup, block_each)
    return timing, carry[0], carry[1]


def gpt_batch(vocab: int, batch: int, seq: int, sharding: Any = None, seed: int = 0) -> dict[str, Any]:
    """{"inputs", "targets"}: int32 [batch, seq] uniform random tokens below `vocab` (targets = inputs shifted by
    one), from `np.random.default_rng(seed)`; numpy arrays, or placed by `sharding` (e.g. `step.batch_sharding`)."""
    toks = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1))
    out = {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)}
    return out if sharding is None else jax.device_put(out, sharding)


def save_json(result: Any, path: str | os.PathLike, indent: int = 1) -> Path:
    """Writes a benchmark's result as JSON (creating its folder; values JSON lacks as their str), says where, and
    returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=indent, default=str))
    print(f"wrote {out}")
    return out
