"""The balanced data-parallel train step: device d runs counts[d] equal micro-batches (hetero.py has the split).

    step = sk.make_train_step(model, tx, mesh, sk.hetero.make_strategy(counts=[3, 3, 2, 2, 1, 1, 2, 2], microbatch=4))
    state, metrics = step(state, batch)      # batch: sum(counts) * microbatch rows, device d's rows contiguous

The batch's rows are laid out on the host as `[devices, max(counts), microbatch, ...]` (device d's rows are
rows offset_d .. offset_d + counts[d] * microbatch of the global batch; the rest of its slots are padding it never
reads). Inside one `shard_map` each device runs a `lax.fori_loop` of `counts[d]` iterations (`mode="loop"`: a
per-device trip count, so a device with fewer micro-batches does less work) or of max(counts) iterations with the
padding weighted 0 (`mode="pad"`: what padding and masking costs, for comparison). The parameters are marked
varying over the axis before the loop (`lax.pcast`), so each device's gradient stays local in the loop and the
one all-reduce comes after it: the gradient is the exact mean over the global batch, as one device computes it.

Model state (docs/hetero.md): dropout (`sk.layers.Dropout`) draws each example's mask from its global row, on any
split. BatchNorm (`sk.layers.BatchNorm`) under the default "global" `norm` kernel needs every example's sums before
it normalises, which uneven loops cannot give it: each device then runs its max(counts) slots as the lanes of one
vmap (`_one_pass`), padding masked out of the statistics, which are summed over the lanes and all-reduced: one
device's statistics and running averages. Under `norm=group` the loops stay and each micro-batch is normalised by
its own statistics (one device under `norm=group:G`, G = sum(counts)).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.batch_layers import BatchNorm, Dropout, local_batch
from shardkit.clipping import global_norm
from shardkit.dispatch import register_step
from shardkit.errors import ShardkitError
from shardkit.parallel.hetero.uneven import HeteroConfig, even_split, simulated_step_time, split_batch
from shardkit.parallel.hetero.uneven import make_strategy as hetero_strategy
from shardkit.step import TrainState, TrainStep, check_alive, require_one_axis


@register_step("hetero")
class HeteroTrainStep(TrainStep):
    """`make_train_step` for `sk.hetero.make_strategy(counts, microbatch)`: a TrainStep whose batch is split
    unevenly."""

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
        cfg = self.options_of(HeteroConfig, "sk.hetero.make_strategy(counts, microbatch)")
        self.cfg, axis, mesh = cfg, cfg.axis, self.mesh
        require_one_axis(mesh, axis, "hetero_dp", self.microbatches)
        if len(cfg.counts) != mesh.shape[axis]:
            raise ShardkitError(
                f"hetero counts {list(cfg.counts)} name {len(cfg.counts)} devices but the {axis!r} axis has "
                f"{mesh.shape[axis]}: give one micro-batch count per device (sk.hetero.split_batch)"
            )
        self.norm = self.strategy.kernels.get("norm", "global")
        self.batch_stats = check_model_state(self.source_model, self.norm)
        # BatchNorm over the global batch needs every device's rows before it normalises: one pass per device
        self.one_pass = self.batch_stats and self.norm == "global"
        self.offsets = np.concatenate([[0], np.cumsum(cfg.counts)[:-1]]) * cfg.microbatch
        self._rows = self._row_index()
        self._blocks = self._rows.reshape(len(cfg.counts), max(cfg.counts), cfg.microbatch)  # rows per micro-batch

    def _row_index(self) -> np.ndarray:
        """int [devices, max(counts) * microbatch]: the global row each slot reads (padding reads its own first)."""
        c, mb = self.cfg.counts, self.cfg.microbatch
        width = max(c) * mb
        return np.stack([off + (np.arange(width) % (n * mb)) for off, n in zip(self.offsets, c, strict=True)])

    def describe(self, say: Any = print) -> None:
        """The split, and with the devices' speeds the simulated step time of it vs the even split (CLI header):
        of the work each device computes, max(counts) everywhere when padded (mode=pad, or global BatchNorm)."""
        c, m = self.cfg, max(self.cfg.counts)
        how = "per-device trip counts" if c.mode == "loop" else f"padded to {m} and masked"
        if self.one_pass:
            how = f"one pass of {m} slots per device, padding masked (BatchNorm statistics over the global batch)"
        say(f"  hetero: micro-batches of {c.microbatch} per device {list(c.counts)} (sum {sum(c.counts)}), {how}")
        if self.one_pass:
            say(
                "  hetero: every device computes as much as the busiest (BatchNorm needs the sums over every example "
                "before it normalises); --config.kernels=norm=group: per-micro-batch statistics, per-device trip counts"
            )
        if c.speeds:
            even = even_split(sum(c.counts), len(c.counts))
            work = list(c.counts) if c.mode == "loop" and not self.one_pass else [m] * len(c.counts)
            t, t_even = simulated_step_time(work, c.speeds), simulated_step_time(even, c.speeds)
            say(
                f"  hetero: speeds {list(c.speeds)}: simulated step time {t:.2f} vs {t_even:.2f} for the even split "
                f"{even} (micro-batch units; x{t_even / t:.2f}). Simulated: these devices are not the preset's"
            )

    # ------------------------------------------------------------------------------------------------ batch
    def check_batch(self, batch: Any, microbatches: int | None = None, *, evaluation: bool = False) -> None:
        """A training batch: exactly sum(counts) x microbatch rows. With `evaluation=True` (what `evaluate` and the
        CLI's check of validation batches pass): an evaluation batch, split evenly as under dp."""
        if evaluation:
            return super().check_batch(batch, evaluation=True)
        for path, x in jax.tree_util.tree_leaves_with_path(batch):
            if x.shape[0] != self.cfg.global_batch:
                raise ShardkitError(
                    f"batch{jax.tree_util.keystr(path)} has {x.shape[0]} rows; hetero_dp's counts "
                    f"{list(self.cfg.counts)} x {self.cfg.microbatch} need exactly {self.cfg.global_batch}"
                )
        return None

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
        return super().evaluate(state, batch)

    # ------------------------------------------------------------------------------------------------- step
    def _local(self, params: Any, model_state: Any, batch: Any) -> tuple[Any, jax.Array, Any, Any]:
        """One device: its counts[d] micro-batches in a loop with no collective inside; then one all-reduce."""
        axis, counts = self.cfg.axis, jnp.asarray(self.cfg.counts, jnp.int32)
        me = jax.lax.axis_index(axis)
        mine, blocks = counts[me], jnp.asarray(self._blocks)[me]  # blocks[i]: micro-batch i's global rows
        params = jax.lax.pcast(params, (axis,), to="varying")  # local gradients inside the loop (module doc)

        def loss(p: Any, b: Any, rows: jax.Array) -> Any:
            with local_batch(rows):  # dropout: one key per global row; BatchNorm (norm=group): this micro-batch's
                return self.apply(p, model_state, b, local=True)

        value_and_grad = jax.value_and_grad(loss, has_aux=True)

        def body(i: jax.Array, acc: Any) -> Any:
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x[0], i, keepdims=False), batch)
            (loss, (aux, new)), grads = value_and_grad(params, mb, blocks[i])
            weight = (i < mine).astype(jnp.float32)  # 1 except on padding (mode="pad")
            summed = jax.tree.map(lambda a, v: a + weight * v.astype(a.dtype), acc[0], (loss, aux, grads))
            # model state: floats (BatchNorm's running statistics) averaged over the micro-batches, as the "group"
            # norm kernel averages its groups'; integers (RNG counters, key data) are the same in every one
            kept = jax.tree.map(lambda a, v: a + weight * v if _floating(a) else jnp.where(weight > 0, v, a),
                                acc[1], _vary(new, axis))  # fmt: skip
            return summed, kept

        first = jax.tree.map(lambda x: x[0, 0], batch)
        (loss_s, (aux_s, _)), grads_s = jax.eval_shape(value_and_grad, params, first, blocks[0])
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32)),
                             (loss_s, aux_s, grads_s))  # fmt: skip
        state0 = jax.tree.map(lambda x: jnp.zeros_like(x) if _floating(x) else x, model_state)
        init = _vary((jax.lax.pcast(zeros, (axis,), to="varying"), state0), axis)
        trips = mine if self.cfg.mode == "loop" else max(self.cfg.counts)
        total, new = jax.lax.fori_loop(0, trips, body, init)
        g = sum(self.cfg.counts)
        loss, aux, grads = jax.tree.map(lambda x: jax.lax.psum(x, axis) / g, total)
        new = jax.tree.map(lambda x: jax.lax.psum(x, axis) / g if _floating(x) else jax.lax.pmax(x, axis), new)
        return grads, loss, aux, new

    def _one_pass(self, params: Any, model_state: Any, batch: Any) -> tuple[Any, jax.Array, Any, Any]:
        """One device, BatchNorm over the global batch: its max(counts) micro-batch slots as lanes of one vmap, the
        padding slots masked out of every BatchNorm's sums, which are all-reduced over the lanes and the devices
        before normalising (shardkit/batch_layers.py): the statistics one device takes of the whole batch."""
        axis, counts = self.cfg.axis, jnp.asarray(self.cfg.counts, jnp.int32)
        me = jax.lax.axis_index(axis)
        valid, blocks = jnp.arange(max(self.cfg.counts)) < counts[me], jnp.asarray(self._blocks)[me]
        params = jax.lax.pcast(params, (axis,), to="varying")  # gradients local until the one all-reduce after

        def lane(p: Any, b: Any, rows: jax.Array, ok: jax.Array) -> Any:
            with local_batch(rows, ok, (axis,), lanes=True):
                loss, (aux, new) = self.apply(p, model_state, b, local=True)
            return loss, aux, new

        def total(p: Any) -> Any:
            lanes = jax.vmap(lane, in_axes=(None, 0, 0, 0))
            loss, aux, new = lanes(p, jax.tree.map(lambda x: x[0], batch), blocks, valid)
            w = valid.astype(jnp.float32)  # padding slots weigh 0
            weigh = lambda v: (w * v.astype(jnp.promote_types(v.dtype, jnp.float32))).sum()
            return weigh(loss), (jax.tree.map(weigh, aux), jax.tree.map(lambda x: x[0], new))

        (loss, (aux, new)), grads = jax.value_and_grad(total, has_aux=True)(params)
        g = sum(self.cfg.counts)
        loss, aux, grads = jax.tree.map(lambda x: jax.lax.psum(x, axis) / g, (loss, aux, grads))
        # every lane and device holds the same new statistics / counters (from all-reduced sums): pmax is exact
        new = jax.tree.map(lambda x: jax.lax.pmax(x, axis) if axis in _vma(x) else x, new)
        return grads, loss, aux, new

    def step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        specs = jax.tree.map(lambda _: P(self.cfg.axis), batch)
        fn = self._one_pass if self.one_pass else self._local
        local = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), P(), specs), out_specs=P())
        grads, loss, aux, model_state = local(state.params, state.model_state, batch)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = jax.lax.with_sharding_constraint(optax.apply_updates(state.params, updates), self.param_shardings)
        metrics = {**aux, "loss": loss, "grad_norm": global_norm(grads)}
        model_state = jax.tree.map(lambda new, old: new.astype(old.dtype), model_state, state.model_state)
        return TrainState(state.step + 1, params, opt_state, model_state), metrics


def _floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _vma(x: Any) -> frozenset:
    t = jax.typeof(x)  # jax 0.10 and 0.12: aval.manual_axis_type.varying; older: aval.vma
    return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))


def _vary(tree: Any, axis: str) -> Any:
    """Every leaf varying over `axis` (a loop carry's type must not change between iterations)."""
    return jax.tree.map(lambda x: x if axis in _vma(x) else jax.lax.pcast(x, (axis,), to="varying"), tree)


def check_model_state(model: nnx.Module, norm: str) -> bool:
    """Whether the model has BatchNorm statistics hetero_dp can carry (True: some); a ShardkitError naming any
    model state it cannot: Flax's own BatchNorm / Dropout (statistics and masks of each device's part alone),
    variables other than BatchNorm statistics and RNG streams, an explicit group count."""
    if ":" in norm:
        raise ShardkitError(
            f"kernels norm={norm!r}: under hetero_dp the groups are the micro-batches (norm=group: "
            "hetero.microbatch examples each); drop the count"
        )
    stats = False
    for path, node in nnx.iter_graph(model):
        where = "/".join(map(str, path)) or type(model).__name__
        if isinstance(node, nnx.BatchNorm) and not isinstance(node, BatchNorm):
            raise ShardkitError(
                f"hetero_dp: {where} is Flax's nnx.BatchNorm, whose statistics would be each device's uneven part's "
                "alone: use sk.layers.BatchNorm (the same layer; global statistics over the devices' parts)"
            )
        if isinstance(node, nnx.Dropout) and not isinstance(node, Dropout) and node.rate > 0:
            raise ShardkitError(
                f"hetero_dp: {where} is Flax's nnx.Dropout, whose masks would depend on how the batch is split "
                "(the same key on every device): use sk.layers.Dropout (one key per example)"
            )
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.Param | nnx.RngState):
            if not isinstance(node, nnx.BatchStat):
                raise ShardkitError(
                    f"hetero_dp cannot carry the model state {where} ({type(node).__name__}) through its per-device "
                    "loops (only BatchNorm statistics and RNG streams): use plain dp for this model"
                )
            stats = True
    return stats


__all__ = ["HeteroTrainStep", "check_model_state"]
