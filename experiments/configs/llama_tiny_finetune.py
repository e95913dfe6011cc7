"""llama_tiny_finetune: fine-tune the committed tiny random Llama 3.1 (tests/assets/hf/llama) on byte-level text.

    python -m experiments.train --config=experiments/configs/llama_tiny_finetune.py      # fsdp, 8 CPU devices, ~1 min

The model (2 layers x 32 wide, vocabulary 264 >= the 257 byte tokens) and its weights come from the Hugging Face
folder (`init_from`, docs/models.md); the data is the default byte-level corpus (experiments/data/text.py). Any
strategy works: --config.strategy=tp --config.mesh=data=4,tensor=2, or pp_dp with --config.mesh=stage=2,data=4.
"""

from __future__ import annotations

from pathlib import Path

import ml_collections

from experiments.configs import base

LLAMA = Path(__file__).resolve().parents[2] / "tests" / "assets" / "hf" / "llama"


def get_config() -> ml_collections.ConfigDict:
    c = base.get_config()
    c.config_name = "llama_tiny_finetune"
    c.init_from = f"hf:{LLAMA}"
    c.seq_len = 64  # the folder's max_position_embeddings is 128
    c.batch_size = 16
    c.steps = 60
    c.eval_every = 20
    c.ckpt_every = 0  # at the end only
    c.optimizer.lr = 3e-3
    c.optimizer.weight_decay = 0.0
    return c
