"""MaxText's train step compiled for a TPU topology (or a GPU node) on this host, as a child of `bench_peers
--target`. Runs in MaxText's venv, never in shardkit's:

    /work/venv-maxtext/bin/python experiments/bench/peer_maxtext_tpu.py '<json: model, target, mesh, remat>' OUT_DIR
    /work/venv-maxtext/bin/python experiments/bench/peer_maxtext_tpu.py \
        '<json: model_name, target, batch, seq>' OUT_DIR     # a scale cell: MaxText's own model config, its defaults

Follows MaxText's own ahead-of-time compile (`maxtext.trainers.pre_train.train_compile`: `get_topology_mesh`,
`get_shaped_inputs`, `get_functional_train_with_signature`, `jit_and_compile`) with its packaged base.yml plus the
overrides below (bf16 compute, fp32 weights, AdamW, scanned layers, its default attention: splash on TPU), and
writes what the parent reads with shardkit's parser: OUT_DIR/maxtext.hlo (the compiled program's text) and
OUT_DIR/maxtext.json (memory and cost analysis, the mesh, which device runs each partition, the parameter count,
the versions). Imports nothing from shardkit: MaxText needs Python >= 3.12 and its own JAX.

With `model_name` (a scale cell, `bench_peers --target v5p-128 --model 7b`), MaxText's own model file
(configs/models/<model_name>.yml) and base.yml's defaults decide everything (its mesh: ici_fsdp_parallelism=-1 over
the slice; its remat policy, dtypes, attention, optimizer) except the global batch (`per_device_batch_size` = batch /
devices) and the sequence length (`max_target_length`). A program the compiler refuses for memory is recorded as
refused, with the compiler's message, instead of failing.

With `gpu` (`bench_peers --target h100-8`: {"spec": GpuTargetConfigProto text, "topology": "1x1x8"}), the program is
compiled by XLA's CUDA compiler (JAX's CUDA plugin in MaxText's venv, JAX_PLATFORMS=cpu) with hardware=gpu and
compile_topology=a3 (MaxText's name for an 8 x H100 host). MaxText's train_compile cannot give it the devices:
`get_topology_mesh`'s GPU branch takes `jax.devices()`, the GPUs of the host it runs on; without one that is the
host's CPU, and its `create_device_mesh` stops ("Number of devices per slice 1 does not match the product of the ICI
parallelism 8"). The devices come from XLA's topology description of the spec instead (gpu_topology_mesh), and the
rest of its mesh code runs as it is. tokamax's cross_compile option lets MaxText's GPU flash attention be traced on
the CPU (cross_compile). `attention` (optional) overrides MaxText's default.
"""

import contextlib
import importlib.metadata
import json
import math
import os
import sys
import tempfile
import time

import peer_maxtext  # its sibling, the CPU timing child: the same model keys (this file's folder is on sys.path)

#: shardkit mesh axis -> MaxText's ici_*_parallelism key
ICI = {"fsdp": "ici_fsdp_parallelism", "data": "ici_data_parallelism", "tensor": "ici_tensor_parallelism"}


def overrides(m: dict, target: str, mesh: dict[str, int], remat: str) -> dict:
    """peer_maxtext.py's keys for the model `m` (its CPU timing child), for the TPU `target`: bf16 compute, the mesh
    `mesh` (shardkit axis -> size), MaxText's default attention (splash on TPU), remat policy `remat`."""
    devices = math.prod(mesh.values())
    keys = peer_maxtext.overrides({**m, "maxtext_remat": remat}, devices)
    keys.pop("attention")  # its default, "autoselected": splash on TPU, as shardkit's auto block
    ici = {key: 1 for key in ICI.values()} | {ICI[axis]: n for axis, n in mesh.items()}
    return {
        **keys,
        **ici,
        "run_name": "bench_peers_tpu",
        "base_output_directory": tempfile.mkdtemp(prefix="maxtext_tpu_"),
        "hardware": "tpu",
        "compile_topology": target,
        "compile_topology_num_slices": 1,
        "dtype": "bfloat16",
    }


def gpu_overrides(spec: dict) -> dict:
    """overrides() for a GPU node: hardware=gpu, compile_topology=a3 (8 GPUs a host, its only GPU topology) over
    `spec["gpu"]["hosts"]` hosts; MaxText's default attention on GPU unless `spec["attention"]` names one."""
    keys = overrides(spec["model"], "a3", spec["mesh"], spec["remat"])
    keys.update(run_name="bench_peers_gpu", hardware="gpu", compile_topology_num_slices=spec["gpu"]["hosts"])
    return keys | ({"attention": spec["attention"]} if spec.get("attention") else {})


def gpu_topology_mesh(config, gpu: dict):
    """train_compile.get_topology_mesh for GPUs that are not here: the devices of XLA's topology description of the
    GpuTargetConfigProto `gpu["spec"]` ("1x<hosts>x<gpus>"), where MaxText's GPU branch takes `jax.devices()`, then
    its own mesh code (`create_device_mesh`, the axis types) as get_topology_mesh runs it."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.utils import maxtext_utils

    desc = topologies.get_topology_desc(platform="cuda", target_config=gpu["spec"], topology=gpu["topology"])
    devices = sorted(desc.devices, key=lambda d: (d.process_index, d.id))
    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    return Mesh(maxtext_utils.create_device_mesh(config, devices), config.mesh_axes,
                axis_types=(axis_type,) * len(config.mesh_axes))  # fmt: skip


def cross_compile(gpu: bool):
    """For a GPU target, tokamax's `cross_compile` option: its kernels (MaxText's GPU flash attention) check the
    device they are traced on, and refuse the host's CPU ("Not supported on cpu") unless it is set."""
    if not gpu:
        return contextlib.nullcontext()
    import tokamax

    return tokamax.config.cross_compile(True)


def versions(gpu: bool) -> dict[str, str]:
    """The compiler's and MaxText's versions (the CUDA plugin and ptxas for a GPU target, libtpu for a TPU)."""
    names = ("jax-cuda13-plugin", "jax-cuda12-plugin", "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12", "tokamax")
    names = names if gpu else ("libtpu",)
    out = {}
    for p in ("jax", "jaxlib", *names, "maxtext"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[p] = importlib.metadata.version(p)
    return out


def scale_overrides(spec: dict) -> dict:
    """A scale cell's keys: MaxText's model `spec["model_name"]` at its defaults, for `spec["target"]` (a Cloud name
    such as v5p-128, which MaxText's compile_topology takes as it is), at `spec["batch"]` x `spec["seq"]` tokens."""
    chips = int(spec["target"].rsplit("-", 1)[1]) // (2 if spec["target"].startswith(("v4", "v5p")) else 1)
    return {
        "model_name": spec["model_name"],
        "per_device_batch_size": spec["batch"] / chips,
        "max_target_length": spec["seq"],
        "run_name": "bench_peers_tpu_scale",
        "base_output_directory": tempfile.mkdtemp(prefix="maxtext_tpu_"),
        "enable_checkpointing": False,
        "compile_topology": spec["target"],
        "compile_topology_num_slices": 1,
    }


def count_params(abstract_state) -> int:
    """The model's parameter count, as MaxText's train loop logs it (the state's nnx.Param leaves)."""
    from flax import nnx

    _, params, _ = nnx.split(abstract_state.model, nnx.Param, ...)
    return int(sum(x.size for x in __import__("jax").tree.leaves(params)))


def main() -> None:
    spec, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    if "gpu" in spec:  # as get_topology_mesh's GPU branch (autotuning spread over hosts can hang an AOT compile)
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_shard_autotuning=false"
    import jax
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")  # as train_compile.main
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    if "model_name" in spec:
        keys = scale_overrides(spec)
    elif "gpu" in spec:
        keys = gpu_overrides(spec)
    else:
        keys = overrides(spec["model"], spec["target"], spec["mesh"], spec["remat"])
    config = pyconfig.initialize(["train_compile.py", base, *(f"{k}={v}" for k, v in keys.items())])
    train_compile.validate_config(config)
    mesh = gpu_topology_mesh(config, spec["gpu"]) if "gpu" in spec else train_compile.get_topology_mesh(config)
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings
    )
    t0 = time.perf_counter()
    versions_ = versions("gpu" in spec)
    mesh_record = {"axis_names": list(mesh.axis_names), "shape": list(mesh.devices.shape),
                   "device_ids": [d.id for d in mesh.devices.flat]}  # fmt: skip
    try:
        with cross_compile("gpu" in spec):
            compiled = train_compile.jit_and_compile(func, args, kwargs, mesh, in_shard, out_shard, static, donate,
                                                     config, logical_axis_rules(config.logical_axis_rules))  # fmt: skip
    except Exception as e:  # the compiler's refusal (larger than HBM) is the cell's verdict; anything else fails
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        refused = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0]
        record = {"refused": refused, "compile_s": time.perf_counter() - t0, "mesh": mesh_record,
                  "params": count_params(args[0]), "settings": keys, "versions": versions_}  # fmt: skip
        with open(os.path.join(out_dir, "maxtext.json"), "w") as f:
            json.dump(record, f)
        return
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}  # None from the CUDA compiler
    params = count_params(args[0])
    with open(os.path.join(out_dir, "maxtext.hlo"), "w") as f:
        f.write(compiled.as_text())
    try:
        order = [d.id for d in compiled._executable._unloaded_executable.device_list]
    except Exception:  # the partition -> device map is only a label for the collectives' axes
        order = None
    record = {
        "compile_s": compile_s,
        "memory": {
            k: getattr(mem, k)
            for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
        },
        "hbm_bytes_accessed": float(cost["bytes accessed"]) if "bytes accessed" in cost else None,
        "flops": float(cost["flops"]) if "flops" in cost else None,
        "mesh": mesh_record,
        "partition_device_ids": order,
        "params": params,
        "settings": keys,
        "versions": versions_,
    }
    with open(os.path.join(out_dir, "maxtext.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
