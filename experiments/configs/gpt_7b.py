"""gpt_7b: LLaMA-2-7B shape (32 x 4096, 32 heads, 6.5B non-embedding), bf16 + full remat, FSDP x TP on a pod."""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config() -> ml_collections.ConfigDict:
    """fsdp over all but 8 devices x tensor=8 inside a node/slice; 4M tokens/step. Multi-host: distributed=True."""
    c = base.get_config()
    c.config_name = "gpt_7b"
    c.hardware, c.mesh, c.strategy = "auto", "fsdp=-1,tensor=8", "fsdp_tp"
    c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=32, head_dim=128, mlp_dim=11008,
                   vocab_size=32000)  # fmt: skip
    c.model.update(dtype="bfloat16", remat="full", rope_theta=500_000.0)
    c.optimizer.update(lr=3e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95)
    c.batch_size, c.seq_len, c.steps = 1024, 4096, 100_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 1000, 4, 500, 10
    return c
