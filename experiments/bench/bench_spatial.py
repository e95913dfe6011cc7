"""Benchmark spatial parallelism for 3D CNNs on 8 CPU devices: memory vs spatial degree, explicit vs GSPMD halos.

    python -m experiments.bench.bench_spatial [--out experiments/bench/results/bench_spatial.json] [--reps 3]
        [--sizes 32,64,128]

1. memory: per-device XLA temporaries (`memory_analysis().temp_size_in_bytes`) of fwd + bwd of a 3-block conv
   trunk (conv3d k=3, 8 -> 16 -> 16 channels, ReLU, 2^3 max pool; batch 1) through the explicit halo kernels,
   depth split over `space` of degree S = 1, 2, 4, 8, for volumes of size^3; the ratio to S = 1 against the
   target 1.05 / S; and, from the measured bytes per voxel, the largest cube that fits a per-device budget.
2. the CosmoFlow train step (models/cosmoflow.py, 32^3, batch 16, BatchNorm) on data=2 x space=2 x space_h=2
   under `spatial_dp` (GSPMD halos) and `spatial_dp_halo` (explicit): collective-permute count and bytes, all-
   reduces, step time, next to the same step on one device and under plain `dp` on data=8; the halo share of
   the bytes; and the halo bytes the kernels predict at trace time (`sk.spatial.recording`) vs the compiled ones.
   The 8 virtual devices share this host's cores, so times measure total work and overhead, not speed-up.
3. the activation memory models (models/cosmoflow_cost.py, models/unet3d_cost.py) against the compiled train
   step's temporaries per device, for cosmoflow_tiny (32^3, batch 16) and unet3d_tiny (24^3, batch 8) under `dp`
   on one device and `spatial_halo` at spatial degree S = 2 (depth), 4 (depth x height), 8 (x width): predicted /
   compiled, and the share only XLA:CPU allocates (`xla_cpu`: its max-pool gradient expansion, halo pads).
4. planning: `sk.plan` ranks data x spatial splits of CosmoFlow at 512^3 (experiments/configs/cosmoflow_512.py)
   on the `lassen` preset (2048 V100 16 GB, the class of machine of Oyama et al.) by predicted communication time,
   within memory (models/cosmoflow_cost.py), next to data parallelism alone.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardkit as sk
from experiments.bench.timing import RESULTS, save_json, time_calls
from models.cosmoflow import CosmoFlow, CosmoFlowConfig
from models.unet3d import UNet3D, UNet3DConfig
from shardkit import hlo

TRUNK = (8, 16, 16)  # output channels of the 3 conv blocks of the memory benchmark (input: 1 channel)
COSMO = CosmoFlowConfig(size=32, widths=(8, 16, 16, 32, 32), dense=(64, 32), batch_norm=True, spatial_blocks=3)
BATCH = 16


def trunk_temp_bytes(size: int, degree: int) -> int:
    """Per-device temporaries of fwd + bwd of the trunk on a size^3 volume split over `space` of `degree`."""
    mesh = sk.make_mesh(f"space={degree}", jax.devices()[:degree])
    axes = ("space", None, None)
    x = jax.ShapeDtypeStruct((1, size, size, size, 1), jnp.float32)
    ws, c = [], 1
    for w in TRUNK:
        ws.append(jax.ShapeDtypeStruct((3, 3, 3, c, w), jnp.float32))
        c = w

    def loss(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        for i, w in enumerate(ws):
            x = jax.nn.relu(sk.spatial.conv(x, w, mesh=mesh, spatial_axes=axes, name=f"conv{i}"))
            x = sk.spatial.pool(x, window=2, mesh=mesh, spatial_axes=axes, name=f"pool{i}")
        return (x**2).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def memory_table(sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        one = None
        for degree in (1, 2, 4, 8):
            if size % degree or (size // degree) % 2 ** len(TRUNK):  # every pool halves the local extent
                print(
                    f"  {size:>4}^3  S={degree}  skipped: {size // degree} voxels per device do not halve {len(TRUNK)}x"
                )
                continue
            temp = trunk_temp_bytes(size, degree)
            one = temp if degree == 1 else one
            rows.append(dict(size=size, degree=degree, temp_bytes=temp, ratio=temp / one, target=1.05 / degree,
                             bytes_per_voxel=temp * degree / size**3))  # fmt: skip
            print(f"  {size:>4}^3  S={degree}  temp {temp / 2**20:9.2f} MiB  ratio {temp / one:.3f}  "
                  f"(target <= {1.05 / degree:.3f})")  # fmt: skip
    return rows


UNET = UNet3DConfig(widths=(8, 16, 32), num_classes=3)
#: spatial degree -> (strategy, mesh) of the memory model table
DEGREES = {1: ("dp", "data=1"), 2: ("spatial_halo", "space=2"), 4: ("spatial_halo", "space=2,space_h=2"),
           8: ("spatial_halo", "space=2,space_h=2,space_w=2")}  # fmt: skip


def memory_model_rows() -> list[dict[str, Any]]:
    """Predicted activations (backend "cpu") / compiled temporaries per model and spatial degree (abstract state:
    compiled, never run)."""
    models = {
        "cosmoflow_tiny": (COSMO, lambda r: CosmoFlow(COSMO, rngs=r), {"volume": ((BATCH, 32, 32, 32, 1), jnp.float32),
                           "target": ((BATCH, 4), jnp.float32)}),
        "unet3d_tiny": (UNET, lambda r: UNet3D(UNET, rngs=r), {"volume": ((8, 24, 24, 24, 1), jnp.float32),
                        "label": ((8, 24, 24, 24), jnp.int32)}),
    }  # fmt: skip
    rows = []
    for name, (cfg, make, shapes) in models.items():
        for degree, (strategy, spec) in DEGREES.items():
            mesh = sk.make_mesh(spec, jax.devices()[:degree])
            step = sk.make_train_step(sk.abstract_model(make), optax.sgd(0.01), mesh, strategy)
            batch = {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}
            temp = int(step.lower(step.abstract_state(), batch).compile().memory_analysis().temp_size_in_bytes)
            cost, sizes = sk.costmodel.for_config(cfg), {k: v[0] for k, v in shapes.items()}
            _, mem, _ = cost.predict(strategy, dict(mesh.shape), sizes, 4, "cpu")
            _, gpu, _ = cost.predict(strategy, dict(mesh.shape), sizes, 4, "gpu")
            rows.append(dict(model=name, degree=degree, strategy=strategy, mesh=spec, temp_bytes=temp,
                             predicted_bytes=mem["activations"], ratio=mem["activations"] / temp,
                             xla_cpu_share=mem["xla_cpu"] / mem["activations"],
                             gpu_estimate_bytes=gpu["activations"]))  # fmt: skip
            r = rows[-1]
            print(f"  {name:<15} S={degree}  {strategy:<13} {spec:<28} compiled {temp / 2**20:8.2f} MiB  predicted "
                  f"{r['predicted_bytes'] / 2**20:8.2f} MiB  ratio {r['ratio']:.3f}  XLA:CPU-only "
                  f"{r['xla_cpu_share']:4.0%}  (GPU estimate {r['gpu_estimate_bytes'] / 2**20:.2f} MiB)")  # fmt: skip
    return rows


def step_row(spec: str, strategy: str, reps: int, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    n = np.prod([int(a.split("=")[1]) for a in spec.split(",")])
    mesh = sk.make_mesh(spec, jax.devices()[:n])
    model = sk.sharded_init(lambda rngs: CosmoFlow(COSMO, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(model, optax.sgd(0.01), mesh, strategy, donate=False)
    state = step.init_state()
    placed = jax.device_put(batch, step.batch_shardings(batch))
    with sk.spatial.recording() as layers:
        lowered = step.lower(state, placed)
    compiled = lowered.compile()
    step_s = time_calls(lambda: compiled(state, placed), reps).best  # the same state each time (donate=False)
    colls = hlo.collectives(compiled, mesh)
    permutes = [c for c in colls if c.kind == "collective-permute"]
    row = dict(mesh=spec, strategy=strategy, step_s=step_s,
               permute_count=sum(c.count for c in permutes), permute_bytes=sum(c.bytes_sent for c in permutes),
               all_reduce_count=sum(c.count for c in colls if c.kind == "all-reduce"),
               all_reduce_bytes=sum(c.bytes_sent for c in colls if c.kind == "all-reduce"),
               other_bytes=sum(c.bytes_sent for c in colls if c.kind not in ("collective-permute", "all-reduce")),
               temp_bytes=int(compiled.memory_analysis().temp_size_in_bytes),
               predicted_permute_bytes=sum(e.bytes * (1 + e.backward) for e in layers) if layers else None,
               predicted_permute_count=sum(len(e.sends) * (1 + e.backward) for e in layers) if layers else None,
               )  # fmt: skip
    total = row["permute_bytes"] + row["all_reduce_bytes"] + row["other_bytes"]
    row["halo_share"] = row["permute_bytes"] / total if total else 0.0
    est = sk.costmodel.for_config(COSMO).predict(strategy, dict(mesh.shape), {"volume": (BATCH,)}, 4, "cpu")
    row["estimated_activation_bytes"] = est[1]["activations"] if est else None
    return row


def trunk_section(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, int]]:
    print("1. per-device temporaries of a 3-block conv trunk (fwd + bwd), depth split over space=S:")
    mem = memory_table([int(s) for s in args.sizes.split(",")])
    biggest = max(r["size"] for r in mem)
    fits = {}
    for r in (r for r in mem if r["size"] == biggest):  # bytes per voxel at the largest size measured
        side = int((args.budget_gib * 2**30 * r["degree"] / r["bytes_per_voxel"]) ** (1 / 3))
        fits[r["degree"]] = side
    print(f"  largest cube within {args.budget_gib:g} GiB per device (this trunk, batch 1): "
          + ", ".join(f"S={d}: {s}^3" for d, s in fits.items()))  # fmt: skip

    return mem, fits


def step_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\n2. CosmoFlow train step, 32^3, batch {BATCH} (BatchNorm, 3 spatial blocks):")
    rng = np.random.default_rng(0)
    batch = {"volume": rng.normal(size=(BATCH, 32, 32, 32, 1)).astype(np.float32),
             "target": rng.uniform(-1, 1, (BATCH, 4)).astype(np.float32)}  # fmt: skip
    rows = [step_row("data=1", "dp", args.reps, batch), step_row("data=8", "dp", args.reps, batch)]
    rows += [step_row("data=2,space=2,space_h=2", s, args.reps, batch) for s in ("spatial_dp", "spatial_dp_halo")]
    base = rows[0]["step_s"]
    head = f"{'strategy':<16} {'mesh':<26} {'time':>7} {'vs 1 dev':>8} {'permutes':>8} {'halo KiB':>9} "
    head += f"{'pred KiB':>9} {'AR':>3} {'halo share':>10} {'temp MiB':>9}"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        pred = (
            f"{r['predicted_permute_bytes'] / 1024:9.1f}" if r["predicted_permute_bytes"] is not None else f"{'-':>9}"
        )
        print(f"{r['strategy']:<16} {r['mesh']:<26} {r['step_s']:7.3f} {r['step_s'] / base:8.2f} "
              f"{r['permute_count']:>8} {r['permute_bytes'] / 1024:9.1f} {pred} {r['all_reduce_count']:>3} "
              f"{r['halo_share']:10.1%} {r['temp_bytes'] / 2**20:9.2f}")  # fmt: skip
    gspmd, halo = rows[2], rows[3]
    print(f"\nexplicit / GSPMD: halo bytes {halo['permute_bytes'] / gspmd['permute_bytes']:.3f}, permutes "
          f"{halo['permute_count']} vs {gspmd['permute_count']}, all-reduces {halo['all_reduce_count']} vs "
          f"{gspmd['all_reduce_count']}, step time {halo['step_s'] / gspmd['step_s']:.3f}")  # fmt: skip
    print(
        f"activations predicted by models/cosmoflow_cost.py (backend cpu): "
        f"{halo['estimated_activation_bytes'] / 2**20:.2f} MiB per device; compiled temporaries "
        f"{halo['temp_bytes'] / 2**20:.2f} MiB ({halo['estimated_activation_bytes'] / halo['temp_bytes']:.3f})"
    )
    print(f"explicit, predicted at trace time / compiled halo bytes: "
          f"{halo['predicted_permute_bytes'] / halo['permute_bytes']:.4f}")  # fmt: skip

    return rows


def plan_section(args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"\n4. sk.plan: CosmoFlow 512^3 x 4 channels on lassen (2048 x V100 16 GB), global batch {args.plan_batch}, "
          "bf16:")  # fmt: skip
    big = CosmoFlowConfig(size=512, in_channels=4, widths=(16, 32, 64, 128, 256, 256, 256), dense=(128, 64),
                          spatial_blocks=5)  # fmt: skip
    plans = sk.plan(big, devices=2048, hardware="lassen", global_batch=args.plan_batch,
                    strategies=("dp", "spatial_dp_halo"), include_rejected=True, nbytes=2)  # fmt: skip
    fitting = [p for p in plans if p.fits]
    print(sk.costmodel.format_plans(fitting[:5]))
    dp = [p for p in plans if p.strategy == "dp"]
    rejected = [p for p in plans if not p.fits]
    dp_text = f"dropped (batch {args.plan_batch} < 2048 devices)" if not dp else dp[0].reason or "fits"
    print(f"  {len(fitting)} plans fit, {len(rejected)} rejected for memory; data parallelism alone: {dp_text}")
    one = sk.plan(big, devices=2048, hardware="lassen", global_batch=2048, strategies=("dp",), nbytes=2,
                  include_rejected=True)[0]  # fmt: skip
    print(f"  data parallelism at batch 2048 (one volume per device): {one.reason or 'fits'}")
    plan_rows = [dict(strategy=p.strategy, mesh=p.mesh, comm_ms=p.comm_time_s * 1e3, fits=p.fits, reason=p.reason,
                      memory_gib=p.memory["total"] / 2**30) for p in plans[:20]]  # fmt: skip

    return plan_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=f"{RESULTS}/bench_spatial.json")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="32,64,128", help="cube sizes of the memory table")
    parser.add_argument("--budget_gib", type=float, default=16.0, help="per-device memory budget (V100: 16 GiB)")
    parser.add_argument("--plan_batch", type=int, default=256, help="global batch of the 512^3 plan")
    parser.add_argument("--sections", default="1,2,3,4", help="which of the sections above to run")
    args = parser.parse_args()
    run = {int(x) for x in args.sections.split(",")}

    mem, fits = trunk_section(args) if 1 in run else ([], {})
    rows = step_section(args) if 2 in run else []
    if 3 in run:
        print("\n3. activation memory: models/*_cost.py (backend cpu) vs compiled temporaries per device:")
    model_rows = memory_model_rows() if 3 in run else []
    plan_rows = plan_section(args) if 4 in run else []

    setup = dict(devices=jax.device_count(), backend=jax.default_backend(), jax=jax.__version__, trunk=TRUNK,
                 cosmoflow=str(COSMO), batch=BATCH, reps=args.reps, budget_gib=args.budget_gib)  # fmt: skip
    report = {"setup": setup, "memory": mem, "fits": fits, "steps": rows, "memory_model": model_rows,
              "plans": plan_rows}  # fmt: skip
    save_json(report, args.out, indent=2)


if __name__ == "__main__":
    main()
