"""Mixture of experts (shardkit/parallel/moe/routing.py): expert-parallel formulations, memory, dropping, and the loss.

    python -m experiments.bench.bench_moe [--steps 150] [--out experiments/bench/results/bench_moe.json]
    python -m experiments.bench.bench_moe --dispatch-only   # part 5 only, into the existing --out file

One process, 8 CPU devices, a GPT-MoE (4 layers x 64, 8 SwiGLU experts of mlp 128, top-2) on the stdlib corpus:
1. `ep` (explicit all-to-alls in shard_map) vs `ep_gspmd` (GSPMD's dispatch / combine einsums) on data=2,expert=4:
   collective bytes per device per step by kind (compiled HLO), XLA temporaries, median step time.
2. expert parallel (ep: each device holds 8 / 4 experts) vs replicated experts (dp on data=8): per-device
   parameter + optimizer bytes.
3. fraction of (token, choice) pairs dropped vs the capacity factor, at initialisation and after training.
4. validation loss after --steps steps of GPT-MoE vs a dense GPT of equal *active* parameters (mlp 256 = top-2 x
   128) on the same batches, and the MoE loss's terms.
5. dispatch under ep on data=2,expert=4: capacity factor 1.25 (`all_to_all`), today's dropless (capacity = seq)
   and the dropless grouped-matmul kernel (`moe=ragged`, #28): compiled FLOPs and bytes accessed per device
   (XLA's cost analysis, which counts the body of the scanned layer stack once: one layer + embedding and head,
   compare rows, not with 6N), all-to-all bytes, step time, validation loss, pairs dropped; and the compiled
   FLOPs of one layer's grouped expert SwiGLU (`sk.moe.grouped_dot`, and `jax.lax.ragged_dot` for comparison) on
   an ep device's received buffer and on one device's pairs, against the routed pairs'. --dispatch-only reruns
   this part (with its own capacity-1.25 row) and replaces it in the --out file, keeping parts 1-4.
CPU devices share the host's cores: step times measure total work, not a cluster's critical path.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import dataclasses
import json
import math

import jax
import numpy as np
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, save_json, time_steps
from experiments.data import text
from models.gpt import GPT, GPTConfig

MOE = GPTConfig(num_layers=4, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                vocab_size=text.PADDED_VOCAB, max_seq_len=64, num_experts=8, top_k=2, capacity_factor=1.25)  # fmt: skip
DENSE = dataclasses.replace(MOE, num_experts=0, mlp_dim=256)  # the same active MLP width per token
SEQ, BATCH = 64, 32


def _bytes(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def train(cfg: GPTConfig, strategy: str | sk.Strategy, mesh_spec: str, it, val, steps: int) -> dict:
    mesh = sk.make_mesh(mesh_spec)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(model, optax.adamw(3e-3), mesh, strategy)
    state = step.init_state()
    first = it(0)
    compiled = step.lower(state, first).compile()
    colls: dict[str, float] = {}
    for c in sk.hlo.collectives(compiled, mesh):
        colls[c.kind] = colls.get(c.kind, 0.0) + c.bytes_sent
    cost = compiled.cost_analysis()  # per device; a list of one dict in some jax versions
    cost = cost[0] if isinstance(cost, list) else cost
    out = dict(strategy=getattr(strategy, "name", strategy), mesh=mesh_spec,
               state_bytes=_bytes((state.params, state.opt_state)),
               temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes), bytes_by_kind=colls,
               flops=float(cost["flops"]), bytes_accessed=float(cost["bytes accessed"]))  # fmt: skip
    # `steps` training steps on batches it(0), it(1), ... (read inside the timed region); the first 3 (the first
    # one compiles the jitted step) are left out of the median
    warmup = min(3, steps - 1)
    timing, state, metrics = time_steps(step, state, it, steps - warmup, warmup=warmup)
    out.update(step_s=timing.median, val_loss=float(step.eval_loss(state, val)),
               final={k: float(v) for k, v in metrics.items()})  # fmt: skip
    return out


def dropped(cfg: GPTConfig, factor: float, it) -> float:
    """Dropped fraction at initialisation, one device, for capacity factor `factor`."""
    c = dataclasses.replace(cfg, capacity_factor=factor)
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    model = sk.sharded_init(lambda rngs: GPT(c, rngs=rngs), mesh, "dp", seed=0)
    return float(model.loss(it(0))[1]["moe_dropped"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=f"{RESULTS}/bench_moe.json")
    parser.add_argument("--dispatch-only", action="store_true", help="part 5 only, replaced in the --out file")
    args = parser.parse_args()
    ds = text.load_dataset()
    loader = text.BatchIterator(ds, BATCH, SEQ)
    it = lambda i: {k: np.asarray(v) for k, v in loader.batch(i).items()}
    vals = text.val_batches(ds, 4, BATCH, SEQ)
    val = {k: np.concatenate([v[k] for v in vals]) for k in vals[0]}
    if args.dispatch_only:
        with open(args.out) as fh:
            old = json.load(fh)
        dispatch = dispatch_rows(train(MOE, "ep", "data=2,expert=4", it, val, args.steps), it, val, args.steps)
        old["ratios"] = {k: v for k, v in old["ratios"].items() if not k.startswith(("ragged_", "expert_"))}
        old["ratios"].update(dispatch.pop("ratios"))
        save_json({**old, "dispatch": dispatch}, args.out)
        return
    runs = [train(MOE, "ep", "data=2,expert=4", it, val, args.steps),
            train(MOE, "ep_gspmd", "data=2,expert=4", it, val, args.steps),
            train(MOE, "dp", "data=8", it, val, args.steps),
            train(DENSE, "dp", "data=8", it, val, args.steps)]  # fmt: skip
    runs[3]["strategy"] = "dp (dense GPT)"
    ep, gs, rep, dense = runs
    total = lambda r: sum(r["bytes_by_kind"].values())
    print(
        f"\nGPT-MoE {MOE.num_layers} x {MOE.d_model}, {MOE.num_experts} experts x mlp {MOE.mlp_dim}, "
        f"top-{MOE.top_k}, cf {MOE.capacity_factor}; {args.steps} steps, batch {BATCH} x {SEQ}; 8 CPU devices"
    )
    print(f"{'run':<16} {'mesh':<16} {'state/dev KiB':>13} {'temp MiB':>9} {'sent KiB/step':>14} {'step ms':>8} "
          f"{'val loss':>9}  bytes by kind")  # fmt: skip
    for r in runs:
        kinds = ", ".join(f"{k} {v / 1024:.0f}" for k, v in sorted(r["bytes_by_kind"].items()) if v > 1024)
        print(f"{r['strategy']:<16} {r['mesh']:<16} {r['state_bytes'] / 1024:13.0f} {r['temp_bytes'] / 2**20:9.1f} "
              f"{total(r) / 1024:14.0f} {r['step_s'] * 1e3:8.1f} {r['val_loss']:9.4f}  {kinds}")  # fmt: skip
    ratios = dict(gspmd_bytes_over_a2a=total(gs) / total(ep), gspmd_time_over_a2a=gs["step_s"] / ep["step_s"],
                  gspmd_temp_over_a2a=gs["temp_bytes"] / ep["temp_bytes"],
                  replicated_state_over_ep=rep["state_bytes"] / ep["state_bytes"],
                  moe_minus_dense_val=ep["val_loss"] - dense["val_loss"])  # fmt: skip
    print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    drops = {f: dropped(MOE, f, it) for f in (0.5, 1.0, 1.25, 2.0)}
    print("dropped at init vs capacity factor: " + ", ".join(f"cf {f}: {d:.1%}" for f, d in drops.items()))
    print(
        f"after training (cf {MOE.capacity_factor}, ep): dropped {ep['final']['moe_dropped']:.1%}, "
        f"aux {ep['final']['moe_aux']:.3f} (1 = balanced), z {ep['final']['moe_z']:.3f}"
    )
    dispatch = dispatch_rows(ep, it, val, args.steps)
    ratios.update(dispatch.pop("ratios"))
    save_json(dict(runs=runs, dispatch=dispatch, ratios=ratios, dropped_at_init=drops, moe=dataclasses.asdict(MOE),
                   steps=args.steps), args.out)  # fmt: skip


def dispatch_rows(cf: dict, it, val, steps: int) -> dict:
    """Part 5: ep at capacity factor 1.25 (the run `cf` of part 1), ep dropless (capacity = seq) and ep with the
    ragged kernel, side by side; ratios of the ragged row to the other two."""
    ragged = sk.strategy("ep").replace(name="ep_ragged", kernels={"moe": "ragged"})
    rows = {f"cf {MOE.capacity_factor}": cf,
            "dropless (C = S)": train(dataclasses.replace(MOE, dropless=True), "ep", "data=2,expert=4", it, val, steps),
            "ragged": train(MOE, ragged, "data=2,expert=4", it, val, steps)}  # fmt: skip
    print(f"\ndispatch under ep (data=2,expert=4), {steps} steps; per device: compiled FLOPs and bytes accessed (XLA "
          f"counts the scanned layer once), all-to-all bytes sent per step")  # fmt: skip
    print(f"{'dispatch':<18} {'GFLOP':>8} {'GB acc.':>8} {'a2a KiB':>8} {'step ms':>8} {'val loss':>9} {'dropped':>8}")
    for label, r in rows.items():
        a2a = r["bytes_by_kind"].get("all-to-all", 0.0)
        print(f"{label:<18} {r['flops'] / 1e9:8.2f} {r['bytes_accessed'] / 1e9:8.3f} {a2a / 1024:8.0f} "
              f"{r['step_s'] * 1e3:8.1f} {r['val_loss']:9.4f} {r['final']['moe_dropped']:8.1%}")  # fmt: skip
    rg, dl = rows["ragged"], rows["dropless (C = S)"]
    a2a = lambda r: r["bytes_by_kind"].get("all-to-all", 0.0)
    ratios = dict(ragged_flops_over_cf=rg["flops"] / cf["flops"], ragged_flops_over_dropless=rg["flops"] / dl["flops"],
                  ragged_bytes_over_cf=rg["bytes_accessed"] / cf["bytes_accessed"],
                  ragged_bytes_over_dropless=rg["bytes_accessed"] / dl["bytes_accessed"],
                  ragged_a2a_over_dropless=a2a(rg) / a2a(dl), ragged_time_over_cf=rg["step_s"] / cf["step_s"],
                  ragged_time_over_dropless=rg["step_s"] / dl["step_s"],
                  ragged_minus_cf_val=rg["val_loss"] - cf["val_loss"])  # fmt: skip
    print("ragged: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    # one layer's expert SwiGLU, per device: ep's received buffer (X B rows, E / X local experts; N routed pairs
    # on average) and one device holding all E experts (N rows)
    n, n_x = BATCH // 8 * SEQ * MOE.top_k, 4  # (token, choice) pairs per device on 8 devices; expert=4
    shapes = {"ep": (n_x * min(n, math.ceil(n * sk.moe.RAGGED_PADDING / n_x)), MOE.num_experts // n_x),
              "one_device": (n, MOE.num_experts)}  # fmt: skip
    experts = {}
    for where, (n_rows, e) in shapes.items():
        for method in ("tiled", "ragged_dot"):
            ratio = expert_flops(n_rows, e, method) / (3 * 2 * n * MOE.d_model * MOE.mlp_dim)
            ratios[f"expert_flops_over_routed_{where}_{method}"] = ratio
            experts[f"{where} {method}"] = dict(rows=n_rows, experts=e, routed=n, flops_over_routed=ratio)
    print(f"expert SwiGLU FLOPs / the routed pairs' ({n} per device), tile {sk.moe.TILE}: "
          + ", ".join(f"{k} ({v['rows']} rows, {v['experts']} experts) {v['flops_over_routed']:.3f}"
                      for k, v in experts.items()))  # fmt: skip
    return {"rows": rows, "experts": experts, "ratios": ratios}


def expert_flops(rows: int, experts: int, method: str) -> float:
    """Compiled FLOPs of the GPT's grouped SwiGLU (3 grouped_dots) on `rows` rows sorted over `experts` experts."""
    m, f = MOE.d_model, MOE.mlp_dim

    def swiglu(w_gu, w_down, xs, sizes):
        gate, up = (sk.moe.grouped_dot(xs, w_gu[:, :, i], sizes, method=method) for i in (0, 1))
        return sk.moe.grouped_dot(jax.nn.silu(gate) * up, w_down, sizes, method=method)

    args = (np.zeros((experts, m, 2, f), np.float32), np.zeros((experts, f, m), np.float32),
            np.zeros((rows, m), np.float32), np.zeros((experts,), np.int32))  # fmt: skip
    cost = jax.jit(swiglu).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


if __name__ == "__main__":
    main()
