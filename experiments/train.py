"""Train a model under any shardkit strategy: config files + flags, real data, checkpoints, metrics, MFU.

    python -m experiments.train                          # gpt_tiny: fsdp on 8 virtual CPU devices, ~2.5 min
    python -m experiments.train --config.strategy=tp --config.mesh="data=2,tensor=4"          # another strategy
    python -m experiments.train --config=experiments/configs/gpt_1b.py --config.data.path=/data/owt   # a pod
    python -m experiments.train --config=experiments/configs/resnet_digits.py     # a ResNet on digits, dp, ~1 min
    python -m experiments.train --config.strategy=auto   # the planner picks strategy, mesh, remat (experiments/auto.py)
    python -m experiments.train --config=experiments/configs/gpt_7b.py --config.target=v5p-128 --config.compile_only
                                                         # compile for a TPU slice from here; exit 0 if it fits in HBM

`config.task` picks the model family (experiments/tasks.py): "lm" (GPT on tokens, the default) or
"image_classification" (ResNet on images). Writes `<run_dir>/<name>/` (name: `--config.name`, default
`<config_name>-<strategy>`): `config.json` (the resolved config; `experiments.sample` rebuilds a GPT from it),
`metrics.jsonl` (per step: step, loss, the loss's own metrics (accuracy), grad_norm, lr, tokens or examples,
step_time, tokens_per_s or examples_per_s, mfu, + val_loss (val_accuracy) on eval steps; `experiments.plot`
draws it) and `checkpoints/<step>/`. Rerunning the same command resumes from the last checkpoint exactly (same
losses: the data order is a function of the step; the optimizer state, BatchNorm statistics and dropout's RNG
counter are in the checkpoint); `--config.name=<run>` with another mesh or strategy resumes that run resharded.
SIGTERM / Ctrl-C finish the step, checkpoint and exit; a NaN or Inf stops the run and keeps the last good
checkpoint. `train(config) -> summary` is the in-process API.
"""

from __future__ import annotations

import os
import re
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    _n = re.search(r"--config\.cpu_devices[= ](\d+)", " ".join(sys.argv))
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n.group(1) if _n else 8}"
    ).strip()

import shardkit  # noqa: F401, I001  (before jax: JAX's CUDA plugin starts quietly on a host without a GPU)

import contextlib
import dataclasses
import json
import signal
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections
import numpy as np
import optax
from absl import flags, logging
from ml_collections import config_flags
from tqdm import tqdm

import shardkit as sk
from experiments import auto, compile_only, goodput, resume, runtime, supervise
from experiments.metrics_log import Log, val_text
from experiments.optim import make_optimizer
from experiments.profiling import Profiler
from experiments.runtime import bytes_per_device, calibrate_peak_flops, cluster_env, init_distributed, resolve_preset
from experiments.stopping import Stop, die, hang_here, injected_hang, injected_kill
from experiments.tasks import ImageTask, LMTask, VolumeTask, build_task, model_config  # noqa: F401  (explain uses model_config)
from experiments.watchdog import Watchdog
from shardkit.checkpoint import Checkpointer, NonFiniteError, SaveError, all_finite

DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "configs" / "gpt_tiny.py")
with warnings.catch_warnings():  # ml_collections loads config files with the deprecated importlib load_module()
    warnings.simplefilter("ignore", DeprecationWarning)
    try:  # ml_collections applies `--config.x=...` overrides from sys.argv right here, at import
        _CONFIG = config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "experiment config file (experiments/configs/)"
        )
    except (AttributeError, KeyError, OSError, TypeError, ValueError) as _e:
        print(f"error: {runtime.config_error(_e)}", file=sys.stderr)
        sys.exit(2)
# Several processes by hand (a cluster's launcher usually sets these for you: see init_distributed).
_COORD = flags.DEFINE_string("coordinator_address", "", "host:port of process 0 (sets JAX_COORDINATOR_ADDRESS)")
_NPROC = flags.DEFINE_integer("num_processes", -1, "number of processes (sets JAX_NUM_PROCESSES)")
_PID = flags.DEFINE_integer("process_id", -1, "this process's index (sets JAX_PROCESS_ID)")


# ------------------------------------------------------------------------------------------------------ building


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


@dataclasses.dataclass
class Run:
    """Everything `train` builds before it touches parameters: validated, nothing compiled yet."""

    mesh: jax.sharding.Mesh
    task: LMTask | ImageTask | VolumeTask  # the model family: model config, data, batches (experiments/tasks.py)
    step: sk.TrainStep  # built on the abstract model: shardings and jitted functions, no parameters
    schedule: optax.Schedule
    dir: Path
    preset: sk.HardwarePreset | None

    @property
    def model_cfg(self) -> Any:
        return self.task.model_cfg


def build(config: ml_collections.ConfigDict) -> Run:
    """Validates the config against the devices and data (ShardkitError with the fix) and builds the train step."""
    for key in ("steps", "batch_size", "seq_len", "microbatches", "keep", "eval_batches", "log_every"):
        if key in config and config[key] < 1:
            raise sk.ShardkitError(f"{key}={config[key]} must be >= 1")
    for key in ("eval_every", "ckpt_every", "seed"):  # 0: only at the end (intervals)
        if key in config and config[key] < 0:
            raise sk.ShardkitError(f"{key}={config[key]} must be >= 0")
    runtime.check_choices(config)
    tgt = sk.target(config.target) if config.get("target") else None  # compile-only devices (docs/targets.md)
    n_dev = tgt.num_devices if tgt else jax.device_count()
    # the config sections named after the strategy's step (`sdp`, `hetero`) and kernels (`pipeline`) configure them
    strategy = runtime.strategy_of(config, n_dev)  # --config.strategy looked up once
    mesh = sk.make_mesh(runtime.target_axes(config, n_dev, strategy), target=tgt)  # "auto": one the strategy fits
    preset = tgt.preset(dict(mesh.shape)) if tgt else resolve_preset(config.hardware)
    bound = strategy.bind(mesh)  # and bound once: a mesh it does not fit is refused here
    task = build_task(config)
    tx, schedule = make_optimizer(config.optimizer, config.steps)
    abstract = sk.abstract_model(task.make_model, config.seed)
    step = sk.make_train_step(abstract, tx, mesh, bound, loss_fn=task.loss_fn, batch_axes=task.batch_axes,
                              microbatches=config.microbatches)  # fmt: skip
    step.check_batch(task.batch_spec())
    if isinstance(task, ImageTask | VolumeTask):  # the validation batches too (evaluate checks them like training)
        step.check_batch(task.batch_spec(size=task.val_batch_size), evaluation=True)
    name = config.name or f"{config.config_name}-{config.strategy}"
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise sk.ShardkitError(f"name={name!r}: a run name is one folder name under run_dir (no '/', no '..')")
    return Run(mesh, task, step, schedule, Path(config.run_dir).expanduser() / name, preset)


# ------------------------------------------------------------------------------------------------------ running
def _evaluate(step: sk.TrainStep, state: sk.TrainState, batches: list[Any],
              progress: Callable[[], None] = lambda: None) -> dict[str, float]:  # fmt: skip
    """val_loss and val_<metric> for each of the loss's metrics: means over equal-sized batches, eval mode.
    `progress` is called after each batch (the watchdog's beat: a long evaluation is progress, not a hang)."""
    outs = []
    for v in batches:
        outs.append(jax.device_get(step.evaluate(state, v)))
        progress()
    val = {"val_loss": float(np.mean([loss for loss, _ in outs]))}
    return val | {f"val_{k}": float(np.mean([aux[k] for _, aux in outs])) for k in outs[0][1]}


def multi_process(config: ml_collections.ConfigDict) -> bool:
    """Whether this run joins several processes (`distributed`, JAX_COORDINATOR_ADDRESS, or a cluster's launcher)."""
    return bool(config.distributed or os.environ.get("JAX_COORDINATOR_ADDRESS") or cluster_env())


def train(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Trains (or resumes) the run `config` describes; returns a summary dict. Raises ShardkitError on bad config.
    `config.compile_only` (or a `target`, which needs it): compiles and reports instead (experiments/compile_only)."""
    if config.get("compile_only") or config.get("target"):
        return compile_only.run(config, print if jax.process_index() == 0 else lambda _: None, build)
    if multi_process(config) and not jax.distributed.is_initialized():
        init_distributed(heartbeat_timeout_s=config.get("heartbeat_timeout", 60))
    if config.jax_cache_dir and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(Path(config.jax_cache_dir).expanduser()))
    main = jax.process_index() == 0
    t_start = goodput.run_start()  # the process's start (imports included), or now for a later in-process call
    show_bar = main and config.progress and sys.stderr.isatty()
    say: Callable[[str], None] = (tqdm.write if show_bar else print) if main else (lambda _: None)
    compiled, chosen = None, None
    if config.strategy == "auto":  # the planner picks; then exactly the run the user would have typed (auto.py)
        best, why = auto.choose(config, build, say)
        config, run, compiled = auto.resolved(config, best), best.run, best.compiled
        chosen = {**best.overrides(), "estimate_s": best.estimate_s, "memory": best.memory, "why": why}
    else:
        run = build(config)
    # one trainer per run, taken before the checkpointer (which clears unfinished saves) and the metrics file
    with runtime.RunLock(run.dir) if main else contextlib.nullcontext():
        ckpt = Checkpointer(run.dir / "checkpoints", keep=config.keep, async_save=config.async_checkpointing)
        try:
            return _train(config, run, ckpt, say, show_bar, t_start, compiled, chosen)
        finally:
            ckpt.close()  # waits for an in-flight save: the last good checkpoint is committed


def _header(config: ml_collections.ConfigDict, run: Run, say: Callable[[str], None]) -> dict[str, Any]:
    """Prints what is about to run; returns the run's `info` (also stored in config.json)."""
    step, mesh, n_dev = run.step, run.mesh, run.mesh.devices.size
    where = f"{step.strategy.name} on mesh {','.join(f'{a}={n}' for a, n in mesh.shape.items())}"
    if config.mesh.strip() == "auto":
        where += " (auto: --config.mesh=... to choose)"
    say(f"shardkit: {run.dir} | {where} | {n_dev} x {jax.devices()[0].device_kind}, {jax.process_count()} process(es)")
    say(f"  strategy {step.strategy.name}: {step.strategy.description}")
    if getattr(step, "describe", None):  # a step's own header lines (sdp: the ownership, what a device sends)
        step.describe(say)
    info = run.task.describe(say)
    preset = run.preset
    peak = config.peak_flops or (preset.peak_flops if preset else 0.0)
    if not peak and sk.rules.platform_family(mesh) == "cpu":
        peak = calibrate_peak_flops(mesh.devices.flat)
        say(
            f"peak: measured {peak * n_dev / 1e9:.1f} GFLOP/s fp32 matmul (512^3 on {n_dev} CPU devices at once) = "
            f"{peak / 1e9:.2f} GFLOP/s per device; MFU is relative to that"
        )
    elif peak:
        say(f"peak: {peak / 1e12:.1f} TFLOP/s per device ({f'preset {preset.name}' if preset else 'config'})")
    else:
        say(f"peak: unknown for {jax.devices()[0].device_kind}: no MFU (give --config.peak_flops or a preset)")
    hbm = preset.hbm_bytes if preset else 0.0
    return dict(where=where, task=run.task.kind, **info, peak_flops=peak, hbm=hbm)


def _train(
    config: ml_collections.ConfigDict, run: Run, ckpt: Checkpointer, say: Callable[[str], None], bar: bool, t0: float,
    compiled: Any = None, chosen: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    step, task = run.step, run.task
    supervise.report(run_dir=str(run.dir), process=jax.process_index(), processes=jax.process_count(),
                     checkpoints=str(ckpt.directory), checkpoint=ckpt.latest_step(), phase="start-up",
                     heartbeat_timeout=config.get("heartbeat_timeout", 60))  # fmt: skip
    prof = Profiler(config, run.dir, say)  # an unwritable profile directory: the error, before anything runs
    gp = goodput.Goodput(run.dir, t0)  # where the wall time goes (experiments/goodput.py)
    info = _header(config, run, say)
    if chosen:
        info["auto"] = chosen
    if compiled is None:
        t_compile = time.perf_counter()
        with gp.timed("compile"):
            compiled = step.lower(step.abstract_state(), task.batch_spec(step)).compile()
        say(f"compiled the train step in {time.perf_counter() - t_compile:.1f} s")
    local = resume.emergency_checkpointer(config, run.dir)  # each process's own shards, every few steps
    state, start = resume.start(config, run, ckpt, local, say)  # the newest checkpoint, else a fresh model
    gp.resumed = start > 0
    mem = bytes_per_device((state.params, state.opt_state))
    temp, hbm = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0), info.pop("hbm")
    say(
        f"memory: params + optimizer state {_mb(max(mem.values()))} per device (max over {len(mem)} devices"
        f"{f', of {_mb(hbm)} HBM' if hbm else ''}); XLA temporaries {_mb(temp)}"
    )
    if jax.process_index() == 0:
        run.dir.mkdir(parents=True, exist_ok=True)
        resolved = {**config.to_dict(), "model": dataclasses.asdict(run.model_cfg), "info": info}
        (run.dir / "config.json.tmp").write_text(json.dumps(resolved, indent=2))
        os.replace(run.dir / "config.json.tmp", run.dir / "config.json")

    val = task.val_batches(step)
    log, pending, stopped = Log(config, run, start, info["peak_flops"], say, bar, t0), None, None
    last_good = lambda: f"step {ckpt.latest_step()} in {ckpt.directory}"
    every = resume.emergency_every(config)
    status = dict(run_dir=str(run.dir), process=jax.process_index(), processes=jax.process_count(),
                  checkpoints=str(ckpt.directory), checkpoint=ckpt.latest_step(), step=start,
                  heartbeat_timeout=config.get("heartbeat_timeout", 60),
                  emergency_dir=str(local.directory.parent) if local else None)  # fmt: skip
    supervise.report(**status)  # the supervising parent's view (experiments/supervise.py), kept current
    supervised = supervise.supervised()

    def phase(name: str, k: int) -> None:  # what the run was doing, for the line a dead peer's survivor gets
        status.update(phase=name, phase_step=k, step=k)  # step k's metrics are in: the step reached
        if supervised:
            supervise.report(**status | {"checkpoint": ckpt.latest_step()})

    dog = Watchdog(config.get("watchdog", "auto"), run.dir / "logs", jax.process_index(),
                   lambda: supervise.resume_from(status))  # fmt: skip
    try:
        with Stop() as stop, dog, gp.loop():
            hang, kill = injected_hang(), injected_kill()  # the fault tests' hooks: None in a real run
            for s in range(start, config.steps):
                with gp.timed("profile"):
                    prof.at(s, state)  # the trace of --config.profile.steps steps starts or stops here
                if s + 1 == hang:
                    hang_here()
                with gp.timed("data"):
                    batch = task.train_batch(step, s)
                state, metrics = compiled(
                    state, step.prepare(batch)
                )  # dispatched: the host goes on while the devices work
                ckpt.check()  # a background save that failed (disk full) stops the run here, last good step named
                if pending:
                    log.emit(log.record(*pending, last_good()))
                    dog.beat(pending[0])
                k, pending = s + 1, (s + 1, metrics)
                stopping = stop.at(k)  # every process asks at every step (several processes: a collective answer)
                evaluate = k == config.steps or (config.eval_every and k % config.eval_every == 0)
                save = k == config.steps or (config.ckpt_every and k % config.ckpt_every == 0) or stopping
                emergency = local is not None and k % every == 0 and not save
                if evaluate or save or emergency:
                    rec, pending = log.record(*pending, last_good()), None
                    dog.beat(k)
                    if evaluate:
                        phase("evaluation", k)
                        first = contextlib.nullcontext() if log.evaluated else dog.paused()  # its compile
                        with first, gp.timed("evaluation"):
                            rec.update(_evaluate(step, state, val, lambda k=k: dog.beat(k)))
                        log.evaluated = True
                    log.emit(rec)
                    if save:
                        phase("checkpoint save", k)
                        with gp.timed("checkpoint"):
                            ckpt.save(state, resume.meta(config, k, info["where"]))
                            if k == kill:
                                die()  # the fault tests: a peer dying inside a save
                            if stopping:
                                ckpt.wait()  # committed while a second Ctrl-C is still only a warning
                    elif emergency:
                        phase("emergency checkpoint", k)
                        with gp.timed("checkpoint"):
                            ok = all_finite(state)
                        if ok:  # a non-finite state is the next record's error
                            with gp.timed("checkpoint"):
                                local.save(state, resume.meta(config, k, info["where"]))
                            status["emergency"] = k
                    status["phase"] = "training"
                    dog.beat(k)
                    log.t_last = time.perf_counter()
                if supervised and (save or emergency or evaluate or k % config.log_every == 0):  # not every step
                    supervise.report(**status | {"step": k - (pending is not None), "checkpoint": ckpt.latest_step()})
                if stopping:
                    stopped = signal.Signals(stop.signal).name
                    supervise.report(stopped=stopped)
                    line = f"{stopped}: checkpointed step {k}; rerun the same command to resume"
                    say(line) if jax.process_index() == 0 else print(line, flush=True)  # every process says it
                    break
            with gp.timed("profile"):
                prof.stop(state)  # a trace still running when the run ends
            phase("checkpoint save", int(state.step))
            with gp.timed("checkpoint"):
                ckpt.wait()  # the last save committed before "done" is said (a peer lost here is named as lost here)
    finally:
        goodput.finish(gp, log, start, say)  # <run>/goodput.json, the line, TensorBoard; closes the log
    summary = _summary(config, run, info, log.records, state, start, stopped, mem, t0, say)
    return summary | {"first_step_s": log.first_step_s, "auto": chosen}


def _summary(config: ml_collections.ConfigDict, run: Run, info: dict, recs: list, state: sk.TrainState, start: int,
             stopped: str | None, mem: dict, t0: float, say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The summary dict `train` returns, and the closing line."""
    rate_key = f"{run.task.unit}_per_s"
    rates = [r[rate_key] for r in recs[1:] or recs]
    last_val = next((r for r in reversed(recs) if "val_loss" in r), {})
    summary = dict(run_dir=str(run.dir), start_step=start, step=int(state.step), stopped=stopped)
    summary.update(val_loss=last_val.get("val_loss"), val_accuracy=last_val.get("val_accuracy"))
    summary.update(
        losses=[r["loss"] for r in recs], loss=recs[-1]["loss"] if recs else None, wall_s=time.perf_counter() - t0
    )
    summary.update({rate_key: statistics.median(rates) if rates else None})
    summary.update({k: info[k] for k in ("unigram_entropy", "chance_loss", "chance_accuracy", "baseline_loss")
                    if k in info})  # fmt: skip
    summary.update(mfu=statistics.median(r["mfu"] for r in recs) if recs and info["peak_flops"] else None)
    summary.update(num_params=run.model_cfg.num_params(), bytes_per_device=max(mem.values()))
    if not recs:
        say(f"nothing to do: the run is already at step {start} of {config.steps} (raise --config.steps to go on)")
        return summary
    vs = ""
    if last_val and "unigram_entropy" in info:
        vs = f" | val_loss {last_val['val_loss']:.4f} vs unigram entropy {info['unigram_entropy']:.3f}"
    elif last_val and "baseline_loss" in info:
        vs = f" | val_loss {last_val['val_loss']:.4f} vs predicting the mean {info['baseline_loss']:.4f}"
    elif last_val:
        vs = f" | {val_text(last_val)} (chance {info['chance_accuracy']:.1%})"
    mfu = f" | MFU {summary['mfu']:.1%} median" if summary["mfu"] is not None else " | MFU not computed (no peak)"
    say(
        f"done: step {summary['step']} in {summary['wall_s']:.0f} s | loss {summary['loss']:.4f}{vs} | "
        f"{summary[rate_key]:,.0f} {run.task.short}/s median{mfu}"
    )
    return summary


def main(argv: Sequence[str]) -> None:
    """absl entry point: `python -m experiments.train --config=... --config.x=...`; errors exit 2 (config) or 1."""
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    for flag, var in (_COORD, "JAX_COORDINATOR_ADDRESS"), (_NPROC, "JAX_NUM_PROCESSES"), (_PID, "JAX_PROCESS_ID"):
        if flag.value not in ("", -1):
            os.environ[var] = str(flag.value)
    config = runtime.loaded_config(_CONFIG)
    if multi_process(config) and config.get("supervise", True) and not supervise.supervised():
        sys.exit(supervise.run(sys.argv[1:]))  # this process trains as its child: a dead peer is one line
    try:
        summary = train(config)
    except Exception as e:
        if jax.process_count() > 1 and supervise.collective_failure(e):  # a peer died: named by the supervisor
            supervise.peer_failure(e, config.get("heartbeat_timeout", 60))
        if not isinstance(e, sk.ShardkitError | NonFiniteError):
            raise
        print(f"error: {e}", file=sys.stderr)  # 2: the config or the input; 1: the run failed (NaN, disk full)
        sys.exit(2 if isinstance(e, sk.ShardkitError) and not isinstance(e, SaveError) else 1)
    if summary["stopped"]:
        sys.exit(128 + signal.Signals[summary["stopped"]].value)
    if summary.get("compile_only"):
        sys.exit(0 if summary["fits"] is not False else 1)  # 1: the compiled peak does not fit in HBM


if __name__ == "__main__":
    runtime.run_app(main)
