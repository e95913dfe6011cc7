"""shardkit: write a Flax model once with logical axis names, train it under any SPMD parallelism."""

from shardkit import attention, checkpoint, collectives, costmodel, inspect, layers, pipeline, tensor3d
from shardkit.checkpoint import Checkpointer, NonFiniteError
from shardkit.costmodel import plan
from shardkit.errors import ShardkitError
from shardkit.init import abstract_model, param_logical_axes, param_shardings, sharded_init
from shardkit.inspect import explain
from shardkit.mesh import HardwarePreset, available_presets, load_preset, make_mesh, mesh_shape_str
from shardkit.rules import constrain, logical_to_spec, use_rules
from shardkit.strategies import STRATEGIES, BoundStrategy, Strategy, register_strategy, strategy
from shardkit.train import TrainState, TrainStep, make_train_step

__all__ = [
    "STRATEGIES",
    "BoundStrategy",
    "Checkpointer",
    "HardwarePreset",
    "NonFiniteError",
    "ShardkitError",
    "Strategy",
    "TrainState",
    "TrainStep",
    "abstract_model",
    "attention",
    "available_presets",
    "checkpoint",
    "collectives",
    "constrain",
    "costmodel",
    "explain",
    "inspect",
    "layers",
    "load_preset",
    "logical_to_spec",
    "make_mesh",
    "make_train_step",
    "mesh_shape_str",
    "param_logical_axes",
    "param_shardings",
    "pipeline",
    "plan",
    "register_strategy",
    "sharded_init",
    "strategy",
    "tensor3d",
    "use_rules",
]
