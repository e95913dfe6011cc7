"""shardkit: write a Flax model once with logical axis names, train it under any SPMD parallelism.

Every public name, one line each: docs/api.md. Functions and classes are here; a namespace is a module whose
functions are the API (`sk.attention.ring_attention`, `sk.tensor3d.linear`, `sk.hlo.collectives`, ...).
"""

import warnings as _warnings
from typing import Any as _Any

# _host first: it imports jax with the CUDA plugin's driver-search lines held back on a host without a GPU
from shardkit import (
    _host,  # noqa: F401
    attention,
    collectives,
    costmodel,
    embedding,
    hlo,
    kernels,
    layers,
    offload,
    targets_gpu,  # noqa: F401  (registers the GPU targets with shardkit.targets)
)
from shardkit.checkpoint import Checkpointer, NonFiniteError
from shardkit.clipping import clip_by_global_norm, global_norm
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
from shardkit.losses import cross_entropy
from shardkit.mesh import HardwarePreset, available_presets, load_preset, make_mesh, mesh_shape_str
from shardkit.parallel import hetero, moe, pipeline, sdp, spatial, tensor3d  # they register themselves
from shardkit.rules import constrain, logical_to_spec, platform_family, scope, use_rules
from shardkit.step import TrainState, TrainStep
from shardkit.strategies import STRATEGIES, BoundStrategy, Strategy, register_strategy, strategy
from shardkit.targets import Target, keep_host_platforms, target
from shardkit.traits import Traits  # what a strategy is, from its tables (Strategy.traits() is deprecated)

keep_host_platforms()  # before JAX starts its backends: no libtpu probe on a host without a TPU (target.py)

#: Names that moved, served for one more release with a DeprecationWarning: old name -> (module, what to use now).
_MOVED = {
    "train": ("shardkit.parallel.gspmd.step", "sk.cross_entropy, sk.clip_by_global_norm, sk.global_norm"),
    "inspect": ("shardkit.explain", "sk.explain (the function) or `import shardkit.explain`"),
}


def __getattr__(name: str) -> _Any:
    if name in _MOVED:
        import importlib

        module, instead = _MOVED[name]
        _warnings.warn(f"sk.{name} is deprecated and will be removed: use {instead}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(module)
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")


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
    "Traits",
    "abstract_model",
    "attention",
    "available_presets",
    "clip_by_global_norm",
    "collectives",
    "configure",
    "constrain",
    "costmodel",
    "cross_entropy",
    "embedding",
    "explain",
    "from_linen",
    "global_norm",
    "hetero",
    "hlo",
    "keep_host_platforms",
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
    "platform_family",
    "register_step",
    "register_strategy",
    "scope",
    "sdp",
    "sharded_init",
    "spatial",
    "state_logical_axes",
    "strategy",
    "target",
    "tensor3d",
    "use_rules",
]
