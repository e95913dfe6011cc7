"""Explain a training plan without training: collectives per mesh axis and memory per device, vs the cost model.

    python -m experiments.explain --config=experiments/configs/gpt_tiny.py --config.strategy=fsdp_tp \
        --config.mesh="data=2,fsdp=2,tensor=2" [--json=report.json] [--plot=report.png]
    python -m experiments.explain --config=experiments/configs/gpt_7b.py --config.mesh="data=4,fsdp=8,tensor=8"

Takes the same config files and `--config.x` flags as `experiments.train`, but reads no data and allocates no
parameters: the train step is built from the abstract model and compiled for ShapeDtypeStructs that carry their
shardings. A mesh larger than this machine (a 256-device plan on a laptop) cannot be compiled here: it says so,
compiles on the largest mesh with the same axis proportions that fits (else with the largest axes halved), and
prints the figures scaled to the requested mesh, labelled SCALED (method in shardkit/explain.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from absl import flags, logging

import shardkit as sk
from experiments import runtime, tasks
from experiments import train as tr  # sets XLA_FLAGS (virtual CPU devices) before jax is imported
from experiments.data import text
from models.gpt import GPT
from shardkit.explain import POLICIES, Report, explain

_JSON = flags.DEFINE_string("json", "", "also write the report as JSON to this path")
_PLOT = flags.DEFINE_string("plot", "", "also write a PNG bar chart to this path")
_REMAT = flags.DEFINE_string(
    "remat_policies",
    "",
    "also compile the step under these remat policies, ';'-separated ('all': none;full;dots;"
    "dots_no_batch; 'names:a,b' allowed), and tabulate each one's temporary memory and recomputed FLOPs",
)


target_axes = runtime.target_axes  # (config, devices) -> the plan's mesh; "auto" fits the strategy


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
    n_here = jax.device_count()
    target = target_axes(config, n_here)
    built, how = fit_mesh(target, n_here)
    strategy = runtime.strategy_of(config, math.prod(built.values()))
    mesh = sk.make_mesh(built, jax.devices()[: math.prod(built.values())])
    strategy.bind(mesh)
    tx, _ = tr.make_optimizer(config.optimizer, max(config.steps, config.optimizer.warmup_steps + 1))
    if lm:
        model_cfg = tr.model_config(config, text.VOCAB_SIZE)
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
    report = explain(step, step.abstract_state(), batch, model_cfg=model_cfg, target_mesh=target if scaled else None,
                     remat_policies=remat_policies)  # fmt: skip
    grid = lambda m: ",".join(f"{a}={n}" for a, n in m.items())
    header = (f"{config.config_name}: {model_cfg.num_params() / 1e6:.2f}M parameters, {config.strategy}, "
              f"mesh {grid(target)} ({math.prod(target.values())} devices"
              f"{', auto: --config.mesh=... to choose' if config.mesh.strip() == 'auto' else ''})")  # fmt: skip
    if scaled:
        header += (f"\nthis machine has {n_here} {jax.devices()[0].platform} devices, fewer than the plan's "
                   f"{math.prod(target.values())}: XLA cannot compile for devices it lacks, so the step is compiled on "
                   f"{grid(built)} ({how}) and the figures marked SCALED are estimates for {grid(target)}")  # fmt: skip
    return report, header


def main(argv: Sequence[str]) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    try:
        policies = POLICIES if _REMAT.value == "all" else [p for p in _REMAT.value.split(";") if p]
        report, header = explain_config(runtime.loaded_config(tr._CONFIG), policies)
    except sk.ShardkitError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(header)
    print(report.text())
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            f.write(report.to_json())
        print(f"wrote {_JSON.value}")
    if _PLOT.value:
        print(f"wrote {report.plot(_PLOT.value)}")


if __name__ == "__main__":
    runtime.run_app(main)
