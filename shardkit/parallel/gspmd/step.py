"""The GSPMD train step: the strategy's rules tables, XLA's partitioner, gradient accumulation, optax update.

The default step of every strategy (`Strategy.step == "gspmd"`): one `jax.jit` of the whole step with the
parameter / optimizer-state / batch shardings from the strategy's tables, and the forward pass traced under its
compute rules, so that GSPMD partitions every op. The interface it implements is shardkit/step.py's, the registry
`make_train_step` looks it up in shardkit/dispatch.py's; steps of their own live in shardkit/parallel/.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.accumulate import accumulate, split_microbatches
from shardkit.batch import Batch
from shardkit.clipping import clip_by_global_norm, global_norm, norm_weights
from shardkit.dispatch import make_train_step, register_step
from shardkit.losses import cross_entropy
from shardkit.rules import pin
from shardkit.step import TrainState, TrainStep


@register_step("gspmd")
class GSPMDStep(TrainStep):
    """The strategy's tables applied by GSPMD; `microbatches > 1` accumulates gradients with one reduction."""

    def _accumulate(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, Any, Any, Any]:
        """Mean loss, metrics and gradient over `microbatches` slices of the batch, reduced over devices once.

        Under plain GSPMD a scan over microbatches all-reduces the gradients inside the loop, M times per step.
        Instead each of the D batch shards keeps its own unreduced gradient: the loss is vmapped over a leading
        shard axis placed on the batch mesh axes (`spmd_axis_name`), the accumulator is [D, *param] with one
        full-size gradient per device (the price, as with DDP's no_sync), and one sum over D after the loop is
        the step's only gradient reduction (an all-reduce, or a reduce-scatter for sharded parameters).

        A model with state besides parameters (BatchNorm statistics, dropout RNG counters) takes a plain scan
        instead, carrying that state from microbatch to microbatch as one device would: per-shard vmapping would
        give per-shard batch statistics and the same random bits on every shard. Its gradients are reduced once
        per microbatch. So does explicit mode (strategy 'annotated' on Explicit axes).
        """
        m = self.microbatches
        axes = self.bound.compute_rules.get("batch") or ()
        d = math.prod(self.mesh.shape[a] for a in axes)
        value_and_grad = jax.value_and_grad(self.apply, has_aux=True)
        # sequential, the state carried (shardkit/accumulate.py); in explicit mode too: vmap refuses parameters
        # whose Explicit sharding names the batch axes it maps over
        if self.has_model_state or d == 1 or self.explicit:
            (loss, (aux, model_state)), grads = accumulate(value_and_grad, params, model_state, batch, m)
            return loss, aux, grads, model_state

        micro = split_microbatches(batch, m)  # each microbatch keeps the batch's sharding
        first = jax.tree.map(lambda x: x[0], micro)
        local_rules = {**self.bound.compute_rules, "batch": None}  # the shard axis carries the batch sharding
        per_shard = jax.vmap(
            lambda p, b: value_and_grad(p, model_state, b, local_rules), in_axes=(None, 0), spmd_axis_name=axes
        )
        split = lambda mb: jax.tree.map(lambda x: x.reshape(d, x.shape[0] // d, *x.shape[1:]), mb)

        def grad_fn(mb: Batch) -> Any:
            (loss, (aux, _)), grads = per_shard(params, split(mb))
            return loss, aux, grads

        def add(carry: Any, mb: Batch) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, carry, grad_fn(mb)), None

        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(grad_fn, first))
        unreduced = NamedSharding(self.mesh, PartitionSpec(axes))
        zeros = pin(zeros, jax.tree.map(lambda _: unreduced, zeros))
        total, _ = jax.lax.scan(add, zeros, micro)
        loss, aux, grads = jax.tree.map(lambda x: x.sum(axis=0) / (m * d), total)
        return loss, aux, grads, model_state

    def step_fn(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        params = self.params_on_device(state.params)  # host memory -> device when offloaded (shardkit/offload.py)
        if self.microbatches == 1:
            (loss, (aux, model_state)), grads = jax.value_and_grad(self.apply, has_aux=True)(
                params, state.model_state, batch
            )
        else:
            loss, aux, grads, model_state = self._accumulate(params, state.model_state, batch)
        # Gradients take the optimizer state's layout: the parameters' for most strategies; for ZeRO-1 they are
        # reduce-scattered, the update runs on optimizer-state shards, and the new parameters are all-gathered.
        # (`pin`: a sharding constraint; on Explicit axes, the strategy 'annotated' in explicit mode, a reshard)
        grads = pin(grads, self.update_shardings)
        updates, opt_state = self.tx.update(grads, self.opt_state_on_device(state.opt_state), params)
        updates = pin(updates, self.update_shardings)
        params = pin(optax.apply_updates(params, updates), self.param_shardings)
        model_state = pin(model_state, self.model_state_shardings)
        metrics = {**aux, "loss": loss, "grad_norm": global_norm(grads)}
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        return new, metrics


__all__ = [
    "GSPMDStep",
    "TrainState",
    "TrainStep",
    "clip_by_global_norm",
    "cross_entropy",
    "global_norm",
    "make_train_step",
    "norm_weights",
]
