"""Explain a training plan without training: collectives per mesh axis and memory per device, vs the cost model.

    python -m experiments.explain --config=experiments/configs/gpt_tiny.py --config.strategy=fsdp_tp \
        --config.mesh="data=2,fsdp=2,tensor=2" [--json=report.json] [--plot=report.png]
    python -m experiments.explain --config=experiments/configs/gpt_7b.py --config.mesh="data=4,fsdp=8,tensor=8"
    python -m experiments.explain --config=experiments/configs/gpt_7b.py --config.target=v5p-128   # TPU's compiler

Takes the same config files and `--config.x` flags as `experiments.train`, but reads no data and allocates no
parameters: the train step is built from the abstract model and compiled for ShapeDtypeStructs that carry their
shardings. A mesh larger than this machine (a 256-device plan on a laptop) cannot be compiled here: it says so,
compiles on the largest mesh with the same axis proportions that fits (else with the largest axes halved), and
prints the figures scaled to the requested mesh, labelled SCALED (method in shardkit/explain.py). With
`--config.target` (a TPU slice, shardkit/targets.py) the step is compiled for that hardware by XLA's TPU compiler,
whatever this machine is, and the report says whether it fits in the chips' HBM (docs/targets.md).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags, logging

import shardkit as sk
from experiments import runtime
from experiments import train as tr  # sets XLA_FLAGS (virtual CPU devices) before jax is imported
from experiments.compile_only import explain_config, fit_mesh  # noqa: F401  (the plan compiled, no parameters)
from shardkit.explain import POLICIES

_JSON = flags.DEFINE_string("json", "", "also write the report as JSON to this path")
_PLOT = flags.DEFINE_string("plot", "", "also write a PNG bar chart to this path")
_REMAT = flags.DEFINE_string(
    "remat_policies",
    "",
    "also compile the step under these remat policies, ';'-separated ('all': none;full;dots;"
    "dots_no_batch; 'names:a,b' allowed), and tabulate each one's temporary memory and recomputed FLOPs",
)


target_axes = runtime.target_axes  # (config, devices) -> the plan's mesh; "auto" fits the strategy


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
