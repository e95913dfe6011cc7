"""The loss the built-in models train with, public as `sk.cross_entropy`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer labels in nats, in fp32 at least (fp64 under x64 stays fp64)."""
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(dtype), labels).mean()


__all__ = ["cross_entropy"]
