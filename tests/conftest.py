"""8 virtual CPU devices and a persistent compile cache, set before anything imports jax."""

import os
import pathlib
import sys

# LLVM's optimisation passes are most of XLA:CPU's compile time and none of what the tests check: the HLO after
# SPMD partitioning (collectives, bytes) is the same, and numerics are compared between programs compiled alike.
# Off here, the suite compiles ~2.5x faster (tests/test_parity.py + test_structure.py: 174 s -> 67 s, cold cache).
# Users' runs keep XLA's defaults. Subprocesses (experiments, notebooks, launch_local) inherit these flags.
FAST_COMPILE = " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + FAST_COMPILE
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # models/, meshes/ and experiments/ are used from the repository root

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("SHARDKIT_JAX_CACHE", str(ROOT / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.devices()}"
