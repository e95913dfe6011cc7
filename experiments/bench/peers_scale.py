"""Scale cells: shardkit's 7B / 70B programs against MaxText's own llama2 configs, compiled for a v5p slice here.

    python -m experiments.bench.bench_peers --target v5p-128 --model 7b [--cells plan,config,fsdp,maxtext]
    python -m experiments.bench.bench_peers --target v5p-256 --model 70b [--cells plan,config,maxtext]

Every cell is one train step compiled by XLA's TPU compiler for the target's compile-only devices and read by the
same parser as the v5e-8 comparison (`peers_tpu.program_figures`): peak memory, temporaries, HBM bytes, matmul
FLOPs, collective bytes by kind and mesh axes, and whether the peak fits the chip's HBM less shardkit's margin
(`sk.target(...).fits`). All cells of a model run at one global batch and sequence length (SCALE), bf16 compute,
fp32 parameters, AdamW:
- `plan`: the first plan `sk.plan` (shardkit.costmodel) ranks as fitting, for the config's model at that batch,
  with the remat policy it chose, compiled the way `experiments.plan --compile` compiles it (the config with the
  plan's strategy, mesh and `remat=` kernel);
- `config`: the config in experiments/configs as it is (its mesh, strategy and remat), at that batch;
  `config_own_batch` (7B) the same at the config's own batch, which the compiler may refuse (gpt_7b's is now 256,
  SCALE's: the JSON's record of it is the former fsdp_tp config at 1024, refused);
- `fsdp` (7B): the config's model under strategy `fsdp` over the whole slice with full remat, MaxText's layout;
  `fsdp_lean` the same with the head's dot in the compute dtype and the loss in chunks of 512
  (`logits_dot_in_fp32=False, loss_chunk=512`: docs/performance.md's `lean`, MaxText's logits);
- `config_lean` (70B): the config with `logits_dot_in_fp32=False, loss_chunk=512`; `config_lean_unfused` the same
  with splash's backward as two kernels (dq apart from dkv, as MaxText's `sa_use_fused_bwd_kernel: false` runs it)
  where shardkit's splash fuses them (shardkit/attention/blocks.py): the bench swaps the kernel's block sizes for
  this cell only (`unfused_splash_backward`), to measure that term; shardkit has no setting for it;
- `maxtext`: MaxText's `model_name=llama2-7b` / `llama2-70b` at its defaults (ici_fsdp_parallelism=-1, remat
  `full`, its default attention), through peer_maxtext_tpu.py in its venv.

shardkit's configs are compiled at llama2's vocabulary of 32000 (VOCAB; gpt_7b and gpt_70b set it too, and a
config left to the data would get the byte tokenizer's 384, which would hide the embedding and head). A program
the compiler refuses for memory is recorded as refused with the compiler's message and the memory it asked for.
Cells merge into the model's JSON (experiments/bench/results/bench_peers_tpu_<model>.json), so they can be compiled
in separate invocations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.bench import peers_tpu

#: --model -> (shardkit's config, MaxText's model_name, the target its cells are for, global batch, sequence)
SCALE = {
    "7b": ("gpt_7b", "llama2-7b", "v5p-128", 256, 4096),
    "70b": ("gpt_70b", "llama2-70b", "v5p-256", 256, 4096),
}
CELLS = {
    "7b": ("plan", "config", "config_own_batch", "fsdp", "fsdp_lean", "maxtext"),
    "70b": ("plan", "config", "config_lean", "config_lean_unfused", "maxtext"),
}
VOCAB = 32000  # llama2's


def scale_config(model: str, target: str, **overrides: Any) -> Any:
    """The model's config from experiments/configs at SCALE's batch and sequence, VOCAB, compiled for `target`."""
    name, _, _, batch, seq = SCALE[model]
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    config.update(batch_size=batch, seq_len=seq, target=target, compile_only=True, **overrides)
    config.model.vocab_size = VOCAB
    return config


def first_plan(model: str, target: str) -> Any:
    """The first plan `sk.plan` ranks as fitting (as experiments.plan calls it: every remat policy tried)."""
    import shardkit as sk
    from experiments.plan import model_from_config
    from shardkit import costmodel

    name, _, _, batch, seq = SCALE[model]
    cfg, _, _ = model_from_config(name)
    cfg = dataclasses.replace(cfg, vocab_size=VOCAB, remat="none")
    tgt = sk.target(target)
    plans = costmodel.plan(cfg, tgt.num_devices, tgt.preset(), batch, seq, include_rejected=True,
                           remat=costmodel.REMAT_POLICIES)  # fmt: skip
    fitting = [p for p in plans if p.fits]
    if not fitting:
        raise sk.ShardkitError(f"sk.plan finds no plan of {name} that fits {target} at batch {batch} x {seq}")
    return fitting[0]


def config_program(config: Any, **record: Any) -> dict[str, Any]:
    """`config` compiled as `experiments.train --config.compile_only` compiles it (experiments.compile_only), and
    its figures; {"refused": ...} when the compiler will not emit it for the chip's HBM."""
    import jax

    import shardkit as sk
    from experiments import tasks
    from experiments.compile_only import explain_config
    from experiments.data import text

    tgt = sk.target(config.target)
    record["params"] = tasks.model_config(config, text.VOCAB_SIZE).num_params()
    t0 = time.perf_counter()
    try:
        report, _ = explain_config(config)
    except jax.errors.JaxRuntimeError as e:
        if not (why := sk.targets.out_of_memory(e)):
            raise
        return peers_tpu.refused(why, time.perf_counter() - t0, **record)
    compile_s = time.perf_counter() - t0
    compiled = report.compiled
    ma = compiled.memory_analysis()
    memory = {k: getattr(ma, k) for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                          "temp_size_in_bytes")}  # fmt: skip
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mesh = sk.make_mesh(report.mesh, target=tgt)  # the mesh explain_config compiled on (make_mesh is deterministic)
    out = peers_tpu.program_figures(compiled.as_text(), memory, float(cost.get("bytes accessed", 0.0)), mesh)
    fits, spare = tgt.fits(out["peak"])
    return dict(out, fits=fits, spare_bytes=spare, compile_s=compile_s, **record)


@contextlib.contextmanager
def unfused_splash_backward() -> Iterator[None]:
    """Within: shardkit's splash kernels are built with separate dq and dkv backward kernels (Pallas splash's
    `use_fused_bwd_kernel=False`, dq blocks as the forward's). A measurement of one memory term, not a setting."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa

    from shardkit.attention import blocks

    fused = sa.BlockSizes

    def unfused(**kw: Any) -> Any:
        kw.update(use_fused_bwd_kernel=False, block_q_dq=kw["block_q"], block_kv_dq=kw["block_kv"])
        return fused(**kw)

    sa.BlockSizes = unfused
    blocks.splash_kernel.cache_clear()  # kernels are cached per shape
    try:
        yield
    finally:
        sa.BlockSizes = fused
        blocks.splash_kernel.cache_clear()


def cell(model: str, name: str, target: str, maxtext_python: str, logs: Path) -> dict[str, Any]:
    """One cell's record (the module docstring says which program each cell is)."""
    import shardkit as sk

    _, model_name, _, batch, seq = SCALE[model]
    if name == "plan":
        p = first_plan(model, target)
        mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items())
        config = scale_config(model, target, strategy=p.strategy, mesh=mesh)
        config.model.remat = "none"  # the planner's policy as the `remat` kernel, as experiments.plan compiles it
        config.kernels = ",".join(filter(None, [config.get("kernels", ""), f"remat={p.remat}"]))
        return config_program(config, strategy=p.strategy, mesh=mesh, remat=p.remat,
                              predicted_peak=p.memory["total"], predicted_collective_bytes=p.comm_bytes)  # fmt: skip
    if name in ("config", "config_own_batch"):
        config = scale_config(model, target)
        if name == "config_own_batch":
            own = importlib.import_module(f"experiments.configs.{SCALE[model][0]}").get_config()
            config.batch_size = own.batch_size
        return config_program(config, strategy=config.strategy, mesh=config.mesh, remat=config.model.remat,
                              batch=config.batch_size)  # fmt: skip
    if name in ("config_lean", "config_lean_unfused"):
        config = scale_config(model, target)
        config.model.update(logits_dot_in_fp32=False, loss_chunk=512)
        record = dict(strategy=config.strategy, mesh=config.mesh, remat=config.model.remat)
        if name == "config_lean":
            return config_program(config, **record)
        with unfused_splash_backward():
            return config_program(config, **record)
    if name in ("fsdp", "fsdp_lean"):
        config = scale_config(model, target, strategy="fsdp", mesh="fsdp=-1")
        config.model.remat = "full"
        if name == "fsdp_lean":
            config.model.update(logits_dot_in_fp32=False, loss_chunk=512)
        return config_program(config, strategy=name, mesh=f"fsdp={sk.target(target).num_devices}", remat="full")
    if name == "maxtext":
        spec = {"model_name": model_name, "target": target, "batch": batch, "seq": seq}
        out = peers_tpu.maxtext_compile(maxtext_python, spec, logs / f"maxtext_{model_name}_{target}.log", model_name)
        if "refused" not in out:
            out["fits"], out["spare_bytes"] = sk.target(target).fits(out["peak"])
        axes = {a: n for a, n in zip(out["mesh"]["axis_names"], out["mesh"]["shape"], strict=True) if n > 1}
        return dict(out, strategy=f"MaxText {model_name}", mesh=",".join(f"{a}={n}" for a, n in axes.items()),
                    remat=out["settings"].get("remat_policy", "full (base.yml)"))  # fmt: skip
    raise sk.ShardkitError(f"scale cell {name!r}: choose of {', '.join(CELLS[model])}")


GIB = 2**30
ROWS = (("peak", "peak GiB", GIB), ("temp", "temporaries GiB", GIB), ("hbm_bytes_accessed", "HBM bytes GB", 1e9),
        ("matmul_flops", "matmul TFLOPs", 1e12), ("collective_bytes", "collectives GiB sent", GIB))  # fmt: skip


def table(cells: dict[str, dict[str, Any]]) -> str:
    """The cells side by side: a column each, a row per figure and per collective kind (GiB one device sends)."""
    names = list(cells)
    lines = [f"{'':34s}" + "".join(f"{n:>22s}" for n in names)]
    lines.append(f"{'program':34s}" + "".join(f"{c.get('strategy', ''):>22s}" for c in cells.values()))
    lines.append(f"{'mesh':34s}" + "".join(f"{c.get('mesh', '')[:21]:>22s}" for c in cells.values()))
    lines.append(f"{'remat':34s}" + "".join(f"{c.get('remat', ''):>22s}" for c in cells.values()))
    for key, label, unit in ROWS:
        vals = [f"{c[key] / unit:.2f}" if key in c else "-" for c in cells.values()]
        lines.append(f"{label:34s}" + "".join(f"{v:>22s}" for v in vals))
    fits = []
    for c in cells.values():
        if "refused" in c:
            need = c.get("required_bytes")
            fits.append(f"refused ({need / GIB:.1f} GiB)" if need else "refused")
        else:
            fits.append(f"{'yes' if c['fits'] else 'NO'} ({c['spare_bytes'] / GIB:+.1f})")
    lines.append(f"{'fits HBM (GiB to spare)':34s}" + "".join(f"{f:>22s}" for f in fits))
    kinds = sorted({k for c in cells.values() for k in c.get("collectives", {})})
    for kind in kinds:
        vals = [f"{c['collectives'].get(kind, 0.0) / GIB:.2f}" if "collectives" in c else "-" for c in cells.values()]
        lines.append(f"  {kind[:32]:32s}" + "".join(f"{v:>22s}" for v in vals))
    return "\n".join(lines)


def run(target: str, model: str, cells: list[str], maxtext_python: str, logs: Path, out: str) -> dict[str, Any]:
    """Compiles `cells` of `model` for `target`, merges them into the JSON at `out` and prints every cell it has."""
    import shardkit as sk

    if model not in SCALE:
        raise sk.ShardkitError(f"--model {model!r}: choose one of {', '.join(SCALE)}")
    if target != SCALE[model][2]:
        print(f"note: the {model} cells are meant for {SCALE[model][2]}; compiling them for {target}")
    bad = [c for c in cells if c not in CELLS[model]]
    if bad:
        raise sk.ShardkitError(f"--cells {','.join(bad)}: the {model} cells are {','.join(CELLS[model])}")
    logs.mkdir(parents=True, exist_ok=True)
    path = Path(out)
    record = json.loads(path.read_text()) if path.exists() else {}
    if record.get("target") not in (None, target):
        record = {}  # another target's cells are not this one's
    _, _, _, batch, seq = SCALE[model]
    record.update(target=target, model=model, batch=batch, seq=seq, vocab=VOCAB)
    record.setdefault("cells", {})
    record.setdefault("versions", {})["shardkit"] = {p: importlib.metadata.version(p) for p in ("jax", "libtpu")}
    for name in cells:
        t0 = time.perf_counter()
        got = cell(model, name, target, maxtext_python, logs)
        got["wall_s"] = time.perf_counter() - t0
        if "versions" in got:
            record["versions"]["maxtext"] = got.pop("versions")
        record["cells"][name] = got
        print(f"{name}: {got.get('strategy')} {got.get('mesh')} remat {got.get('remat')}, {got['wall_s']:.0f} s",
              flush=True)  # fmt: skip
    order = [c for c in CELLS[model] if c in record["cells"]]
    record["cells"] = {c: record["cells"][c] for c in order}
    print(f"{model} on {target}, global batch {batch} x {seq}, vocabulary {VOCAB}, per device:")
    print(table(record["cells"]))
    return record
