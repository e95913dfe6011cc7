"""The GPT's output head settings and its cross-entropy in chunks of positions (`GPTConfig.loss_chunk`): only one
chunk's logits ever live, and no chunk is recomputed. docs/performance.md, "The loss in chunks" and "Lean by default
on a target"."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import shardkit as sk
from models.axes import BATCH, EMBED, SEQ, VOCAB

#: With `GPTConfig.loss_chunk=None` (auto) on a TPU or GPU with 16-bit compute, the loss runs in chunks once a
#: device's fp32 logits would exceed this, in as few chunks as bring each under it. At 64 MiB (d_model 64,
#: vocabulary 8192, sequence 1024 on a v5e-8) the TPU compiler already keeps the whole loss's logits out of HBM and
#: chunking raised the temporaries (6.1 -> 10.9 MB); at 500 MiB (issue #41's decoder, fsdp on a v5e-8) 4 chunks cut
#: the peak by a third (docs/performance.md, "The loss in chunks").
CHUNK_ABOVE_BYTES = 128 * 2**20


def _lean(cfg: Any, platform: str) -> bool:
    return platform in ("gpu", "tpu") and jnp.dtype(getattr(cfg, "dtype", "float32")).itemsize < 4


def logits_dot_in_fp32(cfg: Any, platform: str) -> bool:
    """Whether the head's dot returns fp32 (`GPTConfig.logits_dot_in_fp32`; None: not on a TPU or GPU with 16-bit
    compute, `auto_head`)."""
    fp32 = getattr(cfg, "logits_dot_in_fp32", None)
    return (not _lean(cfg, platform)) if fp32 is None else bool(fp32)


def auto_head(cfg: Any, platform: str, seq_len: int, logits_per_device: float, seq_split: int = 1) -> tuple[bool, int]:
    """(logits_dot_in_fp32, loss_chunk) for `cfg` compiled for a `platform` family ("cpu", "gpu", "tpu"), where a
    device holds `logits_per_device` logits (elements) of sequences `seq_len` long split `seq_split` ways. Fields the
    config sets are kept; None means auto:
    - on a TPU or GPU with 16-bit compute (bf16), the head's dot in the compute dtype, cast to fp32 for the loss
      (MaxText's default), and the loss in chunks when a device's fp32 logits exceed `CHUNK_ABOVE_BYTES`: the fewest
      chunks that bring each under it (or, where the sequence is split too finely for that, as many as it allows), each
      chunk a whole number of positions on every device of a split sequence;
    - otherwise (CPU programs, fp32 compute) fp32 logits and the whole loss, as before these were automatic."""
    lean, fp32 = _lean(cfg, platform), logits_dot_in_fp32(cfg, platform)
    if getattr(cfg, "loss_chunk", None) is not None:
        return fp32, int(cfg.loss_chunk)
    if not lean or logits_per_device * 4 <= CHUNK_ABOVE_BYTES:
        return fp32, 0
    least = math.ceil(logits_per_device * 4 / CHUNK_ABOVE_BYTES)
    for n in [*range(least, seq_len + 1), *range(least - 1, 1, -1)]:  # else as many as the split sequence allows
        if seq_len % n == 0 and (seq_len // n) % seq_split == 0:
            return fp32, seq_len // n
    return fp32, 0


def head_settings(cfg: Any, targets_shape: Sequence[int]) -> tuple[bool, int]:
    """`auto_head` for the step being traced: the platform of the mesh it is compiled for (`sk.platform_family`)
    and the per-device logits of a [batch, seq] batch of `targets_shape` as the active rules lay them out."""
    b, s = targets_shape
    with sk.scope("head"):
        local = sk.rules.local_shape((BATCH, SEQ, VOCAB), (b, s, cfg.vocab_size))
    return auto_head(cfg, sk.platform_family(), s, math.prod(local), seq_split=-(-s // local[1]))


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
