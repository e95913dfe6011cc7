"""gpt_moe_8x350m: gpt_350m's attention with 8 experts per block (GShard top-2), for accelerators (not run here)."""

from __future__ import annotations

import ml_collections

from experiments.configs import gpt_350m


def get_config() -> ml_collections.ConfigDict:
    """24 x 1024, 8 experts of mlp 2816 (top-2: 2x gpt_350m's active MLP), bf16 + remat, ep over 8 devices.

    Expert parallelism wants the experts' axis inside a node (its all-to-alls): expert=8 on one 8-GPU host,
    data over the hosts (--config.mesh="data=-1,expert=8")."""
    c = gpt_350m.get_config()
    c.config_name = "gpt_moe_8x350m"
    c.strategy, c.mesh = "ep", "data=-1,expert=8"
    c.model.update(num_experts=8, top_k=2, capacity_factor=1.25)
    return c
