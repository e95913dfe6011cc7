"""gpt_small: GPT-2-small shape (12 x 768, ~85M non-embedding params), bf16, one GPU node or TPU v5e-8."""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config() -> ml_collections.ConfigDict:
    """12 layers x 768, seq 1024, 0.5M tokens/step, FSDP over every device."""
    c = base.get_config()
    c.config_name = "gpt_small"
    c.hardware, c.mesh, c.strategy = "auto", "fsdp=-1", "fsdp"
    c.model.update(num_layers=12, d_model=768, num_heads=12, num_kv_heads=12, head_dim=64, mlp_dim=2048)
    c.model.update(dtype="bfloat16", remat="none")
    c.optimizer.update(lr=6e-4, warmup_steps=700, weight_decay=0.1)
    c.batch_size, c.seq_len, c.steps = 512, 1024, 20_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 500, 8, 1000, 50
    return c
