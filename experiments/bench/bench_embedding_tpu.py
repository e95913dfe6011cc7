"""The `embed` kernel slot on a TPU target: the table gathered (GSPMD) against each device's own columns (`local`).

    python -m experiments.bench.bench_embedding_tpu [--target v5e-8] [--mesh fsdp=8] [--remat full]
        [--logits-bf16 [--loss-chunk 512]] [--out experiments/bench/results/bench_embedding_tpu.json]

The decoder of the MaxText comparison (issue #41): 8 layers x 1024, 8 heads x 128, SwiGLU 4096, vocabulary 32000
(untied), RoPE, RMSNorm; sequence 2048, global batch 16, bf16 compute, fp32 parameters, AdamW, full remat; fsdp
over the 8 chips of a v5e-8. The train step is compiled twice by XLA's TPU compiler on this host (no chip), with
`--config.kernels=embed=gather` and `embed=local` (shardkit/embedding.py), and the two programs are read the same
way: collectives by (kind, mesh axis) in bytes one device sends (ring volume, `sk.explain`), temporaries, peak
memory (arguments + outputs - aliased + temporaries), HBM bytes accessed (`cost_analysis`) and the matmul FLOPs
counted with loop trip counts (`hlo.matmul_flops`). Prints local / gather for each; writes JSON. No time: no chip ran.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, save_json
from models.gpt import GPT, GPTConfig
from shardkit import hlo

CFG = GPTConfig(num_layers=8, d_model=1024, num_heads=8, num_kv_heads=8, head_dim=128, mlp_dim=4096, vocab_size=32000,
                max_seq_len=2048, dtype="bfloat16", param_dtype="float32", remat="full")  # fmt: skip
BATCH, SEQ = 16, 2048


def measure(kernel: str, target: str, mesh_spec: str, cfg: GPTConfig) -> dict[str, Any]:
    mesh = sk.make_mesh(mesh_spec, target=target)
    strategy = sk.strategy("fsdp")
    strategy = strategy.replace(kernels={**strategy.kernels, "embed": kernel})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    batch = step.abstract_batch({"inputs": ((BATCH, SEQ), jnp.int32), "targets": ((BATCH, SEQ), jnp.int32)})
    t0 = time.perf_counter()
    compiled = step.compile(step.abstract_state(), batch)
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    by_kind: dict[str, float] = collections.defaultdict(float)
    for c in hlo.collectives(compiled, mesh):
        by_kind[f"{c.kind} {','.join(c.axes)}"] += c.bytes_sent
    return dict(kernel=kernel, compile_s=compile_s, peak=peak, temp=m.temp_size_in_bytes,
                hbm_bytes_accessed=float(cost.get("bytes accessed", 0.0)), matmul_flops=hlo.matmul_flops(compiled),
                collectives=dict(sorted(by_kind.items())), collective_bytes=sum(by_kind.values()),
                params=cfg.num_params())  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5e-8")
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--logits-bf16", action="store_true", help="also: local + the head's dot in bf16 (MaxText's)")
    ap.add_argument("--loss-chunk", type=int, default=0, help="with --logits-bf16, also: the loss in chunks")
    ap.add_argument("--out", default=f"{RESULTS}/bench_embedding_tpu.json")
    a = ap.parse_args()
    cfg = GPTConfig(**{**CFG.__dict__, "remat": a.remat})
    runs = {k: measure(k, a.target, a.mesh, cfg) for k in ("gather", "local")}
    if a.logits_bf16:  # and MaxText's logits: the head's dot in bf16, cast to fp32 for the loss
        bf16 = GPTConfig(**{**cfg.__dict__, "logits_dot_in_fp32": False})
        runs["local, logits bf16"] = measure("local", a.target, a.mesh, bf16)
        if a.loss_chunk:  # and the head + loss in chunks of positions (GPTConfig.loss_chunk)
            chunked = GPTConfig(**{**bf16.__dict__, "loss_chunk": a.loss_chunk})
            runs[f"local, logits bf16, loss_chunk {a.loss_chunk}"] = measure("local", a.target, a.mesh, chunked)
    g, loc = runs["gather"], runs["local"]
    gib = lambda x: f"{x / 2**30:.3f} GiB"
    print(f"fsdp on {a.target} ({a.mesh}), {cfg.num_params():,} parameters, batch {BATCH} x {SEQ}, remat {a.remat}")
    for key, fmt in (("peak", gib), ("temp", gib), ("hbm_bytes_accessed", lambda x: f"{x / 1e9:.2f} GB"),
                     ("matmul_flops", lambda x: f"{x / 1e12:.3f} T"),
                     ("collective_bytes", lambda x: f"{x / 1e6:.1f} MB")):  # fmt: skip
        ratio = loc[key] / g[key]
        print(f"  {key:20s} gather {fmt(g[key]):>12s}  local {fmt(loc[key]):>12s}  local / gather {ratio:.3f}")
    for kind in sorted(set(g["collectives"]) | set(loc["collectives"])):
        a_, b_ = g["collectives"].get(kind, 0.0), loc["collectives"].get(kind, 0.0)
        print(f"    {kind:32s} gather {a_ / 1e6:9.1f} MB  local {b_ / 1e6:9.1f} MB")
    for name, r in runs.items():
        if name.startswith("local, "):
            kinds = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["collectives"].items())
            print(f"  {name}: peak {gib(r['peak'])}, temp {gib(r['temp'])}, HBM accessed "
                  f"{r['hbm_bytes_accessed'] / 1e9:.2f} GB, matmul {r['matmul_flops'] / 1e12:.3f} T, collectives "
                  f"{r['collective_bytes'] / 1e6:.1f} MB ({kinds})")  # fmt: skip
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}
    save_json(dict(target=a.target, mesh=a.mesh, batch=BATCH, seq=SEQ, remat=a.remat, versions=versions,
                   devices=str(jax.devices()[0]), runs=runs), a.out)  # fmt: skip


if __name__ == "__main__":
    main()
