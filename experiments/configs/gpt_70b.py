"""gpt_70b: LLaMA-2-70B shape (80 x 8192, 64 heads with 8 KV heads, SwiGLU 28672), bf16 + full remat, for a v5p-256.

Too large for any one host to train; its use here is planning and compiling for its TARGET (v5p-256: 128 chips of
95 GiB HBM) from any machine, with the plan `sk.plan` ranks first there (`python -m experiments.plan --model gpt_70b
--target v5p-256`): tp3d over data=4 x depth=16 x row=2, full remat, 256 x 4096 tokens (1M) a step. Compiled:
`python -m experiments.train --config=experiments/configs/gpt_70b.py --config.target=v5p-256 --config.compile_only`
(docs/targets.md §6).
"""

from __future__ import annotations

import ml_collections

from experiments.configs import base

#: the hardware this config is planned for (docstring; tests/test_scale_configs.py)
TARGET = "v5p-256"


def get_config() -> ml_collections.ConfigDict:
    """tp3d data x depth=16 x row=2 (data=4 on a v5p-256); 256 sequences of 4096 tokens; vocabulary 32000."""
    c = base.get_config()
    c.config_name = "gpt_70b"
    c.hardware, c.mesh, c.strategy = "auto", "data=-1,depth=16,row=2", "tp3d"
    c.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                   vocab_size=32000)  # fmt: skip
    c.model.update(dtype="bfloat16", remat="full", rope_theta=500_000.0)
    c.optimizer.update(lr=1.5e-4, warmup_steps=2000, weight_decay=0.1, b2=0.95)
    c.batch_size, c.seq_len, c.steps = 256, 4096, 100_000
    c.eval_every, c.eval_batches, c.ckpt_every, c.log_every = 1000, 4, 500, 10
    return c
