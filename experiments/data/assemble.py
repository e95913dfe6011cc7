"""One way to build a global batch: each addressable device's block read once, however the mesh lays it out.

Every data source (images, text, volumes) hands `global_array` a `read(spans)` that returns the block of the global
array covering `spans` (one `(start, stop)` per dimension). JAX's `make_array_from_callback` asks for the block of
each addressable device, so a process reads only what its own devices hold, and the result equals the
single-process batch whatever the process count; devices that hold the same block (replicas over some mesh axes)
share one read. It also covers meshes that interleave processes along a sharded dimension, where a process's data
is no dense box (`make_array_from_process_local_data` would need one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

Spans = tuple[tuple[int, int], ...]  # (start, stop) per dimension, step 1


def spans_of(index: tuple[slice, ...], shape: Sequence[int]) -> Spans:
    """A device's block (`addressable_devices_indices_map`'s slices) as (start, stop) per dimension."""
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"unexpected shard index {index}: only contiguous blocks are laid out")
        out.append((start, stop))
    return tuple(out)


def global_array(
    shape: Sequence[int], sharding: jax.sharding.Sharding, read: Callable[[Spans], np.ndarray], dtype: type = np.float32
) -> jax.Array:
    """The global array of `shape` laid out by `sharding`, each addressable device's block `read(spans)`, each
    distinct block read once."""
    shape = tuple(int(n) for n in shape)
    blocks: dict[Spans, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        spans = spans_of(index, shape)
        if spans not in blocks:
            block = np.asarray(read(spans)).astype(dtype, copy=False)
            want = tuple(b - a for a, b in spans)
            if block.shape != want:
                raise ValueError(f"read({spans}) gave a block of shape {block.shape}, expected {want}")
            blocks[spans] = block
        return blocks[spans]

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def global_arrays(
    shape: Sequence[int], sharding: jax.sharding.Sharding, read: Callable[[Spans], dict[str, np.ndarray]],
    keys: Sequence[str], dtype: type = np.int32,
) -> dict[str, jax.Array]:  # fmt: skip
    """Global arrays of one shape and sharding (a text batch's inputs, targets, positions, ...) whose blocks come
    from one `read(spans) -> {key: block}` per distinct block."""
    reads: dict[Spans, dict[str, np.ndarray]] = {}

    def block(spans: Spans, key: str) -> np.ndarray:
        if spans not in reads:
            reads[spans] = read(spans)
        return reads[spans][key]

    return {k: global_array(shape, sharding, lambda spans, k=k: block(spans, k), dtype) for k in keys}


__all__ = ["Spans", "global_array", "global_arrays", "spans_of"]
