"""gpt_moe_8x350m: gpt_350m's attention with 8 experts per block (GShard top-2), for a TPU v5p-16 (not run here)."""

from __future__ import annotations

import ml_collections

from experiments.configs import gpt_350m

#: the hardware this config is planned for (docstring; tests/test_scale_configs.py)
TARGET = "v5p-16"


def get_config() -> ml_collections.ConfigDict:
    """24 x 1024, 8 experts of mlp 2816 (top-2: 2x gpt_350m's active MLP), bf16 + remat dots_no_batch.

    TARGET (v5p-16: 8 chips of 95 GiB) with the plan `sk.plan` ranks first there (`python -m experiments.plan
    --model gpt_moe_8x350m --target v5p-16`): ep over data x expert=2 (data=4 there), 512 x 1024 a step, no
    microbatches. Expert parallelism wants the experts' axis inside a node (its all-to-alls): on 8-GPU hosts,
    e.g. --config.mesh="data=-1,expert=8"."""
    c = gpt_350m.get_config()
    c.config_name = "gpt_moe_8x350m"
    c.strategy, c.mesh = "ep", "data=-1,expert=2"
    c.model.remat = "dots"
    c.model.update(num_experts=8, top_k=2, capacity_factor=1.25)
    return c
