"""Checks and partition-spec helpers shared by the context-parallel kernels (ring, Ulysses, USP)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from shardkit.errors import ShardkitError
from shardkit.rules import ShardingContext

# The kernels are correct under check_vma=True (tested), but the train step's microbatch loop vmaps the loss
# with spmd_axis_name, and batching a shard_map then adds the batch axes to only some values' varying axes
# ("mul requires varying manual axes to match", jax 0.10-0.12); nothing here relies on replication checks.
CHECK_VMA = False


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Any, what: str) -> None:
    """Shapes: q [b, s, heads, d], k = v [b, s, kv_heads, d] with heads % kv_heads == 0, segment_ids [b, s]."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or (q.shape[:2], q.shape[3]) != (k.shape[:2], k.shape[3]):
        raise ShardkitError(
            f"{what}: q {q.shape}, k {k.shape}, v {v.shape} must be [batch, seq, heads, head_dim] with k and v "
            "equal and [batch, seq, kv_heads, head_dim]"
        )
    if q.shape[2] % k.shape[2]:
        raise ShardkitError(f"{what}: query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}")
    if segment_ids is not None and tuple(segment_ids.shape) != q.shape[:2]:
        raise ShardkitError(
            f"{what}: segment_ids shape {tuple(segment_ids.shape)} must be [batch, seq] = {q.shape[:2]}; "
            "give one document id per token (int32)"
        )


def check_axis(mesh: Mesh, axis: str, what: str) -> int:
    if axis not in mesh.shape:
        raise ShardkitError(
            f"{what}: mesh axis {axis!r} is not in the mesh {dict(mesh.shape)}; add it (e.g. "
            f"sk.make_mesh('{axis}={len(mesh.devices.flat)}')) or pass the axis that shards the sequence"
        )
    return mesh.shape[axis]


def spec_entry(axes: Any) -> Any:
    """('data',) -> 'data', ('data', 'fsdp') -> ('data', 'fsdp'), None / () -> None."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return None if not axes else axes[0] if len(axes) == 1 else axes


def context_axes(context: ShardingContext | None, seq: tuple[str, ...], kernel: str) -> tuple[Mesh, Any, Any]:
    """(mesh, batch axes, head axes) from the compute rules, which must shard `seq` over exactly `seq`."""
    if context is None:
        raise ShardkitError(f"attention {kernel!r} runs inside a train step (sk.use_rules); call it directly instead")
    got = tuple(context.rules.get("seq") or ())
    if got != seq:
        raise ShardkitError(
            f"attention {kernel!r} needs the compute rule seq: {seq} but the strategy has seq: {got or None}; "
            f"map 'seq' (and 'res_seq') to {seq} in the strategy's compute rules"
        )
    return context.mesh, context.rules.get("batch"), context.rules.get("heads")


def match_kv_heads(k: jax.Array, v: jax.Array, heads: int, context: ShardingContext) -> tuple[jax.Array, jax.Array]:
    """Repeats K, V to `heads` heads when the strategy shards kv_heads unlike heads (e.g. kv_heads replicated)."""
    if context.rules.get("heads") == context.rules.get("kv_heads"):
        return k, v
    g = heads // k.shape[2]
    return jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
