"""MaxText's own train step as a timing child of bench_peers.py. Runs in MaxText's venv, never in shardkit's.

    /work/venv-maxtext/bin/python experiments/bench/peer_maxtext.py '<json: model and setting>'

Builds MaxText's config programmatically (`pyconfig.initialize` from its packaged base.yml plus overrides:
synthetic data, hardware=cpu, fsdp over every device, the model of the JSON argument), then sets up its train
loop the way `maxtext.trainers.pre_train.train.train_loop` does (`setup_train_loop`, `nnx.split`,
`jit_train_and_eval_step`, one synthetic batch from its data loader) and runs its `train_step` itself, so that
only the step is timed (not MaxText's logging and metric writing between steps). Protocol with the parent on
stdout, one line each, prefixed by `@@peer ` (MaxText prints its own lines there too):

    -> {"ready": true, "first_step_s": ...}      after compiling and running two warm-up steps
    <- "steps N" on stdin                          -> {"times": [N seconds]}
    <- "quit"                                      -> exits

This file imports nothing from shardkit or from the repository: MaxText needs Python >= 3.12 and its own JAX.
"""

import time

T0 = time.perf_counter()  # before the imports: start-up includes them, as on shardkit's side

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

PREFIX = "@@peer "


def say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def overrides(m: dict, devices: int) -> dict:
    """MaxText config keys for the model `m` (bench_peers.MODELS' fields) with fsdp over every device."""
    return {
        "run_name": "bench_peers",
        "base_output_directory": tempfile.mkdtemp(prefix="maxtext_bench_"),
        "hardware": "cpu",
        "dataset_type": "synthetic",
        "enable_checkpointing": False,
        "enable_tensorboard": False,
        "skip_jax_distributed_system": True,
        "jax_cache_dir": "",  # no persistent compile cache (base.yml's ~/jax_cache): cold compiles on both sides
        "steps": 10_000,
        "per_device_batch_size": m["batch"] / devices,
        "max_target_length": m["seq"],
        "vocab_size": m["vocab"],
        "base_emb_dim": m["d_model"],
        "base_num_query_heads": m["heads"],
        "base_num_kv_heads": m["kv_heads"],
        "head_dim": m["head_dim"],
        "base_mlp_dim": m["mlp_dim"],
        "base_num_decoder_layers": m["layers"],
        "decoder_block": "llama2",  # RMSNorm, RoPE, SwiGLU (mlp_activations silu, linear): shardkit's GPT
        "dtype": "float32",
        "weight_dtype": "float32",
        "ici_fsdp_parallelism": devices,
        "ici_data_parallelism": 1,
        "remat_policy": m.get("maxtext_remat", "full"),
        "scan_layers": True,
        "attention": "dot_product",  # the XLA attention on CPU (flash / splash are TPU / GPU kernels)
        "enable_dropout": False,
        "logits_via_embedding": False,  # untied output projection, as shardkit's GPT by default
        "opt_type": "adamw",
    }


def main() -> None:
    m = json.loads(sys.argv[1])
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train
    from maxtext.utils import sharding, train_utils

    devices = jax.device_count()
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    argv = ["train.py", base, *(f"{k}={v}" for k, v in overrides(m, devices).items())]
    config = pyconfig.initialize(argv)
    train_utils.validate_train_config(config)
    jax.config.update("jax_use_shardy_partitioner", config.shardy)
    out = train_utils.setup_train_loop(config, None)
    _, _, state_mesh_shardings, _, mesh, _, _, data_loader, rampup_manager, _, state = out
    jit_model, state = nnx.split(state)
    _, params, _ = nnx.split(state.model, nnx.Param, ...)  # as train_loop counts them for its log
    n_params = sum(x.size for x in jax.tree.leaves(params))
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings
    )
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, state, state_mesh_shardings, train.train_step, None, None, params_shardings
    )
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
        batch = data_loader.load_next_batch(rampup_manager=rampup_manager)
        carry = [state]

        def step() -> float:
            t = time.perf_counter()
            carry[0], metrics = p_train_step(carry[0], batch)
            jax.block_until_ready((carry[0], metrics))
            return time.perf_counter() - t

        step()
        first = time.perf_counter() - T0
        step()  # a second warm-up: anything the first call left (buffer donation settling, caches)
        say({"ready": True, "first_step_s": first, "jax": jax.__version__, "devices": devices, "params": n_params})
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] == "quit":
                break
            say({"times": [step() for _ in range(int(cmd[1]))]})


if __name__ == "__main__":
    main()
