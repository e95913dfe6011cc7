"""Benchmark the context-parallel attentions on 8 CPU devices: memory, time, causal balance, a peer kernel.

    python -m experiments.bench.bench_attention [--out experiments/bench/results/bench_attention.json]
        [--mem-seqs 4096,8192,16384,32768] [--time-seqs 2048,4096,8192,16384] [--dense-max 8192] [--reps 5]
        [--peer-chunks 128,256,512]

Causal attention, fwd + bwd (the vjp of the output w.r.t. q, k, v), fp32, batch 1, 8 heads of 32 (MHA, so the
peer kernel, which has no GQA, runs the same problem), each kernel at its default chunk (`chunk=None`: chosen per
backend, shardkit/parallel/context/chunking.py; 128 on CPU). Kernels: ring attention in the three layouts and Ulysses on
mesh seq=8, USP on seq_u=2 x seq_r=4 (zigzag). One process; all figures are ratios measured here.

1. memory: per-device bytes of the compiled fwd+bwd program (`memory_analysis()`: arguments + outputs +
   temporaries - aliased), against the GSPMD baseline: dense `jax.nn.dot_product_attention` jitted with the
   sequence sharded over seq=8 and XLA left to gather K, V (each device then holds [S/8, S] scores). Compiled
   only, so the seq can go past what this host could run.
2. time: fastest of `--reps` runs after a warm-up, the kernels' runs interleaved in a new random order each round (in
   a fixed order the kernel after the dense reference paid for the pages it freed: up to 1.5x), against dense
   attention on ONE device, timed apart, for the same S up to `--dense-max` (it holds [S, S] scores per head; above
   that the numerics are compared with ring:contiguous instead). The 8 virtual devices share this host's cores, so
   the time is the total work of all devices, not the critical path: the ratio measures the kernel's overhead and its
   causal skipping, not scaling (dense computes the masked half too, the kernels skip it). Other work on a shared
   host still moves these times by tens of percent. `peak`: the kernel's attention FLOP/s as a fraction of the
   host's calibrated fp32 matmul peak (bench_mfu's `host_peak`: the larger of one device's and 8 x the per-device
   peak with all 8 multiplying at once, `experiments.runtime.calibrate_peak_flops`), FLOPs counted as MaxText does
   (`calculate_tflops_training_per_device`): 4 B S^2 H D for a non-causal forward (Q K^T and P V), halved for
   causal (the masked half counted zero times, each visible score once), x 3 for forward + backward (the
   backward's recomputation of the scores is not counted).
3. causal load balance: attention FLOPs per device, counted from the kernels' own skip rule (a chunk pair runs
   iff some query position >= some key position) at the kernels' chunk size; max / mean over the 8 devices,
   and the critical path (the busiest device's FLOPs) of each layout relative to zigzag's.
4. peer: `ringattention` 0.1.2 (PyPI, pure-JAX `ringattention_jax.ring_attention`, its own custom VJP,
   contiguous layout, causal_block_size=1) on the same inputs, at each of `--peer-chunks` (query = key chunk),
   against ring:contiguous at the same chunks: time, `speedup` = peer / ours at the same chunk, best against
   best, and at both defaults (`speedup_defaults`: ours at chunk=None, the peer at 512, the chunk of its
   README's example; the package itself has no default), and the max relative difference of output and
   gradients. Its top-level import fails on current JAX, so the module file is loaded directly (install it
   apart from shardkit's venv, e.g. `pip install --target /work/peer-pkgs --no-deps ringattention==0.1.2
   einops`, and put that folder on PYTHONPATH).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import functools
import importlib.util
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import shardkit as sk
from experiments.bench.bench_mfu import host_peak
from experiments.bench.timing import RESULTS, save_json, time_calls, time_interleaved
from shardkit.parallel.context.chunking import default_chunk
from shardkit.parallel.context.layouts import layout_perm

B, H, D, N = 1, 8, 32, 8
CHUNK = None  # every kernel at its default chunk (chosen per backend and block: chunking.py)
PEER_CHUNKS = (128, 256, 512)  # the head-to-head with the peer runs both sides at each of these (--peer-chunks)
PEER_DEFAULT = 512  # the peer's chunk when untuned: its README's example (the package has no default)
SEQ_AXES = {"seq=8": "seq", "seq_u=2,seq_r=4": ("seq_r", "seq_u")}
#: name -> (mesh spec, layout, kernel(q, k, v, mesh) on laid-out inputs)
KERNELS: dict[str, tuple[str, str, Callable[..., jax.Array]]] = {
    **{
        f"ring:{lay}": (
            "seq=8",
            lay,
            lambda q, k, v, m, lay=lay: sk.attention.ring_attention(q, k, v, mesh=m, layout=lay, chunk=CHUNK),
        )
        for lay in sk.attention.LAYOUTS
    },
    "ulysses": ("seq=8", "contiguous", lambda q, k, v, m: sk.attention.ulysses_attention(q, k, v, mesh=m, chunk=CHUNK)),
    "usp:zigzag": (
        "seq_u=2,seq_r=4",
        "zigzag",
        lambda q, k, v, m: sk.attention.usp_attention(q, k, v, mesh=m, layout="zigzag", chunk=CHUNK),
    ),
}


def fwd_bwd(attn: Callable[..., jax.Array]) -> Callable[..., tuple]:
    """(q, k, v, dO) -> (O, dQ, dK, dV)."""

    def run(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))

    return run


def per_device_bytes(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def sharded_program(spec: str, attn: Callable[..., jax.Array]) -> tuple[Any, NamedSharding]:
    mesh = sk.make_mesh(spec)
    sharding = NamedSharding(mesh, PartitionSpec(None, SEQ_AXES[spec]))
    fn = jax.jit(fwd_bwd(lambda q, k, v: attn(q, k, v, mesh)), in_shardings=sharding, out_shardings=sharding)
    return fn, sharding


def dense(q, k, v, mesh=None):
    return sk.attention.dense_attention(q, k, v, causal=True)


def memory(seq: int) -> dict[str, float]:
    shapes = [jax.ShapeDtypeStruct((B, seq, H, D), jnp.float32)] * 4
    out = {}
    for name, (spec, _, attn) in {"gspmd_dense": ("seq=8", "", dense), **KERNELS}.items():
        fn, _ = sharded_program(spec, attn)
        out[name] = per_device_bytes(fn.lower(*shapes).compile())
    return out


def rel_diff(a: Any, b: Any) -> float:
    pairs = zip(map(np.asarray, a), map(np.asarray, b), strict=True)
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in pairs)


def load_peer() -> tuple[Any, str]:
    """The `ringattention` package's pure-JAX module, or (None, why not)."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None, "ringattention is not installed (pip install ringattention einops)"
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "ringattention_jax.py"
    try:
        mod_spec = importlib.util.spec_from_file_location("ringattention_jax", path)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        return module, "loaded " + str(path)
    except Exception as e:  # an import-time failure of the peer is a result to report, not a crash
        return None, f"ringattention_jax failed to import: {type(e).__name__}: {e}"


def peer_kernel(module: Any, seq: int, chunk: int) -> Callable[..., jax.Array]:
    c = seq // N
    kw = dict(
        causal_block_size=1, query_chunk_size=min(chunk, c), key_chunk_size=min(chunk, c),
        deterministic=True, dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32,
        policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True,
    )  # fmt: skip
    body = lambda q, k, v: module.ring_attention(q, k, v, None, None, None, "seq", True, kw)

    def attn(q, k, v, mesh):
        spec = PartitionSpec(None, "seq")
        return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)

    return attn


def attention_flops(seq: int) -> float:
    """Causal fwd + bwd FLOPs, MaxText's convention: 4 B S^2 H D forward, halved by the mask, x 3 with the bwd."""
    return 3 * 4 * B * seq**2 * H * D / 2


def timing(seq: int, reps: int, peer: Any, dense_max: int, chunks: tuple[int, ...]) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (B, seq, H, D), jnp.float32) for key in keys)
    kernels = dict(KERNELS)
    for chunk in chunks:
        ring = lambda q, k, v, m, c=chunk: sk.attention.ring_attention(q, k, v, mesh=m, chunk=c)
        kernels[f"ring:contiguous@{chunk}"] = ("seq=8", "contiguous", ring)
        if peer is not None:
            kernels[f"ringattention_pkg@{chunk}"] = ("seq=8", "contiguous", peer_kernel(peer, seq, chunk))
    programs = {}
    results = {}
    if seq <= dense_max:  # timed apart: it frees [S, S] scores per head, and whatever ran next paid the pages
        dense_1dev = functools.partial(jax.jit(fwd_bwd(dense)), *jax.device_put((q, k, v, do), jax.devices()[0]))
        results["dense_1dev"] = time_calls(dense_1dev, reps)
    placed = {}
    for name, (spec, layout, attn) in kernels.items():
        fn, sharding = sharded_program(spec, attn)
        placed[name] = (layout, sharding.mesh, "seq_r" if "seq_r" in spec else "seq")
        to = lambda x, p=placed[name]: sk.attention.to_layout(x, *p)
        programs[name] = functools.partial(fn, *(jax.device_put(to(x), sharding) for x in (q, k, v, do)))
    # the fastest of `reps` runs after a warm-up (the least disturbed one), the runs alternating between kernels
    # in a new order each round (a fixed order made one kernel always follow the same, heavier, one)
    results.update(time_interleaved(programs, reps, shuffle=seq))
    outs = {name: [sk.attention.from_layout(x, *placed[name]) for x in r.out] for name, r in results.items()
            if name in placed}  # fmt: skip
    if "dense_1dev" in results:
        t_ref, ref, ref_name = results["dense_1dev"].best, results["dense_1dev"].out, "dense_1dev"
    else:
        t_ref, ref, ref_name = None, outs["ring:contiguous"], "ring:contiguous"
    rows: dict[str, Any] = {"dense_1dev_s": t_ref, "numerics_reference": ref_name}
    peak = host_peak(N)  # the host's calibrated matmul peak, which the 8 devices share (bench_mfu)
    for name, out in outs.items():
        t = results[name].best
        rows[name] = {"s": t, "vs_dense_1dev": t / t_ref if t_ref else None, "rel_diff": rel_diff(out, ref),
                      "peak": attention_flops(seq) / t / peak}  # fmt: skip
    rows["default_chunk"] = default_chunk(seq // N, "contiguous", N, jax.devices()[0].platform)
    if peer is not None:
        ours = lambda c: rows[f"ring:contiguous@{c}"]["s"]
        theirs = lambda c: rows[f"ringattention_pkg@{c}"]["s"]
        rows["peer"] = {
            **{f"speedup_at_chunk_{c}": theirs(c) / ours(c) for c in chunks},
            "speedup_best_vs_best": min(map(theirs, chunks)) / min(map(ours, chunks)),
            "peer_best_chunk": min(chunks, key=theirs),
            "ours_best_chunk": min(chunks, key=ours),
        }
        if PEER_DEFAULT in chunks:  # ours at chunk=None against the peer at its README's chunk
            rows["peer"]["speedup_defaults"] = theirs(PEER_DEFAULT) / rows["ring:contiguous"]["s"]
    return rows


def load_balance(seq: int) -> dict[str, dict[str, float]]:
    """Causal attention FLOPs per device from the kernels' skip rule, for each layout on a ring of N."""
    out = {}
    for layout in sk.attention.LAYOUTS:
        c = seq // N
        cq = default_chunk(c, layout, N, jax.devices()[0].platform)
        pos = layout_perm(layout, seq, N).reshape(N, c // cq, cq)
        qmax, kmin = pos.max(-1), pos.min(-1)  # [rank, chunk]
        pairs = [sum(int((qmax[r][:, None] >= kmin[s][None, :]).sum()) for s in range(N)) for r in range(N)]
        flops = np.array(pairs, float) * cq * cq * 4 * H * D  # QK^T and PV of each computed pair, forward
        out[layout] = {"chunk": cq, "max_over_mean": float(flops.max() / flops.mean()), "per_device": flops.tolist()}
    for row in out.values():  # the busiest device sets the step time on real hardware
        row["critical_path_vs_zigzag"] = max(row["per_device"]) / max(out["zigzag"]["per_device"])
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["memory per device, fwd+bwd causal (MiB; x = GSPMD dense / kernel)"]
    names = ["gspmd_dense", *KERNELS]
    lines.append(f"{'seq':>6} " + " ".join(f"{n:>17}" for n in names))
    for seq, mem in result["memory"].items():
        cells = [f"{mem[n] / 2**20:9.1f} {mem['gspmd_dense'] / mem[n]:6.1f}x" for n in names]
        lines.append(f"{seq:>6} " + " ".join(f"{c:>17}" for c in cells))
    lines.append("")
    lines.append("time fwd+bwd causal, 8 devices sharing the host vs dense on 1 device (s; x = kernel / dense; peak = "
                 "attention FLOP/s / calibrated matmul peak, causal FLOPs counted once)")  # fmt: skip
    for seq, rows in result["time"].items():
        dense_s = rows["dense_1dev_s"]
        lines.append(f"  seq {seq}: dense 1 device " + (f"{dense_s:.3f} s" if dense_s else "not run (--dense-max)")
                     + f"; default chunk {rows['default_chunk']}")  # fmt: skip
        for name, row in rows.items():
            if isinstance(row, dict) and "s" in row:
                x = f"{row['vs_dense_1dev']:6.2f}x" if row["vs_dense_1dev"] else "      "
                lines.append(f"    {name:<22} {row['s']:8.3f} s {x} peak {row['peak']:5.1%}  rel diff vs "
                             f"{rows['numerics_reference']} {row['rel_diff']:.1e}")  # fmt: skip
        if "peer" in rows:
            p = rows["peer"]
            same = ", ".join(f"chunk {c}: {v:.2f}x" for k, v in p.items() for c in [k.rsplit("_", 1)[-1]]
                             if k.startswith("speedup_at_chunk_"))  # fmt: skip
            defaults = f"; defaults (ours {rows['default_chunk']}, peer {PEER_DEFAULT}) {p['speedup_defaults']:.2f}x"
            lines.append(f"    ringattention / ours: {same}; best vs best {p['speedup_best_vs_best']:.2f}x "
                         f"(peer at {p['peer_best_chunk']}, ours at {p['ours_best_chunk']})"
                         + (defaults if "speedup_defaults" in p else ""))  # fmt: skip
    lines.append("")
    lines.append(f"causal load balance, N={N}, seq {result['balance_seq']}: max/mean attention FLOPs per device")
    for layout, row in result["balance"].items():
        crit, mean = row["critical_path_vs_zigzag"], row["max_over_mean"]
        lines.append(f"    {layout:<11} {mean:.3f}  critical path {crit:.2f}x zigzag's (chunk {row['chunk']})")
    lines.append(f"peer: {result['peer']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=f"{RESULTS}/bench_attention.json")
    parser.add_argument("--mem-seqs", default="4096,8192,16384,32768")
    parser.add_argument("--time-seqs", default="2048,4096,8192,16384")
    parser.add_argument("--dense-max", type=int, default=8192, help="largest S timed with the dense 1-device reference")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--peer-chunks", default=",".join(map(str, PEER_CHUNKS)), help="both sides at each chunk")
    args = parser.parse_args(argv)
    assert jax.device_count() >= 8, "needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
    peer, peer_status = load_peer()
    result: dict[str, Any] = {"config": {"batch": B, "heads": H, "head_dim": D, "ring": N, "dtype": "float32"}}
    result["peer"] = peer_status
    result["memory"] = {int(s): memory(int(s)) for s in args.mem_seqs.split(",")}
    chunks = tuple(int(c) for c in args.peer_chunks.split(","))
    result["config"]["flops"] = "causal fwd+bwd = 3 x 4 B S^2 H D / 2 (MaxText's convention: masked half not counted)"
    result["time"] = {
        int(s): timing(int(s), args.reps, peer, args.dense_max, chunks) for s in args.time_seqs.split(",")
    }
    result["balance_seq"] = max(result["memory"])
    result["balance"] = load_balance(result["balance_seq"])
    result["jax"] = jax.__version__
    print(table(result))
    save_json(result, args.out)


if __name__ == "__main__":
    main()
