"""Facts about the machine a run needs: the hardware preset, a measured peak, memory per device, distributed init."""

from __future__ import annotations

import inspect
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import shardkit as sk
from models import gpt


def resolve_preset(name: str) -> sk.HardwarePreset | None:
    """The named preset; for "auto" the preset whose device kind (and count) matches jax.devices(), else None."""
    if name != "auto":
        return sk.load_preset(name)
    kind, n = jax.devices()[0].device_kind, jax.device_count()
    found = [p for p in map(sk.load_preset, sk.available_presets()) if p.device_kind == kind]
    return min(found, key=lambda p: p.num_devices != n, default=None)


def target_axes(config: Any, num_devices: int, strategy: sk.Strategy | None = None) -> dict[str, int]:
    """The run's mesh from `config.mesh`: "auto" (the default) = a mesh the strategy fits on `num_devices`
    (`Strategy.default_mesh` of the run's `strategy`, from `strategy_of`), "axis=n,..." (one n may be -1), a preset
    name, or "" = the hardware preset's mesh. An explicit mesh is taken as given: if it does not fit the strategy,
    binding it raises the ShardkitError."""
    from shardkit.mesh import parse_spec, resolve_axes

    spec = config.mesh.strip()
    if spec == "auto":
        return (strategy or sk.strategy(config.strategy)).default_mesh(num_devices)
    if not spec:
        preset = resolve_preset(config.hardware)
        if preset is None:
            raise sk.ShardkitError("config.mesh is empty and hardware='auto' matched no preset; give --config.mesh")
        return dict(preset.axes)
    preset = mesh_preset(config)
    if preset is not None:
        return dict(preset.axes)
    axes = parse_spec(spec)
    return resolve_axes(axes, num_devices) if -1 in axes.values() else {a: int(n) for a, n in axes.items()}


def mesh_preset(config: Any) -> sk.HardwarePreset | None:
    """The hardware preset `--config.mesh` names (e.g. hetero_v100_p100: its device groups), or None."""
    spec = config.mesh.strip()
    return sk.load_preset(spec) if spec.replace("-", "_").isidentifier() and spec != "auto" else None


def calibrate_peak_flops(devices: Sequence[jax.Device], n: int = 512, reps: int = 20) -> float:
    """Per-device FLOP/s of an fp32 [n, n] @ [n, n] matmul run on all `devices` at once (best of `reps`)."""
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x = jax.device_put(jnp.ones((len(devices), n, n), jnp.float32), NamedSharding(mesh, PartitionSpec("d")))
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of `tree`'s arrays held by each addressable device (sum over the arrays' addressable shards)."""
    out: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def cluster_env() -> bool:
    """A cluster launcher started several processes of this command (JAX's detector for it counts more than one:
    experiments/cluster.py), so the run joins them without `--config.distributed=True`."""
    from experiments import cluster

    return cluster.launched_several()


def init_distributed(heartbeat_timeout_s: int = 60, initialization_timeout_s: int = 120) -> None:
    """jax.distributed.initialize from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (the --coordinator
    flags set them; experiments/launch_local.py too), else JAX's own cluster detection (experiments/cluster.py:
    Slurm, Open MPI, Cloud TPU VMs, GKE TPU pods, Kubernetes), whose match is printed; when nothing matched, the
    error lists what was looked for. A peer silent for `heartbeat_timeout_s` is declared dead, so the others fail
    instead of hanging."""
    from experiments import cluster

    env = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
           "process_id": "JAX_PROCESS_ID"}  # fmt: skip
    kw: dict[str, Any] = {k: os.environ[v] for k, v in env.items() if os.environ.get(v)}
    try:
        kw.update({k: int(v) for k, v in kw.items() if k != "coordinator_address"})
    except ValueError as e:
        raise sk.ShardkitError(f"JAX_NUM_PROCESSES / JAX_PROCESS_ID must be integers: {e}") from e
    try:
        found = None if len(kw) == 3 else cluster.detect()  # all three given: JAX asks no detector for them
    except ValueError as e:  # a Slurm node list JAX would misread
        raise sk.ShardkitError(str(e)) from e
    if "coordinator_address" not in kw and found is None and not cluster.available():  # a jax without them
        print("distributed: JAX's cluster detectors could not be read in this jax; jax.distributed.initialize() "
              "detects the cluster itself", file=sys.stderr, flush=True)  # fmt: skip
    elif "coordinator_address" not in kw and found is None:
        raise sk.ShardkitError(
            "distributed=True but no cluster was found. JAX looked for: " + cluster.looked_for() + ". Give "
            "--coordinator_address=host:port --num_processes=N --process_id=i to every process (or the "
            "JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID variables), start it with one of the "
            "launchers in launch/, or start local processes with `python -m experiments.launch_local`"
        )
    if found is not None:
        print(f"distributed: {found.describe()}", file=sys.stderr, flush=True)
    pid = kw.get("process_id", found.process_id if found else None)
    count = kw.get("num_processes", found.process_count if found else None)
    where = kw.get("coordinator_address") or (found.coordinator if found else None) or "the cluster's coordinator"
    if pid == 0 and ":" in where:
        _check_port_free(where)
    timeouts = dict(heartbeat_timeout_seconds=heartbeat_timeout_s, initialization_timeout=initialization_timeout_s)
    params = inspect.signature(jax.distributed.initialize).parameters
    print(f"distributed: process {'?' if pid is None else pid} of {count or '?'} waiting up to "
          f"{initialization_timeout_s} s for all processes at {where} (XLA ends this process with DEADLINE_EXCEEDED, "
          "'another task died', if one never starts)", file=sys.stderr, flush=True)  # fmt: skip
    try:
        jax.distributed.initialize(**kw, **{k: v for k, v in timeouts.items() if k in params})
    except (RuntimeError, ValueError) as e:
        raise sk.ShardkitError(f"jax.distributed.initialize({where}): {str(e).splitlines()[0]}") from e


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on `address`'s port (JAX listens on every interface): a port already taken
    is an error here, not in XLA. The host is not resolved (a pod's DNS name may not exist yet: JAX waits for it)."""
    import socket

    _, _, port = address.rpartition(":")
    if not port.isdigit():
        raise sk.ShardkitError(f"coordinator address {address!r}: write host:port, e.g. localhost:12345")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", int(port)))
        except OSError as e:
            raise sk.ShardkitError(
                f"coordinator address {address}: port {port} cannot be served here ({e.strerror}); another run (or "
                "a stale process) holds it: pick another --coordinator_address port or stop that process"
            ) from e


class RunLock:
    """One trainer per run directory: an exclusive `flock` on `<run>/lock`, holding the owner's pid and host.

    A second trainer on the same run (which would truncate the live run's metrics and delete its in-flight
    checkpoint) gets a ShardkitError naming the owner. The kernel drops the lock when its process dies, however
    it dies, so a lock left by a killed run is no obstacle: the next trainer takes it over (the file's old pid
    is only information). Local file systems; on NFS flock may not reach across hosts.
    """

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / "lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl
        import socket

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            where = f"run directory {self.path.parent}: {e.strerror}"
            raise sk.ShardkitError(f"{where}; choose a writable --config.run_dir") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise sk.ShardkitError(
                f"run {self.path.parent} is being trained by {holder}: one trainer per run. Wait for it, stop it, "
                "or give this run another --config.name"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (it is only information)
            self._fd = None


def with_kernels(strategy: sk.Strategy, spec: str) -> sk.Strategy:
    """The strategy with `--config.kernels="slot=name,..."` over its kernel table; ShardkitError naming a bad entry.

    A piece without `=` continues the previous kernel's options list: "remat=names:qkv_proj,mlp_in,norm=group" is
    remat = "names:qkv_proj,mlp_in" and norm = "group"."""
    table: dict[str, str] = {}
    last = None
    for item in filter(None, (p.strip() for p in (spec or "").split(","))):
        slot, sep, name = item.partition("=")
        if not sep and last is not None and ":" in table[last]:
            table[last] += "," + item
            continue
        if not sep or not slot.strip() or not name.strip():
            raise sk.ShardkitError(f"kernels={spec!r}: write slot=name pairs separated by commas, e.g. 'norm=group'")
        last = slot.strip()
        table[last] = name.strip()
    for slot, name in table.items():
        sk.kernels.lookup(slot, name)  # unknown slot or kernel: an error listing what exists
    sk.kernels.check(table)  # options a kernel cannot take (a remat policy's names, host offload on this backend)
    return strategy.replace(kernels=table) if table else strategy


def _choices() -> dict[str, tuple[str, ...]]:
    """Every config field with a closed set of values -> the values, from the code that reads each."""
    from shardkit.parallel import pipeline, sdp

    return {
        "model.remat": tuple(gpt.REMAT_ALIASES),
        "optimizer.name": ("adamw",),
        "pipeline.schedule": pipeline.SCHEDULES,
        "hetero.mode": ("loop", "pad"),
        "sdp.granularity": sdp.GRANULARITIES, "sdp.masking": sdp.MASKINGS, "sdp.ownership": sdp.OWNERSHIPS,
        "sdp.reduce": sdp.REDUCTIONS, "sdp.eval": sdp.EVALS,
    }  # fmt: skip


def check_choices(config: Any) -> None:
    """Every field with a closed set of values holds one of them, whether or not this run reads it (a typo in an
    unused section is still a typo), and the data's token dtype is an integer dtype: before anything is built."""
    from shardkit.parallel import pipeline

    for field, allowed in _choices().items():
        section, _, key = field.partition(".")
        if section in config and key in config[section] and config[section][key] not in allowed:
            raise sk.ShardkitError(f"{field}={config[section][key]!r}: choose one of {', '.join(allowed)}")
    cut = config.pipeline.get("stage_layers", "") if "pipeline" in config else ""
    if str(cut).strip() not in ("", "hetero"):
        pipeline.parse_cut(cut, "pipeline.stage_layers")  # counts >= 1; matched to the stages when the kernel runs
    for field in ("model.dtype", "model.param_dtype"):
        section, _, key = field.partition(".")
        value = config[section][key] if section in config and key in config[section] else "float32"
        try:
            ok = jnp.issubdtype(np.dtype(value), jnp.floating)
        except TypeError:
            ok = False
        if not ok:
            raise sk.ShardkitError(f"{field}={value!r}: give a float dtype, e.g. 'float32' or 'bfloat16'")
    if "data" in config and "bin_dtype" in config.data:
        value = config.data.bin_dtype
        try:
            ok = np.issubdtype(np.dtype(value), np.integer)
        except TypeError:
            ok = False
        if not ok:
            raise sk.ShardkitError(f"data.bin_dtype={value!r}: give the .bin files' integer token dtype, e.g. "
                                   "'uint16' (nanoGPT's) or 'uint32'")  # fmt: skip


def strategy_of(config: Any, devices: int) -> sk.Strategy:
    """The run's strategy: `--config.strategy` looked up once, here, with the config sections of its step and
    kernels (`sk.configure`), the `kernels` overrides and `strict_names`, checked. The caller binds it to the mesh
    once (`Strategy.bind`) and hands the BoundStrategy down."""
    named = sk.strategy(config.strategy)  # the one look-up of the name below the command line
    sections = config.to_dict()
    note = stage_layers(config, named, sections, devices)
    strategy = sk.configure(named, sections, devices=devices, global_batch=config.batch_size,
                            preset=mesh_preset(config))  # fmt: skip
    layers = strategy.kernels.get("layers", "")
    if "@" in layers:  # the cut the run uses: checked against the mesh and the model now, printed with the strategy
        from shardkit.parallel import pipeline

        if "model" in config and "num_layers" in config.model:
            stages = target_axes(config, devices, named).get("stage", 1)
            pipeline.stage_cut(layers, stages, config.model.num_layers)
        strategy = strategy.replace(description=f"{strategy.description}; {note}")
    strategy = with_kernels(strategy, config.get("kernels", ""))
    if "model" in config and "remat" in config.model:  # the GPT's alias and the remat kernel: one policy, or an error
        sk.layers.combine_remat(strategy.kernels.get("remat"), gpt.REMAT_ALIASES.get(config.model.remat, "none"))
    strategy = strategy.replace(offload=config.get("offload", ""))  # host offload of the state (ZeRO-Offload)
    return strategy.replace(strict_names=True) if config.get("strict_names", False) else strategy


def stage_layers(config: Any, strategy: sk.Strategy, sections: dict[str, Any], devices: int) -> str:
    """Resolves `pipeline.stage_layers="hetero"` in `sections` to layer counts: the min-max cut of the model's
    layers over the pipeline stages, each as fast as its slowest device in the hardware preset's [[groups]] (the
    mesh preset's, else `hardware`'s; `sk.hetero.hetero_stage_plan`). Returns the line describing the cut."""
    cut = str(sections.get("pipeline", {}).get("stage_layers", "") or "").strip()
    if not cut:
        return ""
    if cut != "hetero":
        return f"stage layers {cut} (given; pipeline.stage_layers)"
    if not strategy.kernels.get("layers", "").startswith("pipeline"):
        return ""  # this run has no pipeline to cut
    preset = mesh_preset(config) or resolve_preset(config.hardware)
    if preset is None or not preset.groups:
        raise sk.ShardkitError(
            f"pipeline.stage_layers='hetero' cuts the layers by the device speeds of a heterogeneous preset, but "
            f"{getattr(preset, 'name', config.hardware)!r} has no [[groups]]: give --config.hardware=hetero_v100_p100 "
            "(or another meshes/hetero_*.toml), or the counts, e.g. --config.pipeline.stage_layers=3,5"
        )
    axes = target_axes(config, devices, strategy)
    plan = sk.hetero.hetero_stage_plan(preset.device_speeds(), axes, config.model.num_layers)
    speeds = sk.hetero.stage_speeds(preset.device_speeds(), axes)
    sections["pipeline"]["stage_layers"] = ",".join(map(str, plan.counts))
    p, n = len(speeds), config.model.num_layers
    even = sk.hetero.plan_of([n // p + (s < n % p) for s in range(p)], speeds).step_time
    return (f"stage layers {','.join(map(str, plan.counts))} (hetero: min-max cut over {preset.name}'s stage speeds "
            f"{','.join(f'{v:g}' for v in speeds)}; SIMULATED slowest stage {plan.step_time:.2f} vs {even:.2f} layers "
            "per unit speed for the even cut)")  # fmt: skip


def run_app(main: Any) -> None:
    """absl's `app.run(main)`, where a config file (`--config=...`) or override that does not load or apply ends
    in one `error:` line and exit 2, as it does for the default config, instead of a traceback."""
    from absl import app, flags

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except flags.Error as e:  # absl's own: an unknown flag, a value of the wrong type (--config.steps=abc)
            print(f"error: {e}; see --help", file=sys.stderr)
            sys.exit(2)
        except (AttributeError, KeyError, OSError, TypeError, ValueError) as e:
            print(f"error: {config_error(e)}", file=sys.stderr)
            sys.exit(2)

    app.run(main, flags_parser=parse)


def config_error(e: BaseException) -> str:
    """One line for a config file or `--config.x` override that ml_collections could not load or apply."""
    text = str(e.args[0]) if e.args else str(e)
    if isinstance(e, AttributeError | KeyError):  # a field that does not exist, with ml_collections' suggestion
        name, _, hint = text.strip("'\"").replace("\\'", "'").replace("\\n", "\n").partition("\n")
        return (f"config has no field {name}{'; ' + hint.strip() if hint else ''} (every field is documented in "
                "experiments/configs/base.py and the config file)")  # fmt: skip
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    detail = next((ln for ln in reversed(lines) if ln.startswith("[Errno")), lines[-1] if lines else repr(e))
    path = next((ln for ln in lines if ln.endswith(".py")), "")
    return f"config file {path + ': ' if path else ''}{detail}"


def loaded_config(flag: Any) -> Any:
    """The config of a `DEFINE_config_file` flag, or an `error:` line and exit 2 when its file did not load
    (ml_collections defers that error to the first use of the config)."""
    config = flag.value
    try:
        config.get("task")
    except (OSError, AttributeError, TypeError, ValueError) as e:
        print(f"error: {config_error(e)}", file=sys.stderr)
        sys.exit(2)
    return config
