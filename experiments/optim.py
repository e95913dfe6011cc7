"""The training runs' optimizer: AdamW with warmup + cosine decay and clipping, its settings checked up front."""

from __future__ import annotations

import math

import jax
import ml_collections
import optax

import shardkit as sk


def schedule_length(opt: ml_collections.ConfigDict, steps: int) -> tuple[int, int]:
    """(warmup steps, schedule length) as `make_optimizer` resolves them: the length is optimizer.decay_steps or
    `steps`, the warmup optimizer.warmup_steps or min(30, length // 10). A checkpoint records them, so that a resume
    with another `steps` says that the schedule changes (experiments/train.py)."""
    decay = opt.decay_steps or steps
    return (opt.warmup_steps if opt.warmup_steps >= 0 else min(30, decay // 10)), decay


def make_optimizer(opt: ml_collections.ConfigDict, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup + cosine decay to lr * min_lr_ratio, global-norm clipping, no decay on norms.

    The clipping is `sk.clip_by_global_norm` (optax's, but a parameter stored once per holder under SDP
    counts once).

    optimizer.warmup_steps < 0 (the default) = min(30, schedule length // 10), the schedule length being
    optimizer.decay_steps or steps."""
    if opt.name != "adamw":
        raise sk.ShardkitError(f"optimizer.name={opt.name!r}: only 'adamw' is implemented")
    checks = {
        "lr": opt.lr > 0,
        "grad_clip": opt.grad_clip >= 0,
        "weight_decay": opt.weight_decay >= 0,
        "eps": opt.eps >= 0,
        "b1": 0 <= opt.b1 < 1,
        "b2": 0 <= opt.b2 < 1,
        "min_lr_ratio": opt.min_lr_ratio >= 0,
    }
    for key, ok in checks.items():  # NaN fails every comparison: refused too
        if not ok or not math.isfinite(opt[key]):
            want = {"lr": "> 0", "eps": ">= 0", "b1": "in [0, 1)", "b2": "in [0, 1)"}.get(key, ">= 0 (0 = off)")
            raise sk.ShardkitError(f"optimizer.{key}={opt[key]} must be finite and {want} (a negative learning "
                                   "rate or clip norm would train uphill)")  # fmt: skip
    warmup, decay = schedule_length(opt, steps)
    if not warmup < decay:
        raise sk.ShardkitError(
            f"optimizer.warmup_steps={warmup} must be < {decay} (the schedule length: optimizer.decay_steps or "
            f"steps); set --config.optimizer.warmup_steps={decay // 10}, or -1 for min(30, {decay} // 10)"
        )
    schedule = optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, decay, opt.lr * opt.min_lr_ratio)
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params
    )
    adamw = optax.adamw(schedule, opt.b1, opt.b2, opt.eps, weight_decay=opt.weight_decay, mask=decay_mask)
    return (optax.chain(sk.clip_by_global_norm(opt.grad_clip), adamw) if opt.grad_clip else adamw), schedule
