"""Sharded global batches of volumes: each addressable device generates or reads only its batch rows x its
spatial block (experiments/data/assemble.py builds the arrays)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from experiments.data.assemble import Spans, global_array
from experiments.data.volumes.checks import Block, _check_int
from experiments.data.volumes.cosmo import CosmoSpec, cosmo_block, cosmo_params
from experiments.data.volumes.seg import SegSpec, _seg_label_block, seg_block


def global_batch(
    fn: Callable[[int, Block], np.ndarray],
    indices: Sequence[int],
    shape: Sequence[int],
    sharding: jax.sharding.Sharding,
    dtype=np.float32,
) -> jax.Array:
    """A global array [len(indices), D, H, W, (C...)] of shape `shape` laid out by `sharding`
    (`assemble.global_array`): each addressable device generates only its own block
    (its batch slice of `indices` × its spatial slices), never the whole sample. `fn(index, block)` returns
    one sample's block with the trailing dims.

    Trailing dims (after W) are generated whole by ``fn`` and sliced if ``sharding`` splits them. Devices holding
    the same shard (replication over some mesh axes) share one call of ``fn`` per sample.
    """
    indices = [_check_int("batch index", i, 0) for i in indices]
    shape = tuple(int(n) for n in shape)
    if len(shape) < 4 or shape[0] != len(indices):
        raise ValueError(f"shape {shape} must be [len(indices)={len(indices)}, D, H, W, ...]")
    samples: dict[tuple[int, Spans], np.ndarray] = {}

    def sample_block(i: int, spatial: Spans) -> np.ndarray:
        if (i, spatial) not in samples:
            out = np.asarray(fn(i, tuple(slice(a, b) for a, b in spatial)))
            want = (*(b - a for a, b in spatial), *shape[4:])
            if out.shape != want:
                raise ValueError(f"fn({i}, block) returned shape {out.shape}, expected {want} for block {spatial}")
            samples[(i, spatial)] = out
        return samples[(i, spatial)]

    def read(spans: Spans) -> np.ndarray:
        spatial, trailing = spans[1:4], tuple(slice(a, b) for a, b in spans[4:])
        return np.stack([sample_block(indices[b], spatial)[(Ellipsis, *trailing)] for b in range(*spans[0])])

    return global_array(shape, sharding, read, dtype)


def _per_sample_batch(
    fn: Callable[[int], np.ndarray], indices: Sequence[int], shape: Sequence[int], sharding, dtype
) -> jax.Array:
    """A global ``[len(indices), ...]`` array of small per-sample rows (e.g. targets) laid out by ``sharding``."""

    def read(spans: Spans) -> np.ndarray:
        return np.stack(
            [np.asarray(fn(indices[b]))[tuple(slice(a, b) for a, b in spans[1:])] for b in range(*spans[0])]
        )

    return global_array(shape, sharding, read, dtype)


def cosmo_batch(
    seed: int,
    indices: Sequence[int],
    spec: CosmoSpec,
    image_sharding: jax.sharding.Sharding,
    target_sharding: jax.sharding.Sharding,
) -> dict[str, jax.Array]:
    """``{"volume": f32[B, S, S, S, 1], "target": f32[B, 4]}`` of samples ``indices``, each device its own block."""
    s, b = spec.size, len(indices)
    volume = global_batch(lambda i, blk: cosmo_block(seed, i, spec, blk), indices, (b, s, s, s, 1), image_sharding)
    target = _per_sample_batch(
        lambda i: cosmo_params(seed, i, spec)[1], indices, (b, len(CosmoSpec.PARAM_NAMES)), target_sharding, np.float32
    )
    return {"volume": volume, "target": target}


def seg_batch(
    seed: int,
    indices: Sequence[int],
    spec: SegSpec,
    image_sharding: jax.sharding.Sharding,
    label_sharding: jax.sharding.Sharding,
) -> dict[str, jax.Array]:
    """``{"volume": f32[B, S, S, S, 1], "label": int32[B, S, S, S]}``; ``label_sharding`` covers ``[B, D, H, W]``."""
    s, b = spec.size, len(indices)
    volume = global_batch(lambda i, blk: seg_block(seed, i, spec, blk)[0], indices, (b, s, s, s, 1), image_sharding)
    label = global_batch(
        lambda i, blk: _seg_label_block(seed, i, spec, blk), indices, (b, s, s, s), label_sharding, np.int32
    )
    return {"volume": volume, "label": label}
