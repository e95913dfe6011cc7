"""The GPT's `remat` config field: the older alias of the `remat` kernel slot, read by the model and its cost model.

`dots` kept its meaning: matmuls without batch dimensions (the projections), not attention's scores. Any other
policy is the strategy's `remat` kernel, kernels={'remat': ...} (docs/memory.md).
"""

#: `GPTConfig.remat` -> the remat policy it means (models/gpt.py applies it; models/gpt_cost/ prices it)
REMAT_ALIASES: dict[str, str] = {"none": "none", "full": "full", "dots": "dots_no_batch"}

__all__ = ["REMAT_ALIASES"]
