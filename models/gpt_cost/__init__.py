"""The GPT's cost model: collectives, memory and recompute of one train step of models/gpt.py, per strategy.

- model.py: `GPTCostModel`, the sk.costmodel.CostModel registered for GPTConfig: which formulas apply, their terms;
- classify.py: which formula family describes a strategy, read from its tables (`Traits.of`), never its name;
- shapes.py: the GPT's shape numbers, its parameters and whether they divide a mesh;
- comms.py: the collectives of one step per family; tpu.py: what the TPU compiler's programs send and keep;
- memory.py: model state and activations per device; remat.py: per remat policy, and the recompute FLOPs;
- sdp.py: subnetwork data parallelism; moe.py: the MoE GPT under expert parallelism.

The one place in models/ that names mesh axes (its formulas are per strategy and mesh); gpt.py names none.
"""

from models.gpt_cost.classify import MODELLED, cp_formula, formula, pp_formula, sdp_options, tpu_formula
from models.gpt_cost.comms import cached_comms, gpt_extra_comms, strategy_comms
from models.gpt_cost.memory import activation_bytes
from models.gpt_cost.model import GPTCostModel
from models.gpt_cost.sdp import sdp_divisibility, sdp_terms
from models.gpt_cost.shapes import blocks_per_layer, divisibility, fc_layers, logit_tokens, num_params

__all__ = ["MODELLED", "GPTCostModel", "activation_bytes", "blocks_per_layer", "cached_comms", "cp_formula",
           "divisibility", "fc_layers", "formula", "gpt_extra_comms", "logit_tokens", "num_params",
           "pp_formula", "sdp_divisibility", "sdp_options", "sdp_terms", "strategy_comms", "tpu_formula"]  # fmt: skip
