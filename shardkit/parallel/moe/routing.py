"""Mixture-of-experts routing and expert parallelism (GShard, Lepikhin et al. 2006.16668; Switch, Fedus et al.
2101.03961), as the `moe` kernel slot.

Routing (`route`) works on groups of tokens ([G, S, M]: the GPT's groups are its sequences): a softmax router,
top-k experts per token (k = 1 Switch, k = 2 GShard), each expert taking at most C tokens per group. First
choices fill the experts in token order; second choices queue behind *all* first choices of the group (GShard);
a token past its expert's capacity is dropped for that expert (its output keeps only the residual), unless C = S
(`dropless`: no expert can receive more than S tokens of a group, first and second choices together). GShard
renormalises the two gates to sum to 1; Switch keeps the top-1 probability. Returned: the top-k experts and
gates [G, S, k], dispatch and combine tensors [G, S, E, C] (not with cap=None), the load-balancing loss
mean_e(f_e p_e) E^2 (f_e: fraction of first choices sent to e, p_e: mean router probability of e; 1 when
balanced) and the router z-loss mean(logsumexp(logits)^2).

Applying the experts (`apply`, the slot's entry point) dispatches [G, S, M] -> [E, G, C, M], runs
`expert_fn(params, xe)` and combines back. Kernels:
- `einsum` (default): the dispatch and combine einsums under GSPMD (MaxText's / Flaxformer's formulation). With
  expert parallelism the groups and experts are reshaped to their shards and re-pinned (Flaxformer's idiom), so
  GSPMD moves the tokens with the same 2 all-to-alls as the explicit kernel (a plain constraint on the experts
  would make it all-gather them instead).
- `all_to_all`: expert parallelism in one `shard_map` over the batch mesh axes, groups sharded over all of
  them, experts over `expert`: local dispatch of the device's groups to all E experts, one `all_to_all` over
  `expert` ([E, G_l, C, M] -> [E / X, X G_l, C, M]: each device gets its experts' tokens from every device of
  the axis), the local experts, one `all_to_all` back, local combine. Exactly 2 all-to-alls forward (and their
  2 transposes backward) of E G_l C M elements per device per MoE layer.
- `ragged` (dropless, no capacity; MegaBlocks' idea, Gale et al., MLSys 2023, arXiv 2211.15841): the routed
  (token, choice) pairs sorted by expert, each expert's MLP on its contiguous group by `grouped_fn(params, xs,
  sizes)` (`grouped_dot` in the GPT), unsorted and combined with the gates. It needs `route(..., cap=None)`'s
  "experts" / "gates" only (no [G, S, E, C] tensors). Under expert parallelism it exchanges the pairs in a fixed
  buffer per (source, destination) device pair: `moe_ragged.py` states the bound, and `ragged:<factor>` sets it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit import kernels
from shardkit.errors import ShardkitError
from shardkit.parallel.moe.ragged import RAGGED_PADDING, RAGGED_PATHS, TILE, GroupedFn, grouped_dot, params_experts
from shardkit.strategies import Strategy, register_strategy, strategy, table

kernels.DEFAULTS.setdefault("moe", "einsum")
ExpertFn = Callable[[Any, jax.Array], jax.Array]  # (expert params with a leading E dim, [E, N, C, M]) -> same
#: kernels that take the routed experts and gates (no capacity) instead of the dispatch / combine tensors
GROUPED = {"ragged"}


def capacity(tokens: int, experts: int, top_k: int, factor: float, dropless: bool = False) -> int:
    """Tokens per expert per group: ceil(k S cf / E) (at least 1), or S when dropless."""
    if dropless:
        return tokens
    return max(1, min(tokens, math.ceil(top_k * tokens * factor / experts)))


def route(logits: jax.Array, top_k: int, cap: int | None, *, normalize: bool | None = None) -> dict[str, jax.Array]:
    """logits [G, S, E] -> {"experts": int32[G, S, k], "gates": [G, S, k], "dispatch", "combine": [G, S, E, C],
    "aux_loss", "z_loss", "dropped"} (module doc). cap=None (the dropless `ragged` kernel): no dispatch / combine
    tensors, and "dropped" is 0."""
    if top_k not in (1, 2):
        raise ShardkitError(f"top_k={top_k}: 1 (Switch) or 2 (GShard)")
    if cap is not None and cap < 1:
        raise ShardkitError(f"capacity {cap}: at least 1 token per expert per group, or None (dropless, ragged)")
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    g, s, e = logits.shape
    if top_k > e:
        raise ShardkitError(f"top_k={top_k} needs at least that many experts, not {e}")
    probs = jax.nn.softmax(logits, axis=-1)
    idx1 = jnp.argmax(probs, axis=-1)
    first = jax.nn.one_hot(idx1, e, dtype=probs.dtype)  # [G, S, E]
    pos1 = jnp.cumsum(first, axis=1) - 1  # position in its expert's queue, in token order
    keep1 = first * (pos1 < cap) if cap is not None else first
    gate1 = jnp.sum(probs * first, axis=-1)  # [G, S]
    slots = [(keep1, pos1, gate1)]
    idx = [idx1]
    if top_k == 2:
        idx2 = jnp.argmax(probs * (1 - first), axis=-1)
        second = jax.nn.one_hot(idx2, e, dtype=probs.dtype)
        pos2 = jnp.cumsum(second, axis=1) - 1 + jnp.sum(first, axis=1, keepdims=True)  # behind all first choices
        keep2 = second * (pos2 < cap) if cap is not None else second
        gate2 = jnp.sum(probs * second, axis=-1)
        if normalize is None or normalize:
            denom = gate1 + gate2
            gate1, gate2 = gate1 / denom, gate2 / denom
        slots = [(keep1, pos1, gate1), (keep2, pos2, gate2)]
        idx.append(idx2)
    density, mean_prob = jnp.mean(first, axis=1), jnp.mean(probs, axis=1)  # [G, E]
    out = {
        "experts": jnp.stack(idx, axis=-1).astype(jnp.int32),
        "gates": jnp.stack([gate for _, _, gate in slots], axis=-1),
        "aux_loss": jnp.mean(density * mean_prob) * e * e,
        "z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
    }
    if cap is None:  # dropless: every (token, choice) pair reaches its expert
        return {**out, "dropped": jnp.zeros((), probs.dtype)}
    dispatch = jnp.zeros((g, s, e, cap), probs.dtype)
    combine = jnp.zeros((g, s, e, cap), probs.dtype)
    for keep, pos, gate in slots:
        where = keep[..., None] * jax.nn.one_hot(pos.astype(jnp.int32), cap, dtype=probs.dtype)  # [G, S, E, C]
        dispatch = dispatch + where
        combine = combine + where * gate[..., None, None]
    dropped = 1.0 - jnp.sum(dispatch) / (g * s * top_k)  # fraction of (token, choice) pairs over capacity
    return {**out, "dispatch": dispatch, "combine": combine, "dropped": dropped}


def _einsum(x: jax.Array, dispatch: jax.Array, combine: jax.Array, expert_fn: ExpertFn, params: Any, *,
            context: Any = None) -> jax.Array:  # fmt: skip
    """GSPMD's formulation, with Flaxformer's reshape idiom when the experts' mesh axis X also shards the groups.

    A plain constraint putting the experts on X (while the groups were on X) makes GSPMD replicate the dispatch
    with all-gathers (docs/algorithms.md §11). Instead the group dimension is reshaped to its shards (D, X, G_l) and
    the experts to (X, E / X); re-pinning X from the groups' factor to the experts' factor is what GSPMD compiles
    to one all-to-all, and the reverse on the way back."""
    axes = _expert_axes(context)
    if axes is None:  # no expert parallelism: the plain einsums, sharded by the rules
        xe = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), x)
        return jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), expert_fn(params, xe))
    mesh, axis, rest = context.mesh, *axes
    d = math.prod(mesh.shape[a] for a in rest)
    nx = mesh.shape[axis]
    g, _, e, c = dispatch.shape
    m = x.shape[-1]
    pin = lambda t, *spec: jax.lax.with_sharding_constraint(t, NamedSharding(mesh, P(*spec)))
    rest = rest or None
    xe = jnp.einsum("gsec,gsm->gecm", dispatch.astype(x.dtype), x)  # local: [G, E, C, M], G over (rest, X)
    xe = pin(xe.reshape(d, nx, g // (d * nx), nx, e // nx, c, m), rest, axis)  # X on the groups' factor
    xe = pin(xe, rest, None, None, axis)  # X moved to the experts' factor: one all-to-all
    xe = xe.transpose(3, 4, 0, 1, 2, 5, 6).reshape(e, g, c, m)  # [E, G, C, M]: E over X, G over the rest
    ye = pin(expert_fn(params, pin(xe, axis, rest)), axis, rest)
    ye = ye.reshape(nx, e // nx, d, nx, g // (d * nx), c, m).transpose(2, 3, 4, 0, 1, 5, 6)  # [D, Xg, Gl, Xe, El]
    ye = pin(ye, rest, None, None, axis)
    ye = pin(ye, rest, axis).reshape(g, e, c, m)  # back to the groups: the second all-to-all
    return jnp.einsum("gsec,gecm->gsm", combine.astype(x.dtype), ye)


def _expert_axes(context: Any) -> tuple[str, tuple[str, ...]] | None:
    """(the experts' mesh axis, the other batch axes) when the experts' axis also shards the batch, else None."""
    if context is None:
        return None
    mesh, rules = context.mesh, context.rules
    on = lambda name: tuple(a for a in (rules.get(name) or ()) if a in mesh.shape and mesh.shape[a] > 1)
    experts, batch = on("experts"), on("batch")
    if len(experts) != 1 or experts[0] not in batch or batch[-1] != experts[0]:
        return None
    return experts[0], batch[:-1]


def _all_to_all(x: jax.Array, dispatch: jax.Array, combine: jax.Array, expert_fn: ExpertFn, params: Any, *,
                context: Any = None) -> jax.Array:  # fmt: skip
    if context is None:
        raise ShardkitError("the all_to_all MoE kernel runs inside a train step (it needs the mesh and the rules)")
    mesh, rules = context.mesh, context.rules
    batch = tuple(a for a in (rules.get("batch") or ()) if a in mesh.shape)
    expert = tuple(a for a in (rules.get("experts") or ()) if a in mesh.shape)
    if len(expert) != 1 or expert[0] not in batch:
        raise ShardkitError(
            f"moe kernel all_to_all: `experts` must map to one mesh axis that also shards `batch` (expert "
            f"parallelism, e.g. batch -> (data, expert), experts -> expert); the rules give batch {batch}, "
            f"experts {expert}"
        )
    (axis,) = expert
    n_exp = dispatch.shape[2]
    if n_exp % mesh.shape[axis]:
        raise ShardkitError(f"{n_exp} experts do not split over mesh axis {axis!r} of size {mesh.shape[axis]}")
    groups = math.prod(mesh.shape[a] for a in batch)
    if x.shape[0] % groups:
        raise ShardkitError(f"{x.shape[0]} token groups do not split over the batch mesh axes {batch} ({groups})")

    def body(x: jax.Array, dispatch: jax.Array, combine: jax.Array, params: Any) -> jax.Array:
        xe = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), x)  # [E, G_l, C, M]: every expert
        xe = jax.lax.all_to_all(xe, axis, 0, 1, tiled=True)  # [E / X, X G_l, C, M]: this device's experts
        ye = expert_fn(params, xe)
        ye = jax.lax.all_to_all(ye, axis, 1, 0, tiled=True)  # back: [E, G_l, C, M]
        return jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), ye)

    rows = P(batch)
    spec = jax.tree.map(lambda _: P(axis), params)
    # manual over the batch axes only: other axes (tensor-split expert MLPs) stay GSPMD's inside the kernel
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, spec), out_specs=rows, axis_names=set(batch),
                         check_vma=False)(x, dispatch, combine, params)  # fmt: skip


kernels.register("moe", "einsum", _einsum, description="dispatch / combine einsums under GSPMD")
kernels.register("moe", "all_to_all", _all_to_all, description="expert parallelism: 2 all-to-alls per layer")


def is_grouped() -> bool:
    """Whether the active `moe` kernel is dropless over grouped tokens (route with cap=None, pass grouped_fn)."""
    return kernels.active("moe")[0].name in GROUPED


def apply(x: jax.Array, routing: dict[str, jax.Array], expert_fn: ExpertFn, params: Any, *,
          grouped_fn: GroupedFn | None = None, with_dropped: bool = False) -> Any:  # fmt: skip
    """[G, S, M] -> [G, S, M]: the experts on their dispatched tokens, combined, by the active `moe` kernel.

    `expert_fn` runs the capacity kernels' [E, N, C, M] slots, `grouped_fn` the grouped kernels' (`ragged`) tokens
    sorted by expert. with_dropped=True: ([G, S, M], the fraction of (token, choice) pairs dropped: routing's
    "dropped" for capacity kernels, the expert-parallel buffer's overflow for `ragged`)."""
    kernel, name, ctx = kernels.active("moe")
    if kernel.name in GROUPED:
        if grouped_fn is None:
            raise ShardkitError(
                f"moe kernel {name!r} runs grouped tokens: pass grouped_fn(params, xs [N, M], group_sizes [E]) -> "
                f"[N, M] to sk.moe.apply (e.g. sk.moe.grouped_dot per layer)"
            )
        y, dropped = kernel.fn(x, routing["experts"], routing["gates"], grouped_fn, params, context=ctx, name=name)
        return (y, dropped) if with_dropped else y
    if "dispatch" not in routing:
        raise ShardkitError(f"moe kernel {name!r} needs capacity slots: route with a capacity, not cap=None "
                            f"(cap=None is for the dropless kernels {sorted(GROUPED)})")  # fmt: skip
    _check_order_free(routing["dispatch"].shape, ctx)
    y = kernel.fn(x, routing["dispatch"], routing["combine"], expert_fn, params, context=ctx)
    return (y, routing["dropped"]) if with_dropped else y


def _check_order_free(dispatch_shape: tuple[int, ...], ctx: Any) -> None:
    """Capacity below the group's length drops tokens by their place in the queue, i.e. by their order in the
    sequence: under a strategy that lays the sequence out in another order (cp_zigzag, cp_striped, cp_usp) other
    tokens would be dropped than on one device (the MoE GPT at capacity_factor 1 was 4e-3 off). Refused."""
    s, cap = dispatch_shape[1], dispatch_shape[-1]
    if ctx is None or cap >= s:
        return
    layout, n = kernels.batch_layout(ctx, ctx.mesh)
    if layout != "contiguous":
        raise ShardkitError(
            f"moe: capacity {cap} < {s} tokens per group can drop tokens, and which ones depends on their order in "
            f"the sequence, which attention {ctx.kernels.get('attention')!r} lays out {layout} over {n} ranks: the "
            "step would differ from one device. Route dropless (capacity = tokens per group, or moe='ragged'), or use "
            "a context parallelism with the contiguous layout (cp_ring, cp_ulysses)"
        )


# ------------------------------------------------------------------------------------------------------------
# Expert parallelism as strategies: the `experts` dimension over the `expert` mesh axis, the moe slot's kernel
# (all_to_all above, or einsum for GSPMD's own dispatch).
register_strategy(
    Strategy(
        "ep",
        table(experts="expert"),
        table(batch=("data", "expert"), experts="expert"),
        required_axes=("expert",),
        kernels={"moe": "all_to_all"},
        description="expert parallelism: tokens over data x expert, each device holds E / expert of the experts; "
        "dispatch and combine by all_to_all over expert",
        collectives="2 all-to-alls forward + 2 backward per MoE layer over expert; gradient all-reduce of the "
        "replicated weights over data x expert, of the experts' over data",
    )
)
register_strategy(
    Strategy(
        "ep_tp",
        table(experts="expert", mlp="tensor"),
        table(batch=("data", "expert"), experts="expert", mlp="tensor"),
        required_axes=("expert", "tensor"),
        kernels={"moe": "all_to_all"},
        description="ep with every expert's MLP tensor-split (Megatron's column / row split of mlp over tensor)",
        collectives="ep's all-to-alls over expert; an all-reduce over tensor of each expert MLP's output",
    )
)
register_strategy(
    Strategy(
        "ep_fsdp",
        table(experts="expert", embed="fsdp"),
        table(batch=("data", "fsdp", "expert"), experts="expert"),
        required_axes=("expert", "fsdp"),
        kernels={"moe": "all_to_all"},
        description="ep with ZeRO-3: tokens over data x fsdp x expert, parameters (and the experts' slices) over fsdp",
        collectives="ep's all-to-alls over expert; parameter all-gathers and gradient reduce-scatters over fsdp",
    )
)
register_strategy(
    strategy("ep").replace(
        name="ep_gspmd",
        kernels={"moe": "einsum"},
        description="ep's rules with the dispatch / combine einsums left to GSPMD; Flaxformer's reshape of groups "
        "and experts makes it compile to ep's 2 all-to-alls (a plain constraint would all-gather the tokens)",
    )
)


__all__ = ["GROUPED", "RAGGED_PADDING", "RAGGED_PATHS", "TILE", "GroupedFn", "apply", "capacity", "grouped_dot",
           "is_grouped", "params_experts", "route"]  # fmt: skip
