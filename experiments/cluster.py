"""Which cluster started this process: JAX's own detectors (`jax._src.clusters`), asked in JAX's order.

`jax.distributed.initialize()` with no arguments walks the `ClusterEnv` subclasses JAX defines (Open MPI, Slurm,
the Cloud TPU VM and GKE TPU detectors, Kubernetes; mpi4py only when asked for) and takes the first whose
`is_env_present()` is true. `detect()` asks the same question first, so the run can say which environment matched
(and which process it is) before it waits on the coordinator, and the error when none matched lists what was
looked for (`looked_for()`). The detectors live in a private module (the same interface in jax 0.10 and 0.12; 0.12
adds TPU_PROCESS_ADDRESSES_PATH and sends Open MPI 5 to mpi4py): where it cannot be imported, `detect()` returns
None and `looked_for()` says so; `jax.distributed.initialize()` still runs its own detection then.

`slurm_hosts("node[001-004,007]")` expands a Slurm host list (the first host is the coordinator JAX picks).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

#: what each of JAX's detectors reads (for the messages; the detectors themselves decide)
WHAT = {
    "OmpiCluster": "Open MPI's mpirun (OMPI_MCA_orte_hnp_uri)",
    "SlurmCluster": "Slurm's srun (SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID)",
    "Mpi4pyCluster": "mpi4py (only with cluster_detection_method='mpi4py')",
    "GceTpuCluster": "a Cloud TPU VM (the metadata server's agent-worker-number; not with TPU_SKIP_MDS_QUERY)",
    "GkeTpuCluster": "a GKE TPU pod (TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES on a TPU host)",
    "K8sCluster": "a Kubernetes Indexed Job / JobSet (KUBERNETES_SERVICE_HOST and the `kubernetes` package)",
}
#: a launcher that starts several processes sets one of these (the automatic start asks the detectors only then)
LAUNCHER_VARIABLES = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                      "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_ADDRESSES_PATH", "JOB_COMPLETION_INDEX")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Found:
    """The environment that matched: JAX's class name, what it reads, and (when it can say) this process's place."""

    name: str
    what: str
    process_id: int | None
    process_count: int | None
    coordinator: str | None = None  # where JAX will look for it (asked only of the detectors that compute it locally)

    def describe(self) -> str:
        place = f"process {self.process_id} of {self.process_count}" if self.process_count else "process ? of ?"
        at = f", coordinator {self.coordinator}" if self.coordinator else ""
        return f"{self.name} matched ({self.what}): {place}{at}"


def _envs() -> list[Any] | None:
    """JAX's ClusterEnv subclasses in its detection order, or None where the private module is not there."""
    try:
        from jax._src import clusters

        return [e for e in clusters.ClusterEnv._cluster_types if e.__name__ in WHAT or e.__name__.endswith("Cluster")]
    except (ImportError, AttributeError):
        return None


def available() -> bool:
    """Whether JAX's detectors could be read (else `jax.distributed.initialize()` is left to detect alone)."""
    return _envs() is not None


def _ask(method: Any) -> int | None:
    try:
        return int(method())
    except Exception:  # a detector that needs the network or a package: JAX will ask again, and say why
        return None


def detect() -> Found | None:
    """The first environment JAX would pick (opt-in ones skipped, as JAX does without a detection method), or None."""
    for env in _envs() or []:
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            present = bool(env.is_env_present())
        except Exception:  # a detector that fails is not this environment (JAX's own call would fail the same way)
            present = False
        if present:
            name, coordinator = env.__name__, None
            if name in ("SlurmCluster", "OmpiCluster"):  # computed from variables (the others wait on DNS or an API)
                if name == "SlurmCluster":
                    slurm_hosts(os.environ.get("SLURM_STEP_NODELIST", ""))  # a list JAX would misread: said here
                try:
                    port = os.environ.get("JAX_COORDINATOR_PORT")
                    coordinator = env.get_coordinator_address(timeout_secs=None, override_coordinator_port=port)
                except Exception:
                    coordinator = None
            return Found(name, WHAT.get(name, name), _ask(env.get_process_id), _ask(env.get_process_count),
                         coordinator)  # fmt: skip
    return None


def looked_for() -> str:
    """What JAX's detection checked, for the error when nothing matched."""
    envs = _envs()
    if envs is None:
        return "JAX's cluster detectors (jax._src.clusters could not be imported in this jax version)"
    return "; ".join(WHAT.get(e.__name__, e.__name__) for e in envs if e.__name__ != "BaseTpuCluster")


def launched_several() -> bool:
    """Whether a launcher started several processes of this command, so the run joins them without being told
    (`--config.distributed=True` is not needed): JAX's detector matched and counts more than one process. Under
    Slurm only inside an `srun` step (SLURM_STEP_ID): a batch script's own shell also carries SLURM_NTASKS."""
    if "SLURM_JOB_ID" in os.environ and "SLURM_STEP_ID" not in os.environ:
        return False
    if not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return False  # no launcher's variable: no detector is asked (a plain run starts at once)
    found = detect()
    return found is not None and (found.process_count or 1) > 1


def slurm_hosts(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names: "node[001-004,007],gpu7" -> node001..node004, node007, gpu7
    (zero padding kept). A ValueError names a list it cannot read."""
    items, depth, cur = [], 0, ""
    for ch in nodelist.strip():  # split at the commas outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"Slurm node list {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items, cur = [*items, cur], ""
        else:
            cur += ch
    hosts: list[str] = []
    for item in [*items, cur]:
        m = re.fullmatch(r"([^\[\]]*)\[([\d,-]+)\]([^\[\]]*)", item)
        if m is None:
            if not item or "[" in item or "]" in item:
                raise ValueError(f"Slurm node list {nodelist!r}: cannot read {item!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
                raise ValueError(f"Slurm node list {nodelist!r}: cannot read the range {part!r}")
            hosts += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts
