"""shardkit's train step against MaxText's, both compiled for one 8 x H100 node by XLA's CUDA compiler on this host.

    python -m experiments.bench.bench_peers --target h100-8 [--meshes fsdp,tp,tp_sp] [--remat full,best]
        [--maxtext-attention dot_product] [--maxtext-python /work/venv-maxtext/bin/python]
        [--out experiments/bench/results/bench_peers_gpu.json]

The TPU comparison's model, meshes, remat settings, parser and figures (experiments/bench/peers_tpu.py), for
`h100-8`: no GPU is needed or used. Each side compiles with its own JAX's CUDA plugin and ptxas, with
JAX_PLATFORMS=cpu (docs/targets.md §8): shardkit in its venv through `sk.target("h100-8")`, MaxText in its venv
through its train_compile path (peer_maxtext_tpu.py; hardware=gpu, compile_topology=a3, the devices of XLA's
topology description of meshes/gpu_specs/h100_sxm.txtpb, since MaxText's own GPU branch takes `jax.devices()`, the
host's CPU here). The CUDA compiler has no cost analysis: no HBM-bytes figure on either side.

Attention differs by default. MaxText's `autoselected` picks tokamax's Pallas Triton flash attention on GPU
(`pallas_flash_attention*` kernels; tokamax's cross_compile option lets it trace on the host's CPU). shardkit's
`auto` picks cuDNN's fused attention where cuDNN loads and XLA's dense attention where it does not: the small
compile-only set has no cuDNN, so its default here is XLA's. Hence two shardkit variants: `default` (its defaults)
and `pallas_gpu` (attention_block=pallas_gpu, JAX's Pallas Triton flash attention: like with like). Matmul FLOPs
count dots only: a kernel's attention FLOPs are not in them (the XLA attention's are). `--maxtext-attention`
compiles MaxText once more per cell with that attention (e.g. `dot_product`, its XLA attention, beside shardkit's
default). Nothing is timed; gemm tiles are XLA's fallback ones (no autotuning without a GPU).

MaxText's venv needs XLA's CUDA compiler beside its TPU set (no GPU needed). bench_peers.py's pinned install gives
it jax 0.12.0.1's CUDA 12 plugin and ptxas, the same compiler as shardkit's on jax 0.12.0.1 (docs/performance.md,
"The GPU program against MaxText's", also keeps the two-venv recipe the first tables were made with).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from experiments.bench.peers_tpu import MESHES, MODEL, REMAT, markdown, maxtext_compile, shardkit_program, table

#: shardkit's variants on GPU: GPTConfig overrides and kernel slots; embed "tpu": the kernel `auto` takes on a TPU
#: for the cell's strategy (local under fsdp, vocab under tp and tp_sp), where on a GPU it takes gather
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "default": ({}, {}),
    "pallas_gpu": ({}, {"attention_block": "pallas_gpu"}),
    "pallas_gpu+embed": ({}, {"attention_block": "pallas_gpu", "embed": "tpu"}),
}
#: the markdown's ratios: the issue's goal (defaults), then like with like (XLA's attention; Triton flash attention)
PAIRS = (("shardkit default", "maxtext"), ("shardkit default", "maxtext dot_product"),
         ("shardkit pallas_gpu", "maxtext"), ("shardkit pallas_gpu+embed", "maxtext"))  # fmt: skip
#: the CUDA compiler's packages on either side (JAX 0.10's plugin is cuda12, 0.12.1's cuda13)
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvcc")


def versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[p] = importlib.metadata.version(p)
    return out


#: run in MaxText's venv: which of the CUDA compiler's parts are missing there (nothing printed: none)
PROBE = """import importlib.util as u
def has(m):
    try:
        return u.find_spec(m) is not None
    except (ImportError, ValueError):
        return False
plugin = has("jax_plugins.xla_cuda13") or has("jax_plugins.xla_cuda12")
ptxas = has("nvidia.cu13") or has("nvidia.cuda_nvcc")
print(", ".join([*([] if plugin else ["JAX's CUDA plugin"]), *([] if ptxas else ["ptxas"])]))"""


def check_cuda(python: str) -> None:
    """A ShardkitError naming what to install when MaxText's venv lacks XLA's CUDA compiler."""
    from shardkit.errors import ShardkitError

    got = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    if got.returncode or got.stdout.strip():
        missing = got.stdout.strip() or got.stderr.strip()[-300:]
        v = _version(python)  # jax up to 0.12.0.1 has a CUDA 12 plugin (shardkit's compiler), 0.12.1 only CUDA 13
        cuda = (f'"jax[cuda12-local]=={v}" nvidia-cuda-nvcc-cu12' if v.startswith(("0.10.", "0.11.", "0.12.0"))
                else f'"jax[cuda13-local]=={v}" "nvidia-cuda-nvcc>=13.0.48"')  # fmt: skip
        raise ShardkitError(f"MaxText's venv ({python}) cannot compile for a GPU ({missing} missing): {python} -m pip "
                            f"install {cuda} (no GPU needed)")  # fmt: skip


def _version(python: str) -> str:
    got = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('jax'))"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    return got.stdout.strip() or "<its jax version>"


def maxtext_program(python: str, target: str, mesh_name: str, remat: str, attention: str, log: Path) -> dict:
    """MaxText's train step for the GPU `target` (its GpuTargetConfigProto and topology from shardkit's target)."""
    import shardkit as sk

    tgt = sk.target(target)
    gpu = {"spec": tgt.spec_text, "topology": tgt.topology, "hosts": tgt.num_slices}
    spec = {"model": MODEL, "target": target, "mesh": MESHES[mesh_name][2], "remat": REMAT[remat][1], "gpu": gpu,
            "attention": attention}  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # the CUDA plugin registers only with JAX on the CPU (no GPU here)
    return maxtext_compile(python, spec, log, f"{mesh_name} / {remat} / {attention or 'default'}", env)


def run(target: str, meshes: list[str], remats: list[str], maxtext_python: str, logs: Path,
        maxtext_attention: str = "") -> dict[str, Any]:  # fmt: skip
    """Compiles every (mesh, remat) cell for both sides; returns the JSON record (and prints as it goes)."""
    import shardkit as sk

    check_cuda(maxtext_python)
    cudnn = sk.attention.blocks.cudnn_loadable()
    why = "cuDNN's (cuDNN loads)" if cudnn else "XLA's (no cuDNN: pip install nvidia-cudnn-cu12 for a GPU host's)"
    print(f"shardkit's default attention here: {why}", flush=True)
    logs.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict[str, Any]] = {}
    maxtext: dict[tuple, dict[str, Any]] = {}  # one MaxText compile per (its mesh, its remat, attention)
    attentions = ["", *([maxtext_attention] if maxtext_attention else [])]
    for mesh_name in meshes:
        for remat in remats:
            cell = f"{mesh_name}, remat {remat} (shardkit {REMAT[remat][0]}, MaxText {REMAT[remat][1]})"
            spec, strategy, _ = MESHES[mesh_name]
            runs = {}
            for v, (o, k) in VARIANTS.items():
                if k.get("embed") == "tpu":
                    k = {**k, "embed": sk.embedding.planned(strategy, MESHES[mesh_name][2], MODEL["batch"], "tpu")}
                runs[f"shardkit {v}"] = shardkit_program(target, spec, strategy, REMAT[remat][0], o, kernels=k)
            for attention in attentions:
                key = (json.dumps(MESHES[mesh_name][2]), remat, attention)
                if key not in maxtext:
                    log = logs / f"maxtext_gpu_{mesh_name}_{remat}{'_' + attention if attention else ''}.log"
                    maxtext[key] = maxtext_program(maxtext_python, target, mesh_name, remat, attention, log)
                runs[f"maxtext {attention}" if attention else "maxtext"] = maxtext[key]
            cells[cell] = runs
            print(table({cell: runs}), flush=True)
    ours = versions()
    theirs = next(iter(cells.values()))["maxtext"]["versions"]
    print(f"compilers: shardkit {ours}; MaxText {theirs}")
    if any(theirs.get(p) != v for p, v in ours.items()):  # docs/performance.md: a venv with shardkit's compiler
        print(
            "note: the two sides were compiled by different compilers; --maxtext-python a MaxText venv with "
            f"shardkit's ({', '.join(f'{p}=={v}' for p, v in ours.items())}) compares like with like"
        )
    params = {c: {s: r["params"] for s, r in runs.items()} for c, runs in cells.items()}
    if any(len(set(p.values())) > 1 for p in params.values()):
        print(f"note: parameter counts differ: {params}")
    sides = tuple(s for s in next(iter(cells.values())) if s != "maxtext")
    print(markdown(cells, sides, ratio=tuple((a, b) for a, b in PAIRS if a in sides and b in (*sides, "maxtext"))))
    return {"target": target, "model": MODEL, "versions": {"shardkit": ours, "maxtext": theirs},
            "cudnn_loadable": sk.attention.blocks.cudnn_loadable(),  # True: shardkit's default attention is cuDNN's
            "shardkit_variants": {v: {"overrides": o, "kernels": k} for v, (o, k) in VARIANTS.items()},
            "cells": cells}  # fmt: skip
