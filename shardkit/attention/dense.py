"""Dense attention (the reference every context-parallel kernel is tested against) and the kernel registry."""

from __future__ import annotations

from collections.abc import Callable

import jax

from shardkit.errors import ShardkitError
from shardkit.rules import current_context

AttentionFn = Callable[..., jax.Array]
_KERNELS: dict[str, AttentionFn] = {}


def register_attention(name: str, fn: AttentionFn) -> None:
    """Makes a strategy with `attention=name` call `fn(q, k, v, *, causal, segment_ids, context)`."""
    _KERNELS[name] = fn


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: jax.Array | None = None
) -> jax.Array:
    """softmax(q kᵀ/√d + mask) v with q [b, s, heads, d], k, v [b, s, kv_heads, d] (GQA when kv_heads < heads).

    `jax.nn.dot_product_attention` with the XLA implementation: it materialises [b, heads, s, s] scores, which
    is what the context-parallel kernels avoid. segment_ids [b, s] mask attention across packed documents.
    """
    mask = None
    if segment_ids is not None:
        if segment_ids.shape != q.shape[:2]:
            raise ShardkitError(f"segment_ids shape {segment_ids.shape} must be [batch, seq] = {q.shape[:2]}")
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [b, 1, s, s]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
    return out.astype(q.dtype)


register_attention(
    "dense",
    lambda q, k, v, *, causal, segment_ids, context: dense_attention(q, k, v, causal=causal, segment_ids=segment_ids),
)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: jax.Array | None = None
) -> jax.Array:
    """[b, s, heads, d] x 2 x [b, s, kv_heads, d] -> [b, s, heads, d] with the kernel the strategy chose."""
    ctx = current_context()
    name = "dense" if ctx is None else ctx.attention
    if name not in _KERNELS:
        raise ShardkitError(f"attention kernel {name!r} is not available; registered: {', '.join(_KERNELS)}")
    if q.shape[2] % k.shape[2]:
        raise ShardkitError(f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}")
    return _KERNELS[name](q, k, v, causal=causal, segment_ids=segment_ids, context=ctx)
