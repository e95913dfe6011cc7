"""Dense attention (the reference every context-parallel kernel is tested against) and the kernel registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from shardkit import kernels
from shardkit.attention import blocks
from shardkit.attention.blocks import CUDNN_DTYPES
from shardkit.errors import ShardkitError
from shardkit.rules import platform_family

AttentionFn = Callable[..., jax.Array]


def register_attention(
    name: str, fn: AttentionFn, layout: kernels.LayoutFn | None = None, check: Callable[[str], Any] | None = None
) -> None:
    """Makes a strategy with `kernels={"attention": name}` call `fn(q, k, v, *, causal, segment_ids, context)`.

    `layout(name, mesh) -> (layout, ring size)`: the sequence layout the kernel needs its data in (ring kernels).
    `check(full name)` raises ShardkitError for options after the name it cannot take (`name:<options>`)."""
    kernels.register("attention", name, fn, layout=layout, check=check)


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
    if q.dtype == jnp.float64:  # jax.nn computes the softmax in fp32 always; float64 parity tests need float64
        return _float64_attention(q, k, v, causal, mask)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")
    return out.astype(q.dtype)


def _float64_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, mask: jax.Array | None) -> jax.Array:
    """The same attention written out, every step in q's dtype (query head h reads key/value head h // g)."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    keep = jnp.ones(logits.shape[-2:], bool) if mask is None else mask
    if causal:
        keep = keep & jnp.tril(jnp.ones(logits.shape[-2:], bool))
    probs = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _dense_from_context(q, k, v, *, causal: bool, segment_ids: Any, context: Any) -> jax.Array:
    """Dense attention inside a train step: by the block kernel the strategy names (`attention_block`, blocks.py;
    auto: from the mesh's devices), a fused one inside a `shard_map` over the batch and head axes (a Mosaic kernel
    cannot be partitioned by GSPMD), else `dense_attention` under GSPMD (`auto`: where `blocks.dense_keeps_xla`)."""
    if context is None:
        return dense_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    named = blocks.named()
    seq_sharded = bool(context.rules.get("seq"))
    if named == "xla" or (named == "auto" and blocks.dense_keeps_xla(context.rules, dict(context.mesh.shape))):
        return dense_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    what = "dense attention"
    kernel = blocks.resolve(named, platform_family(context.mesh), lengths=(q.shape[1],), ring=False, dtype=q.dtype,
                            segment_ids=segment_ids is not None, what=what, devices=context.mesh.size)  # fmt: skip
    if kernel == "xla":
        return dense_attention(q, k, v, causal=causal, segment_ids=segment_ids)
    if seq_sharded:
        raise ShardkitError(
            f"{what}: attention_block={kernel} needs each device's whole sequence, and this strategy shards it over "
            f"{context.rules['seq']}; use attention_block=xla here, or a context-parallel strategy (cp_*)"
        )
    return blocks.sharded_local(kernel, q, k, v, segment_ids, causal, context)


register_attention("dense", _dense_from_context)


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: jax.Array | None = None
) -> jax.Array:
    """[b, s, heads, d] x 2 x [b, s, kv_heads, d] -> [b, s, heads, d] by cuDNN's fused flash attention (NVIDIA GPUs).

    `jax.nn.dot_product_attention(implementation="cudnn")`: no [s, s] scores in memory, the causal upper half
    never computed, GQA native. Checked here first, since cuDNN's own refusal is an opaque lowering error: a
    GPU backend, bf16 / fp16 inputs, and no packed documents (cuDNN's fused kernel takes sequence lengths,
    not a [s, s] segment mask; use attention=dense for `segment_ids`).
    """
    if q.dtype.name not in CUDNN_DTYPES:
        raise ShardkitError(
            f"attention=cudnn takes {' or '.join(CUDNN_DTYPES)} inputs, got {q.dtype.name}: set the model's "
            "dtype='bfloat16' (mixed precision), or use attention=dense for fp32"
        )
    if segment_ids is not None:
        raise ShardkitError(
            "attention=cudnn does not take segment_ids (packed documents): cuDNN's fused kernel has no segment "
            "mask here; use attention=dense, or train on unpacked sequences"
        )
    platform = platform_family()  # the mesh's devices: a TPU target compiled from a GPU host gets no cuDNN
    if platform != "gpu":
        raise ShardkitError(
            f"attention=cudnn runs on NVIDIA GPUs only; this program is compiled for the mesh's {platform!r} "
            "devices: use attention=dense (or a ring kernel) there"
        )
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn").astype(q.dtype)


register_attention(
    "cudnn",
    lambda q, k, v, *, causal, segment_ids, context: cudnn_attention(q, k, v, causal=causal, segment_ids=segment_ids),
)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True, segment_ids: jax.Array | None = None
) -> jax.Array:
    """[b, s, heads, d] x 2 x [b, s, kv_heads, d] -> [b, s, heads, d] with the kernel the strategy chose."""
    kernel, _, ctx = kernels.active("attention")
    if q.shape[2] % k.shape[2]:
        raise ShardkitError(f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}")
    return kernel.fn(q, k, v, causal=causal, segment_ids=segment_ids, context=ctx)
