"""The planner's per-remat-policy memory of a GPT config against the compiled train step (docs/planner.md §3).

    python -m experiments.plan_memory --model gpt_small --batch 16      # fp32, fsdp on 8 CPU devices, ~1 min
    python -m experiments.plan_memory --model gpt_tiny --policies none,full --strategy dp

Compiles the step (AdamW, fp32: the formulas' nbytes = 4) under each policy on the strategy's auto mesh, no
parameter allocated, and prints compiled temporaries vs predicted activations + gradients, and compiled
arguments vs predicted parameters + optimizer state.
"""

from __future__ import annotations

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import dataclasses

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from experiments.plan import model_from_config
from models.gpt import GPT


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt_tiny", help="a GPT config in experiments/configs")
    ap.add_argument("--batch", type=int, default=0, help="global batch (default: the config's)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    ap.add_argument("--strategy", default="fsdp")
    ap.add_argument("--policies", default="none,dots,dots_no_batch,full")
    ap.add_argument("--vocab", type=int, default=384, help="vocabulary (default: the byte data's, as training)")
    args = ap.parse_args(argv)
    cfg, batch, seq = model_from_config(args.model)
    batch, seq = args.batch or batch, args.seq or seq
    cfg = dataclasses.replace(cfg, dtype="float32", param_dtype="float32", remat="none", max_seq_len=seq,
                              vocab_size=args.vocab)  # fmt: skip
    axes = sk.strategy(args.strategy).default_mesh(jax.device_count())
    mesh = sk.make_mesh(axes)
    abstract = sk.abstract_model(lambda rngs: GPT(cfg, rngs=rngs), 0)
    mib = lambda b: f"{b / 2**20:,.1f}"
    print(f"{args.model}: batch {batch} x {seq}, fp32, AdamW, {args.strategy} on {axes}; MiB per device")
    print(f"{'policy':<14} {'compiled temp':>13} {'pred acts+grads':>15} {'gap':>7} {'compiled args':>13} "
          f"{'pred params+opt':>15}")  # fmt: skip
    for policy in args.policies.split(","):
        strategy = sk.strategy(args.strategy).replace(kernels={"remat": policy})
        strategy.bind(mesh)
        step = sk.make_train_step(abstract, optax.adamw(1e-3), mesh, strategy)
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=step.batch_sharding)
        ma = step.lower(step.abstract_state(), {"inputs": tokens, "targets": tokens}).compile().memory_analysis()
        mem = sk.costmodel.for_config(cfg).predict(strategy, axes, {"inputs": (batch, seq)}, 4, "cpu")[1]
        pred = mem["activations"] + mem["grads"]
        temp = ma.temp_size_in_bytes
        print(f"{policy:<14} {mib(temp):>13} {mib(pred):>15} {pred / temp - 1:>+7.1%} "
              f"{mib(ma.argument_size_in_bytes):>13} {mib(mem['params'] + mem['optimizer']):>15}")  # fmt: skip


if __name__ == "__main__":
    main()
