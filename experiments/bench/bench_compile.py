"""Compile time against depth, and the default run's start-up with a cold and a warm persistent compile cache.

    python -m experiments.bench.bench_compile [--depths 2,4,8,16,32]
        [--out experiments/bench/results/bench_compile.json]

1. Depth: the gpt_tiny width (128, 4 heads of 32, AdamW, fsdp on data=2,fsdp=4, 8 CPU devices) at L layers, the
   train step lowered and compiled with the persistent cache off, for the layers kernel `scan` (one compiled
   layer: flat in L) and `unrolled` (L inlined layers: grows with L), with one step's time next to it.
2. Start-up: `python -m experiments.train` (the README's default run, 2 steps) in a fresh process, twice, on one
   new cache directory: the first run compiles everything (cold), the second finds it in the cache (warm). The
   CLI's own lines are read: "compiled the train step in X s" and "first step done Y s after start" (Python's
   start-up and imports included).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import optax

import shardkit as sk
from experiments.bench.bench_mfu import VOCAB, model_configs
from experiments.bench.timing import RESULTS, compile_timed, gpt_batch, save_json, time_steps
from models.gpt import GPT


def compile_time(layers: int, kernel: str) -> dict[str, float]:
    cfg, batch, seq = model_configs()["gpt_tiny"]
    cfg = dataclasses.replace(cfg, num_layers=layers)
    mesh = sk.make_mesh("data=2,fsdp=4")
    strategy = sk.strategies.strategy("fsdp").replace(layers=kernel)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy)
    step = sk.make_train_step(model, optax.adamw(1e-4), mesh, strategy)
    state = step.init_state()
    data = gpt_batch(VOCAB, batch, seq, step.batch_sharding)
    compiled, lower_s, compile_s = compile_timed(step, state, data)
    # one warm-up step, then 3 dispatched back to back and waited for once: their mean
    step_s = time_steps(compiled, state, data, 3, block_each=False)[0].median
    return {"lower_s": lower_s, "compile_s": compile_s, "step_s": step_s}


def startup(cache: pathlib.Path, runs: pathlib.Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.train", "--config.steps=2", f"--config.run_dir={runs}",
           f"--config.jax_cache_dir={cache}", "--config.progress=False"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=True).stdout
    wall = time.perf_counter() - t
    grab = lambda pattern: float(m.group(1)) if (m := re.search(pattern, out)) else None
    return {"compile_s": grab(r"compiled the train step in ([\d.]+) s"),
            "first_step_s": grab(r"first step done ([\d.]+) s after start"), "process_wall_s": wall}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="2,4,8,16,32")
    parser.add_argument("--out", default=f"{RESULTS}/bench_compile.json")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # part 1 measures XLA, not the cache
    result: dict[str, Any] = {"jax": jax.__version__, "depth": {}, "startup": {}}
    for layers in map(int, args.depths.split(",")):
        result["depth"][layers] = {kernel: compile_time(layers, kernel) for kernel in ("scan", "unrolled")}
        row = result["depth"][layers]
        print(f"L={layers:>3}: scan compile {row['scan']['compile_s']:5.1f} s, step {row['scan']['step_s']:.3f} s | "
              f"unrolled compile {row['unrolled']['compile_s']:5.1f} s, step {row['unrolled']['step_s']:.3f} s",
              flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cache = pathlib.Path(tmp) / "jax_cache"
        for label in ("cold", "warm"):
            result["startup"][label] = startup(cache, pathlib.Path(tmp) / f"runs_{label}")
            print(f"default run, {label} cache: {result['startup'][label]}", flush=True)
    save_json(result, args.out)


if __name__ == "__main__":
    main()
