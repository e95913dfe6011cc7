"""Synthetic 3D volumes for spatially parallel 3D CNNs, generated one spatial block at a time.

Why blocks. Under spatial parallelism each sample is split over depth / height / width across devices (Oyama et al.,
"The Case for Strong Scaling in Deep Learning: Training Large 3D CNNs with Hybrid Parallelism", arXiv:2007.12856,
IEEE TPDS 2021), so that a volume too large for one device's memory never exists whole on any of them. The data
must then be made the same way: every generator here produces only the block ``(depth, height, width)`` slices of
sample ``index`` that it is asked for, as a pure function of ``(seed, index, block)``, and a block is bitwise equal
to the same slice of the whole sample, whatever the blocking. Nothing is downloaded and nothing is read from disk
except by :class:`NpyVolumes` (the users' own data). :func:`global_batch` assembles a global ``jax.Array`` with
``jax.make_array_from_callback``, each addressable device generating only its batch rows x its spatial block.

Cosmology-like regression (:func:`cosmo_block`, :func:`cosmo_params`). A synthetic stand-in for CosmoFlow
(Mathuriya et al., "CosmoFlow: Using Deep Learning to Learn the Universe at Scale", arXiv:1808.04728, SC18), which
regresses four cosmological parameters from 3D dark-matter density grids: here each sample has four generating
parameters, drawn uniformly in the ranges of :class:`CosmoSpec`, and the targets are those parameters mapped
linearly to [-1, 1]. The volume ``f32[S, S, S, 1]`` is the log-density ``log rho`` of a lognormal field (Coles &
Jones, "A lognormal model for the cosmological mass distribution", MNRAS 248:1, 1991)::

    log rho(x) = sigma * g(x) - sigma**2 / 2 + mean,        so that E[rho] = exp(mean)

where ``g`` is a unit-variance Gaussian random field approximated by a sum of random plane waves (the spectral
representation method, Shinozuka & Deodatis, "Simulation of stochastic processes by spectral representation",
Appl. Mech. Rev. 44(4), 1991) with power spectrum ``P(k) = k**slope * exp(-(k / k_cut)**2)``, ``k`` in units of the
box's fundamental mode. Each of the ``modes`` waves picks an integer wave vector (so the field is periodic on the
box) from the half-space lattice ball ``0 < |k| <= (S - 1) // 2`` with probability proportional to ``P(|k|)`` and a
complex Gaussian amplitude (Rayleigh modulus, uniform phase); waves that pick the same vector add up coherently. The
expected power at every lattice vector is then proportional to ``P(|k|)``. On that lattice distinct wave vectors are
exactly orthogonal over the voxel grid, so the variance of ``g`` over the whole box is known analytically from the
amplitudes (``sum |c|**2 / 2``): ``g`` is normalised from that, not from voxels, so a block needs nothing but its
own voxels, and the whole volume's log-density has standard deviation ``sigma`` and mean ``mean - sigma**2 / 2``
(to rounding). Per voxel, wave ``m`` contributes ``T_m[(k_m . x) mod S]``, a gather from a per-sample table of
``S`` values, and the waves are added in a fixed order: integer arithmetic and elementwise IEEE products and sums
only, so the value at a voxel does not depend on the block that contains it. Cost: ``modes x voxels of the block``.

Segmentation (:func:`seg_block`). ``objects`` spheres and axis-aligned boxes (half spheres, half boxes, in a random
order) with random centres and radii / half-sizes; a voxel's label is the last object covering it (0 background,
1 sphere, 2 box). The image is a class intensity (0, 1, 2), plus a smooth field (a few low-frequency plane waves,
the same construction as above, standard deviation ``smooth``), plus white noise of std ``noise`` that is a
deterministic function of ``(seed, index, global voxel coordinate)``: a splitmix64 hash (Steele, Lea & Flood,
"Fast splittable pseudorandom number generators", OOPSLA 2014; constants of Vigna's ``splitmix64.c``) of the
voxel's linear global index, two hashes per voxel turned into a Gaussian by the Box-Muller transform (Box & Muller,
Ann. Math. Stat. 29(2):610, 1958). With noise 0.6 against class steps of 1.0 a per-voxel threshold mislabels a
large fraction of voxels, while a small 3D U-Net (Çiçek et al., arXiv:1606.06650) that averages neighbours does not.

Randomness. The per-sample scalars (parameters, wave vectors, amplitudes, objects) come from
``np.random.default_rng([seed, index, tag])`` (``tag`` separates the two families), so sample ``index`` is the same
whichever batch, process or blocking asks for it; ``seed`` and ``index`` must be non-negative integers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

Block = tuple[slice, slice, slice]  # (depth, height, width) slices of the global volume, step 1

_COSMO_TAG = 0xC05F10  # separates the RNG streams of the two families for the same (seed, index)
_SEG_TAG = 0x5E6
_SEG_INTENSITY = np.array([0.0, 1.0, 2.0])  # background, sphere, box
_SEG_SMOOTH_WAVES = 4  # plane waves of the smooth intensity field, |k| <= _SEG_SMOOTH_KMAX
_SEG_SMOOTH_KMAX = 2.0
_BOX_SCALE = 0.8  # box half-sizes are 0.8 x a radius draw: a box's volume is then close to a sphere's


# ----------------------------------------------------------------------------------------------------- validation


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_range(name: str, value: Any, minimum: float | None = None, strict: bool = False) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (lo, hi) pair of numbers, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
        raise ValueError(f"{name} must be a finite range with lo <= hi, got {value!r}")
    if minimum is not None and (lo <= minimum if strict else lo < minimum):
        raise ValueError(f"{name} must lie {'above' if strict else 'at or above'} {minimum}, got {value!r}")
    return lo, hi


def _check_nonneg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def _check_block(block: Block | None, shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``block`` as ``((start, stop),) * 3`` inside ``shape`` (None: the whole volume); ValueError otherwise."""
    if block is None:
        return tuple((0, int(n)) for n in shape)
    if not isinstance(block, (tuple, list)) or len(block) != 3 or not all(isinstance(s, slice) for s in block):
        raise ValueError(f"block must be a tuple of 3 slices (depth, height, width), got {block!r}")
    out = []
    for axis, s, n in zip(("depth", "height", "width"), block, shape, strict=True):
        if s.step not in (None, 1):
            raise ValueError(f"block {axis} slice {s!r} must have step 1")
        start = 0 if s.start is None else s.start
        stop = n if s.stop is None else s.stop
        ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (start, stop))
        if not ints or not 0 <= start < stop <= n:
            raise ValueError(f"block {axis} slice {s!r} is not a non-empty range inside [0, {n})")
        out.append((int(start), int(stop)))
    return tuple(out)


def _check_seed_index(seed: Any, index: Any) -> tuple[int, int]:
    return _check_int("seed", seed, 0), _check_int("index", index, 0)


def _to_unit(value: float, lo: float, hi: float) -> float:
    """``value`` in [lo, hi] mapped linearly to [-1, 1] (0 for a degenerate range lo == hi)."""
    return 0.0 if hi == lo else float(np.clip(2.0 * (value - lo) / (hi - lo) - 1.0, -1.0, 1.0))


# ------------------------------------------------------------------------------------------------ plane-wave fields


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


# ------------------------------------------------------------------------------------------ cosmology-like volumes


@dataclasses.dataclass(frozen=True)
class CosmoSpec:
    """A lognormal log-density field of ``size**3`` voxels with four per-sample parameters (module docstring)."""

    size: int = 32  # cubic volume size**3; at least 3 (the smallest box with a non-constant periodic wave)
    modes: int = 96  # random plane waves per sample
    # Four generating parameters, each drawn uniformly in its range per sample; targets are them mapped to [-1, 1].
    sigma: tuple[float, float] = (0.3, 1.0)  # lognormal amplitude: the std of the Gaussian field
    slope: tuple[float, float] = (-3.0, -1.0)  # power-law index n of P(k) ∝ k**n
    k_cut: tuple[float, float] = (2.0, 8.0)  # Gaussian cutoff P(k) *= exp(-(k / k_cut)**2), in fundamental modes
    mean: tuple[float, float] = (-0.5, 0.5)  # an additive offset of the log-density (a mean density, a "bias")

    PARAM_NAMES: ClassVar[tuple[str, ...]] = ("sigma", "slope", "k_cut", "mean")

    def __post_init__(self):
        _check_int("CosmoSpec.size", self.size, 3)
        _check_int("CosmoSpec.modes", self.modes, 1)
        _check_range("CosmoSpec.sigma", self.sigma, minimum=0.0)
        _check_range("CosmoSpec.slope", self.slope)
        _check_range("CosmoSpec.k_cut", self.k_cut, minimum=0.0, strict=True)
        _check_range("CosmoSpec.mean", self.mean)

    def ranges(self) -> tuple[tuple[float, float], ...]:
        """The four parameter ranges, in ``PARAM_NAMES`` order."""
        return tuple(tuple(float(v) for v in getattr(self, name)) for name in self.PARAM_NAMES)


def _cosmo_draw_params(rng: np.random.Generator, spec: CosmoSpec) -> np.ndarray:
    u = rng.random(len(CosmoSpec.PARAM_NAMES))  # the first draws of the sample's stream
    return np.array([lo + ui * (hi - lo) for ui, (lo, hi) in zip(u, spec.ranges(), strict=True)], dtype=np.float64)


@functools.lru_cache(maxsize=256)
def _cosmo_sample(seed: int, index: int, spec: CosmoSpec) -> tuple[np.ndarray, _Waves]:
    """Sample ``index``'s parameters and its waves, scaled by sigma (cached: every block of a sample shares them)."""
    rng = np.random.default_rng([seed, index, _COSMO_TAG])
    params = _cosmo_draw_params(rng, spec)
    sigma, slope, k_cut, _ = params
    _, norm = _lattice(spec.size)
    weights = norm**slope * np.exp(-((norm / k_cut) ** 2))  # P(|k|): the probability of a wave picking k
    if not np.isfinite(weights).all() or weights.sum() <= 0:
        raise ValueError(f"the spectrum P(k) = k**{slope} * exp(-(k/{k_cut})**2) underflows on a {spec.size}^3 box")
    params.setflags(write=False)
    return params, _make_waves(rng, spec.size, weights, spec.modes, float(sigma))


def cosmo_params(seed: int, index: int, spec: CosmoSpec) -> tuple[np.ndarray, np.ndarray]:
    """(physical parameters f64[4], targets f32[4] in [-1, 1]) of sample `index`, in ``CosmoSpec.PARAM_NAMES`` order.

    A target is its parameter mapped linearly from its range ``(lo, hi)`` to [-1, 1] (0 where ``lo == hi``).
    """
    seed, index = _check_seed_index(seed, index)
    params, _ = _cosmo_sample(seed, index, spec)
    targets = np.array([_to_unit(p, lo, hi) for p, (lo, hi) in zip(params, spec.ranges(), strict=True)], np.float32)
    return params.copy(), targets


def cosmo_block(seed: int, index: int, spec: CosmoSpec, block: Block | None = None) -> np.ndarray:
    """f32[d, h, w, 1] the log-density field of sample `index` on `block` (None: the whole volume).

    Bitwise equal to ``cosmo_block(seed, index, spec)[block]`` for any block; costs ``modes x`` the block's voxels.
    """
    seed, index = _check_seed_index(seed, index)
    blk = _check_block(block, (spec.size,) * 3)
    params, waves = _cosmo_sample(seed, index, spec)
    sigma, _, _, mean = params
    field = _eval_waves(waves, spec.size, blk) + (mean - sigma * sigma / 2.0)
    return field.astype(np.float32)[..., None]


def mean_baseline(seed: int, indices: Sequence[int], spec: CosmoSpec) -> float:
    """The MSE of predicting the mean target: the targets of ``indices`` against their own mean, over all 4 targets.

    The loss a regressor must beat. Targets are uniform in [-1, 1] (variance 1/3), so it tends to 1/3 as
    ``len(indices)`` grows (less for parameters whose range is a single value: their target is always 0).
    """
    if len(indices) == 0:
        raise ValueError("mean_baseline needs at least one index")
    t = np.stack([cosmo_params(seed, i, spec)[1] for i in indices]).astype(np.float64)
    return float(np.mean((t - t.mean(axis=0)) ** 2))


# ----------------------------------------------------------------------------------------------- segmentation


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


# ----------------------------------------------------------------------------------------------- users' volumes


class NpyVolumes:
    """Users' own data: a folder of `<name>.npy` volumes (f[D, H, W] or f[D, H, W, C]) and optional targets.

    Arrays are opened with mmap_mode='r' so a block reads only its slice. Volumes are the files matching
    ``pattern`` in sorted name order (the targets file excluded); they must all have the same shape. ``targets``
    names an optional ``f[N, P]`` (or ``f[N]``) file of per-volume regression targets, row ``i`` for volume ``i``.
    """

    def __init__(self, folder: str | os.PathLike, pattern: str = "*.npy", targets: str | None = "targets.npy"):
        self.folder = pathlib.Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"volume folder {str(self.folder)!r} does not exist or is not a folder")
        target_path = self.folder / targets if targets is not None else None
        self.files = sorted(p for p in self.folder.glob(pattern) if p.is_file() and p != target_path)
        if not self.files:
            raise FileNotFoundError(f"no volumes matching {pattern!r} in folder {str(self.folder)!r}")
        shape = None
        for path in self.files:
            arr = np.load(path, mmap_mode="r")
            if arr.ndim not in (3, 4) or not (
                np.issubdtype(arr.dtype, np.number) or np.issubdtype(arr.dtype, np.bool_)
            ):
                raise ValueError(
                    f"{path.name}: expected a numeric [D, H, W] or [D, H, W, C] array, got {arr.dtype}{list(arr.shape)}"
                )
            this = tuple(arr.shape) if arr.ndim == 4 else (*arr.shape, 1)
            if shape is None:
                shape, first = this, path.name
            elif this != shape:
                raise ValueError(
                    f"{path.name} has shape {this} (as D, H, W, C) but {first} has {shape}: "
                    f"all volumes in {str(self.folder)!r} must share one shape"
                )
            del arr
        self._shape = shape
        self._targets = None
        self._targets_name = targets
        if target_path is not None and target_path.is_file():
            t = np.load(target_path).astype(np.float32)
            t = t[:, None] if t.ndim == 1 else t
            if t.ndim != 2 or len(t) != len(self.files):
                raise ValueError(
                    f"{target_path.name} has shape {list(t.shape)}; expected [{len(self.files)}, P], "
                    f"one row per volume ({len(self.files)} volumes)"
                )
            self._targets = t

    def __len__(self) -> int:
        return len(self.files)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(D, H, W, C) shared by all volumes (C = 1 for 3-dimensional files)."""
        return self._shape

    @property
    def has_targets(self) -> bool:
        return self._targets is not None

    def _check_index(self, index: int) -> int:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
            raise IndexError(f"volume index {index!r} out of range: {len(self)} volumes in {str(self.folder)!r}")
        return int(index)

    def block(self, index: int, block: Block | None = None) -> np.ndarray:
        """f32[d, h, w, C] the `block` of volume `index` (None: the whole volume), read from the memory map."""
        index = self._check_index(index)
        blk = _check_block(block, self._shape[:3])
        arr = np.load(self.files[index], mmap_mode="r")
        out = np.array(arr[tuple(slice(a, b) for a, b in blk)], dtype=np.float32)  # a copy: the map is released
        return out if out.ndim == 4 else out[..., None]

    def target(self, index: int) -> np.ndarray:
        """f32[P] the regression targets of volume `index`."""
        index = self._check_index(index)
        if self._targets is None:
            what = "targets=None was given" if self._targets_name is None else f"no {self._targets_name!r} there"
            raise ValueError(f"the volumes in {str(self.folder)!r} have no targets ({what})")
        return self._targets[index].copy()

    def __repr__(self) -> str:
        return f"NpyVolumes({str(self.folder)!r}, n={len(self)}, shape={self._shape}, targets={self.has_targets})"


# ------------------------------------------------------------------------------------------ sharded global batches


def _spans(index: tuple[slice, ...], shape: Sequence[int]) -> list[tuple[int, int]]:
    spans = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        assert step == 1, f"unexpected shard index {index}"
        spans.append((start, stop))
    return spans


def global_batch(
    fn: Callable[[int, Block], np.ndarray],
    indices: Sequence[int],
    shape: Sequence[int],
    sharding: jax.sharding.Sharding,
    dtype=np.float32,
) -> jax.Array:
    """A global array [len(indices), D, H, W, (C...)] of shape `shape` laid out by `sharding`, built with
    jax.make_array_from_callback: each addressable device's callback generates only its own block
    (its batch slice of `indices` × its spatial slices), never the whole sample. `fn(index, block)` returns
    one sample's block with the trailing dims.

    Trailing dims (after W) are generated whole by ``fn`` and sliced if ``sharding`` splits them. Devices holding
    the same shard (replication over some mesh axes) share one call of ``fn`` per sample.
    """
    indices = [_check_int("batch index", i, 0) for i in indices]
    shape = tuple(int(n) for n in shape)
    if len(shape) < 4 or shape[0] != len(indices):
        raise ValueError(f"shape {shape} must be [len(indices)={len(indices)}, D, H, W, ...]")
    blocks: dict[tuple[int, tuple[tuple[int, int], ...]], np.ndarray] = {}

    def sample_block(i: int, spatial: tuple[tuple[int, int], ...]) -> np.ndarray:
        if (i, spatial) not in blocks:
            out = np.asarray(fn(i, tuple(slice(a, b) for a, b in spatial)))
            want = (*(b - a for a, b in spatial), *shape[4:])
            if out.shape != want:
                raise ValueError(f"fn({i}, block) returned shape {out.shape}, expected {want} for block {spatial}")
            blocks[(i, spatial)] = out
        return blocks[(i, spatial)]

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        spans = _spans(index, shape)
        spatial, trailing = tuple(spans[1:4]), tuple(slice(a, b) for a, b in spans[4:])
        rows = [sample_block(indices[b], spatial)[(Ellipsis, *trailing)] for b in range(*spans[0])]
        return np.stack(rows).astype(dtype, copy=False)

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


def _per_sample_batch(
    fn: Callable[[int], np.ndarray], indices: Sequence[int], shape: Sequence[int], sharding, dtype
) -> jax.Array:
    """A global ``[len(indices), ...]`` array of small per-sample rows (e.g. targets) laid out by ``sharding``."""
    shape = tuple(int(n) for n in shape)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        spans = _spans(index, shape)
        rows = [np.asarray(fn(indices[b]))[tuple(slice(a, b) for a, b in spans[1:])] for b in range(*spans[0])]
        return np.stack(rows).astype(dtype, copy=False)

    return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)


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
