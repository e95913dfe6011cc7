"""How a model's stack of identical layers is applied: one call the strategy can swap (scan, or a pipeline).

Models keep their blocks as one module whose parameters have a leading `layers` dimension and call

    x = sk.layers.apply_stack(block_fn, stacked_state, x, positions, segment_ids, remat="none")

with `block_fn(layer_state, x, *args) -> x`; `args` are per-example arrays ([batch, ...], or None) that travel
with `x`. The default kernel is a `lax.scan` (compile time independent of depth). A strategy whose `layers`
kernel table names another `layers` kernel (e.g. a pipeline schedule) gets the same call instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardkit import kernels
from shardkit.errors import ShardkitError

REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block in backward
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep matmul outputs, recompute the rest
}

BlockFn = Callable[..., jax.Array]
StackKernel = Callable[..., jax.Array]


def register_stack(name: str, fn: StackKernel) -> None:
    """A strategy with `kernels={"layers": name}` makes `apply_stack` call
    `fn(block_fn, stacked, x, *args, remat, context)`; a name may carry options after a colon ("pipeline:1f1b")."""
    kernels.register("layers", name, fn)


def scan_stack(
    block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """x -> block_fn(stacked[L-1], ... block_fn(stacked[0], x, *args) ..., *args) as one `lax.scan`."""

    def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return block_fn(layer, x, *args), None

    if REMAT_POLICIES[remat] is not None:
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    return jax.lax.scan(body, x, stacked)[0]


register_stack("scan", scan_stack)


def apply_stack(block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none") -> jax.Array:
    """Applies the L stacked layers to x with the kernel the active strategy chose (default: scan)."""
    if remat not in REMAT_POLICIES:
        raise ShardkitError(f"remat={remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
    kernel, _, ctx = kernels.active("layers")
    return kernel.fn(block_fn, stacked, x, *args, remat=remat, context=ctx)
