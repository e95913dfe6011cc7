"""Where a run starts: the newest of its global checkpoint and its emergency checkpoint, or a fresh model.

`start(config, run, ckpt, local, say)` is what `experiments.train` calls before its loop: every process calls it
(restoring is collective). The global checkpoint (shardkit/checkpoint.py) restores onto any mesh; the emergency
one (shardkit/emergency.py: each process's own shards on its local disk) only onto the same mesh and processes,
and wins when it is newer and every process can read its part.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_collections

import shardkit as sk
from experiments import init_from
from experiments.optim import schedule_length
from shardkit.checkpoint import Checkpointer
from shardkit.emergency import LocalCheckpointer

#: emergency checkpoints' interval where --config.emergency_every=-1 (auto) and the run has several processes
AUTO_EMERGENCY_EVERY = 10


def emergency_every(config: ml_collections.ConfigDict) -> int:
    """The emergency checkpoints' interval in steps (0: none), from --config.emergency_every."""
    every = config.get("emergency_every", 0)
    if every < -1:
        raise sk.ShardkitError(f"emergency_every={every}: give -1 (auto), 0 (off) or an interval in steps")
    return (AUTO_EMERGENCY_EVERY if jax.process_count() > 1 else 0) if every == -1 else every


def emergency_checkpointer(config: ml_collections.ConfigDict, run_dir: Path) -> LocalCheckpointer | None:
    """The run's emergency checkpointer (--config.emergency_dir, default <run>/emergency), or None when off."""
    if not emergency_every(config):
        return None
    return LocalCheckpointer(Path(config.get("emergency_dir") or run_dir / "emergency").expanduser(), keep=2)


def meta(config: ml_collections.ConfigDict, k: int, where: str) -> dict[str, Any]:
    """What a checkpoint of step k records besides the state: where it ran, the seed, the schedule's length."""
    schedule = list(schedule_length(config.optimizer, config.steps))
    return {"step": k, "where": where, "seed": config.seed, "schedule": schedule}


def start(config: ml_collections.ConfigDict, run: Any, ckpt: Checkpointer, local: LocalCheckpointer | None,
          say: Callable[[str], None]) -> tuple[sk.TrainState, int]:  # fmt: skip
    """(state, step) the run continues from (module docstring)."""
    step, task = run.step, run.task
    latest = ckpt.latest_step()
    found = local.newest_common(step.abstract_state(), newer_than=latest or 0) if local else None
    if found is not None:
        state, saved = local.restore(step.abstract_state(), found)
        last = f"the last checkpoint in {ckpt.directory} is step {latest}" if latest else "no checkpoint yet"
        say(f"resumed from the emergency checkpoint of step {found} (each process's own shards, CRC-checked, in "
            f"{local.directory.parent}; {last})")  # fmt: skip
    elif latest is not None:
        with warnings.catch_warnings(record=True) as seen:  # a damaged newest step: set aside, an older one restored
            warnings.simplefilter("always")
            state, saved = ckpt.restore(step.abstract_state())
        for w in seen:
            if "is damaged" in str(w.message):
                say(f"warning: {w.message}")
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        say(f"resumed from step {int(state.step)} (saved under {saved.get('where', '?')}) in {ckpt.directory}")
    else:
        model = init_from.initial_model(config, run, say)  # --config.init_from=hf:<dir>, else a random init
        if model is None:
            model = sk.sharded_init(task.make_model, run.mesh, step.strategy, seed=config.seed)
        return step.init_state(model), 0
    k = int(state.step)
    if saved.get("seed", config.seed) != config.seed:
        say(f"warning: seed {config.seed} differs from the run's {saved['seed']}: the data order changes here")
    say_schedule_change(config, saved, k, say)
    return state, k


def say_schedule_change(config: ml_collections.ConfigDict, saved: dict, k: int, say: Callable[[str], None]) -> None:
    """A resume whose learning-rate schedule differs from the one the checkpoint was trained under (the schedule
    follows `steps` unless optimizer.decay_steps is set) says so, with the flags that keep the run's."""
    was = saved.get("schedule")
    now = list(schedule_length(config.optimizer, config.steps))
    if not was or list(was) == now:
        return
    say(
        f"warning: this run's learning-rate schedule was {was[0]} warmup + {was[1]} steps long; with "
        f"--config.steps={config.steps} it is {now[0]} + {now[1]}, so the learning rate changes from step {k} "
        f"on. To keep the run's: --config.optimizer.decay_steps={was[1]} --config.optimizer.warmup_steps={was[0]}"
    )
