"""The `embed` kernel slot on a TPU target: the table gathered (GSPMD) against each device's own columns (`local`).

    python -m experiments.bench.bench_embedding_tpu [--target v5e-8] [--mesh fsdp=8] [--remat full]
        [--logits-bf16 [--loss-chunk 512]] [--out experiments/bench/results/bench_embedding_tpu.json]

The decoder of the MaxText comparison (issue #41): 8 layers x 1024, 8 heads x 128, SwiGLU 4096, vocabulary 32000
(untied), RoPE, RMSNorm; sequence 2048, global batch 16, bf16 compute, fp32 parameters, AdamW, full remat; fsdp
over the 8 chips of a v5e-8. The train step is compiled twice by XLA's TPU compiler on this host (no chip), with
`--config.kernels=embed=gather` and `embed=local` (shardkit/embedding.py), and both programs are read as
`bench_peers --target` reads them (experiments/bench/peers_tpu.py: peak memory, temporaries, HBM bytes accessed,
loop-aware matmul FLOPs, collectives by kind and mesh axis in bytes one device sends). Prints local / gather for
each; writes JSON. No time: no chip ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata

import jax

from experiments.bench.peers_tpu import FMT, MODEL, RATIO_KEYS, shardkit_program
from experiments.bench.timing import RESULTS, save_json

BATCH, SEQ = MODEL["batch"], MODEL["seq"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5e-8")
    ap.add_argument("--mesh", default="fsdp=8")
    ap.add_argument("--remat", default="full", help="GPTConfig.remat: none, full, dots")
    ap.add_argument("--logits-bf16", action="store_true", help="also: local + the head's dot in bf16 (MaxText's)")
    ap.add_argument("--loss-chunk", type=int, default=0, help="with --logits-bf16, also: the loss in chunks")
    ap.add_argument("--out", default=f"{RESULTS}/bench_embedding_tpu.json")
    a = ap.parse_args()
    measure = lambda kernel, **overrides: shardkit_program(a.target, a.mesh, "fsdp", a.remat, overrides, kernel)
    runs = {k: measure(k) for k in ("gather", "local")}
    if a.logits_bf16:  # and MaxText's logits: the head's dot in bf16, cast to fp32 for the loss
        runs["local, logits bf16"] = measure("local", logits_dot_in_fp32=False)
        if a.loss_chunk:  # and the head + loss in chunks of positions (GPTConfig.loss_chunk)
            key = f"local, logits bf16, loss_chunk {a.loss_chunk}"
            runs[key] = measure("local", logits_dot_in_fp32=False, loss_chunk=a.loss_chunk)
    g, loc = runs["gather"], runs["local"]
    print(f"fsdp on {a.target} ({a.mesh}), {g['params']:,} parameters, batch {BATCH} x {SEQ}, remat {a.remat}")
    for key in RATIO_KEYS:
        ratio = loc[key] / g[key]
        print(
            f"  {key:20s} gather {FMT[key](g[key]):>12s}  local {FMT[key](loc[key]):>12s}  local / gather {ratio:.3f}"
        )
    for kind in sorted(set(g["collectives"]) | set(loc["collectives"])):
        a_, b_ = g["collectives"].get(kind, 0.0), loc["collectives"].get(kind, 0.0)
        print(f"    {kind:32s} gather {a_ / 1e6:9.1f} MB  local {b_ / 1e6:9.1f} MB")
    for name, r in runs.items():
        if name.startswith("local, "):
            kinds = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["collectives"].items())
            print(f"  {name}: " + ", ".join(f"{k} {FMT[k](r[k])}" for k in RATIO_KEYS) + f" ({kinds})")
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}
    save_json(dict(target=a.target, mesh=a.mesh, batch=BATCH, seq=SEQ, remat=a.remat, versions=versions,
                   devices=str(jax.devices()[0]), runs=runs), a.out)  # fmt: skip


if __name__ == "__main__":
    main()
