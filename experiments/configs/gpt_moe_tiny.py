"""gpt_moe_tiny: gpt_tiny with 8 SwiGLU experts per block (GShard top-2), expert parallelism on 8 CPU devices."""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config() -> ml_collections.ConfigDict:
    """4 layers x 128, 8 experts of mlp 256 (top-2: ~the active MLP of gpt_tiny's 512), ep on data=2,expert=4.

    --config.strategy=ep_gspmd runs the same rules with GSPMD's dispatch / combine einsums instead of the
    explicit all-to-alls; --config.model.top_k=1 is Switch; --config.model.dropless=True drops no token."""
    c = base.get_config()
    c.config_name = "gpt_moe_tiny"
    c.strategy = "ep"  # auto mesh: data=2,expert=4
    c.model.update(num_experts=8, top_k=2, mlp_dim=256, capacity_factor=1.25)
    return c
