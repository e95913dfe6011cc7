"""Subnetwork data parallelism's train step (the algorithm, ownership and holder averaging: sdp.py).

`sk.make_train_step(model, tx, mesh, sk.sdp.make_strategy(...))` returns an `SDPTrainStep`: the same interface as any
TrainStep (`init_state`, `__call__`, `evaluate`, `abstract_state` for checkpoints, `lower` for `sk.explain`).
One step is a `shard_map` over the workers' axis: each worker assembles its subnetwork from its slots, computes
its loss and gradient on its batch shard, then the split gradients (and BatchNorm statistics) are averaged over
their holders (`ring_average` / `psum_average`, all arrays of one ownership table packed into one buffer) and
the shared ones, with the loss and metrics, in one all-reduce. The optimizer then runs on the layout outside the
`shard_map`, elementwise on each device's shards; `clip_by_global_norm` counts each held block once
(`shardkit.clipping.norm_weights`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardkit import batch as batching
from shardkit.accumulate import accumulate
from shardkit.clipping import global_norm, norm_weights
from shardkit.dispatch import register_step
from shardkit.errors import ShardkitError
from shardkit.init import is_key, split_params, state_logical_axes
from shardkit.parallel.sdp.compose import (
    inner_axes,
    inner_rules,
    inner_tracing,
    layout_shardings,
    manual_spec,
)
from shardkit.parallel.sdp.costs import SDPCosts
from shardkit.parallel.sdp.subnetworks import (
    SDPConfig,
    Split,
    find_splits,
    masked_average,
    ownership,
    pack,
    psum_average,
    ring_average,
    ring_of,
    slots,
    unpack,
)
from shardkit.parallel.sdp.subnetworks import make_strategy as sdp_strategy
from shardkit.step import TrainState, TrainStep, check_alive


def _is_split(x: Any) -> bool:
    return isinstance(x, Split)


def _map(fn: Any, splits: Any, *trees: Any) -> Any:
    """fn(split or None, *leaves) over trees shaped like `splits` (whose leaves are Split or None)."""
    return jax.tree.map(fn, splits, *trees, is_leaf=lambda x: x is None or _is_split(x))


@register_step("sdp")
class SDPTrainStep(SDPCosts, TrainStep):
    """`make_train_step` for an SDP strategy: `step(state, batch) -> (state, metrics)` like any TrainStep.

    Under forward masking `state.params` (and the optimizer state, and stacked BatchNorm statistics) store each
    split array as `[workers, k, ...]` sharded over the workers' axis, slot j of worker w being its j-th block
    (or unit group) in network order (`step.slots`); `step.full_params(state)` reassembles the full network.
    """

    @classmethod
    def configure(cls, strategy: Any, options: Any, **context: Any) -> Any:
        """`sk.sdp.make_strategy(**options)`: a run's `sdp` section (granularity, coverage, masking, ...)."""
        return sdp_strategy(**options) if options else strategy

    def setup(self) -> None:
        cfg = self.options_of(SDPConfig, "sk.sdp.make_strategy(...)")
        self.cfg, axis, mesh, model = cfg, cfg.axis, self.mesh, self.source_model
        self.inner = inner_axes(mesh, cfg, self.microbatches)  # fsdp / tensor inside each worker (sdp_compose.py)
        self.inner_rules = inner_rules(self.bound.compute_rules, axis)
        self.workers = w = mesh.shape[axis]
        full = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(model)[1]))
        rest_state = split_params(model)[2]
        self.splits = find_splits(self.param_names, full, cfg, w, "parameter")
        forward = cfg.masking == "forward"
        names = state_logical_axes(rest_state, require=False)
        rest_shapes = jax.eval_shape(self.unwrap_keys, nnx.to_pure_dict(rest_state))  # an abstract model's too
        no_split = jax.tree.map(lambda _: None, names, is_leaf=lambda x: isinstance(x, tuple))
        self.state_splits = find_splits(names, rest_shapes, cfg, w, "model state") if forward else no_split
        groups = sorted({s.groups for s in jax.tree.leaves(self.splits, is_leaf=_is_split) if _is_split(s)})
        if not groups:
            raise ShardkitError(
                f"sdp granularity={cfg.granularity!r}: no parameter has the logical name {cfg.units!r}, so there is "
                "nothing to split. Blocks are a stack of identical layers with a leading 'layers' dimension "
                "(models/gpt.py, models/resnet.py); neuron-level SDP splits the units of `units=` (default 'mlp')"
            )
        self.tables = {g: ownership(g, w, cfg.coverage, cfg.ownership, cfg.seed) for g in groups}
        self.slots = {g: slots(t) for g, t in self.tables.items()}
        self.reduction = {g: self._reduction(t) for g, t in self.tables.items()}
        self._metrics_count = 1  # the loss; set to 1 + the loss_fn's metrics when the step is traced
        self._assemble: dict[str, Any] = {}  # compiled layout -> full conversions (full_params)
        if forward:
            self._layout_setup(full, rest_shapes)

    def _reduction(self, table: np.ndarray) -> str:
        ring = ring_of(table)
        if self.cfg.reduce == "ring" and ring is None:
            raise ShardkitError("sdp reduce='ring' needs a cyclic ownership table whose windows tile the ring; "
                                "use reduce='psum' (or 'auto')")  # fmt: skip
        if self.cfg.masking == "backward" or self.cfg.reduce == "psum" or ring is None:
            return "psum"
        k, blocks = int(table[0].sum()), table.shape[1]
        return "ring" if self.cfg.reduce == "ring" or k < blocks else "psum"

    # ------------------------------------------------------------------------------------------ layout
    def _layout_setup(self, full: Any, rest_shapes: Any) -> None:
        """Shardings, shapes and norm weights of the `[workers, k, ...]` layout (forward masking)."""
        rep, lay = self.replicated, lambda s, sh: layout_shardings(s, sh, self.mesh, self.cfg.axis)
        self.layout_params = _map(lay, self.splits, self.param_shardings)
        self.layout_state = _map(lay, self.state_splits, self.model_state_shardings)
        abstract = jax.eval_shape(lambda p: self.to_layout(p, self.splits), full)
        self._layout_abstract = abstract
        self.opt_shardings = optax.tree_utils.tree_map_params(
            self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, abstract), self.layout_params,
            transform_non_params=lambda _: rep,
        )  # fmt: skip
        self.state_shardings = TrainState(
            step=rep, params=self.layout_params, opt_state=self.opt_shardings, model_state=self.layout_state
        )
        self.set_param_layout(abstract)

        def weight(split: Split | None, _: Any) -> Any:
            if split is None:
                return 1.0
            held = self.tables[split.groups].sum(axis=0)[self.slots[split.groups]]  # [W, k] holders of each slot
            lead = (1.0 / held).astype(np.float32)
            return lead.reshape(*lead.shape, *[1] * len(_.shape))  # [W, k, 1, ...] against [W, k, ...]

        self._norm_weights = _map(weight, self.splits, full)

    def to_layout(self, tree: Any, splits: Any) -> Any:
        """Full arrays -> the layout: each split array as [workers, k, ...] (worker w's slots), others as they are."""
        return _map(lambda s, x: x if s is None else s.to_groups(x)[self.slots[s.groups]], splits, tree)

    def from_layout(self, tree: Any, splits: Any) -> Any:
        """The layout -> full arrays, each group read from its first holder."""

        def one(s: Split | None, x: jax.Array) -> jax.Array:
            if s is None:
                return x
            table, where = self.tables[s.groups], self.slots[s.groups]
            w = table.argmax(axis=0)  # first holder of each group
            j = np.asarray([list(where[wi]).index(g) for g, wi in enumerate(w)])
            return s.from_groups(x[w, j])

        return _map(one, splits, tree)

    def full_params(self, state: TrainState | dict[str, Any]) -> tuple[Any, Any]:
        """(parameters, model state) of the full network from an SDP state (replicated, for evaluation)."""
        params, model_state = (state.params, state.model_state) if isinstance(state, TrainState) else (state, None)
        check_alive((params, model_state), "this state")
        if self.cfg.masking == "backward":
            return params, model_state
        if not self._assemble:  # compiled once, reused by every evaluation
            self._assemble["params"] = jax.jit(lambda p: self.from_layout(p, self.splits),
                                               out_shardings=self.param_shardings)  # fmt: skip
            self._assemble["state"] = jax.jit(lambda m: self.from_layout(m, self.state_splits),
                                              out_shardings=self.model_state_shardings)  # fmt: skip
        full = self._assemble["params"](params)
        return full, None if model_state is None else self._assemble["state"](model_state)

    # ------------------------------------------------------------------------------------------- state
    def init_state(self, model: nnx.Module | None = None) -> TrainState:
        if self.cfg.masking == "backward":
            return super().init_state(model)
        _, params, rest = split_params(model or self.source_model)
        params, rest = nnx.to_pure_dict(params), self.unwrap_keys(nnx.to_pure_dict(rest))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((params, rest))):
            raise ShardkitError("this step was built from an abstract model; pass the real one to init_state")
        # arrays on other devices (a model initialised on one device) replicated onto the mesh first: jit takes no
        # inputs committed elsewhere than its outputs (a ValueError otherwise)
        onto = lambda a: jax.device_put(a, self.replicated) if isinstance(a, jax.Array) and set(a.devices()) != set(
            self.mesh.devices.flat) else a  # fmt: skip
        params, rest = jax.tree.map(onto, params), jax.tree.map(onto, rest)
        params = jax.jit(lambda p: self.to_layout(p, self.splits), out_shardings=self.layout_params)(params)
        rest = jax.jit(lambda m: self.to_layout(m, self.state_splits), out_shardings=self.layout_state)(rest)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        return TrainState(step=step, params=params, opt_state=opt_state, model_state=rest)

    def abstract_state(self) -> TrainState:
        if self.cfg.masking == "backward":
            return super().abstract_state()
        rest = jax.eval_shape(
            lambda r: self.to_layout(self.unwrap_keys(r), self.state_splits), self.initial_model_state
        )
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), self._layout_abstract,
                            jax.eval_shape(self.tx.init, self._layout_abstract), rest)  # fmt: skip
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def model(self, params: Any, model_state: Any = None) -> nnx.Module:
        if isinstance(params, TrainState):
            params, model_state = self.full_params(params)
        elif self.cfg.masking == "forward":
            params = self.full_params(params)[0]
        return super().model(params, model_state)

    def evaluate(self, state: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) in evaluation mode: of the subnetworks (each worker's on its batch shard, averaged) or
        of the full network (`eval="full"`, and always under backward masking)."""
        if self.cfg.masking == "forward" and self.cfg.eval == "subnetworks":
            if not isinstance(state, TrainState):
                raise ShardkitError("sdp evaluation of the subnetworks needs the TrainState: step.evaluate(state, b)")
            check_alive(state, "this state")
            key, shardings = self.prepared(batch, evaluation=True)
            if ("sub", key) not in self.cache:
                specs = jax.tree.map(lambda s: manual_spec(s.spec, self.cfg.axis), shardings)
                fn = jax.shard_map(
                    self._local_eval, mesh=self.mesh, check_vma=False, out_specs=P(), **self._manual,
                    in_specs=(self._specs(self.splits, state.params), self._specs(self.state_splits,
                              state.model_state), specs),
                )  # fmt: skip
                self.cache["sub", key] = jax.jit(fn)
            return self.cache["sub", key](state.params, state.model_state, batching.place(batch, shardings))
        if isinstance(state, TrainState):
            check_alive(state, "this state")
            params, model_state = self.full_params(state)
            state = TrainState(state.step, params, None, model_state)
        elif self.cfg.masking == "forward":
            state = self.full_params(state)[0]
        return super().evaluate(state, batch)

    # -------------------------------------------------------------------------------------------- step
    @property
    def _manual(self) -> dict[str, Any]:
        """shard_map manual over the workers' axis alone when fsdp / tensor run automatic inside each worker."""
        return {"axis_names": frozenset({self.cfg.axis})} if self.inner else {}

    def tracing(self, rules: dict[str, Any], local: bool = False) -> Any:
        """Inside the step's shard_map: each worker's rules over fsdp / tensor (sdp_compose.py), else replicated."""
        if local and self.inner:
            return inner_tracing(self.inner_rules, self.strategy.kernels)
        return super().tracing(rules, local)

    def _specs(self, splits: Any, tree: Any) -> Any:
        forward = self.cfg.masking == "forward"
        return _map(lambda s, _: P(self.cfg.axis) if s is not None and forward else P(), splits, tree)

    def _local(self, params: Any, model_state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
        """One worker: its subnetwork's loss and gradient on its batch shard, then holder / data averaging."""
        axis, w, forward = self.cfg.axis, self.workers, self.cfg.masking == "forward"
        idx = jax.lax.axis_index(axis)
        if forward:  # [1, k, ...] slots -> the subnetwork's arrays (k blocks, or k unit groups)
            params = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.splits, params)
            model_state = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.state_splits, model_state)
        keys = jax.tree.map(lambda k, x: k and not is_key(x), self.key_leaves, model_state)
        fold = lambda k, x: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(x), idx)) if k else x
        local_state = jax.tree.map(fold, keys, model_state)  # each worker its own dropout bits
        grad_fn = jax.value_and_grad(lambda p, m, b: self.apply(p, m, b, local=True), has_aux=True)
        if self.microbatches == 1:
            (loss, (aux, new_state)), grads = grad_fn(params, local_state, batch)
        else:  # gradient accumulation inside the worker; one holder averaging per step
            (loss, (aux, new_state)), grads = accumulate(grad_fn, params, local_state, batch, self.microbatches)
        new_state = jax.tree.map(lambda k, x, new: x if k else new, keys, model_state, new_state)

        # split arrays: per table, one buffer of every split gradient (and float statistic) slot -> holder mean
        split_leaves: dict[int, list[tuple[str, Any, Split]]] = {}
        flat_g = _leaves_with_split(self.splits, grads, "g")
        flat_s = _leaves_with_split(self.state_splits, new_state, "s") if forward else []
        for key, x, s in flat_g + [e for e in flat_s if jnp.issubdtype(e[1].dtype, jnp.floating)]:
            if s is not None:
                split_leaves.setdefault(s.groups, []).append((key, x, s))
        done: dict[str, jax.Array] = {}
        for g, entries in split_leaves.items():
            k = self.slots[g].shape[1] if forward else g
            lead = [s.to_groups(x, k) for _, x, s in entries]  # forward: [k, ...]; backward: [G, ...]
            how = masked_average if not forward else ring_average if self.reduction[g] == "ring" else psum_average
            if self.inner:  # array by array, each device its fsdp / tensor shard of it
                outs = [how(x, self.tables[g], axis) for x in lead]
            else:  # one buffer
                buf, meta = pack(lead, lead[0].shape[0])
                outs = unpack(how(buf, self.tables[g], axis), meta)
            for (key, _, s), y in zip(entries, outs, strict=True):
                done[key] = y[None] if forward else s.from_groups(y)

        # shared arrays, float statistics of shared layers and the metrics: one all-reduce, / workers
        shared = [(k, x) for k, x, s in flat_g if s is None]
        shared += [(k, x) for k, x, s in flat_s if s is None and jnp.issubdtype(x.dtype, jnp.floating)]
        if not forward:
            shared += [(k, x) for k, x in _flat(new_state, "s") if jnp.issubdtype(x.dtype, jnp.floating)]
        metrics = {"loss": loss, **aux}
        self._metrics_count = len(metrics)  # the loss and the loss_fn's metrics ride in the shared all-reduce
        shared += [(f"m{name}", jnp.asarray(v, jnp.float32)) for name, v in metrics.items()]
        if self.inner:
            done.update({key: jax.lax.psum(x, axis) / w for key, x in shared})
        else:
            buf, meta = pack([x.reshape(1, *x.shape) for _, x in shared], 1)
            for (key, _), y in zip(shared, unpack(jax.lax.psum(buf, axis) / w, meta), strict=True):
                done[key] = y[0]
        for key, x, s in flat_s:  # split state that is not averaged (integer counters) keeps its slot dimension
            if s is not None and key not in done:
                done[key] = s.to_groups(x, self.slots[s.groups].shape[1])[None]
        grads = _unflat(grads, "g", done)
        new_state = _unflat(new_state, "s", done)
        metrics = {name: done[f"m{name}"] for name in metrics}
        return grads, new_state, metrics

    def _local_eval(self, params: Any, model_state: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One worker's subnetwork in evaluation mode on its batch shard; loss and metrics averaged over workers."""
        params = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.splits, params)
        model_state = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.state_splits, model_state)
        loss, (aux, _) = self.apply(params, model_state, batch, train=False, local=True)
        out = jax.lax.pmean({"loss": loss, **aux}, self.cfg.axis)
        return out.pop("loss"), out

    def step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        batch_specs = jax.tree.map(lambda s: manual_spec(s.spec, self.cfg.axis), self.batch_shardings(batch))
        param_specs = self._specs(self.splits, state.params)
        state_specs = self._specs(self.state_splits, state.model_state)
        local = jax.shard_map(
            self._local, mesh=self.mesh, in_specs=(param_specs, state_specs, batch_specs),
            out_specs=(param_specs, state_specs, P()), check_vma=False, **self._manual,
        )  # fmt: skip
        grads, model_state, metrics = local(state.params, state.model_state, batch)
        forward = self.cfg.masking == "forward"
        weights = self._norm_weights if forward else None
        with norm_weights(weights):
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            metrics = {**metrics, "grad_norm": global_norm(grads)}
        params = optax.apply_updates(state.params, updates)
        shardings = self.layout_params if forward else self.param_shardings
        params = jax.lax.with_sharding_constraint(params, shardings)
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state)
        return new, metrics


def _flat(tree: Any, tag: str) -> list[tuple[str, jax.Array]]:
    return [(tag + jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _leaves_with_split(splits: Any, tree: Any, tag: str) -> list[tuple[str, jax.Array, Split | None]]:
    paired = _map(lambda s, x: (s, x), splits, tree)
    leaves = jax.tree_util.tree_leaves_with_path(paired, is_leaf=lambda v: isinstance(v, tuple) and len(v) == 2)
    return [(tag + jax.tree_util.keystr(p), x, s) for p, (s, x) in leaves]


def _unflat(tree: Any, tag: str, done: dict[str, jax.Array]) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, x: done.get(tag + jax.tree_util.keystr(p), x), tree)


__all__ = ["SDPTrainStep"]
