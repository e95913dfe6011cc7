"""shardkit's train step against MaxText's, both compiled for a TPU topology by XLA's TPU compiler on this host.

    python -m experiments.bench.bench_peers --target v5e-8 [--meshes fsdp,tp,tp_sp] [--remat full,best]
        [--maxtext-python /work/venv-maxtext/bin/python] [--out experiments/bench/results/bench_peers_tpu.json]

No chip runs: each side's train step is lowered and compiled for the target's compile-only devices (libtpu's
topology description), and the two compiled programs are read by one parser (`shardkit.hlo`) and the compiler's
own analyses:
- peak memory per device: arguments + outputs - aliased (donated) + temporaries (`memory_analysis`);
- temporaries alone; HBM bytes accessed (`cost_analysis`, "bytes accessed");
- matmul FLOPs counted with loop trip counts (`hlo.matmul_flops`: XLA's cost analysis counts a scan body once;
  kernels are custom calls and not counted: the attention kernels are listed by name and count instead);
- collectives by kind and mesh axes, in bytes one device sends (ring volume, `hlo.collectives`), and how many of
  those bytes are inside loops (the layer scans) or outside (the embedding, the head, the optimizer).

The model is issue #41's decoder: 8 layers x 1024, 8 heads x 128, SwiGLU 4096, vocabulary 32000 (untied), RoPE,
RMSNorm; sequence 2048, global batch 16, bf16 compute, fp32 parameters, AdamW. Meshes: `fsdp` (fsdp=8: shardkit
`fsdp`, MaxText ici_fsdp_parallelism=8), `tp` and `tp_sp` (data=2 x tensor=4: shardkit `tp` / `tp_sp`, both
against MaxText's ici_data=2 x ici_tensor=4, which keeps the residual stream split over tensor as `tp_sp` does).
Remat: `full` on both sides, and `best`, each side's least-recompute policy that keeps the matmuls' outputs
(shardkit `dots_no_batch`, MaxText `minimal_with_context`). shardkit runs twice: with its
defaults (on a TPU with bf16 compute: bf16 logits, the loss in chunks; models/gpt_loss.py `auto_head`), and `fp32
head` (logits_dot_in_fp32=True, loss_chunk=0: the defaults before they followed the target; docs/performance.md).

MaxText is compiled in its own venv by peer_maxtext_tpu.py (its `train_compile` path), which writes the program's
text and analyses; this process parses them. Both sides should use the same jax and libtpu: the versions are
recorded and a mismatch is printed. Nothing is timed.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
#: issue #41's decoder (bench_peers' keys)
MODEL = dict(layers=8, d_model=1024, heads=8, kv_heads=8, head_dim=128, mlp_dim=4096, vocab=32000, seq=2048, batch=16)
#: name -> (shardkit mesh, shardkit strategy, MaxText's ici parallelism)
MESHES = {
    "fsdp": ("fsdp=8", "fsdp", {"fsdp": 8}),
    "tp": ("data=2,tensor=4", "tp", {"data": 2, "tensor": 4}),
    # MaxText's tensor parallelism shards the residual stream's sequence over `tensor` between the layers (its
    # program all-gathers and reduce-scatters over tensor): Megatron's sequence parallelism, shardkit's `tp_sp`
    "tp_sp": ("data=2,tensor=4", "tp_sp", {"data": 2, "tensor": 4}),
}
#: name -> (shardkit GPTConfig.remat, MaxText remat_policy)
REMAT = {"full": ("full", "full"), "best": ("dots", "minimal_with_context")}
#: shardkit's variants: GPTConfig overrides. "default": the fields left None, chosen from the target (bf16 logits,
#: the loss in chunks when a device's logits are large: models/gpt_loss.py `auto_head`); "fp32 head": the defaults
#: before they were chosen from the target (fp32 logits, the whole loss)
VARIANTS = {"default": {}, "fp32 head": {"logits_dot_in_fp32": True, "loss_chunk": 0}}
KERNEL_PREFIX = ("splash", "flash")  # attention kernels' custom-call names


def program_figures(text: str, memory: dict[str, int], hbm: float | None, mesh: Any) -> dict[str, Any]:
    """One compiled program's figures (this module's docstring), from its text and analyses. Partition i of the
    program runs on `mesh.devices.flat[i]` (as `jax.jit` assigns them). `hbm`: None where the compiler has no cost
    analysis (CUDA). The attention kernels are read as the mesh's platform calls them (Mosaic on TPU, Triton or
    cuDNN custom calls on GPU: `hlo.kernel_calls`)."""
    from shardkit import hlo

    peak = (memory["argument_size_in_bytes"] + memory["output_size_in_bytes"] - memory["alias_size_in_bytes"]
            + memory["temp_size_in_bytes"])  # fmt: skip
    by_kind: dict[str, float] = collections.defaultdict(float)
    where = {"in loops": 0.0, "outside loops": 0.0}
    for c in hlo.collectives(text, mesh):
        by_kind[f"{c.kind} {','.join(c.axes) or '-'}"] += c.bytes_sent
        where["in loops" if c.in_loop else "outside loops"] += c.bytes_sent
    gpu = mesh.devices.flat[0].platform == "gpu"
    kernels = collections.Counter()
    for name, n in hlo.kernel_calls(text, "gpu") if gpu else hlo.kernel_calls(text):
        if gpu or name.startswith(KERNEL_PREFIX):
            kernels[name] += n
    return dict(
        peak=peak,
        temp=memory["temp_size_in_bytes"],
        hbm_bytes_accessed=hbm,
        matmul_flops=hlo.matmul_flops(text),
        collective_bytes=sum(by_kind.values()),
        collectives=dict(sorted(by_kind.items())),
        collectives_where=where,
        attention_kernels=dict(kernels),
    )


def shardkit_program(target: str, spec: str, strategy: str, remat: str, overrides: dict[str, Any] | None = None,
                     embed: str | None = None, kernels: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """shardkit's train step of MODEL under `strategy` on mesh `spec` of `target`, compiled, and its figures.
    `remat`: GPTConfig.remat; `overrides`: other GPTConfig fields; `embed`: the `embed` kernel (the strategy's);
    `kernels`: other kernel slots (e.g. {"attention_block": "pallas_gpu"})."""
    import jax.numpy as jnp
    import optax

    import shardkit as sk
    from models.gpt import GPT, GPTConfig

    m = MODEL
    cfg = GPTConfig(num_layers=m["layers"], d_model=m["d_model"], num_heads=m["heads"], num_kv_heads=m["kv_heads"],
                    head_dim=m["head_dim"], mlp_dim=m["mlp_dim"], vocab_size=m["vocab"], max_seq_len=m["seq"],
                    dtype="bfloat16", param_dtype="float32", remat=remat, **(overrides or {}))  # fmt: skip
    mesh, s = sk.make_mesh(spec, target=target), sk.strategy(strategy)
    more = {**(kernels or {}), **({"embed": embed} if embed else {})}
    s = s.replace(kernels={**s.kernels, **more}) if more else s
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, s)
    shape = ((m["batch"], m["seq"]), jnp.int32)
    t0 = time.perf_counter()
    compiled = step.compile(step.abstract_state(), step.abstract_batch({"inputs": shape, "targets": shape}))
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # None from the CUDA compiler
    memory = {k: getattr(mem, k) for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                           "temp_size_in_bytes")}  # fmt: skip
    hbm = float(cost.get("bytes accessed", 0.0)) if cost else None
    out = program_figures(compiled.as_text(), memory, hbm, mesh)
    settings = dict(mesh=spec, strategy=strategy, embed=embed or "the strategy's", kernels=s.kernels,
                    **dataclasses.asdict(cfg))  # fmt: skip
    return dict(out, params=cfg.num_params(), compile_s=compile_s, settings=settings)


def maxtext_program(python: str, target: str, mesh_name: str, remat: str, log: Path) -> dict[str, Any]:
    spec = {"model": MODEL, "target": target, "mesh": MESHES[mesh_name][2], "remat": REMAT[remat][1]}
    return maxtext_compile(python, spec, log, f"{mesh_name} / {remat}")


def maxtext_compile(python: str, spec: dict[str, Any], log: Path, what: str,
                    env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """MaxText's train step compiled by peer_maxtext_tpu.py in its venv for `spec` (that file's argument), and its
    figures read here; a program the compiler refused for memory comes back as {"refused": its message, ...}.
    `env`: the child's environment (None: this process's)."""
    import jax

    import shardkit as sk

    with tempfile.TemporaryDirectory(prefix="peer_maxtext_") as tmp:
        argv = [python, str(ROOT / "experiments/bench/peer_maxtext_tpu.py"), json.dumps(spec), tmp]
        with log.open("w") as f:
            rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=1800, env=env).returncode
        if rc != 0:
            raise RuntimeError(f"MaxText's compile for {what} exited with {rc}; see {log}")
        rec = json.loads(Path(tmp, "maxtext.json").read_text())
        if "refused" in rec:
            return refused(rec["refused"], rec["compile_s"], params=rec["params"], settings=rec["settings"],
                           versions=rec["versions"], mesh=rec["mesh"])  # fmt: skip
        text = Path(tmp, "maxtext.hlo").read_text()
    by_id = {d.id: d for d in sk.targets.target(spec["target"]).devices}
    ids = rec["mesh"]["device_ids"]
    mesh = jax.sharding.Mesh(np.array([by_id[i] for i in ids]).reshape(rec["mesh"]["shape"]),
                             tuple(rec["mesh"]["axis_names"]))  # fmt: skip
    if rec["partition_device_ids"] not in (None, ids):  # then the axes' names below would be misassigned
        print(f"note: MaxText's partitions run on devices {rec['partition_device_ids']}, its mesh lists {ids}")
    out = program_figures(text, rec["memory"], rec["hbm_bytes_accessed"], mesh)
    return dict(out, params=rec["params"], settings=rec["settings"], versions=rec["versions"],
                compile_s=rec["compile_s"], mesh=rec["mesh"])  # fmt: skip


def refused(why: str, compile_s: float, **extra: Any) -> dict[str, Any]:
    """A cell the compiler would not emit: its message and the memory it asked for ("... (213.45G) exceeds
    available HBM (95.74G)" or "Used 213.45G of 95.74G hbm": the first size, in bytes; None when it has none)."""
    m = re.search(r"(\d+(?:\.\d+)?)([KMGT])\b", why)
    need = float(m.group(1)) * 2 ** (10 * "KMGT".index(m.group(2)) + 10) if m else None
    return dict(refused=why, fits=False, required_bytes=need, compile_s=compile_s, **extra)


RATIO_KEYS = ("peak", "temp", "hbm_bytes_accessed", "matmul_flops", "collective_bytes")
FMT = {"peak": lambda x: f"{x / 2**30:.3f} GiB", "temp": lambda x: f"{x / 2**30:.3f} GiB",
       "hbm_bytes_accessed": lambda x: f"{x / 1e9:.2f} GB", "matmul_flops": lambda x: f"{x / 1e12:.3f} T",
       "collective_bytes": lambda x: f"{x / 1e6:.1f} MB"}  # fmt: skip


def table(cells: dict[str, dict[str, Any]]) -> str:
    """One block per (mesh, remat): each figure for every side, and shardkit / MaxText for each variant."""
    lines = []
    for cell, runs in cells.items():
        mt = runs["maxtext"]
        lines.append(f"{cell}:")
        sides = list(runs)
        lines.append(f"  {'':28s}" + "".join(f"{s:>18s}" for s in sides))
        for key in (k for k in RATIO_KEYS if mt[k] is not None):  # HBM bytes: no cost analysis on GPU
            row = "".join(f"{FMT[key](runs[s][key]):>18s}" for s in sides)
            ratios = ", ".join(f"{s} {runs[s][key] / mt[key]:.2f}x" for s in sides if s != "maxtext" and mt[key])
            lines.append(f"  {key:28s}{row}   (vs MaxText: {ratios})")
        kinds = sorted({k for s in sides for k in runs[s]["collectives"]})
        for kind in kinds:
            row = "".join(f"{runs[s]['collectives'].get(kind, 0.0) / 1e6:>15.1f} MB" for s in sides)
            lines.append(f"    {kind:26s}{row}")
        for w in ("in loops", "outside loops"):
            row = "".join(f"{runs[s]['collectives_where'][w] / 1e6:>15.1f} MB" for s in sides)
            lines.append(f"    {'collectives ' + w:26s}{row}")
        lines.append(
            "    attention kernels: "
            + "; ".join(
                f"{s} " + ", ".join(f"{k} x{n}" for k, n in runs[s]["attention_kernels"].items()) for s in sides
            )
        )
    return "\n".join(lines)


def markdown(cells: dict[str, dict[str, Any]], sides: tuple[str, ...] = ("shardkit fp32 head", "shardkit default"),
             ratio: tuple[tuple[str, str], ...] = (("shardkit default", "maxtext"),)) -> str:  # fmt: skip
    """The comparison as docs/performance.md shows it: a row per (cell, figure), each of `sides` and MaxText, and
    each (a, b) of `ratio` as a / b."""
    short = lambda side: side.removeprefix("shardkit ").replace("maxtext", "MaxText")
    head = "| mesh, remat | figure | " + " | ".join([*sides, "MaxText"]) + " | "
    rows = [head + " | ".join(f"{short(a)} / {short(b)}" for a, b in ratio) + " |",
            "|---|---|" + "---|" * (len(sides) + 1 + len(ratio))]  # fmt: skip
    for cell, runs in cells.items():
        for key in (k for k in RATIO_KEYS if runs["maxtext"][k] is not None):
            figs = " | ".join(FMT[key](runs[s][key]) for s in (*sides, "maxtext"))
            rows.append(f"| {cell.split(' (')[0]} | {key} | {figs} | "
                        + " | ".join(f"**{runs[a][key] / runs[b][key]:.2f}x**" for a, b in ratio) + " |")  # fmt: skip
    return "\n".join(rows)


def run(target: str, meshes: list[str], remats: list[str], maxtext_python: str, logs: Path) -> dict[str, Any]:
    """Compiles every (mesh, remat) cell for both sides; returns the JSON record (and prints as it goes)."""
    logs.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict[str, Any]] = {}
    maxtext: dict[tuple, dict[str, Any]] = {}  # one MaxText compile per (its mesh, its remat): tp and tp_sp share
    for mesh_name in meshes:
        for remat in remats:
            cell = f"{mesh_name}, remat {remat} (shardkit {REMAT[remat][0]}, MaxText {REMAT[remat][1]})"
            spec, strategy, _ = MESHES[mesh_name]
            runs = {f"shardkit {v}": shardkit_program(target, spec, strategy, REMAT[remat][0], overrides)
                    for v, overrides in VARIANTS.items()}  # fmt: skip
            key = (json.dumps(MESHES[mesh_name][2]), remat)
            if key not in maxtext:
                log = logs / f"maxtext_{mesh_name}_{remat}.log"
                maxtext[key] = maxtext_program(maxtext_python, target, mesh_name, remat, log)
            runs["maxtext"] = maxtext[key]
            cells[cell] = runs
            print(table({cell: runs}), flush=True)
    ours = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "libtpu")}
    theirs = next(iter(cells.values()))["maxtext"]["versions"]
    if any(theirs.get(p) != v for p, v in ours.items()):
        print(f"note: the two sides were compiled by different versions: shardkit {ours}, MaxText {theirs}")
    params = {c: {s: r["params"] for s, r in runs.items()} for c, runs in cells.items()}
    if any(len(set(p.values())) > 1 for p in params.values()):
        print(f"note: parameter counts differ: {params}")
    print(markdown(cells))
    return {"target": target, "model": MODEL, "versions": {"shardkit": ours, "maxtext": theirs}, "cells": cells}
