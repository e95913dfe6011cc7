"""Gaussian random fields as sums of plane waves on the box's integer lattice (the spectral representation
method, Shinozuka & Deodatis 1991): a block of the field from its own voxels only (the package docstring)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@functools.lru_cache(maxsize=16)
def _lattice(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Half-space integer wave vectors ``int64 [L, 3]`` with ``0 < |k| <= (size - 1) // 2`` and their norms ``[L]``.

    One of each ``{k, -k}`` pair. Components lie in ``[-K, K]`` with ``2K < size``, so two of these vectors are never
    congruent (nor opposite) modulo ``size``, and ``2k`` is never ``0`` modulo ``size``: the plane waves are exactly
    orthogonal over the ``size**3`` grid, which is what makes the analytic normalisation exact.
    """
    kmax = (size - 1) // 2
    r = np.arange(-kmax, kmax + 1)
    k = np.stack(np.meshgrid(r, r, r, indexing="ij"), axis=-1).reshape(-1, 3)
    half = (k[:, 0] > 0) | ((k[:, 0] == 0) & (k[:, 1] > 0)) | ((k[:, 0] == 0) & (k[:, 1] == 0) & (k[:, 2] > 0))
    norm = np.sqrt((k**2).sum(axis=1))
    keep = half & (norm <= kmax)
    k, norm = k[keep], norm[keep]
    for a in (k, norm):
        a.setflags(write=False)
    return k, norm


@functools.lru_cache(maxsize=16)
def _trig_tables(size: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos(2 pi j / size)`` and ``sin(2 pi j / size)`` for ``j = 0 .. size - 1`` (float64)."""
    angle = 2.0 * np.pi * np.arange(size) / size
    c, s = np.cos(angle), np.sin(angle)
    c.setflags(write=False)
    s.setflags(write=False)
    return c, s


@dataclasses.dataclass(frozen=True, eq=False)
class _Waves:
    """A field ``sum_m scale * Re(c_m exp(2 pi i k_m . x / size))`` over distinct wave vectors, as gather tables."""

    kvec: np.ndarray  # int64 [M, 3], distinct, from _lattice
    table: np.ndarray  # float64 [M, size]: table[m, j] = scale * (Re c_m cos(2 pi j / S) - Im c_m sin(2 pi j / S))
    std: float  # analytic std of the unscaled sum over the whole box, sqrt(sum |c_m|^2 / 2)


def _make_waves(rng: np.random.Generator, size: int, weights: np.ndarray, n_draws: int, std: float) -> _Waves:
    """``n_draws`` waves on ``_lattice(size)`` (vector ~ ``weights``, complex Gaussian amplitude), box std ``std``."""
    kvec, _ = _lattice(size)
    pick = rng.choice(len(kvec), size=n_draws, p=weights / weights.sum())
    re, im = rng.standard_normal((2, n_draws))
    uniq, inverse = np.unique(pick, return_inverse=True)  # duplicates add coherently: still distinct vectors
    a = np.bincount(inverse, weights=re, minlength=len(uniq))
    b = np.bincount(inverse, weights=im, minlength=len(uniq))
    unit_std = math.sqrt(float(np.sum(a * a + b * b)) / 2.0)
    scale = std / unit_std if unit_std > 0 else 0.0
    c, s = _trig_tables(size)
    table = scale * (a[:, None] * c[None, :] - b[:, None] * s[None, :])
    k = kvec[uniq]
    for arr in (k, table):
        arr.setflags(write=False)
    return _Waves(k, table, unit_std)


def _eval_waves(waves: _Waves, size: int, blk: tuple[tuple[int, int], ...]) -> np.ndarray:
    """float64 ``[d, h, w]`` values of ``waves`` on the block; each voxel's value is independent of the block."""
    coords = [np.arange(a, b, dtype=np.int64) for a, b in blk]
    out = np.zeros(tuple(b - a for a, b in blk), dtype=np.float64)
    for k, row in zip(waves.kvec, waves.table, strict=True):
        p0, p1, p2 = ((int(kc) * x) % size for kc, x in zip(k, coords, strict=True))
        phase = (p0[:, None, None] + p1[None, :, None] + p2[None, None, :]) % size  # exact integer k.x mod S
        out += row[phase]  # one gather + one add per wave, in the fixed order of the waves
    return out
