"""experiments/launch_local.py: 2 processes x 4 CPU devices joined by jax.distributed on 127.0.0.1 train exactly
like 1 process x 8 devices, and a killed process stops the run with a clear error instead of a hang.

Every subprocess is bounded by a timeout (hang guards ~10x above what a loaded 2-core machine takes, or the suite's
pytest timeout; nothing asserts a speed); the coordinator listens on 127.0.0.1 only. Losses agree to 1e-5
relative: the same XLA program on the same data, only the collectives' transport differs (gloo vs in-process),
and with it the order of the cross-process sums: measured 8e-8 (one ulp, at one of the 4 AdamW steps).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from experiments import train as tr
from experiments.configs import gpt_tiny

REPO = Path(__file__).resolve().parents[1]
RUN = {
    "strategy": "fsdp_tp", "mesh": "data=2,fsdp=2,tensor=2", "model.num_layers": 2, "model.d_model": 64,
    "model.num_heads": 4, "model.num_kv_heads": 4, "model.head_dim": 16, "model.mlp_dim": 128, "batch_size": 16,
    "seq_len": 32, "steps": 4, "eval_every": 0, "eval_batches": 1, "ckpt_every": 0, "optimizer.warmup_steps": 1,
    "data.max_files": 120, "progress": False, "log_every": 1, "peak_flops": 1e9,
}  # fmt: skip


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multiprocess")


def _settings(tmp: Path, name: str, **over) -> dict:
    return {**RUN, "run_dir": str(tmp / "runs"), "data.cache_dir": str(tmp / "data"), "name": name,
            "jax_cache_dir": str(tmp / "jax"), **over}  # fmt: skip


def _launch(tmp: Path, name: str, **over) -> list[str]:
    flags = [f"--config.{k}={v}" for k, v in _settings(tmp, name, **over).items()]
    return [sys.executable, "-m", "experiments.launch_local", "--processes", "2", "--devices", "4", "--grace", "3",
            "--", *flags]  # fmt: skip


def _losses(tmp: Path, name: str) -> np.ndarray:
    lines = (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return np.array([json.loads(ln)["loss"] for ln in lines if ln.strip()])


@pytest.mark.slow
def test_two_processes_match_one_process(tmp):
    config = gpt_tiny.get_config()
    for key, value in {**_settings(tmp, "one"), "jax_cache_dir": ""}.items():  # keep the suite's compile cache
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    tr.train(config)  # 1 process x 8 devices, in-process; also tokenises the data cache the processes share
    out = subprocess.run(_launch(tmp, "two"), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "2 process(es)" in out.stdout and "all 2 processes finished" in out.stdout
    one, two = _losses(tmp, "one"), _losses(tmp, "two")
    assert len(one) == len(two) == RUN["steps"]
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert (tmp / "runs" / "two" / "checkpoints" / str(RUN["steps"])).is_dir()  # both processes wrote their shards


@pytest.mark.slow
def test_a_killed_process_stops_the_run_with_a_clear_error(tmp):
    proc = subprocess.Popen(_launch(tmp, "killed", steps=100_000), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    seen, pids = [], {}
    try:  # no wall-clock deadline for start-up (compiling is machine-speed bound): the suite's pytest timeout is it
        while not any(ln.startswith("[p0] step") for ln in seen[-3:]):  # training has started
            assert proc.poll() is None, "".join(seen[-40:])
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
            if m := re.search(r"pids (p0=\d+) (p1=\d+)", seen[-1]):
                pids = dict(kv.split("=") for kv in m.groups())
        os.kill(int(pids["p1"]), signal.SIGKILL)
        # Stopping takes the launcher's 0.2 s poll + --grace 3 s, whatever the machine's speed: 60 s only guards a hang.
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(timeout=60)  # the launcher's last lines: read to EOF (not a sleep that a slow machine outlasts)
    text = "".join(seen) + "".join(lines.get() for _ in range(lines.qsize()))
    assert rc != 0, text[-3000:]
    # the launcher itself stopped process 0 (rather than a collective in it timing out later)
    stopped = r"error: process 1 \(pid \d+\) was killed by SIGKILL; stopping the other 1 process"
    assert re.search(stopped, text), text[-3000:]
    with pytest.raises(ProcessLookupError):  # process 0 was stopped too, not left hanging in a collective
        os.kill(int(pids["p0"]), 0)
