"""Save and restore a TrainState with orbax: atomic, keep the last k, restore onto any mesh and strategy.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3)
    ckpt.save(state, meta={"data": {"step": 40, "seed": 0}})     # step = state.step; a non-finite state is refused
    state, meta = ckpt.restore(step.abstract_state())           # latest step, laid out as the target says
    ckpt.close()                                                # waits for an asynchronous save to commit

Atomicity: orbax writes step 40 into ``40.orbax-checkpoint-tmp`` and renames it to ``40`` only once every array and
the metadata are on disk (on object stores such as ``gs://`` a ``commit_success.txt`` marks the commit instead). A
process killed mid-save leaves just the temporary directory: ``latest_step`` ignores it and the next ``Checkpointer``
on that directory deletes it, so a restart resumes from the previous complete step. Old steps are deleted only after
a newer one has committed.

Integrity: every save stores, in its JSON metadata, a checksum of each array (a position-weighted sum of its bits
in uint32, computed where the array lives: integer wrap-around is exact, so the value does not depend on the
sharding or the reduction order). `restore` recomputes them on what it read: a flipped bit, a truncated or
garbled file, damaged metadata or an empty step folder make that step *damaged*. The latest step that is
damaged is reported, moved aside to ``damaged/<step>`` (never deleted) and the newest intact step is restored;
if none is intact the error lists what is wrong with each. A checkpoint whose readable metadata shows other
shapes is not damaged but another model: that stays an error (no fallback).

Resharding: the restore target is a tree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` such as
``TrainStep.abstract_state()``; every array is read straight into that layout, whatever mesh and strategy wrote it
(``fsdp`` on ``fsdp=8`` -> ``tp`` on ``data=2,tensor=4``, or one device for sampling). Shapes must match.
Saving and restoring are collective: in a multi-process run every process calls them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from shardkit import offload
from shardkit.errors import ShardkitError

#: Orbax's marker for a step directory that is still being written (``<step>.orbax-checkpoint-tmp[-<time>]``).
TMP_MARKER = ".orbax-checkpoint-tmp"


class NonFiniteError(FloatingPointError):
    """A loss, gradient or state that is NaN or Inf: stop, keep the last good checkpoint."""


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.array(True)


@jax.jit
def _checksums(tree: Any) -> Any:
    """Per leaf: sum_i bits_i * (i * 2654435761 + 1) in uint32 (wrap-around), bits = the array as uint32 words."""

    def one(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        width = x.dtype.itemsize
        words = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width])
        words = words.reshape(-1).astype(jnp.uint32)
        weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
        return jnp.sum(words * weights, dtype=jnp.uint32)

    return jax.tree.map(one, tree)


def checksums(tree: Any) -> dict[str, int]:
    """{leaf name: checksum} of a tree of arrays (see the module docstring)."""
    sums = jax.device_get(_checksums(offload.on_device(tree)))  # an offloaded state: copied to the devices
    return {_leaf_name(p): int(v) for p, v in jax.tree_util.tree_leaves_with_path(sums)}


_CHECKSUMS = "_checksums"  # the key in the step's JSON metadata


def all_finite(tree: Any) -> bool:
    """True when no floating-point array in `tree` holds a NaN or Inf (one small jitted reduction)."""
    return bool(_all_finite(offload.on_device(tree)))


def _options(keep: int, async_save: bool, read_only: bool) -> ocp.CheckpointManagerOptions:
    kw: dict[str, Any] = dict(enable_async_checkpointing=async_save, read_only=read_only)
    kw.update(create=not read_only, cleanup_tmp_directories=not read_only)
    if read_only:
        kw["save_interval_steps"] = 0  # what orbax sets (with a warning) for read-only managers
    if hasattr(ocp, "checkpoint_managers") and hasattr(ocp.checkpoint_managers, "LatestN"):
        kw["preservation_policy"] = ocp.checkpoint_managers.LatestN(n=keep)  # recent orbax
    else:
        kw["max_to_keep"] = keep  # older orbax (deprecated in newer ones)
    return ocp.CheckpointManagerOptions(**kw)


class SaveError(ShardkitError):
    """A checkpoint could not be written (disk full, permissions, ...). The last committed step is untouched;
    training should stop there rather than go on without a way back."""


class QuietSaveFailures(logging.Filter):
    """Drops orbax's own report of a failed background save: an ERROR line and a traceback from each of its save
    threads (through absl's logger), printed before the Checkpointer's one-line SaveError, which names the reason
    and the last good step and chains orbax's exception as its cause; and, at exit, asyncio's "Task exception was
    never retrieved" for the same save's other writes."""

    MARKS = ("background save thread", "_SignalingThread.run() raised", "Save Finalize thread")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "asyncio":  # at exit: orbax's other writes of the failed save, never awaited
            return not ("exception was never retrieved" in str(record.msg) and "orbax" in record.getMessage())
        ours = f"{os.sep}orbax{os.sep}" in record.pathname
        return not (ours and any(m in str(record.msg) for m in self.MARKS))


def _quiet_unraisable(hook: Any) -> Any:
    """`sys.unraisablehook` without the "Event loop is closed" tracebacks tensorstore's pending writes raise when a
    failed save has closed orbax's event loop (one per pending write); everything else goes to `hook`."""

    def quiet(unraisable: Any) -> None:
        e = unraisable.exc_value
        frames = [f.name for f in traceback.extract_tb(unraisable.exc_traceback)]
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed" and "call_soon_threadsafe" in frames):
            hook(unraisable)

    quiet.shardkit_quiet = True  # type: ignore[attr-defined]
    return quiet


def _quiet_orbax_failures() -> None:
    """Installs both (once per process) the first time a Checkpointer is made."""
    for logger in logging.getLogger("absl"), logging.getLogger("asyncio"):
        if not any(isinstance(f, QuietSaveFailures) for f in logger.filters):
            logger.addFilter(QuietSaveFailures())
    if not getattr(sys.unraisablehook, "shardkit_quiet", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


class Checkpointer:
    """Checkpoints of a TrainState (plus a small JSON `meta` dict) in `directory/<step>/`, the last `keep` kept.

    With `async_save` (the default) `save` returns once the arrays are copied to host memory and the files are
    written by a background thread while training continues; the next `save`, `restore` or `close` waits for it.
    `read_only` (e.g. to sample from a run that is still training) never writes, deletes or cleans up anything.
    """

    def __init__(
        self, directory: str | os.PathLike[str], keep: int = 3, async_save: bool = True, read_only: bool = False
    ):
        if keep < 1:
            raise ShardkitError(f"keep={keep}: keep at least the last checkpoint (keep >= 1)")
        directory = os.fspath(directory)
        self.directory = directory if "://" in directory else os.path.abspath(directory)  # gs://... stays
        self.keep, self.read_only = keep, read_only
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        options = _options(keep, async_save, read_only)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._pending: int | None = None  # the step an asynchronous save is writing
        self._failed: SaveError | None = None
        _quiet_orbax_failures()  # a failed save is one SaveError line, not orbax's tracebacks above it

    # -------------------------------------------------------------------------------------------------- query
    def steps(self) -> list[int]:
        """Committed steps, oldest first: an interrupted save is not one, nor a save still in flight (orbax lists
        a step as soon as its asynchronous save starts, while it is still ``<step>.orbax-checkpoint-tmp``)."""
        steps = sorted(self._manager.all_steps())
        if self._pending is not None and (self._failed is not None or self._manager.is_saving_in_progress()):
            steps = [s for s in steps if s != self._pending]
        return steps

    def latest_step(self) -> int | None:
        """The newest committed step, or None (a peer that dies mid-save never makes that step the good one)."""
        steps = self.steps()
        return steps[-1] if steps else None

    # --------------------------------------------------------------------------------------------------- save
    def save(self, state: Any, meta: dict[str, Any] | None = None, check_finite: bool = True) -> bool:
        """Saves `state` as step `int(state.step)`; False if that step is already saved.

        Raises NonFiniteError (and writes nothing) if `check_finite` and any floating-point array is NaN or Inf.
        """
        step = int(state.step)
        if self.read_only:
            raise ShardkitError(f"cannot save step {step}: this Checkpointer on {self.directory} is read-only")
        if step in self._manager.all_steps():
            return False
        if check_finite and not all_finite(state):
            with contextlib.suppress(SaveError):  # a save in flight commits first: then it is the last good one
                self.wait()
            raise NonFiniteError(
                f"refusing to checkpoint step {step}: the state holds NaN or Inf; "
                f"the last good checkpoint is step {self.latest_step()} in {self.directory}"
            )
        if self._failed is not None:
            raise self._failed
        if self._pending is not None:  # an earlier save still writing: its outcome first, reported as its own
            self.wait()  # (orbax's save waits for it anyway; a failure below is then this step's)
            self._pending = None
        meta = {**dict(meta or {}), _CHECKSUMS: checksums(state)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._pending = step
        with self._failures():
            saved = bool(self._manager.save(step, args=args, force=True))
        self._pending = step
        return saved

    def check(self) -> None:
        """Raises SaveError if an asynchronous save has failed since (cheap: call it every step)."""
        if self._failed is not None:
            raise self._failed
        if self._pending is not None and not self._manager.is_saving_in_progress():
            with self._failures():  # the background save ended: collect its outcome (raises if it failed)
                self._manager.wait_until_finished()
            self._pending = None

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Any error of orbax's writing (ENOSPC arrives as RESOURCE_EXHAUSTED) -> a SaveError naming the good step."""
        try:
            yield
        except SaveError:
            raise
        except Exception as e:
            text = str(e)
            reason = ("the disk is full (No space left on device)" if "No space left" in text or "os_error_code='28'"
                      in text else text.splitlines()[0][:300] if text else type(e).__name__)  # fmt: skip
            good = max((s for s in self._manager.all_steps() if s != self._pending), default=None)  # not this one
            self._failed = SaveError(
                f"saving checkpoint step {self._pending} in {self.directory} failed: {reason}. Training stopped; the "
                f"last good checkpoint is {'step ' + str(good) if good is not None else 'none'} (kept). Free space or "
                "fix the directory, then rerun the same command to resume from it"
            )
            raise self._failed from e

    # ------------------------------------------------------------------------------------------------ restore
    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of `step` (default: the newest intact one), each array laid out by `target`'s shardings.

        `target` is a tree of ShapeDtypeStructs with shardings, e.g. `TrainStep.abstract_state()`. Without `step`,
        a damaged newest step is moved aside to ``damaged/`` and the next older one tried (module docstring).
        """
        self._manager.wait_until_finished()
        if step is not None:
            if step not in self._manager.all_steps():
                have = ", ".join(map(str, self.steps())) or "none"
                raise ShardkitError(f"no checkpoint {step} in {self.directory} (steps: {have})")
            out, problem = self._restore_verified(step, target)
            if problem:
                raise ShardkitError(f"checkpoint step {step} in {self.directory} is damaged: {problem}")
            return out
        problems = []
        for candidate in reversed(self.steps()):
            out, problem = self._restore_verified(candidate, target)
            if not problem:
                if problems:
                    warnings.warn(f"restored step {candidate}; " + "; ".join(problems), stacklevel=2)
                return out
            problems.append(f"step {candidate} is damaged ({problem}){self._set_aside(candidate)}")
        if problems:
            raise ShardkitError(f"no intact checkpoint in {self.directory}: " + "; ".join(problems))
        raise ShardkitError(f"no checkpoint in {self.directory} (steps: none)")

    def _restore_verified(self, step: int, target: Any) -> tuple[Any, str]:
        """((state, meta), "") or (None, what is wrong); a shape mismatch is raised (another model, not damage)."""
        known = self._check_fits(step, target)  # raises for other shapes
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        try:
            out = self._manager.restore(step, args=args)
            state, meta = out["state"], dict(out["meta"] or {})
        except Exception as e:  # tensorstore / orbax / JSON errors of an unreadable step
            if known == "other names":  # metadata readable but not comparable: likely another model, not damage
                raise ShardkitError(f"{self._misfit(step)}: {e}") from e
            return None, f"unreadable: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        want = meta.pop(_CHECKSUMS, None)
        if want is None:
            return (state, meta), ""  # written before checksums existed: nothing to verify
        got = checksums(state)
        bad = sorted(name for name in want if got.get(name) != want[name])
        if bad:
            return None, f"checksum mismatch in {len(bad)} array(s): {', '.join(bad[:3])}{' ...' * (len(bad) > 3)}"
        return (state, meta), ""

    def _set_aside(self, step: int) -> str:
        """Moves a damaged step directory to ``damaged/<step>[-n]`` (kept for inspection); says where."""
        if self.read_only or "://" in self.directory or jax.process_count() > 1:  # others may still be reading it
            return ""
        src = os.path.join(self.directory, str(step))
        dest = os.path.join(self.directory, "damaged", str(step))
        n = 1
        while os.path.exists(dest):
            dest, n = os.path.join(self.directory, "damaged", f"{step}-{n}"), n + 1
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(src, dest)
        except OSError:
            return ""
        self._manager.reload()  # orbax forgets the step
        return f", moved to {dest}"

    def _misfit(self, step: int) -> str:
        return (
            f"checkpoint step {step} in {self.directory} does not fit the restore target: a different model or "
            "optimizer (shapes and tree structure must match; mesh and strategy may differ)"
        )

    def _check_fits(self, step: int, target: Any) -> str:
        """Compares leaf names and shapes with the checkpoint's metadata before orbax reads anything: "fits",
        "unreadable" (damaged metadata), "other names" (not comparable); ShardkitError for other shapes."""
        try:
            metadata = self._manager.item_metadata(step)["state"]
            saved = {m.name: tuple(m.shape) for m in jax.tree.leaves(metadata) if hasattr(m, "name")}
        except Exception:  # no readable metadata: the step is damaged (or incomplete)
            return "unreadable"
        want = {_leaf_name(p): tuple(t.shape) for p, t in jax.tree_util.tree_leaves_with_path(target)}
        if not saved.keys() & want.keys():  # another naming scheme: leave it to orbax
            return "other names"
        bad = [f"{n}: saved {saved[n]}, target {s}" for n, s in want.items() if n in saved and saved[n] != s]
        bad += [f"{n}: missing from the checkpoint" for n in want.keys() - saved.keys()]
        bad += [f"{n}: only in the checkpoint" for n in saved.keys() - want.keys()]
        if bad:
            raise ShardkitError(f"{self._misfit(step)}; {'; '.join(sorted(bad)[:4])}{' ...' * (len(bad) > 4)}")
        return "fits"

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON `meta` of `step` (default: the latest); {} if there is no checkpoint."""
        step = self.latest_step() if step is None else step
        if step is None:
            return {}
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
        return {k: v for k, v in dict(meta).items() if k != _CHECKSUMS}

    # ------------------------------------------------------------------------------------------------ closing
    def wait(self) -> None:
        """Blocks until an asynchronous save has committed (SaveError if it failed)."""
        with self._failures():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, deletions and clean-ups, then releases orbax's threads. A failed save raises
        SaveError here, once: after it was reported (by `save`, `check` or `wait`) closing only cleans up."""
        reported = self._failed is not None
        try:
            with self._failures():
                self._manager.wait_until_finished()
        except SaveError:
            if not reported:
                self._manager.close()
                raise
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leaf_name(path: tuple[Any, ...]) -> str:
    """Orbax's name of a leaf: its keys joined by dots (`opt_state.0.mu.blocks.wo`)."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def tmp_dirs(directory: str | os.PathLike[str]) -> list[str]:
    """Names of unfinished (interrupted or in-flight) step directories under `directory`."""
    try:
        return sorted(n for n in os.listdir(directory) if TMP_MARKER in n)
    except FileNotFoundError:
        return []


__all__ = ["TMP_MARKER", "Checkpointer", "NonFiniteError", "SaveError", "all_finite", "checksums", "tmp_dirs"]
