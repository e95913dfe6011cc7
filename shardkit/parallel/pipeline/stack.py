"""Pipeline parallelism over the `stage` mesh axis: GPipe, 1F1B and circular schedules as data.

A strategy selects it with `layers="pipeline:<schedule>[:<microbatches>[:<virtual stages>]]"`, e.g.
"pipeline:gpipe:8", "pipeline:1f1b:8", "pipeline:circular:8:2" (defaults: m = p microbatches, v = 2 for
circular). These pipeline microbatches are independent of TrainStep's `microbatches` (gradient accumulation,
which the pipeline kernels do not combine with). The parameter rules put the stacked `layers` axis on `stage`.

- GPipe (Huang et al. 2019, 1811.06965): all m forwards, then all backwards; bubble (p-1)/(m+p-1), every stage
  holds the activations of all m microbatches. Backward by autodiff through the forward loop.
- Circular / interleaved (Narayanan et al. 2021, 2104.04473 §2.2): stage s holds v chunks of L/(v p) layers,
  layer chunk c = r p + s (round robin); microbatches go round the ring v times; bubble (p-1)/(v m+p-1).
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, 2006.09503): after p-1-s warm-up forwards stage s alternates
  one forward and one backward, so at most p microbatches are in flight per stage. The loss is computed
  outside `apply_stack`, so the stack is a `jax.custom_vjp`: the primal runs the forward pipeline keeping no
  residuals; the backward replays the 1F1B table (forwards again, then backwards that recompute their stage
  from a stored stage input: at most p stored inputs per stage). Cost: 2 extra stage forwards per microbatch.

Every kernel is one `jax.shard_map` manual over `stage` and the batch mesh axes (those of the `batch` compute
rule, e.g. data / fsdp; tensor stays automatic, so its rules keep working inside). Activations move between
stages with `lax.ppermute` once per tick, and the tick loop is driven by `schedule(p, m, v, kind)`, a
[ticks, stages] table from which the tests also measure the bubble and the activations in flight.
Gradient reduction once per step: each device enters with its stage's full weights (FSDP's all-gather, once
per step, outside the tick loop) and marks them varying over the batch axes before the loop, so every tick
adds to a per-device, unreduced weight gradient (the price: one full-size stage gradient per device, as with
DDP's no_sync), and the one `psum` over the batch axes after the loop (the transpose of that mark; explicit
in 1F1B's backward) is the step's only gradient reduction over them.

Uneven stages (Whale, Jia et al. ATC'22, 2011.09208: devices of different speeds get different layer counts):
"pipeline:1f1b:4@3,5" gives stage s cut[s] contiguous layers (gpipe and 1f1b; `pipeline.stage_layers`, or the
min-max cut `sk.hetero.hetero_stage_plan` derives from a preset's device groups). The parameter layout does not
change (the stacked axis stays evenly on `stage`, so checkpoints and the other strategies are untouched): the
kernel gathers the stack into p x max(cut) slots, stage s's being its layers then padding slots (copies of its
last layer), once per step outside the shard_map (XLA moves the layers that change stage; the transpose of the
gather adds the slots' gradients back). Inside, each slot's layer runs under `lax.cond(slot < cut[s])` on the
device's stage index, so a padding slot computes nothing and its gradient is exactly zero. Circular is refused
with an uneven cut: its v equal chunks per stage would each be padded to the largest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from shardkit.errors import ShardkitError
from shardkit.layers import register_stack, scan_stack
from shardkit.parallel.pipeline.schedules import (
    BWD,
    FWD,
    IDLE,
    SCHEDULES,
    Schedule,
    bubble_formula,
    check_counts,
    parse,
    parse_cut,
    schedule,
    stage_cut,
)
from shardkit.rules import use_rules
from shardkit.strategies import DATA_FSDP, FSDP_RULES, TENSOR_RULES, Strategy, register_strategy, table

AXIS = "stage"


# ------------------------------------------------------------------------------------------------- kernels
def _split(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [m, B/m, ...], strided (row b to microbatch b % m) so each keeps the batch sharding."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _merge(x: jax.Array) -> jax.Array:
    """[m, B/m, ...] -> [B, ...], the inverse of `_split`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _to_stages(stacked: Any, p: int, v: int) -> Any:
    """[L, ...] -> [p, v, L/(v p), ...] with layer r p k + s k + j at [s, r, j] (round robin for v > 1)."""
    return jax.tree.map(lambda w: w.reshape(v, p, w.shape[0] // (v * p), *w.shape[1:]).swapaxes(0, 1), stacked)


def _to_slots(stacked: Any, cut: tuple[int, ...]) -> Any:
    """[L, ...] -> [p, 1, max(cut), ...]: stage s's slots are its cut[s] layers, then padding slots (copies of its
    last layer, which `_skipping` never applies). One gather per step; its transpose adds the slots' gradients
    back to the layers (a padding slot's is exactly zero)."""
    n_max, first = max(cut), np.cumsum((0, *cut))
    idx = np.array([first[s] + min(j, n - 1) for s, n in enumerate(cut) for j in range(n_max)], np.int32)
    return jax.tree.map(lambda w: w[idx].reshape(len(cut), 1, n_max, *w.shape[1:]), stacked)


def _skipping(block_fn: Callable, cut: tuple[int, ...]) -> Callable:
    """The layer body over (weights, slot j) on stage s: block_fn for j < cut[s], else x unchanged, computing nothing
    (`lax.cond` on the device's own stage index: every device of one stage takes the same branch)."""
    counts = np.asarray(cut, np.int32)

    def block(slot: tuple, x: jax.Array, *args: Any) -> jax.Array:
        w, j = slot
        held = jnp.asarray(counts)[lax.axis_index(AXIS)]
        return lax.cond(j < held, lambda h: block_fn(w, h, *args), lambda h: h, x)

    return block


def _varying(x: Any, axes: tuple[str, ...] = (AXIS,)) -> Any:
    """Marks values as differing across the manual `axes` (shard_map's vma check; idempotent)."""

    def vary(a: jax.Array) -> jax.Array:
        t = jax.typeof(a)  # jax 0.12: aval.vma; jax 0.10: aval.manual_axis_type.varying
        vma = getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ())
        missing = tuple(ax for ax in axes if ax not in vma)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(vary, x)


def _local(params: Any, batch: tuple[str, ...]) -> Any:
    """Weights as per-device copies over the batch axes: their gradient (the transpose) is psummed here, once."""
    return _varying(params, batch) if batch else params


def _gathered(params: Any, gather: bool = True) -> Any:
    """Stage weights replicated over the automatic axes: FSDP's all-gather once per step, not once per tick."""
    if not gather:
        return params
    rep = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), P())
    return jax.tree.map(lambda w: lax.with_sharding_constraint(w, rep), params)


def _select(cond: jax.Array, new: jax.Array, buf: jax.Array, i: jax.Array) -> jax.Array:
    """buf[i] = new where cond (one slice rewritten, not the whole buffer)."""
    return buf.at[i].set(jnp.where(cond, new, buf[i]))


def _forward_body(stage_fn: Callable, p: int, m: int, v: int, gather: bool, batch: tuple[str, ...]) -> Callable:
    """Per-device forward of the GPipe/circular pipeline: x [m, b, ...] -> y [1, m, b, ...] (valid on stage 0)."""

    def body(params: Any, xm: jax.Array, argsm: tuple) -> jax.Array:
        params = _gathered(jax.tree.map(lambda w: w[0], params), gather)  # [v, k, ...]: this stage's chunks
        params = _local(params, batch)  # outside the tick loop: d(params) is reduced over `batch` once
        s = lax.axis_index(AXIS)
        ring = [(k, (k + 1) % p) for k in range(p)]

        def tick(carry: tuple, t: jax.Array) -> tuple[tuple, None]:
            recv, buf = carry  # recv: [b, ...] sent by stage s-1 last tick; buf: [m, b, ...] ring input on stage 0
            j = jnp.clip(t - s, 0, v * m - 1)
            r, i = j // m, j % m
            inp = jnp.where(s == 0, buf[i], recv)
            w = jax.tree.map(lambda a: a[r], params)
            y = stage_fn(w, inp, *(a[i] for a in argsm))
            sent = lax.ppermute(y, AXIS, ring)  # [b, ...] stage s -> s+1, and p-1 -> 0 (next repeat / output)
            jl = t - (p - 1)  # what stage p-1 computed this tick lands in stage 0's buffer
            ok = (s == 0) & (jl >= 0) & (jl < v * m)
            return (sent, _select(ok, sent, buf, jnp.clip(jl, 0, v * m - 1) % m)), None

        carry = _varying((jnp.zeros_like(xm[0]), xm), (AXIS, *batch))
        (_, buf), _ = lax.scan(tick, carry, jnp.arange(v * m + p - 1))
        return buf[None]

    return body


def _one_f_one_b_body(stage_fn: Callable, sched: Schedule, gather: bool, batch: tuple[str, ...]) -> Callable:
    """Per-device 1F1B backward: (x [m, b, ...], dy [m, b, ...]) -> (dW [1, 1, k, ...], dx [1, m, b, ...])."""
    p = sched.stages
    table = np.stack([sched.op, sched.mb], axis=-1)  # [ticks, p, 2]

    def body(params: Any, xm: jax.Array, argsm: tuple, dym: jax.Array) -> tuple[Any, jax.Array]:
        params = _local(_gathered(jax.tree.map(lambda w: w[0, 0], params), gather), batch)  # [k, ...]
        s = lax.axis_index(AXIS)
        vary = lambda a: _varying(a, (AXIS, *batch))
        zero = vary(jnp.zeros_like(xm[0]))

        def tick(carry: tuple, row: jax.Array) -> tuple[tuple, None]:
            xbuf, gbuf, dw, dx_out = carry  # xbuf/gbuf: [p, b, ...] stage inputs / output grads by slot i % p
            op, i = row[s, 0], row[s, 1]
            args = tuple(a[i] for a in argsm)
            x_in = jnp.where(s == 0, xm[i], xbuf[i % p])
            f = lambda w, x: stage_fn(w, x, *args)

            def fwd(_: None) -> tuple:
                return f(params, x_in), zero, jax.tree.map(jnp.zeros_like, params)

            def bwd(_: None) -> tuple:
                g = jnp.where(s == p - 1, dym[i], gbuf[i % p])
                dwi, dxi = jax.vjp(f, params, x_in)[1](g)
                return zero, dxi, dwi

            def idle(_: None) -> tuple:
                return zero, zero, jax.tree.map(jnp.zeros_like, params)

            y, dx, dwi = lax.switch(op, [lambda _, br=br: vary(br(None)) for br in (idle, fwd, bwd)], None)
            dw = jax.tree.map(jnp.add, dw, dwi)
            dx_out = _select((s == 0) & (op == BWD), dx, dx_out, i)
            y_recv = lax.ppermute(y, AXIS, [(k, k + 1) for k in range(p - 1)])  # [b, ...] s -> s+1
            g_recv = lax.ppermute(dx, AXIS, [(k + 1, k) for k in range(p - 1)])  # [b, ...] s -> s-1
            prev, nxt = row[jnp.maximum(s - 1, 0)], row[jnp.minimum(s + 1, p - 1)]
            xbuf = _select((s > 0) & (prev[0] == FWD), y_recv, xbuf, prev[1] % p)
            gbuf = _select((s < p - 1) & (nxt[0] == BWD), g_recv, gbuf, nxt[1] % p)
            return (xbuf, gbuf, dw, dx_out), None

        buf = jnp.zeros((p, *xm.shape[1:]), xm.dtype)
        carry = vary((buf, buf, jax.tree.map(jnp.zeros_like, params), jnp.zeros_like(xm)))
        (_, _, dw, dx), _ = lax.scan(tick, carry, jnp.asarray(table))
        dw = lax.psum(dw, batch) if batch else dw  # the step's one gradient reduction over the batch axes
        return jax.tree.map(lambda a: a[None, None], dw), dx[None]

    return body


def pipeline_stack(
    block_fn: Callable, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """The `register_stack("pipeline", ...)` kernel: x [B, ...] -> x [B, ...] through L layers on p stages."""
    name = context.kernels.get("layers", "pipeline") if context is not None else "pipeline"
    p = context.mesh.shape.get(AXIS, 1) if context is not None else 1
    kind, m, v = parse(name, p)
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    cut = stage_cut(name, p, num_layers)  # None: L/p layers per stage
    if cut is None and num_layers % (p * v):
        raise ShardkitError(
            f"{name!r}: {num_layers} layers are not divisible by {p} stages x {v} virtual stages = {p * v}"
        )
    if not isinstance(x, jax.Array):  # e.g. the MoE GPT's (x, aux losses) carry: the stages pass one array
        raise ShardkitError(
            f"{name!r}: the layer stack carries {type(x).__name__} of {len(jax.tree.leaves(x))} arrays between layers "
            "(a MoE model's router losses?); the pipeline kernels pass one activation array from stage to stage. Use "
            "layers='scan' (e.g. ep or fsdp for a MoE model) or a model whose blocks map an array to an array"
        )
    if x.shape[0] % m:
        raise ShardkitError(f"{name!r}: batch {x.shape[0]} is not divisible by {m} pipeline microbatches")
    check_counts(kind, p, m, v)
    if p == 1:
        return scan_stack(block_fn, stacked, x, *args, remat=remat)
    keep = [k for k, a in enumerate(args) if a is not None]
    # The batch mesh axes are manual too (so weight gradients stay per device until one psum after the loop);
    # inside, the batch rule is None: each device already holds only its rows.
    axes_of = lambda axes: (axes,) if isinstance(axes, str) else tuple(axes or ())
    batch = tuple(a for a in axes_of(context.rules.get("batch")) if a in context.mesh.shape)
    d = int(np.prod([context.mesh.shape[a] for a in batch]))
    if (x.shape[0] // m) % d:
        raise ShardkitError(
            f"{name!r}: microbatch of {x.shape[0] // m} rows (batch {x.shape[0]} / {m}) is not divisible by the"
            f" batch mesh axes {batch} of size {d}"
        )
    rules = {k: tuple(a for a in axes_of(axes) if a not in batch) or None for k, axes in context.rules.items()}
    # Weights sharded only over the batch axes (FSDP) are gathered once per step; with tensor-style axes in the
    # compute rules the weights keep their layout (their gather, if any, stays per tick).
    gather = not {a for axes in rules.values() for a in (axes or ())} - {AXIS}

    def stage_fn(w: Any, h: jax.Array, *a: jax.Array) -> jax.Array:
        """k layers on one microbatch, constrained on the abstract mesh in which `stage` and `batch` are manual."""
        mesh = jax.sharding.get_abstract_mesh()
        with use_rules(mesh, rules, kernels=context.kernels):
            if cut is None:
                return scan_stack(block_fn, w, h, *_refill(args, keep, a), remat=remat)
            slots = (w, jnp.arange(max(cut)))
            return scan_stack(_skipping(block_fn, cut), slots, h, *_refill(args, keep, a), remat=remat)

    manual, rows = {AXIS, *batch}, P(None, batch or None)  # rows: [m, b, ...] with b split over `batch`
    fwd = jax.shard_map(
        _forward_body(stage_fn, p, m, v, gather, batch),
        mesh=context.mesh,
        in_specs=(P(AXIS), rows, rows),
        out_specs=P(AXIS, None, batch or None),
        axis_names=manual,
    )
    staged = _to_stages(stacked, p, v) if cut is None else _to_slots(stacked, cut)
    xm, argsm = _split(x, m), tuple(_split(args[k], m) for k in keep)
    if kind != "1f1b":
        return _merge(fwd(staged, xm, argsm)[0])
    bwd = jax.shard_map(
        _one_f_one_b_body(stage_fn, schedule(p, m, 1, kind), gather, batch),
        mesh=context.mesh,
        in_specs=(P(AXIS), rows, rows, rows),
        out_specs=(P(AXIS), P(AXIS, None, batch or None)),
        axis_names=manual,
    )

    @jax.custom_vjp
    def run(w: Any, xm: jax.Array, argsm: tuple) -> jax.Array:
        return fwd(w, xm, argsm)[0]

    def run_fwd(w: Any, xm: jax.Array, argsm: tuple) -> tuple[jax.Array, tuple]:
        return run(w, xm, argsm), (w, xm, argsm)

    def run_bwd(res: tuple, dy: jax.Array) -> tuple:
        w, xm, argsm = res
        dw, dx = bwd(w, xm, argsm, dy)
        return dw, dx[0], jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), argsm)

    run.defvjp(run_fwd, run_bwd)
    return _merge(run(staged, xm, argsm))


def _refill(args: tuple, keep: list[int], given: tuple) -> list[Any]:
    out = list(args)
    for k, a in zip(keep, given, strict=True):
        out[k] = a
    return out


def configure_name(name: str, options: dict[str, Any]) -> str:
    """The kernel name for a run's `pipeline` options (schedule, microbatches, virtual_stages; 0 = default;
    stage_layers: "" = even, "3,5" = layers per stage, appended as "@3,5"). A "hetero" cut must already be
    resolved to counts (`sk.hetero.hetero_stage_plan`: it needs the mesh and the layer count)."""
    kind, m = options.get("schedule", "gpipe"), options.get("microbatches", 0)
    v = options.get("virtual_stages", 0)
    name = f"pipeline:{kind}" + (f":{m}" if m or v else "") + (f":{v}" if v else "")
    cut = str(options.get("stage_layers", "") or "").strip()
    if cut == "hetero":
        raise ShardkitError(
            "pipeline.stage_layers='hetero' is resolved from the hardware preset's [[groups]], the mesh and the "
            "layer count by experiments/train.py (sk.hetero.hetero_stage_plan); here give the counts, e.g. '3,5'"
        )
    return name + (f"@{','.join(map(str, parse_cut(cut, 'pipeline.stage_layers')))}" if cut else "")


register_stack("pipeline", pipeline_stack, configure=configure_name)

__all__ = [
    "BWD",
    "FWD",
    "IDLE",
    "SCHEDULES",
    "Schedule",
    "bubble_formula",
    "configure_name",
    "parse",
    "parse_cut",
    "pipeline_stack",
    "schedule",
    "stage_cut",
]


# ------------------------------------------------------------------------------------------------------------
# The pp* strategies: the stacked `layers` axis rests on `stage`, `layers="pipeline:<schedule>[:<m>[:<v>]]"` picks
# the kernel above (m defaults to the stage count); other axes work inside the pipeline through the usual rules.

for _name, _params, _compute, _required, _what in (
    ("pp", {}, {}, ("stage",), "layers over stage only"),
    ("pp_dp", {}, {"batch": "data"}, ("stage", "data"), "layers over stage x batch over data"),
    ("pp_fsdp", FSDP_RULES, {"batch": DATA_FSDP}, ("stage", "fsdp"), "layers over stage x fsdp (ZeRO-3)"),
    (
        "pp_tp",
        TENSOR_RULES,
        {"batch": "data", **TENSOR_RULES},
        ("stage", "tensor"),
        "layers over stage x Megatron tp over tensor",
    ),
):
    register_strategy(
        Strategy(
            _name,
            table(layers="stage", **_params),
            table(**_compute),
            required_axes=_required,
            layers="pipeline:gpipe",
            description=f"pipeline: {_what}; schedule in `layers` (pipeline:gpipe|1f1b|circular[:m[:v]][@n_0,...])",
            collectives="collective-permute of one microbatch activation per tick over stage (fwd and bwd)"
            " + the other axes' collectives",
        )
    )
