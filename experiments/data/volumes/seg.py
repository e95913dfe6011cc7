"""Segmentation volumes: spheres and boxes over a smooth field and hashed per-voxel noise (the package
docstring)."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from experiments.data.volumes.checks import (
    Block,
    _check_block,
    _check_int,
    _check_nonneg,
    _check_range,
    _check_seed_index,
)
from experiments.data.volumes.waves import _eval_waves, _lattice, _make_waves, _Waves

_SEG_TAG = 0x5E6
_SEG_INTENSITY = np.array([0.0, 1.0, 2.0])  # background, sphere, box
_SEG_SMOOTH_WAVES = 4  # plane waves of the smooth intensity field, |k| <= _SEG_SMOOTH_KMAX
_SEG_SMOOTH_KMAX = 2.0
_BOX_SCALE = 0.8  # box half-sizes are 0.8 x a radius draw: a box's volume is then close to a sphere's


@dataclasses.dataclass(frozen=True)
class SegSpec:
    """``objects`` spheres and boxes in a ``size**3`` volume, a smooth field and voxel noise (module docstring)."""

    size: int = 32
    objects: int = 6  # spheres and boxes per sample (half of each, rounded)
    radius: tuple[float, float] = (3.0, 7.0)  # sphere radius; a box's half-sizes are 0.8 x a draw from this range
    noise: float = 0.6  # std of the voxel noise
    smooth: float = 0.3  # std of the smooth (low-frequency) intensity field

    NUM_CLASSES: ClassVar[int] = 3  # 0 background, 1 sphere, 2 box

    def __post_init__(self):
        _check_int("SegSpec.size", self.size, 3)
        _check_int("SegSpec.objects", self.objects, 1)
        _check_range("SegSpec.radius", self.radius, minimum=0.0, strict=True)
        _check_nonneg("SegSpec.noise", self.noise)
        _check_nonneg("SegSpec.smooth", self.smooth)


@dataclasses.dataclass(frozen=True, eq=False)
class _SegSample:
    classes: np.ndarray  # int32 [N]: 1 sphere, 2 box, in painting order
    centres: np.ndarray  # float64 [N, 3]
    radii: np.ndarray  # float64 [N]: sphere radius
    half: np.ndarray  # float64 [N, 3]: box half-sizes
    waves: _Waves  # the smooth field, scaled to std `smooth`
    key: int  # the sample's noise hash key


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser of a uint64 array (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash_key(*values: int) -> int:
    h = np.zeros(1, dtype=np.uint64)
    for v in values:
        h = _splitmix64(h ^ np.array([v % 2**64], dtype=np.uint64))
    return int(h[0])


@functools.lru_cache(maxsize=256)
def _seg_sample(seed: int, index: int, spec: SegSpec) -> _SegSample:
    rng = np.random.default_rng([seed, index, _SEG_TAG])
    n = spec.objects
    classes = (rng.permutation(np.arange(n) % 2) + 1).astype(np.int32)
    centres = rng.uniform(0.0, spec.size, (n, 3))
    radii = rng.uniform(*spec.radius, n)
    half = _BOX_SCALE * rng.uniform(*spec.radius, (n, 3))
    _, norm = _lattice(spec.size)
    weights = (norm <= _SEG_SMOOTH_KMAX).astype(np.float64)
    waves = _make_waves(rng, spec.size, weights, _SEG_SMOOTH_WAVES, spec.smooth)
    return _SegSample(classes, centres, radii, half, waves, _hash_key(_SEG_TAG, seed, index))


def _seg_label(sample: _SegSample, blk: tuple[tuple[int, int], ...]) -> np.ndarray:
    coords = [np.arange(a, b, dtype=np.float64) for a, b in blk]
    label = np.zeros(tuple(b - a for a, b in blk), dtype=np.int32)
    for cls, centre, radius, half in zip(sample.classes, sample.centres, sample.radii, sample.half, strict=True):
        d = [x - c for x, c in zip(coords, centre, strict=True)]
        if cls == 1:
            r2 = (d[0] ** 2)[:, None, None] + (d[1] ** 2)[None, :, None] + (d[2] ** 2)[None, None, :]
            covers = r2 <= radius * radius
        else:
            i0, i1, i2 = (np.abs(di) <= h for di, h in zip(d, half, strict=True))
            covers = i0[:, None, None] & i1[None, :, None] & i2[None, None, :]
        label[covers] = cls  # the last object covering a voxel wins
    return label


def _voxel_noise(key: int, size: int, blk: tuple[tuple[int, int], ...]) -> np.ndarray:
    """Standard normal float64 ``[d, h, w]``: Box-Muller of two splitmix64 hashes of each voxel's global index."""
    i0, i1, i2 = (np.arange(a, b, dtype=np.uint64) for a, b in blk)
    s = np.uint64(size)
    linear = (i0[:, None, None] * s + i1[None, :, None]) * s + i2[None, None, :]
    k = np.uint64(key)
    h1 = _splitmix64(k ^ (linear << np.uint64(1)))
    h2 = _splitmix64(k ^ ((linear << np.uint64(1)) | np.uint64(1)))
    u1 = ((h1 >> np.uint64(11)) + np.uint64(1)).astype(np.float64) * 2.0**-53  # (0, 1]: log is finite
    u2 = (h2 >> np.uint64(11)).astype(np.float64) * 2.0**-53  # [0, 1)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def seg_block(seed: int, index: int, spec: SegSpec, block: Block | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(image f32[d, h, w, 1], label int32[d, h, w]) of sample `index` on `block` (None: the whole volume).

    Bitwise equal to the same slices of the whole sample for any block.
    """
    seed, index = _check_seed_index(seed, index)
    blk = _check_block(block, (spec.size,) * 3)
    sample = _seg_sample(seed, index, spec)
    label = _seg_label(sample, blk)
    image = _SEG_INTENSITY[label] + _eval_waves(sample.waves, spec.size, blk)
    image = image + spec.noise * _voxel_noise(sample.key, spec.size, blk)
    return image.astype(np.float32)[..., None], label


def _seg_label_block(seed: int, index: int, spec: SegSpec, block: Block | None = None) -> np.ndarray:
    """The label alone (no image, no noise) of ``seg_block``."""
    seed, index = _check_seed_index(seed, index)
    return _seg_label(_seg_sample(seed, index, spec), _check_block(block, (spec.size,) * 3))
