"""The GPT's cost model (backend "tpu") against XLA's TPU compiler, one compile per strategy (issue 39, item 5).

Each strategy's train step (fp32 GPT, AdamW) is compiled for a v5e target by libtpu on this host (`sk.explain`,
no TPU) and its collectives and temporaries are compared with the GPT's cost model's `predict(..., backend="tpu")`
(models/gpt_cost/tpu.py, models/gpt_cost/moe.py: each TPU term is written down there with its evidence).

The shape: 2 x 256 (4 heads), seq 1024, batch 32 — the smallest tried whose temporaries live in HBM (2 x 256,
seq 512, batch 16 reports 4-10 MiB of temporaries against about 90 MiB kept: the residual stacks fit the core's
128 MiB VMEM, which `temp_size_in_bytes` does not count). pp runs the 4-layer GPT, one layer a stage, on v5e-4.
Compile time: 7-15 s a strategy on this 2-core host when it is quiet (twice that when shared); the compile time
hardly shrinks with the shape, so four strategies are compiled here (`CASES`) and all eight by the bench.

Tolerances: collective bytes within 5% (each TPU term is an exact ring volume; left out are the loss / grad-norm
scalars and the norm scales' small exchanges, < 0.2% here; fsdp 2.4%: at this size XLA all-reduces the head's
gradient over fsdp, 8 pieces, instead of reduce-scattering it as at the bench shape); temporaries within 10% (the
residual stacks are itemised to the byte, measured within 0.5% of what the layer loops carry; the rest is what
the TPU compiler keeps in HBM besides them). Misses (tp and ep measured at this shape, not compiled here):
- tp: temporaries 13% above the prediction (measured 636.9 vs 563.3 MiB; 8% at the bench shape): about 90 MiB of
  the backward's working set (one layer's fp32 score gradient, 64 MiB, and more) stays in HBM although one
  layer's scores are 64 MiB, where fsdp's stays on chip; not itemised (dp at the bench shape: the same 89 MiB).
- ep: temporaries 27% above (1238 vs 977 MiB; 9.5% at the bench shape): the MoE backward's working set (the
  experts' [E_l, G, C, f] fp32 gradients, 40 MiB each here) is in HBM; not itemised.
- Attention here is Pallas's splash kernel (a TPU's default block kernel, shardkit/attention/blocks.py; seq 1024
  suits it). Its residuals are itemised (q, k, v, output at the model's dtype, read from the layer loop's tuple), but
  the TPU compiler then keeps two more copies of the bf16 [L, tokens, mlp] stacks for its async slicing of the layer
  loop (2 x 24 MiB under fsdp), which it does not under the XLA attention; not itemised. fsdp 14% above (309.0 vs
  270.3 MiB), fsdp_tp 22% (377.2 vs 309.1). With attention_block=xla both were within 10% (stop 38).
- cp_zigzag (asserted as what is true): temporaries 82% above under splash with libtpu 0.0.42.1 (jax 0.10; 43%
  with libtpu 0.0.50.1, jax 0.12, whose program keeps less: the band covers both) (489 vs 269 MiB; 94% under the XLA
  scan, 521 MiB): the layer loops' tuples are the prediction; the rest, the layer bodies' and the ring's inner
  loops' buffers, is itemised as far as the program text places them in docs/targets.md §5. Its collectives are
  exact (K and V travel in the model's dtype into splash; the scan's dots took them in bf16).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit.explain import Report

CFG = GPTConfig(num_layers=2, d_model=256, num_heads=4, num_kv_heads=4, head_dim=64, mlp_dim=1024, vocab_size=512,
                max_seq_len=1024)  # fmt: skip
BATCH, SEQ = 32, 1024
#: strategy -> (mesh, target): the four whose TPU terms are their own (bf16 gathers and the (data, fsdp) gradient
#: all-reduce; the collective matmul's permutes; the ring's transfers; GPipe's hops and tick residuals). dp, tp,
#: tp3d and ep are measured by experiments/bench/bench_targets.py (all eight, docs/targets.md §5): their collectives
#: are the CPU-tested formulas (tests/test_costmodel.py) with ep's bf16 all-to-alls asserted in tests/test_hlo_tpu.py;
#: a TPU compile at a shape whose temporaries are in HBM costs 12-25 s here, and the suite has 10 minutes.
CASES = {
    "fsdp": ("data=2,fsdp=4", "v5e-8"),
    "fsdp_tp": ("fsdp=4,tensor=2", "v5e-8"),
    "cp_zigzag": ("data=2,seq=4", "v5e-8"),
    "pp": ("stage=4", "v5e-4"),  # one layer a stage: the 4-layer GPT
}
#: compiled / predicted temporaries where the 10% does not hold (module docstring): the measured ratio's band
TEMP_MISS = {"cp_zigzag": (1.35, 2.2), "fsdp": (1.05, 1.25), "fsdp_tp": (1.1, 1.35)}


def _report(strategy: str) -> Report:
    spec, target = CASES[strategy]
    cfg = dataclasses.replace(CFG, num_experts=4, top_k=2) if strategy == "ep" else CFG
    cfg = dataclasses.replace(cfg, num_layers=4) if strategy == "pp" else cfg
    mesh = sk.make_mesh(spec, target=target)
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    shapes = {"inputs": ((BATCH, SEQ), jnp.int32), "targets": ((BATCH, SEQ), jnp.int32)}
    if sk.kernels.batch_layout(step.strategy, mesh)[0] != "contiguous":
        shapes["positions"] = ((BATCH, SEQ), jnp.int32)
    return sk.explain(step, step.abstract_state(), step.abstract_batch(shapes))


@pytest.mark.parametrize("strategy", list(CASES))
def test_tpu_cost_model(strategy):
    report = _report(strategy)
    assert report.platform == "tpu" and "backend tpu" in report.prediction_source
    rows = report.rows()
    compiled = sum(r["bytes_sent"] for r in rows)
    predicted = sum(r["predicted_bytes"] or 0.0 for r in rows)
    assert predicted == pytest.approx(compiled, rel=0.05), report.text()
    temp = next(r for r in report.memory_rows() if r["name"] == "temporaries")
    assert temp["compiled"] > 2**28, "temporaries on chip at this shape: the comparison needs a larger one"
    ratio = temp["compiled"] / temp["predicted"]
    lo, hi = TEMP_MISS.get(strategy, (0.90, 1.10))
    assert lo <= ratio <= hi, (ratio, report.text())
