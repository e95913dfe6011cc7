"""8 virtual CPU devices and a persistent compile cache, set before anything imports jax."""

import importlib.metadata
import os
import pathlib
import sys

# LLVM's optimisation passes are most of XLA:CPU's compile time and none of what the tests check: the HLO after
# SPMD partitioning (collectives, bytes) is the same, and numerics are compared between programs compiled alike.
# Off here, the suite compiles ~2.5x faster (tests/test_parity.py + test_structure.py: 174 s -> 67 s, cold cache).
# XLA:CPU's newer MLIR fusion emitters take 2-4x longer to compile a step than its elemental emitters (a GPT
# train step under fsdp_tp on 8 devices: 1.1 s -> 0.3 s; under cp_zigzag 2.0 s -> 1.0 s); both are XLA's own
# code generators for the same fused HLO, so the tests compare the same programs, compiled faster.
# Users' runs keep XLA's defaults. Subprocesses (experiments, notebooks, launch_local) inherit these flags.
# jaxlib 0.12 has no such flag (XLA aborts on an unknown one), hence the version test.
FAST_COMPILE = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + FAST_COMPILE
# The tests run on the host's CPU (8 virtual devices); TPU targets are compiled for through libtpu's topology
# description, which needs no TPU backend (shardkit/targets.py). Without this, libtpu (in the dev extras) would probe
# for a chip when jax starts its backends below, before `import shardkit` can keep it on the host's platforms.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")  # one libtpu per pytest-xdist worker
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # models/, meshes/ and experiments/ are used from the repository root

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("SHARDKIT_JAX_CACHE", str(ROOT / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.devices()}"


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per core, at most 4. Each worker is a process with its own 8
    virtual devices; XLA:CPU compiles on one thread, so one process kept 2 cores ~54% busy (954 s of CPU in 880 s)
    and a second worker uses the idle core (docs/performance.md, "The test suite"). Each worker holds up to
    ~5 GB; more than 4 mostly adds memory."""
    return max(1, min(4, os.cpu_count() or 1))


#: The files that take longest (seconds of a cold run on 2 cores, 2026-12-07), started first: pytest-xdist's
#: `--dist loadfile` hands files out in collection order, so a heavy file last kept one core busy while the other
#: idled (about 30 s of a 700 s run). The rest keep their order.
HEAVY_FIRST = (
    "test_matrix_lm",
    "test_matrix_tpu",
    "test_multiprocess",
    "test_costmodel_tpu",
    "test_spatial",
    "test_context_parallel",
    "test_experiments",
    "test_pipeline",
    "test_moe",
    "test_matrix_vision",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest as collected
