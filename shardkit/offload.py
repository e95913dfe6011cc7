"""Host offload of the training state (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840): `Strategy.offload`.

    strategy = sk.strategy("fsdp").replace(offload=("opt_state",))     # or ("opt_state", "params")
    python -m experiments.train --config.offload=opt_state,params

What is offloaded rests between steps in the devices' host memory kind (`pinned_host`): the arrays keep their
strategy's shardings, only their memory kind differs (`NamedSharding.with_memory_kind`). The train step brings it
to device memory where it is used (`to_device`: a `jax.device_put` inside the jitted step, which XLA turns into a
host-to-device copy) and the step's output shardings put the new values back. Pure data movement: the step computes
the same numbers as without offload. Its price is the transfers, each step, both ways; its gain is that the
offloaded arrays occupy device memory only while the step runs (XLA may overlap the copies with compute).

Which backends can: those whose devices list a `pinned_host` memory besides their default one
(`device.addressable_memories()`): GPUs and TPUs, and the CPU backend in jax >= 0.10 (there host and device memory
are the same RAM, but the compiled program keeps the two memory spaces apart: the entry layout marks the
offloaded arguments `S(5)`, and `host_bytes` reads them back). Elsewhere `check` refuses with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardkit.errors import ShardkitError
from shardkit.hlo import shape_bytes
from shardkit.rules import platform_family

#: What a strategy may offload: the optimizer state (ZeRO-Offload), and the parameters.
CHOICES = ("opt_state", "params")
#: The memory kind offloaded state rests in, and the kind the step computes in.
HOST, DEVICE = "pinned_host", "device"
_HOST_SPACE = re.compile(r"\b[a-z][a-z0-9]*\[[^\]]*\]\{[^}]*S\(5\)[^}]*\}")  # XLA's host memory space is S(5)


def parse(offload: str | Sequence[str] | None) -> tuple[str, ...]:
    """("opt_state", "params") from "opt_state,params", a sequence of names, or ""/None (nothing); a ShardkitError
    naming an unknown part and the choices."""
    parts = offload.split(",") if isinstance(offload, str) else list(offload or ())
    names = tuple(dict.fromkeys(str(p).strip() for p in parts if str(p).strip()))
    bad = [n for n in names if n not in CHOICES]
    if bad:
        raise ShardkitError(
            f"offload={offload!r}: {bad[0]!r} cannot be offloaded; choose from {', '.join(CHOICES)} "
            "(comma-separated, e.g. 'opt_state,params'), or '' for none"
        )
    return names


def unsupported(devices: Sequence[Any]) -> str:
    """Why `devices` cannot hold arrays in `HOST` memory ("" if they can)."""
    device = devices[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
        default = device.default_memory().kind
    except Exception as e:  # a backend without memory spaces
        return f"its devices report no memory spaces ({type(e).__name__}: {e})"
    if HOST not in kinds:
        return f"its devices have memory kinds {sorted(kinds)}, no {HOST!r}"
    if default == HOST:
        return f"its devices' default memory is already {HOST!r}"
    return ""


def check(offload: tuple[str, ...], mesh: jax.sharding.Mesh, step_name: str) -> tuple[str, ...]:
    """`offload` if this mesh's backend and this train step can offload it; a ShardkitError with the reason."""
    if not offload:
        return offload
    if step_name != "gspmd":
        raise ShardkitError(
            f"offload={','.join(offload)}: the {step_name!r} train step keeps its state on the devices; host offload "
            "is implemented by the GSPMD step (strategies with step='gspmd'). Set offload to '' for this strategy"
        )
    why = unsupported(list(mesh.devices.flat))
    if why:
        platform = platform_family(mesh)
        raise ShardkitError(
            f"offload={','.join(offload)}: the {platform!r} backend cannot keep arrays in host memory: {why}. "
            "Set offload to '' (keep the state on the devices), or shard it further (fsdp, zero1)"
        )
    return offload


def host_shardings(shardings: Any) -> Any:
    """The same shardings in `HOST` memory."""
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), shardings)


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside a jitted step: `tree`'s arrays moved from host memory to device memory, in `shardings` (device kind)."""
    return jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(DEVICE), shardings))


def host_bytes(compiled: Any) -> dict[str, int]:
    """Per device, the bytes of the compiled program's arguments and outputs in host memory (space S(5) in its entry
    layout), and `memory_analysis()`'s own host figures where the backend reports them (0 on XLA:CPU)."""
    args, _, outs = _entry_layout(compiled.as_text()).partition(")->")
    measure = lambda s: sum(shape_bytes(m.group(0)) for m in _HOST_SPACE.finditer(s))
    ma = compiled.memory_analysis()
    return {"host_arguments": measure(args), "host_outputs": measure(outs),
            "analysis_host_arguments": int(getattr(ma, "host_argument_size_in_bytes", 0) or 0),
            "analysis_host_temp": int(getattr(ma, "host_temp_size_in_bytes", 0) or 0)}  # fmt: skip


def _entry_layout(text: str) -> str:
    """The module's `entry_computation_layout={...}` (its braces matched), "" when absent."""
    start = text.find("entry_computation_layout={")
    if start < 0:
        return ""
    i, depth = start + len("entry_computation_layout="), 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return ""


def is_host(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and sharding.memory_kind == HOST


def on_device(tree: Any) -> Any:
    """Outside jit: `tree` with its arrays in host memory copied to device memory (the others as they are), for
    computations on a state that may be offloaded (a checkpoint's checksums: XLA computes on device memory only)."""
    move = lambda x: jax.device_put(x, x.sharding.with_memory_kind(DEVICE)) if is_host(getattr(x, "sharding", 0)) else x
    return jax.tree.map(move, tree)
