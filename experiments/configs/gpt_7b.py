"""gpt_7b: LLaMA-2-7B shape (32 x 4096, 32 heads, vocab 32000: 6.74B params), bf16 + remat, for a TPU v5p-128."""

from __future__ import annotations

import ml_collections

from experiments.configs import base

#: the hardware this config is planned for (docstring; tests/test_scale_configs.py)
TARGET = "v5p-128"


def get_config() -> ml_collections.ConfigDict:
    """TARGET (v5p-128: 64 chips of 95 GiB HBM) with the plan `sk.plan` ranks first there (`python -m
    experiments.plan --model gpt_7b --target v5p-128`): fsdp over data x fsdp=8 (data=8 there), remat dots_no_batch
    (`remat="dots"`), 256 x 4096 tokens (1M) a step. Not LLaMA-2's 4M: gradient accumulation (--config.microbatches)
    re-gathers the weights per microbatch and its compiled peak is higher, not lower (docs/targets.md §6).
    Compiled for it: `python -m experiments.train --config=experiments/configs/gpt_7b.py --config.target=v5p-128
    --config.compile_only` (docs/targets.md §6). Multi-host: distributed=True."""
    c = base.get_config()
    c.config_name = "gpt_7b"
    c.hardware, c.mesh, c.strategy = "auto", "data=-1,fsdp=8", "fsdp"
    c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=32, head_dim=128, mlp_dim=11008,
                   vocab_size=32000)  # fmt: skip
    c.model.update(dtype="bfloat16", remat="dots", rope_theta=500_000.0)
    c.optimizer.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95)
    c.batch_size, c.seq_len, c.steps = 256, 4096, 100_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 1000, 4, 500, 10
    return c
