"""The context-parallel GPT compiled by XLA's TPU compiler (libtpu, compile-only v5e-8 devices, no TPU): the attention
block kernel a TPU gets by default is Pallas's splash attention, called inside the ring, and its program needs less
memory than the XLA scan's.

What is read from the compiled program: the Mosaic custom calls (`tpu_custom_call`) and how often each runs per step
(`hlo.kernel_calls`, loop trip counts included; a `lax.switch` branch counts as run), and the compiler's temporaries
(`memory_analysis`). One layer, d_model 256, 8 heads of 32, batch 1: the attention is what differs. Two programs of
the four context-parallel ones are compiled here (a TPU compile of the 32k pair costs ~30 s of the suite's 10
minutes); `experiments/bench/bench_attention_tpu.py` compiles all of cp_ring, cp_zigzag, cp_striped, cp_ulysses and
cp_usp at 32k and counts their Mosaic calls (docs/context_parallel.md).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit import hlo

MESHES = {"cp_zigzag": "seq=8", "cp_ulysses": "seq=8"}
RING = {"cp_zigzag": 8, "cp_ulysses": 1}  # ring ranks (Ulysses: local attention)


@functools.cache
def _compiled(name: str, seq: int, block: str | None = None):
    cfg = GPTConfig(num_layers=1, d_model=256, num_heads=8, num_kv_heads=8, head_dim=32, mlp_dim=512,
                    vocab_size=384, max_seq_len=seq)  # fmt: skip
    mesh = sk.make_mesh(MESHES[name], target="v5e-8")
    strategy = sk.strategy(name)
    if block is not None:
        strategy = strategy.replace(kernels={**strategy.kernels, "attention_block": block})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    batch = step.abstract_batch({k: ((1, seq), jnp.int32) for k in ("inputs", "targets", "positions")})
    return step.compile(step.abstract_state(), batch)


@pytest.mark.parametrize("name", ["cp_ulysses"])  # the ring: cp_zigzag at 32k below; USP runs the same ring body
def test_a_tpu_gets_splash_attention_inside_the_ring(name):
    calls = hlo.kernel_calls(_compiled(name, 2048))
    assert calls, f"{name}: no Mosaic kernel in the TPU program"
    # forward and backward kernels of the one layer; inside a ring each runs once per ring step
    assert max(n for _, n in calls) >= max(RING[name] - 1, 1), calls


def test_splash_needs_no_more_memory_than_the_scan_at_8k_tokens_over_8_chips():
    """cp_zigzag at S = 8192 (1024 tokens a chip): measured 44.8 MiB of temporaries under splash, 373.4 MiB under the
    XLA scan; at 32k, 277 vs 6817 MiB (there and for the other strategies: docs/context_parallel.md,
    experiments/bench/bench_attention_tpu.py; 32k here took 35-50 s of the suite, 8k takes 16 s)."""
    splash, scan = (_compiled("cp_zigzag", 8192, b) for b in ("splash", "xla"))
    assert max(n for _, n in hlo.kernel_calls(splash)) >= RING["cp_zigzag"] - 1  # inside the ring's loop
    assert not hlo.kernel_calls(scan)  # attention_block=xla keeps the scan on a TPU
    temps = [c.memory_analysis().temp_size_in_bytes for c in (splash, scan)]
    assert temps[0] <= temps[1], temps
