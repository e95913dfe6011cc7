"""shardkit's train step against MaxText's on the same decoder, fsdp over 8 CPU devices: step time and start-up.

    python -m experiments.bench.bench_peers [--models tiny,mid] [--shardkit-remat full,none,none@host]
        [--maxtext-remat full,full@host,minimal] [--rounds 5] [--steps 5]
        [--maxtext-python /work/venv-maxtext/bin/python] [--out experiments/bench/results/bench_peers.json]
    python -m experiments.bench.bench_peers --target v5e-8 [--meshes fsdp,tp,tp_sp] [--remat full,best]
    python -m experiments.bench.bench_peers --target v5p-128 --model 7b [--cells plan,config,fsdp,maxtext]
    python -m experiments.bench.bench_peers --target v5p-256 --model 70b [--cells plan,config,maxtext]
    python -m experiments.bench.bench_peers --target h100-8 [--meshes fsdp,tp,tp_sp] [--remat full,best]
        [--maxtext-attention dot_product]

With --target, nothing runs: both train steps are compiled for that TPU topology by XLA's TPU compiler and their
programs compared (memory, HBM bytes, FLOPs, collectives): experiments/bench/peers_tpu.py says how; a GPU target
(h100-8) by XLA's CUDA compiler, experiments/bench/peers_gpu.py. With --model
too, the scale cells: shardkit's planner's first plan and its config against MaxText's own llama2 config at its
defaults (experiments/bench/peers_scale.py). The rest of
this docstring is the CPU timing.

MaxText is not a dependency of shardkit. It needs Python >= 3.12 and its wheel declares its requirements only
under extras (`cuda12`, `tpu`, ...): a plain `pip install maxtext` installs the package without JAX. The `tpu`
extra is the CPU-capable set (JAX, Flax, Optax, Orbax; its libtpu stays idle without a TPU):

    python3.12 -m venv /work/venv-maxtext        # outside the repository, apart from shardkit's venv
    /work/venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" jax==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.50.1 \
        jax-cuda12-plugin==0.12.0.1 jax-cuda12-pjrt==0.12.0.1 nvidia-cuda-nvcc-cu12

(pinned: unpinned, pip brings jax 0.12.1 / libtpu 0.0.52, whose Mosaic refuses MaxText's splash kernel; the CUDA 12
set is XLA's CUDA compiler for `--target h100-8`, the same as shardkit's on jax 0.12.0.1.)

Without it this benchmark says so, records "missing" in its JSON and exits cleanly.

The model (MODELS): a pre-norm decoder, RMSNorm, RoPE, multi-head attention, SwiGLU MLP, untied output
projection, fp32 parameters and compute, AdamW (warmup + cosine, clipping at 1.0, weight decay 0.1: MaxText's
defaults and the training runs' optimizer, experiments/optim.py), synthetic tokens. shardkit: models/gpt.py,
strategy `fsdp` on mesh fsdp=8, layers scanned (peer_shardkit.py). MaxText: its `llama2` decoder block with
`dot_product` attention, ici_fsdp_parallelism=8, scan_layers, hardware=cpu, dataset_type=synthetic, its own
`train_step` (peer_maxtext.py). Settings: each side's remat policy (shardkit `full` rematerialises every layer as
MaxText's `full` does; `none` keeps the activations; MaxText's `minimal` saves most matmul outputs); every
setting computes the same model and the same gradients.

Each (side, setting) runs in its own process (MaxText in its venv), started one after another: start-up to first
step is the wall time from launching it to the end of its first train step (imports, building the model and state,
tracing, compiling: no persistent compile cache on either side; one sample each). Then the processes stay up and the
timing alternates between them: `--rounds` rounds, each running `--steps` steps of every process in turn (the order
reversed every other round), so that load from other work on the host hits all alike; a process's round time is the
median of its steps. Ratios are per round (MaxText's median / shardkit's median), then the median over rounds, with
the range of the per-round ratios: a ratio > 1 means shardkit is faster. A setting may end in `@host`: that process
runs with experiments/host_malloc.py's allocator settings (glibc keeps freed memory instead of returning it to the
kernel and faulting it back in every step); without it, with glibc's defaults. The 8 virtual devices share the
host's cores: these are the total CPU work of a step, not a cluster's critical path. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.bench.timing import RESULTS, save_json
from experiments.host_malloc import HOST_MALLOC
from shardkit.targets_gpu import is_gpu_name

ROOT = Path(__file__).resolve().parents[2]
MAXTEXT_PYTHON = os.environ.get("MAXTEXT_PYTHON", "/work/venv-maxtext/bin/python")
INSTALL = (
    "MaxText is not installed for this benchmark. It needs Python >= 3.12 and lists its requirements only under "
    "extras; install it apart from shardkit's venv:\n"
    "    python3.12 -m venv /work/venv-maxtext\n"
    '    /work/venv-maxtext/bin/pip install "maxtext[tpu]==0.2.5" jax==0.12.0.1 jaxlib==0.12.0.1 libtpu==0.0.50.1 '
    "jax-cuda12-plugin==0.12.0.1 jax-cuda12-pjrt==0.12.0.1 nvidia-cuda-nvcc-cu12\n"
    "then rerun (or point --maxtext-python / MAXTEXT_PYTHON at that venv's python)."
)
PREFIX = "@@peer "
HOST = "@host"  # a setting's suffix: that process runs with experiments/host_malloc.py's allocator settings
#: name -> shape: the issue's matched tiny decoder (experiments/configs gpt_tiny), bench_mfu's gpt_mid, gpt_small
MODELS: dict[str, dict[str, int]] = {
    "tiny": dict(layers=4, d_model=128, heads=4, kv_heads=4, head_dim=32, mlp_dim=512, vocab=384, seq=128, batch=32),
    "mid": dict(layers=6, d_model=384, heads=6, kv_heads=6, head_dim=64, mlp_dim=1024, vocab=384, seq=256, batch=8),
    "small": dict(layers=12, d_model=768, heads=12, kv_heads=12, head_dim=64, mlp_dim=3072, vocab=384, seq=256,
                  batch=8),
}  # fmt: skip


def malloc_of(setting: str) -> str:
    """A setting's allocator: "host" (experiments/host_malloc.py) when it ends in `@host`, else "glibc"."""
    return "host" if setting.endswith(HOST) else "glibc"


def child_env(malloc: str = "glibc") -> dict[str, str]:
    """A child's environment: 8 CPU devices, no compile cache, and `malloc` "glibc" (the C library's defaults)
    or "host" (experiments/host_malloc.py's settings)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags = (flags + " --xla_force_host_platform_device_count=8").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # cold compiles on both sides
    if malloc == "host":
        env.update(HOST_MALLOC)
    elif malloc == "glibc":
        for name in HOST_MALLOC:
            env.pop(name, None)
    else:
        raise ValueError(f"malloc={malloc!r}: 'host' or 'glibc'")
    return env


def maxtext_version(python: str) -> str | None:
    """MaxText's version in `python`'s environment, or None when that python or its maxtext is missing."""
    if not (Path(python).exists() or shutil.which(python)):
        return None
    probe = "import importlib.metadata as m, maxtext; print(m.version('maxtext'))"
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=child_env(), timeout=300)
    return got.stdout.strip() if got.returncode == 0 else None


class Child:
    """One (side, setting) process: started, waited for until its first steps ran, then driven by `steps`."""

    def __init__(self, side: str, setting: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.side, self.setting, self.log = side, setting, log
        t = time.perf_counter()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True, cwd=ROOT, env=env or child_env())  # fmt: skip
        self.ready = self._read()
        self.startup_s = time.perf_counter() - t

    def _read(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        raise RuntimeError(f"{self.side} ({self.setting}) exited with {self.proc.wait()}; see {self.log}")

    def steps(self, n: int) -> list[float]:
        self.proc.stdin.write(f"steps {n}\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self) -> None:
        """Asks the process to quit (it may have died already: then its log says why)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            self.proc.wait(timeout=120)


def run_model(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    m = MODELS[name]
    sk_json = lambda r: json.dumps({**m, "shardkit_remat": r.removesuffix(HOST)})
    mt_json = lambda r: json.dumps({**m, "maxtext_remat": r.removesuffix(HOST)})
    mt_script = str(ROOT / "experiments/bench/peer_maxtext.py")
    specs = [("shardkit", r, [sys.executable, "-m", "experiments.bench.peer_shardkit", sk_json(r)])
             for r in args.shardkit_remat.split(",")]  # fmt: skip
    specs += [("maxtext", r, [args.maxtext_python, mt_script, mt_json(r)]) for r in args.maxtext_remat.split(",")]
    children: list[Child] = []
    try:
        for side, setting, argv in specs:
            env = child_env(malloc_of(setting))
            children.append(Child(side, setting, argv, logs / f"{name}_{side}_{setting}.log", env))
            print(f"  {name} {side} remat={setting}: first step after {children[-1].startup_s:.1f} s", flush=True)
        rounds: dict[str, list[float]] = {f"{c.side}:{c.setting}": [] for c in children}
        for r in range(args.rounds):
            for c in children if r % 2 == 0 else children[::-1]:
                rounds[f"{c.side}:{c.setting}"].append(statistics.median(c.steps(args.steps)))
    finally:
        for c in children:
            c.close()
    runs = {key: {"round_medians_s": t, "median_s": statistics.median(t)} for key, t in rounds.items()}
    for c in children:
        runs[f"{c.side}:{c.setting}"].update(startup_s=c.startup_s, first_step_s=c.ready["first_step_s"],
                                             jax=c.ready["jax"], params=c.ready.get("params"))  # fmt: skip
    best = {side: min((k for k in runs if k.startswith(side)), key=lambda k: runs[k]["median_s"])
            for side in ("shardkit", "maxtext")}  # fmt: skip
    ratios = {}
    for sk_key in (k for k in runs if k.startswith("shardkit")):
        for mt_key in (k for k in runs if k.startswith("maxtext")):
            per_round = [a / b for a, b in zip(rounds[mt_key], rounds[sk_key], strict=True)]
            ratios[f"{mt_key} / {sk_key}"] = {"median": statistics.median(per_round), "min": min(per_round),
                                              "max": max(per_round), "per_round": per_round}  # fmt: skip
    return {"model": m, "runs": runs, "best": best, "ratios": ratios,
            "best_vs_best": ratios[f"{best['maxtext']} / {best['shardkit']}"]}  # fmt: skip


def table(result: dict[str, Any]) -> str:
    lines = [f"train step, fsdp over 8 CPU devices, fp32, AdamW (host load {result['load_before']} before, "
             f"{result['load_after']} after; @host: experiments/host_malloc.py's allocator; x = MaxText / shardkit, "
             "> 1: shardkit faster)"]  # fmt: skip
    lines.append(f"{'model':<6} {'side':<9} {'remat':<8} {'params':>10} {'step ms':>8} {'first step s':>12} "
                 f"{'x vs MaxText full':>18}")  # fmt: skip
    for name, res in result["models"].items():
        m = res["model"]
        lines.append(f"{name} ({m['layers']} x {m['d_model']}, seq {m['seq']}, batch {m['batch']}):")
        for key, run in res["runs"].items():
            side, setting = key.split(":")
            ref = res["ratios"].get(f"maxtext:full / {key}")
            x = f"{ref['median']:.2f}x ({ref['min']:.2f}-{ref['max']:.2f})" if ref else ""
            lines.append(f"{'':<6} {side:<9} {setting:<8} {run['params'] or 0:10,} {run['median_s'] * 1e3:8.0f} "
                         f"{run['startup_s']:12.1f} {x:>18}")  # fmt: skip
        bb, best = res["best_vs_best"], res["best"]
        lines.append(f"{'':<6} best vs best ({best['maxtext']} / {best['shardkit']}): {bb['median']:.2f}x "
                     f"(rounds {bb['min']:.2f}-{bb['max']:.2f})")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,mid", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--shardkit-remat", default="full,none,none@host", help="settings; @host: host_malloc")
    parser.add_argument("--maxtext-remat", default="full,full@host,minimal", help="settings; @host: host_malloc")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per process per round")
    parser.add_argument("--maxtext-python", default=MAXTEXT_PYTHON)
    parser.add_argument("--out", default=f"{RESULTS}/bench_peers.json")
    parser.add_argument("--logs", default="/tmp/bench_peers_logs", help="the children's stderr")
    parser.add_argument(
        "--target",
        default="",
        help="a TPU target (v5e-8) or a GPU one (h100-8): compile both sides for it, no timing "
        "(experiments/bench/peers_tpu.py, peers_gpu.py); --models and the timing flags are then ignored",
    )
    parser.add_argument("--meshes", default="fsdp,tp,tp_sp", help="with --target: of fsdp, tp, tp_sp")
    parser.add_argument("--remat", default="full,best", help="with --target: of full, best")
    parser.add_argument("--maxtext-attention", default="", help="with a GPU --target: MaxText once more with it")
    parser.add_argument("--model", default="", help="with --target: a scale cell's model, 7b or 70b (peers_scale.py)")
    parser.add_argument("--cells", default="", help="with --model: the cells compiled (default all of the model's)")
    args = parser.parse_args(argv)
    if args.model and not args.target:
        from shardkit.errors import ShardkitError

        raise ShardkitError(f"--model {args.model} compiles scale cells for a target: add --target (v5p-128 for 7b, "
                            "v5p-256 for 70b)")  # fmt: skip
    version = maxtext_version(args.maxtext_python)
    if version is None:
        print(INSTALL)
        save_json({"maxtext": "missing", "maxtext_python": args.maxtext_python, "install": INSTALL}, args.out)
        return
    if args.target and args.model:
        from experiments.bench import peers_scale

        default = args.out == parser.get_default("out")
        out = f"{RESULTS}/bench_peers_tpu_{args.model}.json" if default else args.out
        cells = args.cells.split(",") if args.cells else list(peers_scale.CELLS.get(args.model, ()))
        result = peers_scale.run(args.target, args.model, cells, args.maxtext_python, Path(args.logs), out)
        save_json({"maxtext": version, **result}, out)
        return
    if args.target and is_gpu_name(args.target):
        from experiments.bench import peers_gpu

        out = args.out if args.out != parser.get_default("out") else f"{RESULTS}/bench_peers_gpu.json"
        result = peers_gpu.run(args.target, args.meshes.split(","), args.remat.split(","), args.maxtext_python,
                               Path(args.logs), args.maxtext_attention)  # fmt: skip
        save_json({"maxtext": version, **result}, out)
        return
    if args.target:
        from experiments.bench import peers_tpu

        out = args.out if args.out != parser.get_default("out") else f"{RESULTS}/bench_peers_tpu.json"
        result = peers_tpu.run(args.target, args.meshes.split(","), args.remat.split(","), args.maxtext_python,
                               Path(args.logs))  # fmt: skip
        save_json({"maxtext": version, **result}, out)
        return
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"maxtext": version, "maxtext_python": args.maxtext_python,
                              "load_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
                              "rounds": args.rounds, "steps": args.steps, "host_malloc": HOST_MALLOC,
                              "models": {}}  # fmt: skip
    for name in args.models.split(","):
        result["models"][name] = run_model(name, args, logs)
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(table(result))
    save_json(result, args.out)


if __name__ == "__main__":
    main()
