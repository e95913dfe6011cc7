"""The ring's skeleton, shared by its block kernels (ring.py's scan, ring_fused.py's fused kernels): the static
config of one call and the loop that passes K, V (and dK, dV) one rank on per step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax import lax

from shardkit.parallel.context.layouts import block_positions


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static choices of one kernel call (hashable: it is the custom_vjp's non-differentiable argument)."""

    axis: str | None  # ring mesh axis (None: no ring, one device's full sequence, as inside Ulysses)
    n: int  # ring size
    layout: str
    causal: bool
    chunk_q: int
    chunk_k: int
    block: str = "xla"  # the block kernel (blocks.py): "xla" is ring.py's scan; splash / flash / cudnn fused
    platform: str = "cpu"  # of the devices compiled for: a Mosaic kernel is interpreted off TPU


def ring_loop(cfg: RingConfig, step: Any, travelling: tuple, carry: Any, returning: int = 0) -> Any:
    """Runs step(t, travelling, carry) for t = 0..N-1, passing `travelling` to rank r+1 between steps.

    The next block is sent before this step's compute so that the transfer can overlap it; the trailing
    `returning` entries of `travelling` (dK, dV) are updated by `step` and take one more hop home at the end.
    """
    perm = [(i, (i + 1) % cfg.n) for i in range(cfg.n)]
    send = lambda x: lax.ppermute(x, cfg.axis, perm) if x else x
    if cfg.n > 1:

        def body(t: jax.Array, state: tuple) -> tuple:
            travelling, carry = state
            ahead = send(travelling[: len(travelling) - returning])
            back, carry = step(t, travelling, carry)
            return (*ahead, *send(back)), carry

        travelling, carry = lax.fori_loop(0, cfg.n - 1, body, (travelling, carry))
    back, carry = step(cfg.n - 1, travelling, carry)
    return (send(back) if cfg.n > 1 else back), carry


def prepare(cfg: RingConfig, q: jax.Array) -> tuple:
    """(rank, global positions of the local query block, softmax scale 1/sqrt(d))."""
    c, d = q.shape[1], q.shape[3]
    rank = lax.axis_index(cfg.axis) if cfg.axis is not None and cfg.n > 1 else 0
    qpos = block_positions(cfg.layout, cfg.n, rank, c)
    return rank, qpos, (1.0 / math.sqrt(d))


def lse_vjp(forward: Any, backward: Any) -> Any:
    """f(cfg, q, k, v, seg) -> o as a `custom_vjp` from `forward(cfg, q, k, v, seg) -> (o, lse)` and
    `backward(cfg, (q, k, v, seg, o, lse), do) -> (dq, dk, dv, None)`: what a ring kernel saves is its inputs, its
    output and the log-sum-exp of each query row, whichever block kernel computes them (ring.py, ring_fused.py)."""
    fn = jax.custom_vjp(lambda cfg, q, k, v, seg: forward(cfg, q, k, v, seg)[0], nondiff_argnums=(0,))

    def fwd(cfg: RingConfig, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any) -> tuple:
        o, lse = forward(cfg, q, k, v, seg)
        return o, (q, k, v, seg, o, lse)

    fn.defvjp(fwd, backward)
    return fn
