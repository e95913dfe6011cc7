"""experiments/launch_local.py: 2 processes x 4 CPU devices joined by jax.distributed on 127.0.0.1 train exactly
like 1 process x 8 devices, and a killed process stops the run with a clear error instead of a hang.

And as a cluster runs it (each process started with the environment alone, under its own supervisor,
experiments/supervise.py): with only the variables srun sets, a peer SIGKILLed at a random step, a Ctrl-C to one
process (synced like a preemption) and a peer SIGKILLed inside a checkpoint save; with JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID, a hang injected in one process. Each ends in bounded time with one `error:`
line (or the stop's checkpoint), and the restarts continue to exactly the losses of the uninterrupted 2-process
run, from the emergency checkpoint where it is newer (docs/training.md, "When a host dies", "On a cluster").

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
from experiments.launch_local import child_env, free_port

REPO = Path(__file__).resolve().parents[1]
RUN = {
    "strategy": "fsdp_tp", "mesh": "data=2,fsdp=2,tensor=2", "model.num_layers": 2, "model.d_model": 64,
    "model.num_heads": 4, "model.num_kv_heads": 4, "model.head_dim": 16, "model.mlp_dim": 128, "batch_size": 16,
    "seq_len": 32, "steps": 12, "eval_every": 0, "eval_batches": 1, "ckpt_every": 0, "optimizer.warmup_steps": 1,
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
    assert (tmp / "runs" / "two" / "emergency" / "p1" / "10").is_dir()  # several processes: every 10 steps (auto)


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


# ------------------------------------------------------------------------------------- as a cluster runs it
FAULTS = {"heartbeat_timeout": 5, "emergency_every": 2}  # a dead peer noticed within seconds; local shards often
TRACES = ("Traceback", "Check failure", "Fatal Python error", "Thread 0x", "*** ")  # none may reach the terminal


def srun_env(pid: int, port: int) -> dict[str, str]:
    """What `srun --ntasks=2` sets for task `pid` on one node (and no JAX_* variable): JAX's Slurm detector takes
    the coordinator from the node list and a port from the job id (job id % 4096 + 61440, so `port` is chosen)."""
    env = {k: v for k, v in child_env(pid, 2, 4, port).items() if not k.startswith(("JAX_COORD", "JAX_NUM", "JAX_PRO"))}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID=str(port - 61440 + 4096 * 7), SLURM_STEP_ID="0", SLURM_STEP_NODELIST="localhost",
               SLURM_NODELIST="localhost", SLURM_JOB_NODELIST="localhost", SLURM_NTASKS="2", SLURM_NNODES="1",
               SLURM_STEP_NUM_NODES="1", SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid), SLURM_NODEID="0")  # fmt: skip
    return env


def slurm_port() -> int:
    """A free port in the range JAX's Slurm detector derives from a job id."""
    import random
    import socket

    for port in random.sample(range(61440, 65536), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 61440-65535")


class Process:
    """One `python -m experiments.train` of a 2-process run, started as a cluster starts it: environment only (the
    JAX_* variables, or with `slurm` only what srun sets)."""

    def __init__(self, tmp: Path, name: str, pid: int, port: int, env: dict | None = None, slurm: bool = False,
                 **over):  # fmt: skip
        flags = [f"--config.{k}={v}" for k, v in _settings(tmp, name, **FAULTS, **over).items()]
        launcher = srun_env(pid, port) if slurm else child_env(pid, 2, 4, port)
        environ = {**launcher, **(env or {})}  # the variables a cluster's launcher would set
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *flags], cwd=REPO, env=environ,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.out: queue.Queue[str] = queue.Queue()
        self.lines: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=stream, t=tag: [self.out.put(t + ln) for ln in s], daemon=True)
            for stream, tag in ((self.proc.stdout, ""), (self.proc.stderr, "!"))
        ]  # "!": a stderr line
        for r in self.readers:
            r.start()

    def until(self, pattern: str) -> str:
        """Reads output until a line matches (no deadline: the suite's pytest timeout bounds start-up)."""
        while True:
            try:
                line = self.out.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, "".join(self.lines[-40:])
                continue
            self.lines.append(line)
            if re.search(pattern, line):
                return line

    def finish(self, timeout: float) -> tuple[int, str]:
        """(exit code, everything it printed); `timeout` bounds how long the ending may take."""
        rc = self.proc.wait(timeout=timeout)
        for r in self.readers:  # to EOF: the last lines (not a sleep that a slow machine outlasts)
            r.join(timeout=30)
        while not self.out.empty():
            self.lines.append(self.out.get())
        return rc, "".join(self.lines)

    def trainer_pid(self) -> int:
        """The supervisor's child: the process that trains."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _pair(tmp, name, env=None, slurm=False, **over):
    port = slurm_port() if slurm else free_port()
    return [Process(tmp, name, i, port, env, slurm, **over) for i in range(2)]


@pytest.fixture(scope="module")
def reference(tmp):
    """The uninterrupted 2-process run's losses (test_two_processes_match_one_process makes it, or this does)."""
    if not (tmp / "runs" / "two" / "metrics.jsonl").exists():
        out = subprocess.run(_launch(tmp, "two"), cwd=REPO, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return _losses(tmp, "two")


def _finish(pair, timeout):
    try:
        return [p.finish(timeout) for p in pair]
    finally:
        for p in pair:
            p.kill()


def _one_error(out: str) -> str:
    """The only `error:` line a process printed (none of JAX's traces reached the terminal)."""
    errors = [ln for ln in out.splitlines() if ln.startswith("!error:")]
    assert len(errors) == 1 and not any(t in out for t in TRACES), out[-3000:]
    return errors[0]


@pytest.mark.slow
def test_under_srun_a_dead_peer_a_ctrl_c_and_a_kill_inside_a_save_end_cleanly_and_the_run_ends_bit_for_bit(
    tmp, reference
):
    """Started with only the variables srun sets (JAX's Slurm detector finds the coordinator, and says so):
    1. process 1's trainer SIGKILLed after a random step: process 0 ends with one line naming it (exit 75);
    2. the restart resumes from the emergency step that line named; a Ctrl-C to process 1 alone stops both at the
       same checkpointed step (JAX's preemption sync);
    3. the restart resumes there; process 1, SIGKILLed inside the final checkpoint save (after its part went to
       orbax, before the commit: SHARDKIT_INJECT_KILL), leaves process 0 with one line naming it, the save it was
       in and the step to resume from; the half-written step is not on disk as a step;
    4. the last restart resumes from that step, and every step's loss is the uninterrupted run's, bit for bit."""
    seed = int.from_bytes(os.urandom(2), "little")
    at = 3 + seed % 4  # the step after which process 1 is SIGKILLed: 3..6 of 12, said in any failure
    pair = _pair(tmp, "faults", slurm=True)
    found = pair[0].until(r"distributed: SlurmCluster matched")
    assert "process 0 of 2, coordinator localhost:" in found, found
    pair[0].until(rf"^step +{at}/")
    os.kill(pair[1].trainer_pid(), signal.SIGKILL)  # the trainer itself, as the OOM killer would
    # JAX's coordination service notices within heartbeat_timeout (5 s); 60 s only guards a hang
    (rc0, out0), (rc1, out1) = _finish(pair, 60)
    context = f"(killed after step {at}, seed {seed})\n{out0[-3000:]}"
    assert rc0 == 75 and rc1 == 137, (rc0, rc1, context)
    line = _one_error(out0)
    assert re.match(
        r"!error: process 0: process 1 of 2 stopped \(no heartbeat for 5 s: it died, hangs or was "
        r"preempted\); this process stopped after step \d+(, during the [a-z ]+ of step \d+)?\. Rerun the same "
        r"command on every host to resume from step \d+ \(the emergency checkpoint every process holds",
        line,
    ), context
    resume = int(re.search(r"resume from step (\d+)", line).group(1))  # the run directory is shared here
    assert resume >= 2 and resume % 2 == 0, context
    assert _one_error(out1).startswith("!error: process 1 was killed by SIGKILL"), out1[-2000:]
    log = (tmp / "runs" / "faults" / "logs" / "process0.log").read_text()
    assert "Fatal Python error" in log or "Check failure" in log or "Traceback" in log  # kept there
    # 2. the restart resumes from the emergency checkpoint; a Ctrl-C to process 1 only (a terminal on its host)
    pair = _pair(tmp, "faults", slurm=True)
    assert f"resumed from the emergency checkpoint of step {resume} " in pair[0].until("resumed from")
    pair[0].until(r"^step +\d+/")  # a step after the restart: process 1 is in its loop too (a step is collective)
    pair[1].proc.send_signal(signal.SIGINT)
    (rc0, out0), (rc1, out1) = _finish(pair, 60)
    assert (rc0, rc1) == (128 + signal.SIGTERM, 128 + signal.SIGINT), (rc0, rc1, out0[-3000:], out1[-2000:])
    saved = int(re.search(r"SIGTERM: checkpointed step (\d+)", out0).group(1))
    assert f"SIGINT: checkpointed step {saved}" in out1 and "!error" not in out0 + out1, out1[-2000:]
    assert saved < RUN["steps"], "the stop landed on the last step: nothing left for the kill inside a save"
    # 3. the restart resumes there; process 1 dies inside the final checkpoint save
    pair = _pair(tmp, "faults", env={"SHARDKIT_INJECT_KILL": f"{RUN['steps']}:1"}, slurm=True)
    assert f"resumed from step {saved} " in pair[0].until("resumed from")
    (rc0, out0), (rc1, out1) = _finish(pair, 90)
    assert rc0 == 75 and rc1 == 137, (rc0, rc1, out0[-3000:], out1[-2000:])
    resume = 10 if saved < 10 else saved  # the newest emergency checkpoint (every 2 steps), else the stop's
    assert re.match(
        rf"!error: process 0: process 1 of 2 stopped \(no heartbeat for 5 s: .*\); this process stopped after step "
        rf"\d+, during the checkpoint save of step {RUN['steps']}\. Rerun the same command on every host to resume "
        rf"from step {resume} ",
        _one_error(out0),
    ), out0[-3000:]
    assert not (tmp / "runs" / "faults" / "checkpoints" / str(RUN["steps"])).exists()  # cut short: never committed
    # 4. the last restart resumes from the step named, and finishes on the uninterrupted run's losses
    pair = _pair(tmp, "faults", slurm=True)
    assert f"step {resume} " in pair[0].until("resumed from")
    (rc0, out0), (rc1, _) = _finish(pair, 120)
    assert rc0 == rc1 == 0, out0[-3000:]
    np.testing.assert_array_equal(_losses(tmp, "faults"), reference)


@pytest.mark.slow
def test_a_hung_process_is_caught_by_the_watchdog_in_every_process(tmp):
    """Process 1 stops making progress before step 4 (SHARDKIT_INJECT_HANG): both watchdogs (3 s) fire, each
    process ends with one line naming its stacks file, exit 124."""
    pair = _pair(tmp, "hang", env={"SHARDKIT_INJECT_HANG": "4:1"}, watchdog=3)
    try:
        (rc0, out0), (rc1, out1) = pair[0].finish(120), pair[1].finish(120)
    finally:
        for p in pair:
            p.kill()
    assert rc0 in (124, 75) and rc1 == 124, (rc0, rc1, out0[-3000:], out1[-2000:])
    for i, out in enumerate((out0, out1)):
        errors = [ln for ln in out.splitlines() if ln.startswith("!error:")]
        assert len(errors) == 1 and not any(t in out for t in TRACES), out[-3000:]
        if i == 1 or rc0 == 124:
            assert re.match(
                rf"!error: process {i}: no progress for \d+ s after step \d+ \(watchdog limit 3 s", errors[0]
            )
            stacks = (tmp / "runs" / "hang" / "logs" / f"hang-p{i}.txt").read_text()
            assert "hang_here" in stacks if i == 1 else "train.py" in stacks
