"""Performance levers of the fsdp GPT train step, A/B against a baseline: one process per lever, timed alternately.

    python -m experiments.bench.bench_levers [--model mid] [--levers base,remat_none,remat_dots] [--rounds 3]
        [--steps 2] [--mesh fsdp=8] [--out experiments/bench/results/bench_levers.json]

Each lever is bench_peers.py's shardkit child (`peer_shardkit.py`: the GPT at a MODELS shape, fp32, the training
runs' AdamW, strategy `fsdp`) with one thing changed: a remat policy, a layers kernel, or XLA flags (LEVERS).
A lever's name followed by `@host` (`remat_none@host`) runs it with experiments/host_malloc.py's allocator
settings instead of glibc's defaults, as bench_peers.py's settings do.
The levers that needed code of their own (the stacked weights gathered once before the scan, the scan unrolled
2 layers per iteration: the layers kernels `scan:gather` / `scan:unroll=2` of commit 815421b, reverted after it)
run only with that commit's code applied (`git cherry-pick -n 815421b`); without it they are skipped, not run
as the plain scan. docs/performance.md "Levers tried" has every figure.
The processes start one after another, then the timing alternates between them as bench_peers.py's does
(`--rounds` rounds of `--steps` steps each, the order reversed every other round, a round's time the median of
its steps). A lever's ratio is the median over rounds of base's round time / the lever's (> 1: the lever is
faster), with the range of the per-round ratios. The first lever listed is the base. Nothing is asserted. The
JSON keeps one entry per command line (its arguments), the latest run of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from experiments.bench.bench_peers import HOST, MODELS, Child, child_env, malloc_of
from experiments.bench.timing import RESULTS, save_json

#: name -> (changes to the peer child's JSON, extra XLA flags)
LEVERS: dict[str, tuple[dict[str, Any], str]] = {
    "base": ({"shardkit_remat": "full"}, ""),
    "remat_none": ({"shardkit_remat": "none"}, ""),
    "remat_dots": ({"shardkit_remat": "dots"}, ""),  # = the remat kernel dots_no_batch
    "unrolled": ({"shardkit_remat": "full", "kernels": {"layers": "unrolled"}}, ""),
    "unrolled_none": ({"shardkit_remat": "none", "kernels": {"layers": "unrolled"}}, ""),
    # layers kernels of commit 815421b (measured slower, reverted): run them after `git cherry-pick -n 815421b`
    "gather": ({"shardkit_remat": "full", "kernels": {"layers": "scan:gather"}}, ""),
    "gather_none": ({"shardkit_remat": "none", "kernels": {"layers": "scan:gather"}}, ""),
    "unroll2": ({"shardkit_remat": "full", "kernels": {"layers": "scan:unroll=2"}}, ""),
    "eigen1": ({"shardkit_remat": "full"}, "--xla_cpu_multi_thread_eigen=false"),
    "xnnpack": ({"shardkit_remat": "full"}, "--xla_cpu_use_xnnpack=true"),
    "no_emitters": ({"shardkit_remat": "full"}, "--xla_cpu_use_fusion_emitters=false"),
    "no_conc_sched": ({"shardkit_remat": "full"}, "--xla_cpu_enable_concurrency_optimized_scheduler=false"),
}


def has_scan_options() -> bool:
    """Whether this checkout's `scan` layers kernel takes options (commit 815421b's `scan_options`)."""
    import shardkit.layers

    return hasattr(shardkit.layers, "scan_options")


def lever_of(name: str) -> tuple[dict[str, Any], str]:
    """A lever's (changes to the peer child's JSON, extra XLA flags); `name@host` is `name` under host_malloc."""
    return LEVERS[name.removesuffix(HOST)]


def argv_of(name: str, model: dict[str, int], mesh: str) -> list[str]:
    spec = json.dumps({**model, "mesh": mesh, **lever_of(name)[0]})
    return [sys.executable, "-m", "experiments.bench.peer_shardkit", spec]


def env_of(name: str) -> dict[str, str]:
    """The child's environment: bench_peers' (8 devices, the allocator settings) plus the lever's XLA flags."""
    env = child_env(malloc_of(name))
    flags = lever_of(name)[1]
    if flags:
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {flags}"
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mid", help=f"of {', '.join(MODELS)}")
    parser.add_argument(
        "--levers",
        default="base,remat_none,remat_dots",
        help=f"of {', '.join(LEVERS)}, each optionally @host; first = base",
    )
    parser.add_argument("--mesh", default="fsdp=8")
    parser.add_argument("--batch", type=int, default=0, help="global batch (0: the model's in bench_peers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=f"{RESULTS}/bench_levers.json")
    parser.add_argument("--logs", default="/tmp/bench_levers_logs")
    args = parser.parse_args(argv)
    model = {**MODELS[args.model], **({"batch": args.batch} if args.batch else {})}
    names = args.levers.split(",")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    children: dict[str, Child] = {}
    load_before = [round(x, 2) for x in os.getloadavg()]
    try:
        for name in list(names):
            if ":" in lever_of(name)[0].get("kernels", {}).get("layers", "") and not has_scan_options():
                print(f"  {name}: skipped, needs commit 815421b's scan options (git cherry-pick -n 815421b)")
                names.remove(name)
                continue
            try:
                children[name] = Child("shardkit", name, argv_of(name, model, args.mesh), logs / f"{name}.log",
                                       env_of(name))  # fmt: skip
            except RuntimeError as e:  # e.g. an XLA flag this jaxlib does not know (XLA aborts on those)
                print(f"  {name}: did not start ({e})", flush=True)
                names.remove(name)
                continue
            print(f"  {name}: first step after {children[name].startup_s:.1f} s", flush=True)
        rounds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                rounds[n].append(statistics.median(children[n].steps(args.steps)))
            print(f"  round {r}: " + ", ".join(f"{n} {rounds[n][-1]:.3f} s" for n in names), flush=True)
    finally:
        for c in children.values():
            c.close()
    base = names[0]
    result: dict[str, Any] = {"model": {args.model: model}, "mesh": args.mesh, "rounds": args.rounds,
                              "steps": args.steps, "load_before": load_before,
                              "load_after": [round(x, 2) for x in os.getloadavg()], "levers": {}}  # fmt: skip
    print(f"{args.model} on {args.mesh} (load {load_before} -> {result['load_after']}); x = {base} / lever, > 1 faster")
    for n in names:
        per_round = [a / b for a, b in zip(rounds[base], rounds[n], strict=True)]
        result["levers"][n] = {"what": lever_of(n)[0], "xla_flags": lever_of(n)[1],
                               "malloc": malloc_of(n), "round_s": rounds[n],
                               "median_s": statistics.median(rounds[n]), "x_median": statistics.median(per_round),
                               "x_min": min(per_round), "x_max": max(per_round),
                               "startup_s": children[n].startup_s}  # fmt: skip
        r = result["levers"][n]
        print(f"  {n:<14} {r['median_s'] * 1e3:8.0f} ms  {r['x_median']:.2f}x ({r['x_min']:.2f}-{r['x_max']:.2f})")
    out = Path(args.out)
    runs = json.loads(out.read_text()) if out.exists() else {}  # one entry per command line, the latest kept
    runs[" ".join(sys.argv[1:] if argv is None else argv) or "(defaults)"] = result
    save_json(runs, out)


if __name__ == "__main__":
    main()
