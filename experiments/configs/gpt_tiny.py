"""gpt_tiny: 1.2M-param byte-level GPT on Python source, 8 virtual CPU devices, 300 steps in ~2.5 min (default)."""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config() -> ml_collections.ConfigDict:
    """The base config unchanged: 4 layers x 128 wide, batch 32 x 128 tokens, fsdp on data=2,fsdp=4."""
    return base.get_config()
