"""The small parent each process of a multi-process run trains under: a dead peer is one line, not a stack dump.

When a cluster starts `python -m experiments.train` on every host (Slurm, GKE, a TPU pod: JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID or the cluster's own variables), `experiments.train` runs itself as a child of
this supervisor, as a launcher on each host would (`--config.supervise=False` turns it off). The child's stdout
passes through; its stderr goes to `<run>/logs/process<K>.log`, and only its one-line messages (`error:`,
`warning:`, `distributed:`, Python warnings) also reach the terminal. When the child ends, the supervisor adds
the line the child could not write itself:

- a peer died or stopped heart-beating (JAX's coordination service aborts every survivor, with a C++ check
  failure and a Python stack dump): `error: process K: process J of N stopped ...`, exit `EXIT_PEER_LOST` (75);
- the child was killed (SIGKILL: the OOM killer, a scheduler): `error: process K was killed by SIGKILL ...`,
  exit 128 + the signal;
- any other crash without an `error:` line of its own: `error: process K crashed ...: <the exception>`, exit 1.

Each line names the step reached, the last good checkpoint (global, and the newer emergency one when there is
one) and says to rerun the same command; it is also appended to the process's log. The child reports its run
directory and progress through a small JSON status file (`report`), so the supervisor knows them however the child
ended. SIGTERM and SIGINT are forwarded to the child, which checkpoints and exits (preemption).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_PEER_LOST = 75  #: a peer process died or stopped heart-beating: rerun the same command on every host
STATUS_ENV = "SHARDKIT_STATUS"  #: set in the child: the status file it reports to
#: a stderr line the terminal still shows (the rest, stack traces included, only goes to the log)
SHOWN = re.compile(r"^(error|warning|distributed|stopping)\b|Warning: ")
#: JAX's coordination service on a peer that died or stopped heart-beating (jax 0.10-0.12)
PEER_LOST = re.compile(r"another task died|detected fatal errors|stopped sending heartbeats|unhealthy|"
                       r"heartbeat timeout|Task .* is not connected|DEADLINE_EXCEEDED.*[Bb]arrier")  # fmt: skip
TASK = re.compile(r"/task:(\d+)")
#: a collective's own error when a peer is gone (Gloo on CPU, NCCL on GPU, ICI/DCN on TPU, the coordination service)
COLLECTIVE = re.compile(r"Gloo|gloo|NCCL|nccl|\bICI\b|\bDCN\b|Connection reset|Connection closed|Broken pipe|"
                        r"UNAVAILABLE|DEADLINE_EXCEEDED|coordination service|another task|heartbeat|"
                        r"[Bb]arrier")  # fmt: skip


def supervised() -> bool:
    """Whether this process is a supervisor's child (reports its status, leaves the last line to the parent)."""
    return bool(os.environ.get(STATUS_ENV))


def report(**fields: Any) -> None:
    """Child side: merges `fields` (run_dir, step, checkpoint, emergency, ...) into the status file, atomically."""
    path = os.environ.get(STATUS_ENV)
    if not path:
        return
    status = _read(path) | fields
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def collective_failure(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from or while handling) is a collective that failed because a peer
    is gone: its text names the transport or the coordination service (COLLECTIVE)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if COLLECTIVE.search(f"{type(e).__name__}: {e}"):
            return True
        e = e.__cause__ or e.__context__
    return False


def peer_failure(e: BaseException, heartbeat_timeout: float) -> None:
    """Child side, several processes, a collective failed (`collective_failure`): the raw error and its traceback go
    to stderr, which the supervisor keeps in <run>/logs only; the status says a collective failed; then this process
    waits for JAX's coordination service, which names the dead peer when it aborts the survivors (at most one
    heartbeat timeout away). If no abort comes, it exits EXIT_PEER_LOST and the supervisor says it cannot tell which
    peer stopped. Never returns. Without a supervisor, it writes the one line itself."""
    import traceback

    first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    sys.stderr.write("collective failed (a peer is gone); the raw error:\n" + "".join(traceback.format_exception(e)))
    sys.stderr.flush()
    if not supervised():
        print(f"error: a collective with the other processes failed (a peer died, hangs or was preempted; which one "
              f"this process cannot tell): {first[:300]}. Rerun the same command on every host to resume from the "
              "last checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        os._exit(EXIT_PEER_LOST)
    report(collective_error=first[:300])
    time.sleep(max(5.0, 2 * float(heartbeat_timeout) + 5))  # JAX's abort (SIGABRT) usually ends this sooner
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def _read(path: str | Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _die_with_parent() -> None:
    """In the child, before it runs: killed when the supervisor dies, however it dies (Linux's PR_SET_PDEATHSIG), so a
    SIGKILL to the supervisor (a launcher's, a scheduler's) never leaves the trainer running alone."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the supervisor's own death then leaves the child to its peers
        pass


def _pump(stream: Any, log: Any, seen: list[str]) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if SHOWN.search(line):
            seen.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()


def _signal_name(sig: int) -> str:
    return signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else f"signal {sig}"


def dead_peers(log_text: str) -> list[int]:
    """The process ids JAX's coordination service reported dead in a survivor's stderr (jax 0.10-0.12 wordings)."""
    found = set(map(int, re.findall(r"Task (\d+) heartbeat timeout", log_text)))
    for block in re.findall(r"stopped sending heartbeats\):\s*\n((?:\s*\d+\s*\n)+)", log_text):
        found.update(map(int, block.split()))
    found.update(map(int, re.findall(r"/task:(\d+)", log_text)))
    return sorted(found)


def common_emergency_step(directory: str | os.PathLike[str] | None, processes: int) -> int | None:
    """The newest emergency step every process has committed, when all their folders are visible from here (a
    shared run directory); None when one is not (node-local disks: each host sees its own)."""
    if not directory or not isinstance(processes, int):
        return None
    from shardkit.emergency import committed_steps

    common: set[int] | None = None
    for i in range(processes):
        folder = Path(directory) / f"p{i}"
        if not folder.is_dir():
            return None
        steps = set(committed_steps(folder))
        common = steps if common is None else common & steps
    return max(common) if common else None


def resume_from(status: dict[str, Any]) -> str:
    """Where a rerun resumes, for the closing line: the newer of the emergency and the global checkpoint."""
    checkpoint, emergency = status.get("checkpoint") or 0, status.get("emergency") or 0
    where = f"{status.get('checkpoints', 'the run')}"
    also = f"the last global one is step {checkpoint} in {where}" if checkpoint else f"no global one yet in {where}"
    if emergency > checkpoint:
        common = common_emergency_step(status.get("emergency_dir"), status.get("processes"))
        if common is not None and common > checkpoint:  # every process's folder is visible: the step all hold
            return f"step {common} (the emergency checkpoint every process holds; {also})"
        if common is None:  # the others' folders are not visible here: theirs may be older (killed mid-save)
            return f"the newest emergency checkpoint every process holds (step {emergency} on this one; {also})"
    if checkpoint:
        return f"step {checkpoint} (checkpoint in {where})"
    if "checkpoints" not in status:  # ended before it opened the run: it cannot say which steps are saved
        return "the run's newest checkpoint (this process ended before it read the run's checkpoints)"
    return "step 0 (no checkpoint yet)"


def verdict(rc: int, status: dict[str, Any], log_text: str, said_error: bool, forwarded: bool) -> tuple[str, int]:
    """(the closing `error:` line or "", the exit code) for a child that ended with `rc` (module docstring)."""
    if rc == 0 or said_error or (forwarded and rc in (128 + signal.SIGTERM, 128 + signal.SIGINT)):
        return "", rc
    if status.get("stopped") and rc in (128 + signal.SIGTERM, 128 + signal.SIGINT):  # a synced stop, checkpointed
        return "", rc
    me, n = status.get("process", os.environ.get("JAX_PROCESS_ID", "?")), status.get("processes", "?")
    step = status.get("step")
    at = f"after step {step}" if step is not None else "before its first step"
    if status.get("phase") and status["phase"] != "training":  # where it was when the peer went
        at += f", during the {status['phase']}" + (f" of step {status['phase_step']}" * ("phase_step" in status))
    tail = f"Rerun the same command on every host to resume from {resume_from(status)}"
    if rc < 0 and -rc != signal.SIGABRT:  # killed from outside (JAX's own abort is SIGABRT)
        return (f"error: process {me} was killed by {_signal_name(-rc)} {at} (the system's OOM killer, or the "
                f"scheduler). {tail}", 128 - rc)  # fmt: skip
    jax_lines = "\n".join(ln for ln in log_text.splitlines() if not SHOWN.search(ln))  # not shardkit's own lines
    if PEER_LOST.search(jax_lines) or (rc == EXIT_PEER_LOST and status.get("collective_error")):
        dead = [d for d in dead_peers(jax_lines) if str(d) != str(me)] if PEER_LOST.search(jax_lines) else []
        who = f"process {', '.join(map(str, dead))} of {n}" if dead else f"a peer process (of {n}; JAX named none)"
        beat = status.get("heartbeat_timeout")
        silent = f"no heartbeat for {beat} s" if beat else "no heartbeat"
        return (f"error: process {me}: {who} stopped ({silent}: it died, hangs or was preempted); this process "
                f"stopped {at}. {tail}", EXIT_PEER_LOST)  # fmt: skip
    lines = [ln.strip() for ln in jax_lines.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    last = (errors or lines or [""])[-1]
    return f"error: process {me} crashed {at} (exit code {rc}): {last[:300]}. {tail}", rc if rc > 0 else 1


def run(argv: Sequence[str], module: str = "experiments.train") -> int:
    """Runs `python -m module argv...` as a supervised child; returns the exit code to end with."""
    scratch = Path(tempfile.mkdtemp(prefix="shardkit-supervise-"))
    status_path, log = scratch / "status.json", scratch / "stderr.log"
    env = {**os.environ, STATUS_ENV: str(status_path), "PYTHONUNBUFFERED": "1"}
    seen: list[str] = []
    forwarded: list[int] = []
    with open(log, "w") as log_file:
        # its own session: a terminal's Ctrl-C reaches it once, through `forward` (the Stop is synced from there)
        child = subprocess.Popen([sys.executable, "-u", "-m", module, *argv], env=env, stderr=subprocess.PIPE,
                                 text=True, bufsize=1, preexec_fn=_die_with_parent, start_new_session=True)  # fmt: skip
        pump = threading.Thread(target=_pump, args=(child.stderr, log_file, seen), daemon=True)
        pump.start()

        def forward(sig: int, _: Any) -> None:
            forwarded.append(sig)
            if child.poll() is None:
                child.send_signal(sig)

        old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = child.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        pump.join(timeout=30)
    status = _read(status_path)
    text = log.read_text(errors="replace")
    line, code = verdict(rc, status, text, any(ln.startswith("error:") for ln in seen), bool(forwarded))
    if line:
        text += line + "\n"
    kept = _keep(text, status) if (line or rc != 0 or status.get("run_dir")) else None
    shutil.rmtree(scratch, ignore_errors=True)
    if line:
        sys.stdout.flush()
        print(f"{line} (log: {kept})", file=sys.stderr, flush=True)
    return code


def _keep(text: str, status: dict[str, Any]) -> Path:
    """The child's stderr appended to <run>/logs/process<K>.log (a restart's attempt after the last one's), or
    to a file in the temporary directory when the child ended before it knew its run directory."""
    if status.get("run_dir"):
        path = Path(status["run_dir"]) / "logs" / f"process{status.get('process', 0)}.log"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: process {status.get('process')} ---\n{text}")
            return path
        except OSError:
            pass
    fd, name = tempfile.mkstemp(prefix="shardkit-process-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return Path(name)
