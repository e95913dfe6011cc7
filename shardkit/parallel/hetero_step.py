"""The balanced data-parallel train step: device d runs counts[d] equal micro-batches (hetero.py has the split).

    step = sk.make_train_step(model, tx, mesh, sk.hetero.strategy(counts=[3, 3, 2, 2, 1, 1, 2, 2], microbatch=4))
    state, metrics = step(state, batch)      # batch: sum(counts) * microbatch rows, device d's rows contiguous

The batch's rows are laid out on the host as `[devices, max(counts), microbatch, ...]` (device d's rows are
rows offset_d .. offset_d + counts[d] * microbatch of the global batch; the rest of its slots are padding it never
reads). Inside one `shard_map` each device runs a `lax.fori_loop` of `counts[d]` iterations (`mode="loop"`: a
per-device trip count, so a device with fewer micro-batches does less work) or of max(counts) iterations with the
padding weighted 0 (`mode="pad"`: what padding and masking costs, for comparison). The parameters are marked
varying over the axis before the loop (`lax.pcast`), so each device's gradient stays local in the loop and the
one all-reduce comes after it: the gradient is the exact mean over the global batch, as one device computes it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.clipping import global_norm
from shardkit.dispatch import register_step
from shardkit.errors import ShardkitError
from shardkit.parallel.hetero import HeteroConfig, even_split, simulated_step_time, split_batch
from shardkit.parallel.hetero import strategy as hetero_strategy
from shardkit.step import TrainState, TrainStep, check_alive, require_one_axis


@register_step("hetero")
class HeteroTrainStep(TrainStep):
    """`make_train_step` for `sk.hetero.strategy(counts, microbatch)`: a TrainStep whose batch is split unevenly."""

    @classmethod
    def configure(cls, strategy: Any, options: Any, *, devices: int, global_batch: int = 0, preset: Any = None,
                  **context: Any) -> Any:  # fmt: skip
        """Micro-batch counts balanced over the devices' speeds (a run's `hetero` section): speeds from
        `speeds` ("2,2,1,1,...") or else from the mesh preset's [[groups]]; caps from `microbatch_bytes` (0:
        uncapped) against each device's memory; `balance=False` gives the even split (for comparison)."""
        if not options:
            return strategy
        micro = int(options.get("microbatch", 1))
        if global_batch % micro:
            raise ShardkitError(
                f"batch_size={global_batch} is not a whole number of hetero.microbatch={micro} examples"
            )
        if options.get("speeds"):
            speeds = [float(v) for v in str(options["speeds"]).split(",")]
        elif preset is not None and preset.groups:
            speeds = preset.device_speeds()
        else:
            raise ShardkitError(
                "strategy=hetero_dp needs device speeds: a heterogeneous mesh preset (--config.mesh=hetero_v100_p100, "
                "hetero_a100_h100) or --config.hetero.speeds=2,2,1,1,..."
            )
        if len(speeds) != devices:
            raise ShardkitError(f"{len(speeds)} device speeds {speeds} for {devices} devices: give one per device")
        total = global_batch // micro
        memory = preset.device_memory() if preset is not None and preset.groups else None
        per = float(options.get("microbatch_bytes", 0.0))
        caps = [int(m // per) for m in memory] if memory and per else None
        counts = split_batch(total, speeds, caps) if options.get("balance", True) else even_split(total, devices)
        return hetero_strategy(counts, micro, mode=options.get("mode", "loop"), speeds=speeds)

    def setup(self) -> None:
        cfg = self.options_of(HeteroConfig, "sk.hetero.strategy(counts, microbatch)")
        self.cfg, axis, mesh = cfg, cfg.axis, self.mesh
        require_one_axis(mesh, axis, "hetero_dp", self.microbatches)
        if len(cfg.counts) != mesh.shape[axis]:
            raise ShardkitError(
                f"hetero counts {list(cfg.counts)} name {len(cfg.counts)} devices but the {axis!r} axis has "
                f"{mesh.shape[axis]}: give one micro-batch count per device (sk.hetero.split_batch)"
            )
        if self.has_model_state:
            raise ShardkitError(
                "hetero_dp does not carry model state (BatchNorm statistics, dropout RNG) through its per-device "
                "loops yet: use a model without it, or plain dp"
            )
        self.offsets = np.concatenate([[0], np.cumsum(cfg.counts)[:-1]]) * cfg.microbatch
        self._rows = self._row_index()

    def _row_index(self) -> np.ndarray:
        """int [devices, max(counts) * microbatch]: the global row each slot reads (padding reads its own first)."""
        c, mb = self.cfg.counts, self.cfg.microbatch
        width = max(c) * mb
        return np.stack([off + (np.arange(width) % (n * mb)) for off, n in zip(self.offsets, c, strict=True)])

    def describe(self, say: Any = print) -> None:
        """The split, and with the devices' speeds the simulated step time of it vs the even split (CLI header)."""
        c = self.cfg
        say(
            f"  hetero: micro-batches of {c.microbatch} per device {list(c.counts)} (sum {sum(c.counts)}), "
            f"{'per-device trip counts' if c.mode == 'loop' else 'padded to ' + str(max(c.counts)) + ' and masked'}"
        )
        if c.speeds:
            even = even_split(sum(c.counts), len(c.counts))
            t, t_even = simulated_step_time(c.counts, c.speeds), simulated_step_time(even, c.speeds)
            say(
                f"  hetero: speeds {list(c.speeds)}: simulated step time {t:.2f} vs {t_even:.2f} for the even split "
                f"{even} (micro-batch units; x{t_even / t:.2f}). Simulated: these devices are not the preset's"
            )

    # ------------------------------------------------------------------------------------------------ batch
    def check_batch(self, batch: Any, microbatches: int | None = None) -> None:
        if microbatches == 1 and self._evaluating:
            return super().check_batch(batch, 1)
        for path, x in jax.tree_util.tree_leaves_with_path(batch):
            if x.shape[0] != self.cfg.global_batch:
                raise ShardkitError(
                    f"batch{jax.tree_util.keystr(path)} has {x.shape[0]} rows; hetero_dp's counts "
                    f"{list(self.cfg.counts)} x {self.cfg.microbatch} need exactly {self.cfg.global_batch}"
                )
        return None

    _evaluating = False

    def prepare(self, batch: Any) -> Any:
        return self.layout(batch)

    def layout(self, batch: Any) -> Any:
        """The global batch -> `[devices, max(counts), microbatch, ...]` on the host, each device's block on it."""
        w, m = len(self.cfg.counts), max(self.cfg.counts)
        sharding = NamedSharding(self.mesh, P(self.cfg.axis))

        def one(x: Any) -> jax.Array:
            if isinstance(x, jax.ShapeDtypeStruct):  # lowering from shapes only (the CLI, sk.explain)
                return jax.ShapeDtypeStruct((w, m, self.cfg.microbatch, *x.shape[1:]), x.dtype, sharding=sharding)
            rows = np.asarray(x)[self._rows.reshape(-1)]
            return jax.device_put(rows.reshape(w, m, self.cfg.microbatch, *rows.shape[1:]), sharding)

        return jax.tree.map(one, batch)

    def _compiled(self, laid: Any) -> Any:
        key = "hetero", jax.tree.structure(laid), tuple(x.ndim for x in jax.tree.leaves(laid))
        return self.jit(key, jax.tree.map(lambda _: NamedSharding(self.mesh, P(self.cfg.axis)), laid))

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        if self.donate:
            check_alive(state, "this TrainState")
        self.check_state(state)
        self.check_batch(batch)
        laid = self.layout(batch)
        return self._compiled(laid)(state, laid)

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        self.check_batch(batch)
        laid = self.layout(batch)
        return self._compiled(laid).lower(state, laid)

    def evaluate(self, state: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Evaluation is not uneven: the batch is split evenly, as under dp."""
        self._evaluating = True
        try:
            return super().evaluate(state, batch)
        finally:
            self._evaluating = False

    # ------------------------------------------------------------------------------------------------- step
    def _local(self, params: Any, batch: Any) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
        """One device: its counts[d] micro-batches in a loop with no collective inside; then one all-reduce."""
        axis, counts = self.cfg.axis, jnp.asarray(self.cfg.counts, jnp.int32)
        mine = counts[jax.lax.axis_index(axis)]
        params = jax.lax.pcast(params, (axis,), to="varying")  # local gradients inside the loop (module doc)
        value_and_grad = jax.value_and_grad(
            lambda p, b: self.apply(p, self.initial_model_state, b, local=True), has_aux=True
        )

        def body(i: jax.Array, acc: Any) -> Any:
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x[0], i, keepdims=False), batch)
            (loss, (aux, _)), grads = value_and_grad(params, mb)
            weight = (i < mine).astype(jnp.float32)  # 1 except on padding (mode="pad")
            return jax.tree.map(lambda a, v: a + weight * v.astype(a.dtype), acc, (loss, aux, grads))

        first = jax.tree.map(lambda x: x[0, 0], batch)
        shapes = jax.eval_shape(lambda p, b: value_and_grad(p, b), params, first)
        (loss_s, (aux_s, _)), grads_s = shapes
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)),
                             (loss_s, aux_s, grads_s))  # fmt: skip
        zeros = jax.lax.pcast(zeros, (axis,), to="varying")
        trips = mine if self.cfg.mode == "loop" else max(self.cfg.counts)
        total = jax.lax.fori_loop(0, trips, body, zeros)
        loss, aux, grads = jax.tree.map(lambda x: jax.lax.psum(x, axis) / sum(self.cfg.counts), total)
        return grads, loss, aux

    def step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        specs = jax.tree.map(lambda _: P(self.cfg.axis), batch)
        local = jax.shard_map(self._local, mesh=self.mesh, in_specs=(P(), specs), out_specs=P())
        grads, loss, aux = local(state.params, batch)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(state.params, updates), self.param_shardings)
        metrics = {**aux, "loss": loss, "grad_norm": global_norm(grads)}
        return TrainState(state.step + 1, params, opt_state, state.model_state), metrics


__all__ = ["HeteroTrainStep"]
