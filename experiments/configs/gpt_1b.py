"""gpt_1b: 1.1B non-embedding params (24 x 2048, GQA 16/8, seq 2048), bf16 + remat, for a TPU v4-32 / 2 GPU nodes."""

from __future__ import annotations

import ml_collections

from experiments.configs import base

#: the hardware this config is planned for (docstring; tests/test_scale_configs.py)
TARGET = "v4-32"


def get_config() -> ml_collections.ConfigDict:
    """24 layers x 2048, 1M tokens a step. TARGET (v4-32: 16 chips of 32 GiB) with the plan `sk.plan` ranks first
    there (`python -m experiments.plan --model gpt_1b --target v4-32`): fsdp over data x fsdp=8 (data=2 there),
    full remat, 512 x 2048. On several hosts add
    --config.distributed=True (or JAX_COORDINATOR_ADDRESS)."""
    c = base.get_config()
    c.config_name = "gpt_1b"
    c.hardware, c.mesh, c.strategy = "auto", "data=-1,fsdp=8", "fsdp"
    c.model.update(num_layers=24, d_model=2048, num_heads=16, num_kv_heads=8, head_dim=128, mlp_dim=5632)
    c.model.update(dtype="bfloat16", remat="full", rope_theta=500_000.0)
    c.optimizer.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1)
    c.batch_size, c.seq_len, c.steps = 512, 2048, 50_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 1000, 8, 1000, 20
    return c
