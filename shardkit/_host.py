"""Starting JAX quietly on a host without the accelerator a compiler plugin is installed for (shardkit/targets.py's
keep_host_platforms): is a GPU attached, and JAX's CUDA plugin loaded with its driver-search log lines held back.
`import shardkit` imports this module first (its name sorts first), and importing it imports jax that way
(import_jax_quietly, at the end), before anything else imports jax."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


def pci_vendors() -> list[pathlib.Path]:
    return list(pathlib.Path("/sys/bus/pci/devices").glob("*/vendor"))


def gpu_attached() -> bool:
    """An NVIDIA or AMD GPU on this host: its driver's device files (/dev/nvidia0, /dev/kfd), or a display / 3D
    controller (PCI class 0x03) of NVIDIA (vendor 0x10de) on the PCI bus."""
    if any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/kfd")):
        return True
    try:
        return any(
            p.read_text().strip() == "0x10de" and (p.parent / "class").read_text().startswith("0x03")
            for p in pci_vendors()
        )
    except OSError:
        return False


def _register_plugins_quietly() -> None:
    """JAX registers its PJRT plugins when it starts its backends; the CUDA plugin's libraries then log "Could not
    find cuda drivers on your machine" three or four times (C++ logging, file descriptor 2) on a host without a GPU.
    Registering them now, with those lines held back, leaves the backends unstarted (JAX_PLATFORMS still applies, and
    jax.distributed.initialize can still run). The lines are shown if registration fails."""
    from jax._src import xla_bridge

    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:  # another jax: left to JAX's start-up (its log lines stay)
        _without_cuda_noise(register)


def import_jax_quietly() -> None:
    """`import jax` with JAX's CUDA plugin installed on a host without a GPU: the plugin's libraries log "Could not
    find cuda drivers on your machine, GPU will not be used" three times as JAX imports them (C++ logging, before
    `import shardkit` could do anything about it). Called first thing in `import shardkit`: when jax is not imported
    yet there, it is imported with those lines (only those) held back. Scripts that want a quiet start import
    shardkit before jax."""
    if "jax" in sys.modules or gpu_attached() or not _cuda_plugin():
        return
    _without_cuda_noise(lambda: importlib.import_module("jax"))


_CUDA_NOISE = re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers|log messages before absl::InitializeLog")


def _without_cuda_noise(fn: Callable[[], Any]) -> None:
    """Runs `fn` with file descriptor 2 held; writes back what it said there except the CUDA stub's lines."""
    with _stderr_kept() as said:
        try:
            fn()
        finally:
            kept = "".join(line for line in said().splitlines(keepends=True) if not _CUDA_NOISE.search(line))
    if kept:
        sys.stderr.write(kept)
        sys.stderr.flush()


def _cuda_plugin() -> bool:
    return any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


@contextlib.contextmanager
def _stderr_kept() -> Iterator[Callable[[], str]]:
    """Holds what C++ code writes to file descriptor 2 meanwhile; yields a function that returns it."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as buf:
        saved = os.dup(2)
        os.dup2(buf.fileno(), 2)
        try:
            yield lambda: (buf.seek(0), buf.read().decode(errors="replace"))[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


import_jax_quietly()  # at import: `import shardkit` imports this module before any other (shardkit/__init__.py)
