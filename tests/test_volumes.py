"""Tests for experiments/data/volumes.py: blocks equal slices of whole samples bitwise, statistics follow parameters,
sharded global batches generate only their blocks, users' .npy volumes."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.data import volumes as vol

S = 32  # the default size


def _splits(n: int, parts: int | list[int]) -> list[slice]:
    """``parts`` equal slices of ``range(n)``, or the slices between the given cut points."""
    cuts = [i * n // parts for i in range(parts + 1)] if isinstance(parts, int) else [0, *parts, n]
    return [slice(a, b) for a, b in itertools.pairwise(cuts)]


# Each blocking is one split per axis (depth, height, width): equal splits, a 4x1x1 and odd uneven cuts.
BLOCKINGS = {
    "2x2x1": (2, 2, 1),
    "4x1x1": (4, 1, 1),
    "odd": ([5], [5], [7, 19]),
    "3x5x7": (3, 5, 7),
    "single-voxels": ([1, 2, 31], [30, 31], [1]),
}


def _blocks(n: int, blocking) -> list[vol.Block]:
    return list(itertools.product(*(_splits(n, parts) for parts in blocking)))


@pytest.mark.parametrize("blocking", BLOCKINGS.values(), ids=BLOCKINGS.keys())
def test_cosmo_block_is_the_slice_of_the_whole_bitwise(blocking):
    spec = vol.CosmoSpec()
    for index in (0, 7):
        whole = vol.cosmo_block(3, index, spec)
        assert whole.shape == (S, S, S, 1) and whole.dtype == np.float32
        rebuilt = np.full_like(whole, np.nan)
        for block in _blocks(S, blocking):
            part = vol.cosmo_block(3, index, spec, block)
            np.testing.assert_array_equal(part, whole[block])
            rebuilt[block] = part
        np.testing.assert_array_equal(rebuilt, whole)  # the blocks tile the volume


@pytest.mark.parametrize("blocking", BLOCKINGS.values(), ids=BLOCKINGS.keys())
def test_seg_block_is_the_slice_of_the_whole_bitwise(blocking):
    spec = vol.SegSpec()
    for index in (0, 7):
        image, label = vol.seg_block(3, index, spec)
        assert image.shape == (S, S, S, 1) and image.dtype == np.float32
        assert label.shape == (S, S, S) and label.dtype == np.int32
        for block in _blocks(S, blocking):
            part_image, part_label = vol.seg_block(3, index, spec, block)
            np.testing.assert_array_equal(part_image, image[block])
            np.testing.assert_array_equal(part_label, label[block])


def test_a_block_does_not_need_the_cached_whole_sample():
    """A block computed in a fresh process state (caches cleared) still equals the slice of the whole."""
    spec = vol.CosmoSpec(size=20)
    block = (slice(3, 9), slice(0, 20), slice(11, 12))
    vol.cosmo._cosmo_sample.cache_clear()
    vol.seg._seg_sample.cache_clear()
    first = vol.cosmo_block(5, 2, spec, block)
    first_seg = vol.seg_block(5, 2, vol.SegSpec(size=20), block)
    vol.cosmo._cosmo_sample.cache_clear()
    vol.seg._seg_sample.cache_clear()
    np.testing.assert_array_equal(first, vol.cosmo_block(5, 2, spec)[block])
    whole_seg = vol.seg_block(5, 2, vol.SegSpec(size=20))
    np.testing.assert_array_equal(first_seg[0], whole_seg[0][block])
    np.testing.assert_array_equal(first_seg[1], whole_seg[1][block])


def test_samples_are_deterministic_and_distinct():
    spec, seg = vol.CosmoSpec(size=16), vol.SegSpec(size=16)
    a = vol.cosmo_block(1, 4, spec)
    vol.cosmo._cosmo_sample.cache_clear()
    np.testing.assert_array_equal(a, vol.cosmo_block(1, 4, spec))
    np.testing.assert_array_equal(vol.cosmo_params(1, 4, spec)[0], vol.cosmo_params(1, 4, spec)[0])
    assert not np.array_equal(a, vol.cosmo_block(1, 5, spec))  # another index
    assert not np.array_equal(a, vol.cosmo_block(2, 4, spec))  # another seed
    assert not np.array_equal(vol.cosmo_params(1, 4, spec)[0], vol.cosmo_params(1, 5, spec)[0])
    image, label = vol.seg_block(1, 4, seg)
    vol.seg._seg_sample.cache_clear()
    np.testing.assert_array_equal(image, vol.seg_block(1, 4, seg)[0])
    np.testing.assert_array_equal(label, vol.seg_block(1, 4, seg)[1])
    assert not np.array_equal(label, vol.seg_block(1, 5, seg)[1])
    assert not np.array_equal(image, vol.seg_block(2, 4, seg)[0])


def test_targets_are_the_parameters_mapped_to_unit_range():
    spec = vol.CosmoSpec()
    params, targets = zip(*(vol.cosmo_params(0, i, spec) for i in range(300)), strict=True)
    params, targets = np.stack(params), np.stack(targets)
    assert params.dtype == np.float64 and targets.dtype == np.float32 and targets.shape == (300, 4)
    lo, hi = np.array(spec.ranges()).T
    assert (params >= lo).all() and (params <= hi).all()
    np.testing.assert_allclose(targets, 2 * (params - lo) / (hi - lo) - 1, atol=1e-6)
    assert (targets >= -1).all() and (targets <= 1).all()
    assert (targets.min(0) < -0.9).all() and (targets.max(0) > 0.9).all()  # each spans its range
    assert abs(np.corrcoef(targets.T) - np.eye(4)).max() < 0.2  # drawn independently
    # The mean-prediction baseline: uniform targets in [-1, 1] have variance 1/3.
    assert vol.mean_baseline(0, range(300), spec) == pytest.approx(np.mean((targets - targets.mean(0)) ** 2))
    assert vol.mean_baseline(0, range(300), spec) == pytest.approx(1 / 3, abs=0.03)
    pinned = vol.CosmoSpec(sigma=(0.5, 0.5), slope=(-2.0, -2.0), k_cut=(4.0, 4.0), mean=(0.1, 0.1))
    params, targets = vol.cosmo_params(0, 3, pinned)
    np.testing.assert_array_equal(params, [0.5, -2.0, 4.0, 0.1])
    np.testing.assert_array_equal(targets, np.zeros(4))  # a single-value range maps to 0
    assert vol.mean_baseline(0, range(10), pinned) == 0.0


def test_field_std_and_mean_follow_sigma_and_mean_exactly():
    """Over the whole periodic box the plane waves on distinct lattice vectors are orthogonal, so the analytic
    normalisation makes the log-density's std exactly sigma and its mean exactly mean - sigma^2/2; the tolerance
    is only float32 rounding (and float64 summation over 32^3 voxels). A block's own std is not normalised."""
    spec = vol.CosmoSpec()
    stds = []
    for index in range(6):
        (sigma, _, _, mean), _ = vol.cosmo_params(2, index, spec)
        field = vol.cosmo_block(2, index, spec)[..., 0].astype(np.float64)
        assert field.std() == pytest.approx(sigma, rel=1e-5)
        assert field.mean() == pytest.approx(mean - sigma**2 / 2, abs=1e-5)
        stds.append(field.std())
        corner = field[:8, :8, :8]
        assert corner.std() != pytest.approx(sigma, rel=1e-3)  # so the normalisation did not look at the block
    assert np.ptp(stds) > 0.2  # sigma varies between samples


def _roughness(field: np.ndarray) -> float:
    """Mean squared finite difference (periodic, over the three axes) relative to the variance."""
    return float(np.mean([np.mean((np.roll(field, 1, a) - field) ** 2) for a in range(3)]) / field.var())


def _expected_roughness(spec: vol.CosmoSpec) -> float:
    """The same under the spectrum: a wave k has roughness mean_a 2(1 - cos(2 pi k_a / S)), weighted by P(|k|)."""
    (slope,), (k_cut,) = {spec.slope[0]}, {spec.k_cut[0]}
    k, norm = vol.waves._lattice(spec.size)
    weight = norm**slope * np.exp(-((norm / k_cut) ** 2))
    per_wave = (2 * (1 - np.cos(2 * np.pi * k / spec.size))).mean(axis=1)
    return float((weight * per_wave).sum() / weight.sum())


def test_spectrum_slope_and_cutoff_control_smoothness():
    """A steeper slope (or a lower cutoff) puts the power at low k: a smoother field. Each pinned spectrum's mean
    roughness over 6 samples also matches the spectrum's expectation; with 96 Rayleigh-weighted waves a sample
    scatters ~10-20% about it, so 30% on the mean is loose yet fails for a spectrum ignored (the four settings'
    expectations span 0.03 .. 0.61)."""
    rough = {}
    for slope, k_cut in itertools.product((-3.0, -1.0), (2.0, 8.0)):
        spec = vol.CosmoSpec(sigma=(0.5, 0.5), slope=(slope, slope), k_cut=(k_cut, k_cut))
        values = [_roughness(vol.cosmo_block(1, i, spec)[..., 0].astype(np.float64)) for i in range(6)]
        rough[slope, k_cut] = np.mean(values)
        assert rough[slope, k_cut] == pytest.approx(_expected_roughness(spec), rel=0.3)
    assert rough[-3.0, 8.0] < 0.5 * rough[-1.0, 8.0]  # steeper slope: smoother
    assert rough[-3.0, 2.0] < rough[-1.0, 2.0]
    assert rough[-1.0, 2.0] < 0.2 * rough[-1.0, 8.0]  # lower cutoff: smoother


def test_seg_classes_intensities_and_labels():
    spec = vol.SegSpec()
    means = []
    for index in range(5):
        image, label = vol.seg_block(0, index, spec)
        counts = np.bincount(label.ravel(), minlength=3)
        assert len(counts) == vol.SegSpec.NUM_CLASSES and (counts > 100).all(), counts  # all 3 classes occur
        means.append([image[..., 0][label == c].mean() for c in range(3)])
    means = np.array(means)
    # background < sphere < box, 1 apart on average; the smooth field (std 0.3) shifts an object's mean a little.
    assert (np.diff(means, axis=1) > 0.4).all(), means
    np.testing.assert_allclose(np.diff(means, axis=1).mean(0), [1.0, 1.0], atol=0.15)
    # Not trivially thresholdable: with noise 0.6 a per-voxel cut at 0.5 mislabels many voxels.
    image, label = vol.seg_block(0, 0, spec)
    assert np.mean(image[..., 0][label == 0] > 0.5) > 0.15
    # Without objects' intensity the residual is the smooth field plus the noise: std ~ sqrt(0.3^2 + 0.6^2).
    residual = image[..., 0] - np.array([0.0, 1.0, 2.0])[label]
    assert residual.std() == pytest.approx(np.hypot(spec.smooth, spec.noise), rel=0.05)
    quiet = vol.SegSpec(noise=0.0, smooth=0.0)
    image, label = vol.seg_block(0, 0, quiet)
    np.testing.assert_array_equal(image[..., 0], label.astype(np.float32))  # intensity 0, 1, 2 by class


def test_seg_label_is_the_last_object_covering_a_voxel():
    spec = vol.SegSpec(size=16, objects=8)
    _, label = vol.seg_block(4, 1, spec)
    sample = vol.seg._seg_sample(4, 1, spec)
    rng = np.random.default_rng(0)
    for x in rng.integers(0, 16, (300, 3)):
        want = 0
        for cls, c, r, h in zip(sample.classes, sample.centres, sample.radii, sample.half, strict=True):
            inside = np.sum((x - c) ** 2) <= r * r if cls == 1 else np.all(np.abs(x - c) <= h)
            want = cls if inside else want
        assert label[tuple(x)] == want, x
    assert sorted(sample.classes) == [1] * 4 + [2] * 4  # half spheres, half boxes


def test_invalid_inputs_raise_value_errors_naming_the_value():
    with pytest.raises(ValueError, match=r"size.*0"):
        vol.CosmoSpec(size=0)
    with pytest.raises(ValueError, match=r"size.*-4"):
        vol.SegSpec(size=-4)
    with pytest.raises(ValueError, match=r"sigma.*\(1\.0, 0\.5\)"):
        vol.CosmoSpec(sigma=(1.0, 0.5))
    with pytest.raises(ValueError, match=r"radius.*\(5\.0, 2\.0\)"):
        vol.SegSpec(radius=(5.0, 2.0))
    with pytest.raises(ValueError, match="modes"):
        vol.CosmoSpec(modes=0)
    with pytest.raises(ValueError, match="k_cut"):
        vol.CosmoSpec(k_cut=(0.0, 1.0))
    spec = vol.CosmoSpec(size=8)
    with pytest.raises(ValueError, match=r"depth.*slice\(0, 9"):
        vol.cosmo_block(0, 0, spec, (slice(0, 9), slice(None), slice(None)))
    with pytest.raises(ValueError, match="step 1"):
        vol.cosmo_block(0, 0, spec, (slice(None), slice(0, 8, 2), slice(None)))
    with pytest.raises(ValueError, match="width"):
        vol.seg_block(0, 0, vol.SegSpec(size=8), (slice(None), slice(None), slice(-2, 8)))
    with pytest.raises(ValueError, match="3 slices"):
        vol.cosmo_block(0, 0, spec, (slice(None), slice(None)))
    with pytest.raises(ValueError, match=r"index.*-1"):
        vol.cosmo_params(0, -1, spec)
    with pytest.raises(ValueError, match="seed"):
        vol.seg_block(-3, 0, vol.SegSpec(size=8))


def _mesh():
    return jax.make_mesh((2, 4), ("data", "space"))


def test_global_batch_generates_only_each_devices_block():
    spec = vol.CosmoSpec()
    calls = []

    def fn(index, block):
        calls.append((index, block))
        return vol.cosmo_block(9, index, spec, block)

    sharding = NamedSharding(_mesh(), P("data", "space"))
    out = vol.global_batch(fn, [3, 11], (2, S, S, S, 1), sharding)
    assert out.shape == (2, S, S, S, 1) and out.dtype == np.float32 and out.sharding == sharding
    np.testing.assert_array_equal(np.asarray(out), np.stack([vol.cosmo_block(9, i, spec) for i in (3, 11)]))
    assert len(calls) == 8  # one call per device, each for one sample's block
    for _, (depth, height, width) in calls:
        assert depth.stop - depth.start == S // 4  # never the whole sample
        assert (height.start, height.stop, width.start, width.stop) == (0, S, 0, S)
    assert sorted((i, b[0].start) for i, b in calls) == [(i, d) for i in (3, 11) for d in range(0, S, S // 4)]
    for shard in out.addressable_shards:
        assert shard.data.shape == (1, S // 4, S, S, 1)


def test_global_batch_replicated_devices_share_a_call_and_bad_shapes_raise():
    calls = []

    def fn(index, block):
        calls.append(index)
        return vol.cosmo_block(0, index, vol.CosmoSpec(size=8), block)

    out = vol.global_batch(fn, [0, 1], (2, 8, 8, 8, 1), NamedSharding(_mesh(), P("data")))
    assert sorted(calls) == [0, 1]  # 8 devices, 2 distinct shards: each sample generated once
    np.testing.assert_array_equal(np.asarray(out)[1], vol.cosmo_block(0, 1, vol.CosmoSpec(size=8)))
    with pytest.raises(ValueError, match="len"):
        vol.global_batch(fn, [0, 1, 2], (2, 8, 8, 8, 1), NamedSharding(_mesh(), P("data")))
    with pytest.raises(ValueError, match="returned shape"):
        vol.global_batch(lambda i, b: np.zeros((1, 1, 1, 1)), [0, 1], (2, 8, 8, 8, 1), NamedSharding(_mesh(), P()))


def test_cosmo_and_seg_batches():
    mesh, size = _mesh(), 16
    cosmo, seg = vol.CosmoSpec(size=size), vol.SegSpec(size=size)
    batch = vol.cosmo_batch(7, [4, 5], cosmo, NamedSharding(mesh, P("data", "space")), NamedSharding(mesh, P("data")))
    assert batch["volume"].shape == (2, size, size, size, 1) and batch["target"].shape == (2, 4)
    assert batch["target"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(batch["volume"]), np.stack([vol.cosmo_block(7, i, cosmo) for i in (4, 5)]))
    targets = np.stack([vol.cosmo_params(7, i, cosmo)[1] for i in (4, 5)])
    np.testing.assert_array_equal(np.asarray(batch["target"]), targets)
    batch = vol.seg_batch(
        7, [4, 5], seg, NamedSharding(mesh, P("data", None, "space")), NamedSharding(mesh, P("data", "space"))
    )
    assert batch["volume"].shape == (2, size, size, size, 1) and batch["label"].shape == (2, size, size, size)
    assert batch["label"].dtype == np.int32 and batch["label"].sharding.spec == P("data", "space")
    whole = [vol.seg_block(7, i, seg) for i in (4, 5)]
    np.testing.assert_array_equal(np.asarray(batch["volume"]), np.stack([w[0] for w in whole]))
    np.testing.assert_array_equal(np.asarray(batch["label"]), np.stack([w[1] for w in whole]))


def test_npy_volumes_blocks_targets_and_sharding(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((8, 6, 5, 2)) for _ in range(3)]  # float64 on disk, f32 when read
    for i, a in enumerate(arrays):
        np.save(tmp_path / f"vol{i:02d}.npy", a)
    targets = rng.standard_normal((3, 2)).astype(np.float32)
    np.save(tmp_path / "targets.npy", targets)
    data = vol.NpyVolumes(tmp_path)
    assert len(data) == 3 and data.shape == (8, 6, 5, 2) and data.has_targets
    assert [p.name for p in data.files] == ["vol00.npy", "vol01.npy", "vol02.npy"]  # the targets file left out
    block = (slice(2, 5), slice(0, 6), slice(1, 3))
    out = data.block(1, block)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, arrays[1][block].astype(np.float32))
    np.testing.assert_array_equal(data.block(2), arrays[2].astype(np.float32))
    np.testing.assert_array_equal(data.target(2), targets[2])
    with pytest.raises(IndexError, match="3 volumes"):
        data.block(3)
    with pytest.raises(ValueError, match="depth"):
        data.block(0, (slice(0, 9), slice(None), slice(None)))
    # A user's volumes through global_batch: each device reads its slice of the memory map.
    got = vol.global_batch(data.block, [2, 0], (2, 8, 6, 5, 2), NamedSharding(_mesh(), P("data", "space")))
    np.testing.assert_array_equal(np.asarray(got), np.stack([arrays[2], arrays[0]]).astype(np.float32))
    # 3-dimensional files get a channel axis; without a targets file target() says so.
    plain = tmp_path / "plain"
    plain.mkdir()
    np.save(plain / "a.npy", np.arange(24, dtype=np.int16).reshape(2, 3, 4))
    single = vol.NpyVolumes(plain)
    assert single.shape == (2, 3, 4, 1) and not single.has_targets
    np.testing.assert_array_equal(single.block(0)[..., 0], np.arange(24).reshape(2, 3, 4))
    with pytest.raises(ValueError, match="no targets"):
        single.target(0)


def test_npy_volumes_errors_name_the_folder_or_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        vol.NpyVolumes(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"no volumes matching '\*\.npy'"):
        vol.NpyVolumes(tmp_path)
    np.save(tmp_path / "a.npy", np.zeros((4, 4, 4)))
    np.save(tmp_path / "b.npy", np.zeros((4, 4, 5)))
    with pytest.raises(ValueError, match=r"b\.npy has shape \(4, 4, 5, 1\).*a\.npy"):
        vol.NpyVolumes(tmp_path)
    (tmp_path / "b.npy").unlink()
    np.save(tmp_path / "targets.npy", np.zeros((2, 3)))
    with pytest.raises(ValueError, match="one row per volume"):
        vol.NpyVolumes(tmp_path)
