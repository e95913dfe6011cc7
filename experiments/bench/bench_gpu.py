"""One prepared GPU check (one H200 or H100): the train step's time, MFU and peak memory, and the attention kernels.

    python -m experiments.bench.bench_gpu [--models gpt_350m,gpt_1b] [--steps 10]
        [--out experiments/bench/results/bench_gpu.json]
    python -m experiments.bench.bench_gpu --smoke      # tiny shapes on any backend (CPU): checks the script itself

1. Train step: the config's model in bf16 (its own remat policy), AdamW, batch `--batch` x seq 1024 on one device,
   `dp` with attention=cudnn and attention=dense: median step time of `--steps` after a warm-up, MFU against
   `--peak` (989 TFLOP/s, H100/H200 SXM dense bf16) with `GPTConfig.flops_per_token` (6N + 12·L·d·s), and peak
   device memory (`memory_stats()["peak_bytes_in_use"]`, reset between runs where the backend allows).
2. Attention alone, fwd + bwd, causal, bf16, [b=1, S, 16 heads, 128]: cuDNN's fused kernel, our dense
   (`jax.nn` XLA: [S, S] scores), and our ring kernel on one device (its chunk loop with the online softmax and
   the causal skips, no ring) at chunks 512 / 1024 / 2048, and Pallas's GPU attention (`attention_block=pallas_gpu`,
   what a GPU ring's blocks run): time per call and TFLOP/s (4·S²·h·d·3.5 / 2, causal half), and the max
   difference from cuDNN's output.

3. Host offload (docs/memory.md): the first model's train step (dense attention) with the optimizer state, then
   the optimizer state and the parameters in pinned_host memory (`Strategy.offload`), and with the `offload:`
   remat policy (attn_out, mlp_hidden to the host): 3 steps' losses against no offload (equal: pure data movement),
   step time, peak device memory, and the compiled memory analysis' device and host figures.

Anything a backend cannot run (cuDNN off NVIDIA, memory) is recorded with its error, not a crash: the point is
one run that brings back every figure it can.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, compile_timed, gpt_batch, save_json, time_calls, time_steps
from experiments.configs import gpt_1b, gpt_350m
from models.gpt import GPT, GPTConfig

CONFIGS = {"gpt_350m": gpt_350m, "gpt_1b": gpt_1b}


def peak_memory() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # a kernel this backend lacks, or out of memory: a result to bring back
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def train_step(cfg: GPTConfig, batch: int, seq: int, attention: str, steps: int, peak: float) -> dict[str, Any]:
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    strategy = sk.strategies.strategy("dp").replace(attention=attention)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy)
    step = sk.make_train_step(model, optax.adamw(1e-4), mesh, strategy)
    state = step.init_state()
    del model
    data = gpt_batch(cfg.vocab_size, batch, seq, step.batch_sharding)
    compiled = compile_timed(step, state, data)
    step_s = time_steps(compiled.program, state, data, steps)[0].median
    tokens = batch * seq
    flops = cfg.flops_per_token(seq) * tokens
    return {"attention": attention, "compile_s": compiled.seconds, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": flops / step_s / peak, "peak_bytes": peak_memory()}  # fmt: skip


def offload_runs(cfg: GPTConfig, batch: int, seq: int, smoke: bool = False) -> dict[str, Any]:
    """No offload, then each offload: 3 steps each from the same parameters, their losses, time and memory
    (`smoke`: no offload, both states offloaded, and the activation offload, which the CPU refuses at once)."""
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    cfg = dataclasses.replace(cfg, remat="none")  # the remat slot decides (its alias would conflict with it)
    out: dict[str, Any] = {}
    for label, offload, remat in (("none", "", "none"), ("opt_state", "opt_state", "none"),
                                  ("opt_state,params", "opt_state,params", "none"),
                                  ("remat offload", "", "offload:attn_out,mlp_hidden")):  # fmt: skip
        if smoke and label == "opt_state":
            continue

        def run(offload: str = offload, remat: str = remat) -> dict[str, Any]:
            strategy = sk.strategies.strategy("dp").replace(attention="dense", offload=offload,
                                                            kernels={"remat": remat})  # fmt: skip
            model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=0)
            step = sk.make_train_step(model, optax.adamw(1e-4), mesh, strategy)
            state = step.init_state()
            del model
            data = gpt_batch(cfg.vocab_size, batch, seq, step.batch_sharding)
            compiled = compile_timed(step, state, data).program
            ma = compiled.memory_analysis()
            timing, _, metrics = time_steps(compiled, state, data, 3)
            fields = ("argument", "output", "temp", "host_argument", "host_output", "host_temp")
            return {"step_s": timing.median, "last_loss": float(metrics["loss"]), "peak_bytes": peak_memory(),
                    "host_layout_bytes": sk.offload.host_bytes(compiled)["host_arguments"],
                    **{f"{f}_bytes": int(getattr(ma, f"{f}_size_in_bytes", 0) or 0) for f in fields}}  # fmt: skip

        out[label] = attempt(run)
    return out


def attention_kernels(seq: int, heads: int, dim: int, chunks: tuple[int, ...], reps: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, seq, heads, dim), jnp.bfloat16) for key in keys)
    mesh = sk.make_mesh("seq=1", jax.devices()[:1])
    kernels: dict[str, Callable[..., jax.Array]] = {
        "cudnn": lambda q, k, v: sk.attention.cudnn_attention(q, k, v, causal=True),
        "dense": lambda q, k, v: sk.attention.dense_attention(q, k, v, causal=True),
        # the XLA scan (attention_block=xla: on a GPU `auto` would pick a fused kernel for a ring of one)
        **{f"ring@{c}": (lambda q, k, v, c=c: sk.attention.ring_attention(q, k, v, mesh=mesh, chunk=c, block="xla"))
           for c in chunks if seq % c == 0},
        # Pallas's GPU attention (Triton), the kernel a GPU ring's blocks run (docs/context_parallel.md)
        "pallas_gpu": lambda q, k, v: sk.attention.ring_attention(q, k, v, mesh=mesh, block="pallas_gpu"),
    }  # fmt: skip
    flops = 4 * seq * seq * heads * dim * 3.5 / 2  # fwd 2 matmuls + bwd 5, causal half
    out: dict[str, Any] = {}
    ref = None
    for name, attn in kernels.items():

        def measure(attn: Callable[..., jax.Array] = attn) -> dict[str, Any]:
            nonlocal ref

            @jax.jit
            def fwd_bwd(q, k, v, do):
                o, vjp = jax.vjp(attn, q, k, v)
                return (o, *vjp(do))

            timing = time_calls(lambda: fwd_bwd(q, k, v, do), reps)
            s, o = timing.median, np.asarray(timing.out[0], np.float32)
            ref = o if ref is None else ref
            return {"s": s, "tflops": flops / s / 1e12, "max_diff_vs_first": float(np.abs(o - ref).max())}

        out[name] = attempt(measure)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt_350m,gpt_1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak", type=float, default=989e12, help="device peak FLOP/s (bf16 dense)")
    parser.add_argument("--attn-seqs", default="4096,16384")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any backend: checks the script")
    parser.add_argument("--out", default=f"{RESULTS}/bench_gpu.json")
    args = parser.parse_args(argv)
    seq, heads, dim, chunks = 1024, 16, 128, (512, 1024, 2048)
    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend()}
    result.update(jax=jax.__version__, peak_flops=args.peak, train={}, attention={})
    for name in args.models.split(","):
        fields = {**CONFIGS[name].get_config().model.to_dict(), "vocab_size": 50304, "max_seq_len": seq}
        if args.smoke:
            fields.update(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128,
                          vocab_size=256, max_seq_len=64)  # fmt: skip
        cfg = GPTConfig(**fields)
        s, batch, steps = (64, 2, 2) if args.smoke else (seq, args.batch, args.steps)
        row: dict[str, Any] = {"params": cfg.num_params(include_embedding=True), "config": dataclasses.asdict(cfg)}
        for att in ("cudnn", "dense"):
            row[att] = attempt(functools.partial(train_step, cfg, batch, s, att, steps, args.peak))
        result["train"][name] = row
        print(name, json.dumps({k: v for k, v in result["train"][name].items() if k != "config"}), flush=True)
    first = args.models.split(",")[0]
    fields = {**CONFIGS[first].get_config().model.to_dict(), "vocab_size": 50304, "max_seq_len": seq}
    if args.smoke:
        fields.update(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128,
                      vocab_size=256, max_seq_len=64)  # fmt: skip
    result["offload"] = offload_runs(GPTConfig(**fields), *((2, 64) if args.smoke else (args.batch, seq)), args.smoke)
    print("offload", json.dumps(result["offload"]), flush=True)
    for s in [256] if args.smoke else [int(x) for x in args.attn_seqs.split(",")]:
        small = (2, 32, (64, 128)) if args.smoke else (heads, dim, chunks)
        result["attention"][s] = attention_kernels(s, *small, reps=2 if args.smoke else 10)
        print("attention", s, json.dumps(result["attention"][s]), flush=True)
    save_json(result, args.out)


if __name__ == "__main__":
    main()
