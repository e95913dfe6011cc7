"""Gradient accumulation: the mean loss, metrics and gradient of M microbatches of a batch, one at a time.

One implementation for every step that loops over microbatches sequentially:
- the GSPMD step (shardkit/parallel/gspmd/step.py) for a model with state besides parameters (BatchNorm
  statistics, dropout RNG counters) or an unsharded batch; for a stateless model on a sharded batch it keeps one
  unreduced gradient per batch shard instead (`GSPMDStep._accumulate`), so that the step reduces the gradient
  once, not M times;
- the SDP step (shardkit/parallel/sdp/step.py), inside each worker's `shard_map`.

The heterogeneous-DP step (shardkit/parallel/hetero/step.py) loops too, but over a per-device number of
micro-batches with row masks and a weighted mean; it is a different loop, written there.

The split is strided: row r goes to microbatch r mod M, so that each microbatch keeps the batch's sharding (a
contiguous split would put whole microbatches on a subset of the devices). Model state is carried from
microbatch to microbatch, as one device would, and floating sums run in fp32 at least (bf16 gradients of M
microbatches summed in bf16 lose about log2(M) bits); the means are cast back to each value's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def split_microbatches(batch: Any, m: int) -> Any:
    """[B, ...] -> [m, B / m, ...] for every leaf: row r to microbatch r mod m (the strided split)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)


def accumulate(grad_fn: Any, params: Any, model_state: Any, batch: Any, m: int) -> Any:
    """((loss, (metrics, model_state)), grads) of `m` microbatches of `batch`, loss, metrics and grads their means.

    `grad_fn(params, model_state, microbatch) -> ((loss, (metrics, model_state)), grads)`: a
    `jax.value_and_grad(..., has_aux=True)` of the step's loss. One `lax.scan` over the microbatches; the model
    state each microbatch leaves is the next one's."""
    micro = split_microbatches(batch, m)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss, (aux, _)), grads = jax.eval_shape(lambda b: grad_fn(params, model_state, b), first)
    wide = lambda d: jnp.promote_types(d, jnp.float32) if jnp.issubdtype(d, jnp.floating) else d
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, wide(s.dtype)), (loss, aux, grads))

    def body(carry: Any, mb: Any) -> tuple[Any, None]:
        acc, state = carry
        (loss, (aux, state)), grads = grad_fn(params, state, mb)
        return (jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, (loss, aux, grads)), state), None

    (total, model_state), _ = jax.lax.scan(body, (zeros, model_state), micro)
    back = lambda x, s: (x / m).astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.floating) else x / m
    loss, aux, grads = jax.tree.map(back, total, (loss, aux, grads))
    return (loss, (aux, model_state)), grads


__all__ = ["accumulate", "split_microbatches"]
