"""Compile a run for its hardware without running it (MaxText's train_compile, for every model family and strategy).

    python -m experiments.train --config=experiments/configs/gpt_7b.py --config.target=v5p-128 --config.compile_only
    python -m experiments.train --config.compile_only                     # this machine's devices, no training

Builds the train step on the abstract model (no parameter allocated, no data read beyond the vocabulary), compiles
it for an abstract batch (`step.abstract_batch`) on the target's devices (XLA's TPU compiler for a TPU target, its
CUDA compiler for a GPU one: shardkit/targets_gpu.py) and prints `sk.explain`'s report: collectives read back
from the program, memory per device next to the cost model's prediction, and whether the peak fits in the chip's
HBM. `train` returns its summary; the CLI exits 0 if it fits,
1 if not (and 2 for a configuration error, as every run). `--config.save_executable=path` also writes the
serialized executable (jax.experimental.serialize_executable), for a TPU host to load without compiling.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

import shardkit as sk
from experiments import runtime, tasks
from experiments.data import text
from experiments.optim import make_optimizer
from models.gpt import GPT
from shardkit.explain import Report, explain


def fit_mesh(axes: dict[str, int], num_devices: int) -> tuple[dict[str, int], str]:
    """The largest mesh of at most `num_devices` with the same axis proportions (axes / k, k | every degree > 1);
    failing that, the largest axes halved until it fits. Returns (mesh, how)."""
    if math.prod(axes.values()) <= num_devices:
        return dict(axes), "as requested"
    g = math.gcd(*[n for n in axes.values() if n > 1])
    for k in range(2, g + 1):
        cand = {a: n // k if n > 1 else 1 for a, n in axes.items()}
        if g % k == 0 and math.prod(cand.values()) <= num_devices:
            return cand, f"same proportions: every axis / {k}"
    cand = dict(axes)
    while math.prod(cand.values()) > num_devices:
        a = max(cand, key=cand.get)
        cand[a] //= next(p for p in range(2, cand[a] + 1) if cand[a] % p == 0)
    return cand, "proportions NOT kept (no common factor fits): the largest axes divided until it fits"


def _slices_outermost(axes: dict[str, int], slices: int) -> dict[str, int]:
    """The strategy's default mesh with its first axis a multiple of the target's slices (hosts), which it must span
    (sk.make_mesh): the missing factor moved from the first later axis that has it (data=2,fsdp=16 on 4 hosts ->
    data=4,fsdp=8); unchanged when none has it (make_mesh then says what to give)."""
    names, first = list(axes), next(iter(axes))
    need = slices // math.gcd(axes[first], slices)
    for a in names[1:]:
        if need > 1 and axes[a] % need == 0:
            return {**axes, first: axes[first] * need, a: axes[a] // need}
    return axes


def explain_config(config: ml_collections.ConfigDict, remat_policies: Sequence[str] = ()) -> tuple[Report, str]:
    """(report, header) for the plan `config` describes; no parameter allocated. A GPT config reads no data (its
    vocabulary is the byte tokenizer's); an image config reads the bundled dataset's shape and classes.
    `remat_policies`: adds the per-policy memory / recomputed-FLOPs table (`sk.explain(..., remat_policies=)`)."""
    for key in ("batch_size", "seq_len", "microbatches"):
        if key in config and config[key] < 1:
            raise sk.ShardkitError(f"{key}={config[key]} must be >= 1")
    runtime.check_choices(config)
    lm = config.get("task", "lm") == "lm"
    if lm and config.data.path and not config.model.vocab_size:
        raise sk.ShardkitError("explain reads no data: with data.path set, give --config.model.vocab_size")
    tgt = sk.target(config.target) if config.get("target") else None  # hardware that need not be present
    n_here = tgt.num_devices if tgt else jax.device_count()
    target = runtime.target_axes(config, n_here)
    if tgt and tgt.num_slices > 1 and config.mesh.strip() == "auto":
        target = _slices_outermost(target, tgt.num_slices)
    built, how = fit_mesh(target, n_here)
    if tgt and built != target:
        raise sk.ShardkitError(
            f"mesh {','.join(f'{a}={n}' for a, n in target.items())} needs {math.prod(target.values())} devices, and "
            f"target {tgt.name} has {tgt.num_devices}: give a mesh of {tgt.num_devices} (one degree may be -1), or a "
            "larger target"
        )
    strategy = runtime.strategy_of(config, math.prod(built.values()))  # --config.strategy looked up once
    mesh = sk.make_mesh(built, target=tgt) if tgt else sk.make_mesh(built, jax.devices()[: math.prod(built.values())])
    strategy = strategy.bind(mesh)  # and bound once: make_train_step takes the BoundStrategy as it is
    tx, _ = make_optimizer(config.optimizer, max(config.steps, config.optimizer.warmup_steps + 1))
    if lm:
        model_cfg = tasks.model_config(config, text.VOCAB_SIZE)
        abstract = sk.abstract_model(lambda rngs: GPT(model_cfg, rngs=rngs), config.seed)
        step = sk.make_train_step(abstract, tx, mesh, strategy, microbatches=config.microbatches)
        tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32, sharding=step.batch_sharding)
        batch = {"inputs": tokens, "targets": tokens}
    else:
        task = tasks.build_task(config)
        model_cfg = task.model_cfg
        abstract = sk.abstract_model(task.make_model, config.seed)
        step = sk.make_train_step(abstract, tx, mesh, strategy, loss_fn=task.loss_fn, batch_axes=task.batch_axes,
                                  microbatches=config.microbatches)  # fmt: skip
        batch = task.batch_spec(step)
    scaled = built != target
    try:
        report = explain(step, step.abstract_state(), batch, model_cfg=model_cfg, hardware=tgt,
                         target_mesh=target if scaled else None, remat_policies=remat_policies)  # fmt: skip
    except jax.errors.JaxRuntimeError as e:  # the compiler's refusal: what the cost model expected, for the record
        e.add_note(_predicted_text(step, model_cfg, batch))
        raise
    grid = lambda m: ",".join(f"{a}={n}" for a, n in m.items())
    header = (f"{config.config_name}: {model_cfg.num_params() / 1e6:.2f}M parameters, {config.strategy}, "
              f"mesh {grid(target)} ({math.prod(target.values())} devices"
              f"{f' of target {tgt}, compiled by {tgt.compiler}' if tgt else ''}"
              f"{', auto: --config.mesh=... to choose' if config.mesh.strip() == 'auto' else ''})")  # fmt: skip
    if scaled:
        header += (f"\nthis machine has {n_here} {jax.devices()[0].platform} devices, fewer than the plan's "
                   f"{math.prod(target.values())}: XLA cannot compile for devices it lacks, so the step is compiled on "
                   f"{grid(built)} ({how}) and the figures marked SCALED are estimates for {grid(target)}")  # fmt: skip
    return report, header


def _predicted_text(step: Any, model_cfg: Any, batch: Any) -> str:
    """The cost model's figures for a step the compiler would not emit (memory and collectives per device)."""
    from shardkit.explain import predict

    shapes = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(batch)}
    nbytes = int(jax.numpy.dtype(jax.tree.leaves(step.abstract_state().params)[0].dtype).itemsize)
    platform = sk.rules.platform_family(step.mesh)
    pred = predict(step.strategy, model_cfg, dict(step.mesh.shape), shapes, nbytes, platform)
    if pred is None:
        return "  (no cost model of this model for this strategy: nothing predicted)"
    comms, memory, source = pred
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    mem = ", ".join(f"{k} {gib(v)}" for k, v in memory.items())
    sent = ", ".join(f"{k} {a} {gib(b)}" for (k, a), (_, b) in comms.items())
    return f"  predicted per device ({source}): {mem}\n  predicted collectives: {sent}"


def run(config: ml_collections.ConfigDict, say: Callable[[str], None], build: Callable | None = None) -> dict[str, Any]:
    """Compiles the run `config` describes and reports it; returns {fits, peak, hbm, compile_s, report}.
    `strategy=auto` (with `build`, experiments.train's): the planner's top candidates compiled for the target and
    ranked by what the compiler says (experiments/auto.py), the pick reported."""
    if not config.get("compile_only"):  # a target without it: nothing could run there
        raise sk.ShardkitError(
            f"target={config.target!r}: a target's devices can only be compiled for; add --config.compile_only (on "
            "a host with those chips, drop --config.target and run as usual)"
        )
    if config.strategy == "auto":
        from experiments import auto

        if build is None:
            raise sk.ShardkitError("compile_only with strategy=auto runs from experiments.train (it builds each run)")
        t0 = time.perf_counter()
        best, _ = auto.choose(config, build, say)
        fits = best.fits
        say(f"compiled {config.auto.top} candidates in {time.perf_counter() - t0:.1f} s; the pick: "
            f"--config.strategy={best.strategy} --config.mesh={best.grid} --config.kernels=remat={best.remat} "
            f"({'fits' if fits else 'does NOT fit'}: {best.memory / 2**30:.2f} GiB per device)")  # fmt: skip
        return dict(compile_only=True, fits=fits, peak=best.memory, hbm=None, compile_s=time.perf_counter() - t0,
                    report=None, stopped=None, auto=best.overrides())  # fmt: skip
    t0 = time.perf_counter()
    try:
        report, header = explain_config(config)
    except jax.errors.JaxRuntimeError as e:
        why = sk.targets.out_of_memory(e)
        if not why:
            raise
        # the compiler's own verdict (XLA:TPU's): it will not emit a program larger than the chip's HBM
        where = config.get("target") or "these devices"
        say(f"fits in HBM: NO -- XLA's compiler refused the program for {where}: {why}")
        for note in getattr(e, "__notes__", []):
            say(note)
        say(
            f"  plans that fit, ranked and compiled: python -m experiments.plan --model {config.config_name} "
            f"--batch {config.batch_size}" + (f" --target {config.target}" if config.get("target") else "")
        )
        return dict(compile_only=True, fits=False, peak=None, hbm=None, compile_s=time.perf_counter() - t0,
                    report=None, stopped=None, refused=why)  # fmt: skip
    compile_s = time.perf_counter() - t0
    say(header)
    say(report.text())
    say(f"compiled in {compile_s:.1f} s (and explained); {report.fits_text()}")
    if config.get("save_executable"):
        from jax.experimental.serialize_executable import serialize

        path = Path(config.save_executable).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_bytes(pickle.dumps(serialize(report.compiled)))  # (payload, in_tree, out_tree)
        tmp.replace(path)
        say(f"wrote the serialized executable to {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return dict(compile_only=True, fits=report.fits, peak=report.memory["peak"], hbm=report.hbm_bytes,
                compile_s=compile_s, report=report.to_dict(), stopped=None)  # fmt: skip
