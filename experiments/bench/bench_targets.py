"""The cost model against XLA's TPU compiler: predicted vs compiled memory and collectives, per strategy, on a TPU
target compiled from this machine (no TPU needed; libtpu from the dev extras).

    python -m experiments.bench.bench_targets [--target v5e-8] [--strategies dp,fsdp,tp,...] [--dtype bfloat16]
        [--attention-block auto|xla|splash] [--mesh data=2,fsdp=8] [--out experiments/bench/results/bench_targets.json]

For the GPT (models/gpt.py) under each strategy on the target's 8 chips, the train step (AdamW, fp32) is compiled by
the TPU compiler and `sk.explain` reads back its collectives (kind and mesh axis, bytes sent per device: ring
volume) and memory (`memory_analysis()`), next to the GPT's cost model (models/gpt_cost/, backend "tpu").
Prints, per strategy, compiled / predicted for the temporaries and for the collective bytes of each (kind, axis),
and the totals; writes JSON. The shape is chosen so that the temporaries live in HBM (the TPU compiler keeps small
buffers in on-chip memory, where `temp_size_in_bytes` does not count them: a 2 x 128 GPT reports 0 B).
Nothing here is a time: no chip ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS
from models.gpt import GPT, GPTConfig

#: strategy -> mesh on 8 chips (issue #39's eight); the GPT's cost model covers each
MESHES = {
    "dp": "data=8",
    "fsdp": "data=2,fsdp=4",
    "tp": "data=2,tensor=4",
    "fsdp_tp": "fsdp=4,tensor=2",
    "cp_zigzag": "data=2,seq=4",
    "tp3d": "data=2,row=2,col=2,depth=1",
    "pp": "stage=4",
    "ep": "data=2,expert=4",
}
#: strategies compiled for another target than --target: pp's mesh is stage only, one stage per layer (4 layers);
#: on a GPU target, 4 of its GPUs ("h100-4")
TARGETS = {"pp": "v5e-4"}
CFG = GPTConfig(num_layers=4, d_model=512, num_heads=8, num_kv_heads=8, head_dim=64, mlp_dim=2048, vocab_size=1024,
                max_seq_len=1024)  # fmt: skip
BATCH, SEQ = 16, 1024


def model_for(strategy: str, dtype: str = "float32") -> GPTConfig:
    cfg = dataclasses.replace(CFG, dtype=dtype)
    return dataclasses.replace(cfg, num_experts=4, top_k=2) if strategy.startswith("ep") else cfg


def measure(
    strategy: str, target: str, attention_block: str = "auto", dtype: str = "float32", spec: str | None = None
) -> dict[str, Any]:  # fmt: skip
    """One strategy compiled for the target: the report's rows, compiled vs predicted (compute in `dtype`), on
    `spec` (default `MESHES[strategy]`: 8 devices; a larger target, e.g. h100-8x2's 16 GPUs, needs its own)."""
    cfg = model_for(strategy, dtype)
    gpu = sk.target(target).platform == "gpu"
    if spec is None:
        target = f"{target.split('-')[0]}-4" if gpu and strategy in TARGETS else TARGETS.get(strategy, target)
    spec = spec or MESHES[strategy]
    mesh = sk.make_mesh(spec, target=target)
    named = sk.strategy(strategy)
    named = named.replace(kernels={**named.kernels, "attention_block": attention_block})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, named)
    shapes = {"inputs": ((BATCH, SEQ), jnp.int32), "targets": ((BATCH, SEQ), jnp.int32)}
    layout, _ = sk.kernels.batch_layout(step.strategy, mesh)
    if layout != "contiguous":
        shapes["positions"] = ((BATCH, SEQ), jnp.int32)
    t0 = time.perf_counter()
    report = sk.explain(step, step.abstract_state(), step.abstract_batch(shapes))
    compile_s = time.perf_counter() - t0
    rows = [
        dict(kind=r["kind"], axes=",".join(r["axes"]), compiled=r["bytes_sent"], count=r["count"],
             predicted=r["predicted_bytes"], predicted_count=r["predicted_count"])
        for r in report.rows()
    ]  # fmt: skip
    mem = {r["name"]: dict(compiled=r["compiled"], predicted=r["predicted"]) for r in report.memory_rows()}
    total = sum(r["compiled"] for r in rows)
    ptotal = sum(r["predicted"] or 0.0 for r in rows)
    return dict(strategy=strategy, mesh=spec, target=target, dtype=cfg.dtype, compile_s=compile_s,
                rows=rows, memory=mem, comm_compiled=total, comm_predicted=ptotal, source=report.prediction_source,
                notes=report.notes)  # fmt: skip


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5e-8")
    ap.add_argument("--strategies", default=",".join(MESHES))
    ap.add_argument("--attention-block", default="auto", help="the attention block kernel (auto: splash on TPU)")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="the compute dtype (bfloat16: the head and loss as the target picks them; parameters stay float32)",
    )
    ap.add_argument("--mesh", default=None, help="the mesh for every strategy (default: each one's 8-device mesh)")
    ap.add_argument("--out", default=f"{RESULTS}/bench_targets.json")
    args = ap.parse_args()
    results = []
    for s in [x for x in args.strategies.split(",") if x]:
        r = measure(s, args.target, args.attention_block, args.dtype, args.mesh)
        results.append(r)
        temp = r["memory"]["temporaries"]
        print(f"\n{s} on {r['mesh']} ({r['target']}, compiled in {r['compile_s']:.1f} s): temporaries compiled "
              f"{temp['compiled'] / 2**20:.1f} MiB, predicted {(temp['predicted'] or 0) / 2**20:.1f} MiB "
              f"(compiled/predicted {ratio(temp['compiled'], temp['predicted'])}); collectives compiled "
              f"{r['comm_compiled'] / 2**20:.2f} MiB, predicted {r['comm_predicted'] / 2**20:.2f} MiB "
              f"({ratio(r['comm_compiled'], r['comm_predicted'])})")  # fmt: skip
        for row in r["rows"]:
            mib = row["compiled"] / 2**20
            print(f"  {row['kind']:<18} {row['axes']:<14} compiled {row['count']:>4} x = {mib:>9.3f} "
                  f"MiB | predicted {row['predicted_count'] or '-':>4} x = {(row['predicted'] or 0) / 2**20:>9.3f} MiB"
                  f" | {ratio(row['compiled'], row['predicted'])}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    setup = dict(target=args.target, model=dataclasses.asdict(CFG), batch=BATCH, seq=SEQ, optimizer="adamw fp32",
                 attention_block=args.attention_block, jax=jax.__version__,
                 libtpu=importlib.metadata.version("libtpu"))  # fmt: skip
    Path(args.out).write_text(json.dumps(dict(setup=setup, results=results), indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
