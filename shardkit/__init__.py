"""shardkit: write a Flax model once with logical axis names, train it under any SPMD parallelism."""

import sys as _sys

# _host first: it imports jax with the CUDA plugin's driver-search lines held back on a host without a GPU
from shardkit import (
    _host,  # noqa: F401
    attention,
    checkpoint,
    collectives,
    costmodel,
    dispatch,
    embedding,
    kernels,
    layers,
    offload,
    step,
    targets,
    targets_gpu,  # registers the GPU targets with shardkit.targets
    train,
)
from shardkit.checkpoint import Checkpointer, NonFiniteError
from shardkit.costmodel import plan
from shardkit.dispatch import configure, make_train_step, register_step
from shardkit.errors import ShardkitError
from shardkit.explain import explain  # the function; the module is shardkit.explain in sys.modules
from shardkit.init import (
    abstract_model,
    from_linen,
    param_logical_axes,
    param_shardings,
    sharded_init,
    state_logical_axes,
)
from shardkit.mesh import HardwarePreset, available_presets, load_preset, make_mesh, mesh_shape_str
from shardkit.parallel import hetero, moe, pipeline, sdp, spatial, tensor3d  # they register themselves
from shardkit.rules import constrain, logical_to_spec, scope, use_rules
from shardkit.step import TrainState, TrainStep
from shardkit.strategies import STRATEGIES, BoundStrategy, Strategy, register_strategy, strategy
from shardkit.targets import Target, keep_host_platforms, target

keep_host_platforms()  # before JAX starts its backends: no libtpu probe on a host without a TPU (target.py)

# The explain module was shardkit/inspect.py, which shadowed the standard library's `inspect` for scripts run from
# inside the package; the old import path still works, without a file of that name.
inspect = _sys.modules["shardkit.explain"]
_sys.modules.setdefault("shardkit.inspect", inspect)

__all__ = [
    "STRATEGIES",
    "BoundStrategy",
    "Checkpointer",
    "HardwarePreset",
    "NonFiniteError",
    "ShardkitError",
    "Strategy",
    "Target",
    "TrainState",
    "TrainStep",
    "abstract_model",
    "attention",
    "available_presets",
    "checkpoint",
    "collectives",
    "configure",
    "constrain",
    "costmodel",
    "dispatch",
    "embedding",
    "explain",
    "from_linen",
    "hetero",
    "kernels",
    "layers",
    "load_preset",
    "logical_to_spec",
    "make_mesh",
    "make_train_step",
    "mesh_shape_str",
    "moe",
    "offload",
    "param_logical_axes",
    "param_shardings",
    "pipeline",
    "plan",
    "register_step",
    "register_strategy",
    "scope",
    "sdp",
    "sharded_init",
    "spatial",
    "state_logical_axes",
    "step",
    "strategy",
    "target",
    "targets",
    "targets_gpu",
    "tensor3d",
    "train",
    "use_rules",
]
