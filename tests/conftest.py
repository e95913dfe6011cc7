"""8 virtual CPU devices and a persistent compile cache, set before anything imports jax."""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # models/, meshes/ and experiments/ are used from the repository root

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ.get("SHARDKIT_JAX_CACHE", str(ROOT / ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.devices()}"
