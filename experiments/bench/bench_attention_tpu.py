"""The attention block kernel on a TPU target: XLA's scan against Pallas's splash attention, both compiled by XLA's TPU
compiler on this machine (no TPU needed; libtpu from the dev extras).

    python -m experiments.bench.bench_attention_tpu [--target v5e-8] [--seq 32768] [--strategies cp_ring,...]
        [--out experiments/bench/results/bench_attention_tpu.json]

For a one-layer GPT (d_model 256, 8 heads of 32, batch 1 a ring, bf16 compute, fp32 parameters) under each strategy
on the target's 8 chips, the train step is compiled twice, `attention_block=xla` and `=splash`, and read back:
temporaries and peak (`memory_analysis()`), the Mosaic kernel calls per step (`hlo.kernel_calls`) and the collective
bytes per device (`hlo.collectives`). Prints splash / xla for each; writes JSON. A program the TPU compiler refuses
(out of HBM: dense attention's [s, s] scores at 32k) is recorded with the compiler's reason. Nothing here is a time:
no chip ran.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS
from models.gpt import GPT, GPTConfig
from shardkit import hlo

MESHES = {"cp_ring": "seq=8", "cp_zigzag": "seq=8", "cp_striped": "seq=8", "cp_ulysses": "seq=8",
          "cp_usp": "seq_u=2,seq_r=4", "fsdp": "fsdp=8"}  # fmt: skip


def measure(name: str, block: str, seq: int, target: str) -> dict:
    cfg = GPTConfig(num_layers=1, d_model=256, num_heads=8, num_kv_heads=8, head_dim=32, mlp_dim=512, vocab_size=384,
                    max_seq_len=seq, dtype="bfloat16")  # fmt: skip
    mesh = sk.make_mesh(MESHES[name], target=target)
    strategy = sk.strategy(name)
    strategy = strategy.replace(kernels={**strategy.kernels, "attention_block": block})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    batch_size = 8 if name == "fsdp" else 1  # fsdp shards the batch: one sequence a chip
    batch = step.abstract_batch({k: ((batch_size, seq), jnp.int32) for k in ("inputs", "targets", "positions")})
    t0 = time.perf_counter()
    try:
        compiled = step.compile(step.abstract_state(), batch)
    except Exception as e:  # the compiler's out-of-HBM refusal is a result; anything else is not
        if not (why := sk.targets.out_of_memory(e)):
            raise
        return dict(strategy=name, block=block, seq=seq, refused=why, temp_bytes=None, peak_bytes=None)
    ma = compiled.memory_analysis()
    return dict(
        strategy=name, block=block, seq=seq, compile_s=round(time.perf_counter() - t0, 1),
        temp_bytes=int(ma.temp_size_in_bytes),
        peak_bytes=int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                       + ma.temp_size_in_bytes),
        mosaic_calls=sum(n for _, n in hlo.kernel_calls(compiled)),
        collective_bytes=sum(c.bytes_sent for c in hlo.collectives(compiled, mesh)),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5e-8")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--strategies", default=",".join(MESHES))
    ap.add_argument("--out", default=f"{RESULTS}/bench_attention_tpu.json")
    args = ap.parse_args()
    mib = 2**20
    print(f"{'strategy':<11} {'xla temp':>10} {'splash temp':>12} {'ratio':>6} {'xla peak':>10} {'splash peak':>12} "
          f"{'Mosaic calls':>12} {'coll. splash/xla':>16}")  # fmt: skip
    results = []
    for name in args.strategies.split(","):
        scan, splash = (measure(name, b, args.seq, args.target) for b in ("xla", "splash"))
        results += [scan, splash]
        mi = lambda r, k: f"{r[k] / mib:.1f}Mi" if r.get(k) is not None else "refused"
        ratio = lambda k, a=scan, b=splash: f"{b[k] / a[k]:.3f}" if a.get(k) and b.get(k) else "-"
        print(f"{name:<11} {mi(scan, 'temp_bytes'):>10} {mi(splash, 'temp_bytes'):>12} {ratio('temp_bytes'):>6} "
              f"{mi(scan, 'peak_bytes'):>10} {mi(splash, 'peak_bytes'):>12} {splash.get('mosaic_calls', '-'):>12} "
              f"{ratio('collective_bytes'):>16}", flush=True)  # fmt: skip
        for r in (scan, splash):
            if r.get("refused"):
                print(f"  {name} attention_block={r['block']}: the TPU compiler refused it: {r['refused']}")
    setup = dict(target=args.target, seq=args.seq, jax=jax.__version__, libtpu=importlib.metadata.version("libtpu"),
                 model="GPT 1 x 256, 8 heads of 32, mlp 512, bf16 compute, fp32 params, AdamW",
                 note="compiled only; no time measured")  # fmt: skip
    Path(args.out).write_text(json.dumps(dict(setup=setup, results=results), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
