"""shardkit's GPT train step as a timing child of bench_peers.py (the same protocol as peer_maxtext.py).

    python -m experiments.bench.peer_shardkit '<json: model and setting>'

The GPT of models/gpt.py at the JSON's shape, fp32, the `fsdp` strategy on mesh fsdp=<every device>, the
training runs' optimizer (experiments/optim.py: AdamW, warmup + cosine, clipping at 1.0, weight decay 0.1, as
MaxText's defaults), the layers under the `scan` kernel, remat as the JSON's setting says ("full", "none" or
"dots", with a layers kernel after a "+": "none+unrolled"). One random batch, reused every step. Optional
keys (experiments/bench/bench_levers.py varies them): "mesh" (default fsdp=<every device>) and "kernels" (slot ->
kernel over the strategy's table, e.g. {"layers": "unrolled"}).
Lines to the parent on stdout, prefixed by `@@peer `:

    -> {"ready": true, "first_step_s": ...}      after compiling and running two warm-up steps
    <- "steps N" on stdin                          -> {"times": [N seconds]}
    <- "quit"                                      -> exits
"""

import time

T0 = time.perf_counter()  # before the imports: start-up includes them, as on MaxText's side

import json  # noqa: E402
import sys  # noqa: E402

PREFIX = "@@peer "


def say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    m = json.loads(sys.argv[1])
    import jax

    import shardkit as sk
    from experiments.bench.timing import gpt_batch
    from experiments.configs import base
    from experiments.optim import make_optimizer
    from models.gpt import GPT, GPTConfig

    devices = jax.device_count()
    # a setting is a remat policy, optionally with a layers kernel after "+": "full", "none+unrolled"
    remat, _, layers = m["shardkit_remat"].partition("+")
    kernels = {**m.get("kernels", {}), **({"layers": layers} if layers else {})}
    cfg = GPTConfig(
        vocab_size=m["vocab"], num_layers=m["layers"], d_model=m["d_model"], num_heads=m["heads"],
        num_kv_heads=m["kv_heads"], head_dim=m["head_dim"], mlp_dim=m["mlp_dim"], max_seq_len=m["seq"],
        dtype="float32", remat=remat,
    )  # fmt: skip
    mesh = sk.make_mesh(m.get("mesh") or f"fsdp={devices}")
    strategy = sk.strategy("fsdp")
    if kernels:
        strategy = strategy.replace(kernels=kernels)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy)
    optimizer, _ = make_optimizer(base.get_config().optimizer, steps=10_000)
    step_fn = sk.make_train_step(model, optimizer, mesh, strategy)
    del model
    carry = [step_fn.init_state()]
    batch = gpt_batch(m["vocab"], m["batch"], m["seq"], step_fn.batch_sharding)

    def step() -> float:
        t = time.perf_counter()
        carry[0], metrics = step_fn(carry[0], batch)
        jax.block_until_ready((carry[0], metrics))
        return time.perf_counter() - t

    step()
    first = time.perf_counter() - T0
    step()  # a second warm-up, as on MaxText's side
    params = cfg.num_params(include_embedding=True)
    say({"ready": True, "first_step_s": first, "jax": jax.__version__, "devices": devices, "params": params})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        say({"times": [step() for _ in range(int(cmd[1]))]})


if __name__ == "__main__":
    main()
