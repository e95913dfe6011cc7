"""Run N JAX processes on this machine, joined by jax.distributed over loopback: the real multi-host path.

    python -m experiments.launch_local --processes 2 -- --config.mesh="data=2,fsdp=4" --config.steps=20
    python -m experiments.launch_local --processes 2 --devices 4 --module experiments.train -- <train flags>

Each process gets its own `--devices` virtual CPU devices (XLA_FLAGS, JAX_PLATFORMS=cpu) and
JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>, JAX_NUM_PROCESSES, JAX_PROCESS_ID, from which
`experiments.train` calls `jax.distributed.initialize`; collectives between processes go over gloo. Output is
streamed line by line with a `[pK]` prefix. If a process fails, the launcher says which one and how, stops the
others (SIGTERM, then SIGKILL after `--grace` seconds) and exits non-zero: a dead peer never leaves the rest
hanging in a collective. Ctrl-C / SIGTERM to the launcher are forwarded.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(pid: int, n: int, devices: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env.update(
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(n),
        JAX_PROCESS_ID=str(pid),
        PYTHONUNBUFFERED="1",
    )
    return env


def _describe(rc: int) -> str:
    if rc < 0:
        with_name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else f"signal {-rc}"
        return f"was killed by {with_name}"
    return f"exited with code {rc}"


def _pump(i: int, proc: subprocess.Popen, lock: threading.Lock) -> None:
    for line in proc.stdout:  # type: ignore[union-attr]
        with lock:
            sys.stdout.write(f"[p{i}] {line}")
            sys.stdout.flush()


def launch(
    args: Sequence[str], processes: int = 2, devices: int = 4, module: str = "experiments.train", grace: float = 10.0
) -> int:
    """Starts the processes, streams their output, returns 0 if all succeed, else the first failure's code (>0)."""
    port = free_port()
    lock, procs = threading.Lock(), []
    say = lambda msg: print(f"launch_local: {msg}", flush=True)
    for i in range(processes):
        cmd = [sys.executable, "-u", "-m", module, *args]
        p = subprocess.Popen(cmd, env=child_env(i, processes, devices, port), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, bufsize=1)  # fmt: skip
        procs.append(p)
        threading.Thread(target=_pump, args=(i, p, lock), daemon=True).start()
    say(f"{processes} processes x {devices} CPU devices, coordinator 127.0.0.1:{port}, "
        f"pids {' '.join(f'p{i}={p.pid}' for i, p in enumerate(procs))}")  # fmt: skip

    def stop(reason: str) -> None:
        live = [p for p in procs if p.poll() is None]
        if live:
            say(f"{reason}; stopping the other {len(live)} process(es)")
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    forwarded: list[int] = []
    old = {s: signal.signal(s, lambda sig, _: forwarded.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            if forwarded:
                stop(f"received {signal.Signals(forwarded[0]).name}")
                return 128 + forwarded[0]
            codes = [p.poll() for p in procs]
            failed = next(((i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)), None)
            if failed:
                i, rc = failed
                msg = f"error: process {i} (pid {procs[i].pid}) {_describe(rc)}"
                stop(msg)
                say(f"{msg}; the run failed (the other processes were stopped so none waits on a dead peer)")
                return rc if rc > 0 else 1
            if all(rc == 0 for rc in codes):
                say(f"all {processes} processes finished")
                return 0
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs:
            if p.poll() is None:
                p.kill()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [options] -- <module flags>")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4, help="virtual CPU devices per process")
    ap.add_argument("--module", default="experiments.train", help="python -m target each process runs")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL when stopping")
    a = ap.parse_args(own)
    if a.processes < 1 or a.devices < 1:
        ap.error("--processes and --devices must be >= 1")
    sys.exit(launch(rest, a.processes, a.devices, a.module, a.grace))


if __name__ == "__main__":
    main()
