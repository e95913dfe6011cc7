"""Flax NNX models annotated with logical axis names only (see models/axes.py), and beside each its cost model.

A model's cost model (a `sk.costmodel.CostModel`, registered for its config's type) imports the model, never the
other way; importing the package imports them, so that `sk.plan` and `sk.explain` find them, as `import shardkit`
registers its parallelisms.
"""

from models import cosmoflow_cost, gpt_cost, unet3d_cost  # they register themselves: sk.costmodel.for_config

__all__ = ["cosmoflow_cost", "gpt_cost", "unet3d_cost"]
