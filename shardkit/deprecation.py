"""Old public names that keep working for one release, each saying once that it moved (a DeprecationWarning)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def renamed(new: _F, old: str, now: str) -> _F:
    """`new` under its `old` name: the same signature (help() shows `new`'s keywords), a DeprecationWarning per call
    site that names the public name it has `now`."""

    @functools.wraps(new)
    def alias(*args: Any, **kwargs: Any) -> Any:
        message = f"{old} is deprecated and will be removed: use {now}, the same function"
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return new(*args, **kwargs)

    alias.__name__ = old.rpartition(".")[2]
    return alias  # type: ignore[return-value]


__all__ = ["renamed"]
