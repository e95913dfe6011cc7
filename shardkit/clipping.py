"""The gradient's global norm, and clipping by it, for any strategy's parameter layout.

`optax.clip_by_global_norm` sums the squares of every stored element. Under subnetwork data parallelism a block
is stored once per holder, so the step traces its update under `norm_weights(1 / holder count)` and these count
each parameter once; elsewhere they are optax's. Public as `sk.global_norm` / `clip_by_global_norm`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

#: Per-leaf weights of the gradient's norm while a step traces its update: None (every element once), or, for a
#: layout that stores a parameter once per holder (subnetwork data parallelism), 1 / holder count.
_NORM_WEIGHTS: contextvars.ContextVar[Any] = contextvars.ContextVar("shardkit_norm_weights", default=None)


@contextlib.contextmanager
def norm_weights(weights: Any) -> Iterator[None]:
    """`global_norm` (and so `clip_by_global_norm`) weights each leaf by `weights` (a matching pytree) here."""
    token = _NORM_WEIGHTS.set(weights)
    try:
        yield
    finally:
        _NORM_WEIGHTS.reset(token)


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of the model's gradient `tree`: optax.tree.norm, or under `norm_weights` sqrt(sum w x^2), so
    that a parameter stored once per holder is counted once."""
    weights = _NORM_WEIGHTS.get()
    if weights is None:
        return optax.tree.norm(tree)
    squares = jax.tree.map(lambda x, w: jnp.sum(w * jnp.square(x.astype(jnp.float32))), tree, weights)
    return jnp.sqrt(sum(jax.tree.leaves(squares), start=jnp.zeros((), jnp.float32)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm with the norm of `global_norm`: the same update for every strategy, including
    those that store a parameter on several devices (SDP's holders)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        norm = global_norm(updates)
        trigger = jnp.squeeze(norm < max_norm)
        clipped = jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), updates)
        return clipped, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


__all__ = ["clip_by_global_norm", "global_norm", "norm_weights"]
