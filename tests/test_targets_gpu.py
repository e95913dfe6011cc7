"""GPU targets (shardkit/targets_gpu.py): NVIDIA nodes by name, compiled for by XLA's CUDA compiler on this CPU-only
machine (JAX's CUDA plugin and ptxas from the dev extras; no GPU, nothing runs), and what shardkit/hlo.py reads from
the programs: NCCL-style async collectives, Triton / cuBLAS gemms, Pallas GPU (Triton) kernels.

CI installs the dev extras, which bring the CUDA compiler (pyproject.toml): where it is missing, the first test says
which packages to install and the compiling tests fail with that message, not skip. Each cell is a tiny GPT train
step compiled once per module (a few seconds each).
"""

from __future__ import annotations

import collections
import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit import hlo, targets_gpu

REPO = Path(__file__).resolve().parent.parent
CFG = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=4, head_dim=16, mlp_dim=128, vocab_size=128)
SPEC = "data=2,fsdp=2,tensor=2"


def _need_cuda_compiler() -> None:
    why = targets_gpu.cuda_missing()
    assert not why, f"the dev extras bring XLA's CUDA compiler (pyproject.toml); here: {why}"


def test_the_cuda_compiler_is_installed():
    _need_cuda_compiler()


@pytest.mark.parametrize(
    "name, canonical, hosts, per_host, kind",
    [
        ("h100-8", "h100-8", 1, 8, "NVIDIA H100 80GB HBM3"),
        ("H100-8x4", "h100-8x4", 4, 8, "NVIDIA H100 80GB HBM3"),
        ("a100-8", "a100-8", 1, 8, "NVIDIA A100-SXM4-80GB"),
        ("b200-8", "b200-8", 1, 8, "NVIDIA B200"),
        ("h200-2", "h200-2", 1, 2, "NVIDIA H200"),
    ],
)
def test_gpu_target_names_give_devices_host_by_host(name, canonical, hosts, per_host, kind):
    _need_cuda_compiler()
    t = sk.target(name)
    assert (t.name, t.num_slices, t.chips_per_slice, t.topology) == (
        canonical,
        hosts,
        per_host,
        f"1x{hosts}x{per_host}",
    )
    assert t.platform == "gpu" and isinstance(t, sk.Target)
    devices = t.devices
    assert len(devices) == hosts * per_host and {d.platform for d in devices} == {"gpu"}
    assert {d.device_kind for d in devices} == {kind} == {t.device_kind}  # the preset describes the spec's GPU
    assert [d.process_index for d in devices] == [h for h in range(hosts) for _ in range(per_host)]
    assert t.hbm_bytes >= 80 * 2**30 and t.peak_flops >= 3e14 and t.chip.links["dcn"].bandwidth > 0


def test_h200_is_h100s_spec_with_h200s_memory():
    h100, h200 = (targets_gpu.spec_path(targets_gpu.GPUS[g][0]).read_text() for g in ("h100", "h200"))
    body = lambda s: [ln for ln in s.splitlines() if ln and not ln.startswith("#")]
    differ = {a.split(":")[0].strip() for a, b in zip(body(h100), body(h200), strict=True) if a != b}
    assert differ == {"memory_bandwidth", "device_memory_size", "device_description_str"}


def test_multi_host_mesh_puts_hosts_on_the_first_axis_and_errors_name_the_fix(monkeypatch):
    _need_cuda_compiler()
    mesh = sk.make_mesh("data=4,fsdp=8", target="h100-8x4")
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    assert (hosts == np.arange(4)[:, None]).all()  # each row of data is one host; fsdp stays on NVLink
    assert sk.target("h100-8x4").preset(dict(mesh.shape)).dcn == {"data": 4}
    with pytest.raises(sk.ShardkitError, match=r"4 hosts joined by InfiniBand.*data=2 must span.*multiple of 4"):
        sk.make_mesh("data=2,fsdp=16", target="h100-8x4")
    with pytest.raises(sk.ShardkitError, match=r"unknown GPU target 'v100-8'.*h100-8"):
        sk.target("v100-8")
    with pytest.raises(sk.ShardkitError, match=r"3 GPUs per host.*1, 2, 4 or 8"):
        sk.target("h100-3")
    with pytest.raises(sk.ShardkitError, match=r"unknown target 'v7-8'.*or a GPU node: h100-8"):
        sk.target("v7-8")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if "cuda" in n else real(n, *a))
    with pytest.raises(sk.ShardkitError, match=r'pip install "jax\[cuda12-local\]==.*" nvidia-cuda-nvcc-cu12'):
        targets_gpu._devices.__wrapped__("h100_sxm.txtpb", "1x1x2")  # uncached: as on a host without the plugin


def test_host_without_a_gpu_stays_on_the_cpu_quietly():
    """With JAX's CUDA plugin installed and no GPU, `import shardkit` keeps JAX on the CPU and the plugin's start-up
    lines ("Could not find cuda drivers", "Unable to load CUDA") out of the output; a GPU target still compiles."""
    _need_cuda_compiler()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY")}
    code = ("import shardkit as sk, jax; print(jax.devices()[0].platform, jax.config.jax_platforms, "
            "len(sk.target('h100-2').devices))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if sk.targets.gpu_attached():  # a GPU host keeps JAX's default: the GPU
        assert out.stdout.split()[0] == "gpu"
        return
    assert out.stdout.split() == ["cpu", "cpu", "2"], out.stdout
    for noise in ("cudart_stub", "Unable to load CUDA", "TPU_WORKER_HOSTNAMES", "plugin configuration error"):
        assert noise not in out.stderr, out.stderr


def test_cublas_and_triton_gemms_count_the_dots_flops():
    """cost_analysis() is None on GPU: hlo.matmul_flops reads the gemms, as Triton fusions (the default) or as cuBLAS
    custom calls (`--xla_gpu_enable_triton_gemm=false`), both equal to the dot's 2 m n k per device."""
    _need_cuda_compiler()
    mesh = sk.make_mesh("fsdp=8", target="h100-8")
    f = jax.jit(lambda a, b: a @ b, in_shardings=(NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())))
    low = f.lower(jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 384), jnp.bfloat16))
    with sk.targets.cache_off_for(mesh):
        triton, cublas = low.compile(), low.compile(compiler_options={"xla_gpu_enable_triton_gemm": False})
    assert triton.cost_analysis() in (None, {}, [])  # the reason the HLO is read
    assert "__cublas$lt$matmul" in cublas.as_text() and "__cublas" not in triton.as_text()
    assert hlo.matmul_flops(triton) == hlo.matmul_flops(cublas) == 2 * (1024 // 8) * 256 * 384


@functools.cache
def _cell(strategy: str, spec: str, target: str = "h100-8", seq: int = 128, batch: int = 8, **config) -> sk.explain:
    """A tiny GPT train step under `strategy`, compiled for `target` and explained (cached per module)."""
    _need_cuda_compiler()
    mesh = sk.make_mesh(spec, target=target)
    cfg = GPTConfig(**{**CFG, "max_seq_len": seq, **config})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    report = sk.explain(step, step.abstract_state(), step.abstract_batch({k: ((batch, seq), jnp.int32)
                                                                          for k in ("inputs", "targets")}))  # fmt: skip
    assert all("?" not in c.axes for c in report.collectives), hlo.format_table(report.collectives)
    return report


def _sent(report, kind: str, axes: tuple[str, ...]) -> float:
    return hlo.summarize(report.collectives).get((kind, axes), {}).get("bytes_sent", 0.0)


def _async_pairs(text: str, kind: str) -> tuple[int, int]:
    return text.count(f" {kind}-start("), text.count(f" {kind}-done(")


def test_gpu_program_holds_the_strategys_collectives():
    """fsdp_tp on data x fsdp x tensor: the CUDA compiler's program gathers and reduce-scatters over fsdp, all-reduces
    over tensor (the layers' partial sums) and data (gradients), as NCCL-style async start/done pairs, each counted
    once; the report has the compiler's memory figures and says whether the step fits an H100."""
    r = _cell("fsdp_tp", SPEC)
    text = r.compiled.as_text()
    found = {(c.kind, c.axes) for c in r.collectives if c.bytes_sent > 1024}
    expected = {("all-gather", ("fsdp",)), ("reduce-scatter", ("fsdp",)), ("all-reduce", ("tensor",))}
    assert expected <= found and any(k == "all-reduce" and "data" in a for k, a in found), hlo.format_table(
        r.collectives
    )
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        starts, dones = _async_pairs(text, kind)
        assert starts and starts == dones, (kind, starts, dones)  # NCCL-style async pairs
        rows = sum(c.count for c in r.collectives if c.kind == kind)
        # once per op, a start/done pair being one (x the layer loop at most); jax 0.12's compiler also leaves some
        # combined ones synchronous (a `reduce-scatter(` of a tuple inside the layer loop)
        ops = starts + text.count(f" {kind}(")
        assert rows <= ops * CFG["num_layers"], (kind, rows, starts, ops)
    assert r.platform == "gpu" and r.fits and r.hbm_bytes == 80 * 2**30 and r.memory["peak"] > 0
    assert hlo.matmul_flops(r.compiled) > 0


def test_fsdp_gathers_the_parameters_forward_and_backward():
    """fsdp's all-gathers move each layer's weights (tensor-sharded in fsdp_tp), forward and again in the backward:
    per device (p-1)/p of the gathered bytes, in fp32 or the compiler's bf16 copies."""
    r = _cell("fsdp_tp", SPEC)
    per_layer = (4 * 64 * 64 + 3 * 64 * 128) / 2  # q, k, v, o + SwiGLU's three matrices, halved by tensor=2
    gathered = _sent(r, "all-gather", ("fsdp",)) / (1 / 2)
    assert 2 * per_layer * CFG["num_layers"] * 2 <= gathered <= 2 * per_layer * CFG["num_layers"] * 4 * 1.5


def test_cp_zigzag_rings_with_the_pallas_gpu_kernel():
    """cp_zigzag's default GPU block (pallas_gpu) compiles (it failed in XLA's Shardy pass on zero-sized operands,
    ring_fused._put): K and V travel as collective-permutes over seq; the Triton kernels run inside the ring's loop."""
    r = _cell("cp_zigzag", "data=2,seq=4", seq=1024, batch=2, dtype="bfloat16")
    assert _sent(r, "collective-permute", ("seq",)) > 0, hlo.format_table(r.collectives)
    calls = collections.defaultdict(list)
    for name, n in hlo.kernel_calls(r.compiled, "gpu"):
        calls[name].append(n)
    assert {"mha_forward", "mha_backward"} <= set(calls), calls
    assert max(calls["mha_forward"]) == 3 * CFG["num_layers"]  # inside the ring's loop: n - 1 = 3 trips x 2 layers
    assert any("Triton / cuDNN kernels per step" in n for n in r.notes), r.notes


def test_cli_compiles_for_h100_and_says_whether_it_fits(tmp_path):
    """`--config.target=h100-8x2 --config.compile_only` on this CPU-only host: the CUDA compiler's report, hosts on
    the first axis of the automatic mesh, exit 0 (fits), no plugin lines on stderr."""
    _need_cuda_compiler()
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "experiments.train", "--config.compile_only", "--config.target=h100-8x2",
           "--config.steps=1", f"--config.run_dir={tmp_path}", "--config.model.num_layers=1",
           "--config.batch_size=16", "--config.seq_len=32"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "compiled by XLA's CUDA compiler" in out.stdout and "fits in HBM: yes" in out.stdout, out.stdout[-3000:]
    assert "mesh data=2,fsdp=8" in out.stdout and "reduce-scatter" in out.stdout
    assert "cudart_stub" not in out.stderr and "Unable to load CUDA" not in out.stderr, out.stderr[-2000:]
