"""The GPT's cross-entropy in chunks of positions (`GPTConfig.loss_chunk`): only one chunk's logits ever live, and
no chunk is recomputed. docs/performance.md, "The loss in chunks"."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from models.axes import BATCH, EMBED, SEQ, VOCAB


def chunked_cross_entropy(
    logits: Callable[[jax.Array, jax.Array], jax.Array], w: jax.Array, x: jax.Array, targets: jax.Array, chunk: int
) -> jax.Array:
    """Mean cross-entropy of `logits(x, w)` (fp32 [batch, seq, vocab] from the head's input x [batch, seq, embed] and
    weight w [embed, vocab]) against `targets` [batch, seq], `chunk` positions at a time, so only one chunk's logits
    ever live.

    Differentiated, the forward already computes each chunk's gradients (the logits' cotangent is softmax -
    one-hot, known as soon as the chunk's loss is) and keeps those, not the logits: the backward only scales them,
    so no chunk is recomputed and the FLOPs are the unchunked program's. Not differentiated (evaluation), it is the
    plain chunked forward. The head's weight and input are laid out for the matmul once, before the loop (inside
    it, FSDP would gather the weight and reduce-scatter its gradient once per chunk, and sequence parallelism would
    gather the input once per chunk). A chunk takes every (seq / chunk)-th position, so that where the sequence is
    split (context parallelism), each device's chunk is its own positions."""
    (b, s), c = targets.shape, chunk
    if s % c:
        raise sk.ShardkitError(f"loss_chunk={c} must divide the sequence length {s}")
    with sk.scope("head"):  # the compute layouts: gathered here, once
        w = sk.constrain(w, (EMBED, VOCAB))
        x = sk.constrain(x, (BATCH, SEQ, EMBED))
    n = s // c
    strided = lambda a: jnp.moveaxis(a.reshape(b, c, n, *a.shape[2:]), 2, 0)  # [n, b, c, ...]: chunk i
    ce_sum = lambda z, t: optax.softmax_cross_entropy_with_integer_labels(z, t).sum()
    f32 = jnp.promote_types(x.dtype, jnp.float32)

    def loss_sum(x: jax.Array, w: jax.Array, targets: jax.Array) -> jax.Array:
        body = lambda total, xt: (total + ce_sum(logits(xt[0], w), xt[1]), None)
        return jax.lax.scan(body, jnp.zeros((), f32), (strided(x), strided(targets)))[0]

    def loss_sum_fwd(x: jax.Array, w: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple]:
        def body(carry: tuple, xt: tuple) -> tuple[tuple, jax.Array]:
            z, pullback = jax.vjp(logits, xt[0], w)  # the same transposes autodiff takes
            loss, dz = jax.value_and_grad(ce_sum)(z, xt[1])
            dxc, dwc = pullback(dz)
            return (carry[0] + loss, carry[1] + dwc), dxc

        (total, dw), dx = jax.lax.scan(body, (jnp.zeros((), f32), jnp.zeros_like(w)), (strided(x), strided(targets)))
        return total, (jnp.moveaxis(dx, 0, 2).reshape(x.shape), dw)

    def loss_sum_bwd(res: tuple, g: jax.Array) -> tuple:
        dx, dw = res
        return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None  # integer targets: no cotangent

    fused = jax.custom_vjp(loss_sum)
    fused.defvjp(loss_sum_fwd, loss_sum_bwd)
    return fused(x, w, targets) / (b * s)
