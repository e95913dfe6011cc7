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

from experiments.data.volumes import batch, checks, cosmo, npy, seg, waves
from experiments.data.volumes.batch import cosmo_batch, global_batch, seg_batch
from experiments.data.volumes.checks import Block
from experiments.data.volumes.cosmo import CosmoSpec, cosmo_block, cosmo_params, mean_baseline
from experiments.data.volumes.npy import NpyVolumes
from experiments.data.volumes.seg import SegSpec, seg_block

__all__ = [
    "Block",
    "CosmoSpec",
    "NpyVolumes",
    "SegSpec",
    "batch",
    "checks",
    "cosmo",
    "cosmo_batch",
    "cosmo_block",
    "cosmo_params",
    "global_batch",
    "mean_baseline",
    "npy",
    "seg",
    "seg_batch",
    "seg_block",
    "waves",
]
