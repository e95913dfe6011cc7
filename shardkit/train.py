"""The jitted training step: cross-entropy, gradient accumulation, optax update, explicit shardings, donation.

    step = sk.make_train_step(model, optax.adamw(3e-4), mesh, "fsdp", microbatches=2)
    state = step.init_state()                 # optimizer state created directly sharded
    state, metrics = step(state, batch)       # batch: {"inputs": int32[B, T], "targets": int32[B, T]}

Parameters (fp32 by default) live in `state.params` as a pure dict laid out by the strategy's parameter rules,
the optimizer state by its optimizer-state rules (= parameter rules except for ZeRO-1), and the forward pass
runs under its compute rules. Mixed precision: give the model a bf16 compute dtype; parameters, gradients,
the loss and the optimizer stay fp32.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.init import param_shardings
from shardkit.rules import logical_to_spec, use_rules
from shardkit.strategies import Strategy
from shardkit.strategies import strategy as get_strategy

Batch = dict[str, jax.Array]
BATCH_AXES = ("batch", "seq")  # logical names of every [B, T] batch entry (inputs, targets, positions, ...)


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: dict[str, Any]  # pure dict, the structure of nnx.split(model)[1].to_pure_dict()
    opt_state: Any


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats, computed in fp32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


class TrainStep:
    """A jitted `(state, batch) -> (state, metrics)` with in/out shardings fixed by the strategy."""

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        strategy: str | Strategy,
        microbatches: int = 1,
        donate: bool = True,
    ):
        if microbatches < 1:
            raise ShardkitError(f"microbatches={microbatches} must be >= 1")
        self.strategy = get_strategy(strategy)
        self.bound = self.strategy.bind(mesh)
        self.mesh, self.tx, self.microbatches, self._model = mesh, optimizer, microbatches, model
        self.graphdef, state = nnx.split(model)
        abstract = jax.eval_shape(lambda s: s, state)
        self.param_shardings = param_shardings(abstract, self.bound.param_rules, mesh)
        self._update_shardings = param_shardings(abstract, self.bound.opt_rules, mesh)
        abs_params = nnx.to_pure_dict(abstract)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.opt_shardings = optax.tree_utils.tree_map_params(
            optimizer,
            lambda _, s: s,
            jax.eval_shape(optimizer.init, abs_params),
            self._update_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.state_shardings = TrainState(step=replicated, params=self.param_shardings, opt_state=self.opt_shardings)
        self.batch_sharding = NamedSharding(mesh, logical_to_spec(BATCH_AXES, self.bound.compute_rules, mesh))
        self._replicated = replicated
        self._jitted = jax.jit(
            self._step,
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,) if donate else (),
        )
        self._eval = jax.jit(self._loss, in_shardings=(self.param_shardings, self.batch_sharding))

    # ----------------------------------------------------------------------------------------------- state
    def init_state(self, model: nnx.Module | None = None) -> TrainState:
        """Parameters from `model` (default: the one given at construction), optimizer state sharded.

        The step may be built from `sk.abstract_model(...)` (shapes only) to validate, lower or restore a
        checkpoint before any parameter exists; then pass the real model here.
        """
        params = nnx.to_pure_dict(nnx.split(model or self._model)[1])
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            raise ShardkitError(
                "this TrainStep was built from an abstract model (shapes only); pass the real model: "
                "step.init_state(sk.sharded_init(make_model, mesh, strategy))"
            )
        params = jax.device_put(params, self.param_shardings)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return TrainState(
            step=jax.device_put(jnp.zeros((), jnp.int32), self._replicated), params=params, opt_state=opt_state
        )

    def model(self, params: dict[str, Any]) -> nnx.Module:
        """The NNX module holding `params` (for evaluation or sampling)."""
        return nnx.merge(self.graphdef, params)

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the target tree for restoring a checkpoint onto this mesh."""
        params = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(self._model)[1]))
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(self.tx.init, params))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    # ------------------------------------------------------------------------------------------------ step
    def check_batch(self, batch: Batch) -> None:
        """Divisibility of the batch by the mesh and microbatches, checked before XLA sees it."""
        b, t = batch["inputs"].shape
        spec = self.batch_sharding.spec
        for dim, (size, axes) in enumerate(zip((b, t), tuple(spec) + (None,) * (2 - len(spec)), strict=True)):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
            degree = math.prod(self.mesh.shape[a] for a in axes) * (self.microbatches if dim == 0 else 1)
            if size % degree:
                what = "batch" if dim == 0 else "sequence length"
                raise ShardkitError(
                    f"{what} {size} is not divisible by {degree} (mesh axes {axes or '()'}"
                    f"{f' x {self.microbatches} microbatches' if dim == 0 and self.microbatches > 1 else ''}); "
                    f"use a {what} that is a multiple of {degree}"
                )

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        self.check_batch(batch)
        return self._jitted(state, batch)

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        self.check_batch(batch)
        return self._jitted.lower(state, batch)

    def eval_loss(self, params: dict[str, Any], batch: Batch) -> jax.Array:
        self.check_batch(batch)
        return self._eval(params, batch)

    def _loss(self, params: dict[str, Any], batch: Batch, rules: dict[str, Any] | None = None) -> jax.Array:
        rules = rules or self.bound.compute_rules
        with use_rules(self.mesh, rules, attention=self.strategy.attention, layers=self.strategy.layers):
            extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
            logits = nnx.merge(self.graphdef, params)(batch["inputs"], **extra)
            return cross_entropy(logits, batch["targets"])

    def _accumulate(self, params: dict[str, Any], batch: Batch) -> tuple[jax.Array, Any]:
        """Mean loss and gradient over `microbatches` slices of the batch, reduced over devices once.

        Under plain GSPMD a scan over microbatches all-reduces the gradients inside the loop, M times per step.
        Instead each of the D batch shards keeps its own unreduced gradient: the loss is vmapped over a leading
        shard axis placed on the batch mesh axes (`spmd_axis_name`), the accumulator is [D, *param] with one
        full-size gradient per device (the price, as with DDP's no_sync), and one sum over D after the loop is
        the step's only gradient reduction (an all-reduce, or a reduce-scatter for sharded parameters).
        """
        m = self.microbatches
        # Strided split: row r goes to microbatch r % m, so each microbatch keeps the batch's sharding.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)
        axes = self.bound.compute_rules.get("batch") or ()
        d = math.prod(self.mesh.shape[a] for a in axes)
        if d == 1:
            grad_fn = jax.value_and_grad(self._loss)
        else:
            local_rules = {**self.bound.compute_rules, "batch": None}  # the shard axis carries the batch sharding
            per_shard = jax.vmap(
                jax.value_and_grad(lambda p, b: self._loss(p, b, local_rules)), in_axes=(None, 0), spmd_axis_name=axes
            )
            split = lambda mb: jax.tree.map(lambda x: x.reshape(d, x.shape[0] // d, *x.shape[1:]), mb)
            grad_fn = lambda p, mb: per_shard(p, split(mb))

        def accumulate(carry: Any, mb: Batch) -> tuple[Any, None]:
            return jax.tree.map(jnp.add, carry, grad_fn(params, mb)), None

        zeros = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)
        if d > 1:
            unreduced = NamedSharding(self.mesh, PartitionSpec(axes))
            zeros = jax.lax.with_sharding_constraint(zeros, jax.tree.map(lambda _: unreduced, zeros))
        (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
        if d > 1:
            loss, grads = jax.tree.map(lambda x: x.sum(axis=0), (loss, grads))
        return jax.tree.map(lambda x: x / (m * d), (loss, grads))

    def _step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        grad_fn = jax.value_and_grad(self._loss)
        m = self.microbatches
        if m == 1:
            loss, grads = grad_fn(state.params, batch)
        else:
            loss, grads = self._accumulate(state.params, batch)
        # Gradients take the optimizer state's layout: the parameters' for most strategies; for ZeRO-1 they are
        # reduce-scattered, the update runs on optimizer-state shards, and the new parameters are all-gathered.
        grads = jax.lax.with_sharding_constraint(grads, self._update_shardings)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        updates = jax.lax.with_sharding_constraint(updates, self._update_shardings)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(state.params, updates), self.param_shardings)
        tokens = jnp.asarray(math.prod(batch["targets"].shape), jnp.int32)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": tokens}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_train_step(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | Strategy,
    microbatches: int = 1,
    donate: bool = True,
) -> TrainStep:
    """A jitted train step for `model` under `strategy` on `mesh`: `step(state, batch) -> (state, metrics)`."""
    return TrainStep(model, optimizer, mesh, strategy, microbatches=microbatches, donate=donate)


__all__ = ["TrainState", "TrainStep", "cross_entropy", "make_train_step"]
