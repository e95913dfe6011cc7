"""Cosmology-like regression volumes: lognormal log-density fields of four generating parameters (the package
docstring has the model and its references)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from experiments.data.volumes.checks import Block, _check_block, _check_int, _check_range, _check_seed_index, _to_unit
from experiments.data.volumes.waves import _eval_waves, _lattice, _make_waves, _Waves

_COSMO_TAG = 0xC05F10  # separates the RNG streams of the two families for the same (seed, index)


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
