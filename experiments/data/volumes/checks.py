"""Argument checks shared by the volume generators: every bad value is a ValueError naming it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

Block = tuple[slice, slice, slice]  # (depth, height, width) slices of the global volume, step 1


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
