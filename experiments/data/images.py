"""Image classification data: scikit-learn's handwritten digits, a fixed split, resumable sharded batches.

Data. ``sklearn.datasets.load_digits()``: 1797 grayscale 8x8 images of the digits 0-9 (the UCI "optical
recognition of handwritten digits" test set, 16 gray levels), shipped inside the scikit-learn package: nothing is
downloaded. Images become ``float32 [N, 8, 8, 1]`` scaled to [0, 1] (pixel / 16), labels ``int32 [N]``.

Split. ``np.random.default_rng(split_seed).permutation(1797)``: the first ``val_size`` indices are validation, the
rest train. ``split_seed`` is not the training seed, so runs with different seeds are validated on the same images.
The default ``val_size = 320`` (train 1477) divides into equal batches over any data degree up to 64, so the whole
validation split is evaluated exactly, with no padding and nothing dropped.

Batches. Training batch ``step`` is a pure function of ``(seed, step)``: the train split is walked in epochs, epoch
``e`` in the order ``np.random.default_rng([seed, e]).permutation(n_train)``, and batch ``step`` is positions
``[step * B, (step + 1) * B)`` of that endless stream (a batch may straddle two epochs). Every example is seen once
per epoch, and resuming at step 40 needs only the number 40. ``global_batch`` puts on each addressable device only
its block of the batch (``addressable_devices_indices_map`` of the step's batch shardings), so the result is the
same global array whatever the number of processes: each process holds the whole (small) data set and slices it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from experiments.data.assemble import global_array

SPLIT_SEED = 0
DEFAULT_VAL_SIZE = 320
DATASETS = ("digits",)

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(eq=False)
class ImageDataset:
    """Train / validation images ``float32 [N, H, W, C]`` and labels ``int32 [N]``."""

    train_images: np.ndarray
    train_labels: np.ndarray
    val_images: np.ndarray
    val_labels: np.ndarray
    num_classes: int
    name: str = ""

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of one image."""
        return tuple(self.train_images.shape[1:])

    def split(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(images, labels) of ``split`` ("train" or "val")."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return (self.train_images, self.train_labels) if split == "train" else (self.val_images, self.val_labels)

    def class_counts(self, split: str = "train") -> np.ndarray:
        return np.bincount(self.split(split)[1], minlength=self.num_classes)

    def __repr__(self) -> str:
        n_train, n_val = len(self.train_labels), len(self.val_labels)
        return (
            f"ImageDataset({self.name!r}, {n_train=}, {n_val=}, image={self.image_shape}, classes={self.num_classes})"
        )


def load_digits(val_size: int = DEFAULT_VAL_SIZE, split_seed: int = SPLIT_SEED) -> ImageDataset:
    """scikit-learn's 8x8 digits (bundled with the package), pixels in [0, 1], split as the module docstring says."""
    from sklearn.datasets import load_digits as _load  # import here: only image runs need scikit-learn

    digits = _load()
    images = (digits.images.astype(np.float32) / 16.0)[..., None]  # 16 gray levels -> [0, 1]; [N, 8, 8, 1]
    labels = digits.target.astype(np.int32)
    if not 0 < val_size < len(labels):
        raise ValueError(f"val_size={val_size} must be in [1, {len(labels) - 1}] ({len(labels)} images)")
    order = np.random.default_rng(split_seed).permutation(len(labels))
    val, train = order[:val_size], order[val_size:]
    return ImageDataset(images[train], labels[train], images[val], labels[val], 10, "digits")


def load_dataset(
    name: str = "digits", *, val_size: int = DEFAULT_VAL_SIZE, split_seed: int = SPLIT_SEED
) -> ImageDataset:
    """The named image data set (only ``digits`` for now)."""
    if name != "digits":
        raise ValueError(f"unknown image data set {name!r}; available: {', '.join(DATASETS)}")
    return load_digits(val_size, split_seed)


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(n: int, step: int, batch_size: int, seed: int = 0) -> np.ndarray:
    """Indices into the train split of batch ``step``: positions ``[step * B, (step + 1) * B)`` of the epoch stream."""
    pos = np.arange(step * batch_size, (step + 1) * batch_size, dtype=np.int64)
    epochs, within = np.divmod(pos, n)
    out = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
        out[epochs == e] = _epoch_order(n, seed, int(e))[within[epochs == e]]
    return out


def batch_spec(batch_size: int, image_shape: tuple[int, ...], shardings: Any = None) -> dict[str, Any]:
    """ShapeDtypeStructs of a batch ``{"image": f32[B, H, W, C], "label": int32[B]}`` (with ``shardings``)."""
    shapes = {"image": ((batch_size, *image_shape), np.float32), "label": ((batch_size,), np.int32)}
    sh = shardings or {}
    return {k: jax.ShapeDtypeStruct(s, d, sharding=sh.get(k)) for k, (s, d) in shapes.items()}


def _to_global(arrays: Batch, shardings: dict[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
    """Global arrays from host arrays every process holds whole: each addressable device gets its block."""
    return {
        key: global_array(value.shape, shardings[key], lambda spans, v=value: v[tuple(slice(*s) for s in spans)],
                          value.dtype)
        for key, value in arrays.items()
    }  # fmt: skip


def host_batch(ds: ImageDataset, step: int, batch_size: int, seed: int = 0) -> Batch:
    """The whole training batch ``step`` as numpy ``{"image", "label"}``."""
    images, labels = ds.split("train")
    idx = batch_indices(len(labels), step, batch_size, seed)
    return {"image": images[idx], "label": labels[idx]}


def global_batch(
    ds: ImageDataset, step: int, batch_size: int, shardings: dict[str, jax.sharding.Sharding], seed: int = 0
) -> dict[str, jax.Array]:
    """Training batch ``step`` as global jax arrays laid out by ``shardings`` (``step.batch_shardings(spec)``)."""
    return _to_global(host_batch(ds, step, batch_size, seed), shardings)


def val_batches(
    ds: ImageDataset, n_batches: int, shardings: dict[str, jax.sharding.Sharding] | None = None
) -> list[Any]:
    """The whole validation split in ``n_batches`` equal batches, in split order (numpy, or global jax arrays)."""
    images, labels = ds.split("val")
    if n_batches < 1 or len(labels) % n_batches:
        raise ValueError(f"the {len(labels)} validation images do not split into {n_batches} equal batches")
    size = len(labels) // n_batches
    out = [
        {"image": images[i * size : (i + 1) * size], "label": labels[i * size : (i + 1) * size]}
        for i in range(n_batches)
    ]
    return out if shardings is None else [_to_global(b, shardings) for b in out]
