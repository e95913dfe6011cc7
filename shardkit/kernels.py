"""Kernel slots: the one registry of swappable implementations a strategy picks by name.

A model calls a slot's entry point (`sk.attention.attend`, `sk.layers.apply_stack`, ...) and the strategy's
`kernels` table says which implementation runs there, e.g.

    sk.strategy("cp_zigzag").kernels == {"attention": "ring:zigzag", "layers": "scan"}

A kernel is registered once under `(slot, name)`; a name may carry options after a colon ("pipeline:1f1b:8"),
looked up by the longest registered prefix. A kernel that needs the data in a particular layout (ring
attention's zigzag / striped permutation of the sequence) declares it with `layout=`, and the data loader asks
`batch_layout(strategy, mesh)` instead of parsing kernel names. New slots (convolution, MoE dispatch) are new
`register` calls; nothing in the core changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jax.sharding import Mesh

from shardkit.errors import ShardkitError

#: (layout name, ring size) the batch must be laid out in; ("contiguous", 1) = as it comes.
Layout = tuple[str, int]
LayoutFn = Callable[[str, Mesh], Layout]  # (full kernel name, mesh) -> layout

#: The default implementation of each built-in slot (a strategy that names no kernel for a slot gets this).
DEFAULTS: dict[str, str] = {"attention": "dense", "layers": "scan"}


@dataclasses.dataclass(frozen=True)
class Kernel:
    slot: str
    name: str
    fn: Callable[..., Any]
    layout: LayoutFn | None = None
    description: str = ""
    #: (full name, a run's options for this kernel) -> full name: `sk.configure` applies the config section named
    #: after the kernel (e.g. `pipeline`: schedule, microbatches) to a strategy that uses it
    configure: Callable[[str, dict], str] | None = None
    #: full name -> a ShardkitError for options the kernel cannot run with (`check` calls it, before any trace)
    check: Callable[[str], Any] | None = None


_REGISTRY: dict[str, dict[str, Kernel]] = {}


def register(
    slot: str, name: str, fn: Callable[..., Any], *, layout: LayoutFn | None = None, description: str = "",
    configure: Callable[[str, dict], str] | None = None, check: Callable[[str], Any] | None = None,
) -> Kernel:  # fmt: skip
    """Registers `fn` as implementation `name` of `slot` (replacing one of the same name)."""
    kernel = Kernel(slot, name, fn, layout, description, configure, check)
    _REGISTRY.setdefault(slot, {})[name] = kernel
    return kernel


def available(slot: str) -> list[str]:
    """Names registered for `slot`."""
    return sorted(_REGISTRY.get(slot, {}))


def slots() -> list[str]:
    return sorted(_REGISTRY)


def lookup(slot: str, name: str) -> Kernel:
    """The kernel `name` (or its longest registered prefix before a ':') of `slot`; ShardkitError if none."""
    table = _REGISTRY.get(slot, {})
    probe = name
    while True:
        if probe in table:
            return table[probe]
        if ":" not in probe:
            break
        probe = probe.rsplit(":", 1)[0]
    raise ShardkitError(
        f"kernel {name!r} is not registered for slot {slot!r}; available: {', '.join(available(slot)) or 'none'} "
        f"(register one with sk.kernels.register({slot!r}, name, fn))"
    )


def active(slot: str) -> tuple[Kernel, str, Any]:
    """(kernel, its full name, the tracing context) for `slot` under the active train step (default outside)."""
    from shardkit.rules import current_context  # rules imports nothing from here

    ctx = current_context()
    name = ctx.kernels.get(slot, DEFAULTS.get(slot)) if ctx is not None else DEFAULTS.get(slot)
    if name is None:
        raise ShardkitError(f"no kernel chosen for slot {slot!r} and it has no default; set kernels={{{slot!r}: ...}}")
    return lookup(slot, name), name, ctx


def check(kernels: Mapping[str, str]) -> None:
    """Every (slot, name) of a strategy's table names a registered kernel (slots not registered yet are kept:
    a model's own slot may be registered after the strategy is defined), and its options are ones it can run
    with (the kernel's own `check`, e.g. a remat policy's tagged names or host offload on this backend)."""
    for slot, name in kernels.items():
        if slot in _REGISTRY:
            kernel = lookup(slot, name)
            if kernel.check is not None:
                kernel.check(name)


def batch_layout(strategy: Any, mesh: Mesh) -> Layout:
    """The (layout, ring size) a strategy's kernels need the batch's sequence in; ("contiguous", 1) if none."""
    found = [(k.layout(name, mesh), slot) for slot, name in strategy.kernels.items() if slot in _REGISTRY
             for k in [lookup(slot, name)] if k.layout is not None]  # fmt: skip
    found = [(lay, slot) for lay, slot in found if lay[0] != "contiguous"]
    if len(found) > 1:
        raise ShardkitError(f"kernels {strategy.kernels} need two data layouts {found}; at most one can be applied")
    return found[0][0] if found else ("contiguous", 1)


@dataclasses.dataclass(frozen=True)
class Traced:
    """One kernel call's explicit collectives, reported while it is traced (what GSPMD's tables cannot predict)."""

    slot: str
    layer: str  # the layer's name
    collective: str  # the HLO kind its forward issues, e.g. "collective-permute"
    sends: tuple[tuple[str, int], ...]  # (mesh axis, bytes sent per device), one entry per collective, forward
    backward: bool  # the transposed collectives run too (the kernel's input is differentiated)
    source: str = ""  # the function that computes `sends`, for the reader of a prediction
    detail: Any = None  # the kernel's own record (a spatial halo exchange's plan, ...)


_TRACED: contextvars.ContextVar[tuple[list[Traced], ...] | None] = contextvars.ContextVar(
    "shardkit_traced", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Traced]]:
    """Collects a `Traced` for every kernel call that reports its collectives while traced in this block.

    with sk.kernels.recording() as calls:
        step.lower(state, batch)
    """
    found: list[Traced] = []
    token = _TRACED.set((*(_TRACED.get() or ()), found))  # nested blocks: each collects what is traced in it
    try:
        yield found
    finally:
        _TRACED.reset(token)


def is_recording() -> bool:
    """Whether a `recording()` block is collecting (a kernel skips computing its report otherwise)."""
    return _TRACED.get() is not None


def record(call: Traced) -> None:
    """Reports one kernel call to the enclosing `recording()` blocks' list (nothing outside one)."""
    for found in _TRACED.get() or ():
        found.append(call)


__all__ = ["DEFAULTS", "Kernel", "Layout", "Traced", "active", "available", "batch_layout", "check", "is_recording",
           "lookup", "record", "recording", "register"]  # fmt: skip
