"""Users' own volumes: a folder of .npy files read block by block through memory maps."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from experiments.data.volumes.checks import Block, _check_block


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
