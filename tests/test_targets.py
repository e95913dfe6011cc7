"""Targets (shardkit/targets.py): TPU slices by name, their compile-only devices, the guards on the paths that would
execute there, and the CLI's compile-only mode. Everything here is compiled by XLA's TPU compiler (libtpu, from the
dev extras) on this CPU-only machine; nothing runs on a TPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
import shardkit.targets as target_module
from models.gpt import GPT, GPTConfig

REPO = Path(__file__).resolve().parent.parent
TINY = GPTConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=128,
                 max_seq_len=32)  # fmt: skip


@pytest.mark.parametrize(
    "name, canonical, chips, slices, topology, kind",
    [
        ("v5e-8", "v5e-8", 8, 1, "v5e:2x4", "TPU v5 lite"),
        ("v5litepod-16", "v5e-16", 16, 1, "v5e:4x4", "TPU v5 lite"),
        ("v5p-128", "v5p-128", 64, 1, "v5:4x4x4", "TPU v5"),  # v5p counts TensorCores: 2 per chip
        ("v4-32", "v4-32", 16, 1, "v4:2x2x4", "TPU v4"),
        ("v6e-256", "v6e-256", 256, 1, "v6e:16x16", "TPU v6 lite"),
        ("v5e-8x2", "v5e-8x2", 8, 2, "v5e:2x4", "TPU v5 lite"),
        ("v5e:2x2", "v5e-4", 4, 1, "v5e:2x2", "TPU v5 lite"),  # libtpu's own topology name
    ],
)
def test_target_names(name, canonical, chips, slices, topology, kind):
    t = sk.target(name)
    assert (t.name, t.chips_per_slice, t.num_slices, t.topology) == (canonical, chips, slices, topology)
    devices = t.devices
    assert len(devices) == chips * slices == t.num_devices
    assert {d.platform for d in devices} == {"tpu"} and {d.device_kind for d in devices} == {kind}
    assert t.device_kind == kind  # the preset the figures come from describes the same chip
    assert t.hbm_bytes > 8 * 2**30 and t.peak_flops > 1e14


def test_target_errors(monkeypatch):
    with pytest.raises(sk.ShardkitError, match=r"unknown target 'v7-8'.*v5p-128.*v5e-8"):
        sk.target("v7-8")
    with pytest.raises(sk.ShardkitError, match=r"v5p slices come in these sizes: v5p-8, .*two per chip"):
        sk.target("v5p-12")
    with pytest.raises(sk.ShardkitError, match=r"first axis data=1 .* multiple of 2"):
        sk.make_mesh("data=1,fsdp=16", target="v5e-8x2")
    with pytest.raises(sk.ShardkitError, match=r"needs 4 devices but 8 are available"):
        sk.make_mesh("data=4", target="v5e-8")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "libtpu" else real(n, *a))
    with pytest.raises(sk.ShardkitError, match=r'pip install "jax\[tpu\]==' + jax.__version__.replace(".", r"\.")):
        target_module._devices.__wrapped__("v6e:2x2", None, 1)  # uncached: as on a host without libtpu


def test_multislice_mesh_puts_slices_on_the_first_axis():
    mesh = sk.make_mesh("data=2,fsdp=4,tensor=2", target="v5e-8x2")
    slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slices == np.arange(2)[:, None, None]).all()  # data's two rows are the two slices; the rest is ICI
    assert sk.target("v5e-8x2").preset({"data": 2, "fsdp": 8}).dcn == {"data": 2}


def test_runs_on_a_target_are_refused_with_the_abstract_path_named():
    mesh = sk.make_mesh("data=2,fsdp=4", target="v5e-8")
    with pytest.raises(sk.ShardkitError, match=r"sk.sharded_init runs a computation.*sk.abstract_model"):
        sk.sharded_init(lambda r: GPT(TINY, rngs=r), mesh, "fsdp")
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.adamw(1e-3), mesh, "fsdp")
    batch = step.abstract_batch({"inputs": ((16, 32), jnp.int32), "targets": ((16, 32), jnp.int32)})
    with pytest.raises(sk.ShardkitError, match=r"calling the train step runs a computation"):
        step(step.abstract_state(), batch)
    with pytest.raises(sk.ShardkitError, match=r"leaf 7 is not \(shape, dtype\)"):
        step.abstract_batch({"inputs": 7})
    with pytest.raises(sk.ShardkitError, match=r"batch"):  # 15 examples over data x fsdp = 8: the usual check
        step.abstract_batch({"inputs": ((15, 32), jnp.int32), "targets": ((15, 32), jnp.int32)})
    # the abstract path compiles with the TPU compiler, and the report knows the chip's HBM
    report = sk.explain(step, step.abstract_state(), batch)
    assert report.platform == "tpu" and report.hbm_bytes == sk.target("v5e-8").hbm_bytes
    assert report.fits is True and "fits in HBM: yes" in report.text()
    assert "tpu" in report.prediction_source  # the cost model was asked for the TPU backend
    cpu = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.adamw(1e-3),
                             sk.make_mesh("data=2,fsdp=4"), "fsdp")  # fmt: skip
    assert sk.explain(cpu, cpu.abstract_state(), cpu.abstract_batch(batch)).fits is None  # CPU: no HBM figure


def _cli(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "experiments.train", "--config.compile_only", *flags]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_cli_compile_only_exit_codes(tmp_path):
    """gpt_tiny on a v5e-8 fits (exit 0, an executable written); one 8192 x 262144 SwiGLU layer (17 GB of fp32
    weights and as much AdamW state on one chip) does not fit a v5e-1's 16 GiB (exit 1); a target without
    compile_only is a configuration error (exit 2)."""
    exe = tmp_path / "step.exe"
    ok = _cli("--config.target=v5e-8", "--config.steps=1", f"--config.save_executable={exe}",
              f"--config.run_dir={tmp_path}")  # fmt: skip
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "fits in HBM: yes" in ok.stdout and "reduce-scatter" in ok.stdout, ok.stdout[-3000:]
    assert exe.stat().st_size > 1000 and not list(tmp_path.glob("gpt_tiny*"))  # no run directory: nothing ran
    big = _cli("--config.target=v5e-1", "--config.mesh=data=1", "--config.strategy=dp", "--config.model.num_layers=1",
               "--config.model.d_model=8192", "--config.model.mlp_dim=262144", "--config.batch_size=1",
               "--config.seq_len=128", "--config.model.num_heads=4", "--config.model.num_kv_heads=4",
               "--config.model.head_dim=128")  # fmt: skip
    assert big.returncode == 1, (big.stdout[-2000:], big.stderr[-2000:])
    assert "fits in HBM: NO" in big.stdout
    bad = subprocess.run([sys.executable, "-m", "experiments.train", "--config.target=v5e-8"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "add --config.compile_only" in bad.stderr


def test_host_keeps_its_platforms_without_a_tpu():
    """With libtpu installed and no TPU attached, `import shardkit` keeps JAX on the host's platforms: no libtpu probe
    lines at start-up (they would otherwise be printed by the first jax.devices())."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY")}
    code = "import shardkit, jax; print(jax.devices()[0].platform, jax.config.jax_platforms)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    if target_module.tpu_attached():  # a TPU host keeps JAX's default: the TPU
        assert out.stdout.split()[0] == "tpu"
        return
    assert out.stdout.split() == ["cpu", "cpu"], out.stdout
    assert "TPU_WORKER_HOSTNAMES" not in out.stderr and "INVALID_ARGUMENT" not in out.stderr, out.stderr
