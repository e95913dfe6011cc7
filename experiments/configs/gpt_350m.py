"""gpt_350m: GPT-2-medium shape (24 x 1024, ~300M params), bf16 + remat, for a TPU v5e-8 (one host)."""

from __future__ import annotations

import ml_collections

from experiments.configs import base

#: the hardware this config is planned for (docstring; tests/test_scale_configs.py)
TARGET = "v5e-8"


def get_config() -> ml_collections.ConfigDict:
    """24 layers x 1024, seq 1024, 0.5M tokens a step. TARGET (v5e-8: 8 chips of 16 GiB) with the plan `sk.plan`
    ranks first there (`python -m experiments.plan --model gpt_350m --target v5e-8`): fsdp over data x fsdp=4
    (data=2 there), full remat, 512 x 1024.
    tests/test_scale_configs.py compiles it for the target and checks that it fits."""
    c = base.get_config()
    c.config_name = "gpt_350m"
    c.hardware, c.mesh, c.strategy = "auto", "data=-1,fsdp=4", "fsdp"
    c.model.update(num_layers=24, d_model=1024, num_heads=16, num_kv_heads=16, head_dim=64, mlp_dim=2816)
    c.model.update(dtype="bfloat16", remat="full")
    c.optimizer.update(lr=3e-4, warmup_steps=1000, weight_decay=0.1)
    c.batch_size, c.seq_len, c.steps = 512, 1024, 40_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 1000, 8, 1000, 50
    return c
