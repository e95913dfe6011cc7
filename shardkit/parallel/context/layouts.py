"""Sequence layouts for context parallelism: which tokens each of the N ring ranks holds.

A layout is a permutation of the sequence dimension. The array in layout order, split into N equal contiguous
blocks, gives rank r its block r, so `seq`-sharding a laid-out array puts every token where the kernel expects
it. With c = S / N tokens per rank:

    contiguous   rank r holds tokens [r c, (r + 1) c)                    (Liu et al. 2310.01889)
    zigzag       S in 2N chunks of c/2; rank r holds chunks r and 2N-1-r  (balanced causal work)
    striped      token i on rank i mod N at local index i // N            (Brandon et al. 2311.09431)

`to_layout` / `from_layout` are exact gathers usable outside `shard_map`; `layout_batch` permutes every
[batch, seq] entry of a training batch the same way and adds the original `positions` (RoPE must see them).
The next-token loss is a mean over tokens, so it is unchanged by the permutation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from shardkit.errors import ShardkitError

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout: str, seq: int, n: int, what: str = "sequence") -> None:
    """Raises ShardkitError unless `seq` tokens can be laid out over `n` ranks in `layout`."""
    if layout not in LAYOUTS:
        raise ShardkitError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    need = 2 * n if layout == "zigzag" else n
    if n < 1 or seq % need:
        fix = (seq // need + 1) * need
        raise ShardkitError(
            f"{what} length {seq} is not divisible by {need} ({'2 x ' if layout == 'zigzag' else ''}ring size {n}"
            f"{', zigzag splits it into 2N chunks' if layout == 'zigzag' else ''}); pad or crop it to a multiple "
            f"of {need} (e.g. {fix}), or use a ring of a size that divides it"
        )


def layout_perm(layout: str, seq: int, n: int) -> np.ndarray:
    """int[seq]: the global token index at each position of the laid-out sequence (x_l = x[perm])."""
    check_layout(layout, seq, n)
    if layout == "contiguous":
        return np.arange(seq)
    if layout == "striped":
        return np.arange(seq).reshape(seq // n, n).T.reshape(-1)
    chunks = np.arange(seq).reshape(2 * n, seq // (2 * n))
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * n - 1 - r]]) for r in range(n)])


def block_positions(layout: str, n: int, rank: jax.Array | int, c: int) -> jax.Array:
    """int32[c]: global token indices of the block rank `rank` (traced or static) holds, from the layout formula."""
    i = jnp.arange(c, dtype=jnp.int32)
    rank = jnp.asarray(rank, jnp.int32)
    if layout == "contiguous":
        return rank * c + i
    if layout == "striped":
        return i * n + rank
    h = c // 2
    return jnp.where(i < h, rank * h + i, (2 * n - 1 - rank) * h + i - h)


def _ring_size(mesh: Mesh | None, axis: str | None, n: int | None) -> int:
    if n is not None:
        return n
    if mesh is None or axis is None:
        raise ShardkitError("give the ring size: mesh= and axis= (the ring's mesh axis), or n=")
    if axis not in mesh.shape:
        raise ShardkitError(
            f"mesh axis {axis!r} is not in the mesh {dict(mesh.shape)}; add it (e.g. '{axis}=4') or pass axis="
        )
    return mesh.shape[axis]


def to_layout(
    x: jax.Array,
    layout: str,
    mesh: Mesh | None = None,
    axis: str | None = "seq",
    *,
    n: int | None = None,
    seq_dim: int = 1,
) -> jax.Array:
    """[..., S (natural order), ...] -> [..., S (layout order), ...] for a ring of mesh.shape[axis] (or n) ranks."""
    n = _ring_size(mesh, axis, n)
    return jnp.take(x, jnp.asarray(layout_perm(layout, x.shape[seq_dim], n)), axis=seq_dim)


def from_layout(
    x: jax.Array,
    layout: str,
    mesh: Mesh | None = None,
    axis: str | None = "seq",
    *,
    n: int | None = None,
    seq_dim: int = 1,
) -> jax.Array:
    """[..., S (layout order), ...] -> [..., S (natural order), ...]; the exact inverse of `to_layout`."""
    n = _ring_size(mesh, axis, n)
    inverse = np.argsort(layout_perm(layout, x.shape[seq_dim], n))
    return jnp.take(x, jnp.asarray(inverse), axis=seq_dim)


def layout_batch(batch: Mapping[str, Any], layout: str, n: int) -> dict[str, Any]:
    """{name: [B, T]} in natural order -> the same entries in layout order, plus `positions` if absent.

    Inputs, targets, positions and segment ids move together, so every (input, target) pair and its position
    stay aligned; numpy in, numpy out (jax arrays stay jax arrays).
    """
    first = next(iter(batch.values()))  # every entry is [batch, seq]: any one gives the shape
    b, t = np.shape(first)[:2]
    out = dict(batch)
    if "positions" not in out:
        xp = jnp if isinstance(first, jax.Array) else np
        out["positions"] = xp.broadcast_to(xp.arange(t, dtype=np.int32), (b, t))
    perm = layout_perm(layout, t, n)
    for key, value in out.items():
        if np.shape(value)[:2] != (b, t):
            raise ShardkitError(
                f"batch[{key!r}] has shape {np.shape(value)}; every entry must be [batch, seq] = {(b, t)}"
            )
        out[key] = value[:, perm]
    return out


def strategy_layout(attention: str, mesh: Mesh) -> tuple[str, int]:
    """(layout, ring size) the data must be in for an attention kernel name ('ring:zigzag', 'usp:striped', …).

    The layout is the kernel's own declaration (`shardkit.kernels`); for a whole strategy use
    `sk.kernels.batch_layout(strategy, mesh)`.
    """
    from shardkit import kernels  # the attention kernels register themselves on import of shardkit.attention

    kernel = kernels.lookup("attention", attention)
    return kernel.layout(attention, mesh) if kernel.layout is not None else ("contiguous", 1)
