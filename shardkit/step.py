"""The train-step interface every parallelism implements (the registry that finds a strategy's step: dispatch.py).

    step = sk.make_train_step(model, optax.adamw(3e-4), mesh, "fsdp", loss_fn=loss_fn,
                              batch_axes={"image": ("batch", "height", "width", None), "label": ("batch",)})
    state = step.init_state()                 # optimizer state created directly sharded
    state, metrics = step(state, batch)       # metrics: loss, grad_norm and whatever loss_fn reports

A strategy names the step that runs it (`Strategy.step`, default "gspmd": shardkit/parallel/gspmd/step.py) and
carries that step's options (`Strategy.options`); shardkit/dispatch.py looks it up. A step is a subclass of
`TrainStep` that registers itself next to its parallelism (shardkit/parallel/sdp/step.py, hetero/step.py),
implements `step_fn` (the function that is jitted) and, if it needs to, `setup` (reads its options, after the
common construction below) and the methods whose layout differs from the GSPMD step's (`init_state`,
`abstract_state`, `evaluate`, `prepare`, ...):

    @sk.register_step("my_step")
    class MyStep(sk.TrainStep):
        def step_fn(self, state, batch): ...            # (state, batch) -> (state, metrics), traced once

This file is one idea at about 460 lines, the interface and the construction every step shares; the sharding
tables it computes (and the check that every mesh axis shards something) are step_layout.py's `StepLayout`.

What every step promises:

- `step(state, batch) -> (state, metrics)`: one training step; `metrics` has `loss`, `grad_norm` and the loss
  function's own metrics. The step donates `state` (unless built with `donate=False`).
- `init_state(model=None)`, `abstract_state()`: a `TrainState` laid out as the step stores it (the second as
  ShapeDtypeStructs with shardings, the target of a checkpoint restore).
- `evaluate(state, batch) -> (loss, metrics)` in evaluation mode; `model(state)` the NNX module for inference.
- `check_batch(batch)`: a `ShardkitError` for a batch that does not fit the mesh, before XLA sees it;
  `prepare(batch)`: the batch as `lower(state, batch).compile()` takes it; `lower(state, batch)`.

`loss_fn(model, batch)` returns a scalar or `(scalar, {"metric": value})`; without one the model's own
`loss(batch)` method is used (models/gpt.py's GPT has one). `batch` is any pytree of arrays; `batch_axes` gives
each leaf's logical names, as a matching pytree or one tuple for every leaf (leaves with fewer dimensions take
its prefix); default: the model's `batch_axes` attribute, else ("batch",) (the leading dimension is the batch,
the rest replicated).

Parameters (fp32 by default) live in `state.params` as a pure dict laid out by the strategy's parameter rules,
the optimizer state by its optimizer-state rules (= parameter rules except for ZeRO-1), and the forward pass
runs under its compute rules. Model state that is not a parameter (BatchNorm's `BatchStat`, dropout's RNG
counters) lives in `state.model_state` and is updated by each step; PRNG keys are stored as their raw uint32
data so that checkpoints and `device_put` treat them as plain arrays. Mixed precision: give the model a bf16
compute dtype; parameters, gradients, the loss and the optimizer stay fp32.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardkit import batch as batching
from shardkit import kernels, offload
from shardkit.batch import Batch, BatchAxes
from shardkit.errors import ShardkitError, sharding_mode_error, unbound_axis_name
from shardkit.init import (
    is_key,
    split_params,
    warn_idle_parameter_axes,
)
from shardkit.mesh import has_explicit_axes, step_mesh
from shardkit.rules import compiling_for, flax_rules, logical_to_spec, use_rules
from shardkit.step_layout import StepLayout, TrainState
from shardkit.strategies import BoundStrategy, Strategy, bind
from shardkit.strategies import strategy as get_strategy
from shardkit.targets import cache_off_for, compile_only, require_runnable

LossFn = Callable[[nnx.Module, Batch], jax.Array | tuple[jax.Array, dict[str, jax.Array]]]


def check_alive(tree: Any, what: str) -> None:
    """A ShardkitError, not a crash in XLA, for arrays a donating step has consumed."""
    if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree)):
        raise ShardkitError(
            f"{what} holds deleted arrays: a train step donates the state it is given, so after "
            "`state, metrics = step(state, batch)` only the returned state is valid. Keep using the returned one "
            "(or build the step with donate=False to keep old states alive, at twice the memory)"
        )


def require_one_axis(mesh: Mesh, axis: str, who: str, microbatches: int) -> None:
    """The checks of a step that runs one `shard_map` over one mesh axis (hetero): that axis alone, the
    batch whole."""
    if microbatches != 1:
        raise ShardkitError(f"microbatches={microbatches}: {who} takes the batch whole (leave microbatches at 1)")
    extra = {a: n for a, n in mesh.shape.items() if a != axis and n > 1}
    if axis not in mesh.shape or extra:
        raise ShardkitError(
            f"{who} runs over the mesh axis {axis!r} alone (its devices are the workers); the mesh "
            f"{dict(mesh.shape)} {'has ' + str(extra) if extra else 'lacks it'}: use e.g. --config.mesh={axis}=8"
        )


def _private(tree: Any, shardings: Any) -> Any:
    """Arrays about to be moved to other shardings, copied first: device_put(may_alias=False) onto another device
    set (a model initialised on one device, put on an 8-device mesh) still reused the device-0 buffer, and the first
    step's donation deleted the user's model (tests/test_reliability.py)."""
    copy = lambda a, s: a.copy() if isinstance(a, jax.Array) and a.sharding != s else a
    return jax.tree.map(copy, tree, shardings)


def _param_specs(params: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {
        jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in jax.tree_util.tree_leaves_with_path(params)
    }


class TrainStep(abc.ABC):
    """A jitted `(state, batch) -> (state, metrics)` with in/out shardings fixed by the strategy (module doc).

    The construction every step shares: the strategy bound to the mesh, the loss and batch names, the parameter,
    optimizer-state and model-state shardings. Subclasses implement `step_fn` and may override `setup`."""

    step_name = ""  # the name it is registered under (shardkit/dispatch.py)

    def __init__(
        self,
        model: nnx.Module,
        optimizer: optax.GradientTransformation,
        mesh: Mesh,
        strategy: str | Strategy | BoundStrategy,
        *,
        loss_fn: LossFn | None = None,
        batch_axes: BatchAxes = None,
        microbatches: int = 1,
        donate: bool = True,
    ):
        """The signature of `sk.make_train_step`, which builds the subclass the strategy names. A BoundStrategy (the
        run's strategy resolved once) is taken as it is; a name is looked up here, once."""
        if microbatches < 1:
            raise ShardkitError(f"microbatches={microbatches} must be >= 1")
        self.strategy = get_strategy(strategy)
        # jax.make_mesh's Explicit axes: explicit mode under a strategy that keeps them ('annotated'), else the same
        # mesh with Auto axes (said once)
        mesh = step_mesh(mesh, self.strategy.explicit_axes, "make_train_step")
        self.explicit = has_explicit_axes(mesh)
        with compiling_for(mesh):  # kernel checks that depend on the platform ask the mesh's devices, not the host's
            kernels.check(self.strategy.kernels)
        self.bound = bind(strategy if isinstance(strategy, BoundStrategy) else self.strategy, mesh)
        self.mesh, self.tx, self.microbatches, self.source_model = mesh, optimizer, microbatches, model
        self.loss_fn = self._default_loss(model) if loss_fn is None else loss_fn
        batch_axes = getattr(model, "batch_axes", None) if batch_axes is None else batch_axes
        self.batch_axes = ("batch",) if batch_axes is None else batch_axes
        self.graphdef, params, rest = split_params(model)
        self.step_layout = StepLayout.of(params, rest, self.bound, optimizer, mesh, self.step_name,
                                         batch_axes=self.batch_axes, model_name=type(model).__name__)  # fmt: skip
        self.param_names = self.step_layout.names  # each parameter's logical names
        self.initial_model_state = nnx.to_pure_dict(rest)  # initial values (or shapes, for an abstract model)
        self.key_leaves = jax.tree.map(is_key, self.initial_model_state)  # which model-state leaves are PRNG keys
        abs_params = self.step_layout.abstract_params
        self.set_param_layout(abs_params)
        warn_idle_parameter_axes(self.strategy.name, self.step_layout.params, self.bound.param_rules, mesh, abs_params)
        # the tables under the names steps and explain read them by (a step with a layout of its own, SDP's,
        # replaces opt_shardings / state_shardings)
        lay = self.step_layout
        self.unnamed_params, self.unnamed_splits, self.replicated = lay.unnamed, lay.unnamed_splits, lay.replicated
        self.param_shardings, self.update_shardings, self.opt_shardings = lay.params, lay.updates, lay.opt_state
        self.model_state_shardings, self.offload, self.state_shardings = lay.model_state, lay.offload, lay.state
        self.donate = donate
        self.compile_only = compile_only(mesh)  # a target's devices: lower / compile only (shardkit/targets.py)
        self.cache: dict[Any, Any] = {}  # jitted functions, per batch structure (jit needs shardings up front)
        self._checked: dict[Any, Any] = {}  # batch signature -> its shardings, once checked
        self.setup()

    def setup(self) -> None:  # noqa: B027  (optional hook: most steps need none)
        """A subclass's own construction, after the common one (its options: `self.strategy.options`)."""

    def options_of(self, kind: type, build: str) -> Any:
        """`self.strategy.options`, checked to be a `kind` (a ShardkitError naming `build`, how to make one)."""
        options = self.strategy.options
        if not isinstance(options, kind):
            raise ShardkitError(f"strategy {self.strategy.name!r} names the {self.step_name} step but its options "
                                f"are {options!r}; build it with {build}")  # fmt: skip
        return options

    @classmethod
    def configure(cls, strategy: Strategy, options: Mapping[str, Any], **context: Any) -> Strategy:
        """The strategy with `options` from a run's config (the section named after this step, e.g. `sdp`);
        `context`: devices, global_batch, preset (the mesh's hardware preset, or None). Default: unchanged."""
        return strategy

    @staticmethod
    def _default_loss(model: nnx.Module) -> LossFn:
        method = getattr(type(model), "loss", None)
        if not callable(method):
            raise ShardkitError(
                f"{type(model).__name__} has no loss(batch) method: pass loss_fn=lambda model, batch: scalar "
                "(or (scalar, {'metric': value})) to make_train_step"
            )
        return method  # GPT.loss(model, batch)

    @property
    def has_model_state(self) -> bool:
        return bool(jax.tree.leaves(self.initial_model_state))

    # ----------------------------------------------------------------------------------------------- state
    def set_param_layout(self, abstract_params: Any) -> None:
        """The parameter tree (shapes, dtypes) that `state.params` must have: what `check_state` compares."""
        leaves, self._param_treedef = jax.tree.flatten(abstract_params)
        self._param_leaf_specs = [(tuple(x.shape), x.dtype) for x in leaves]

    def init_state(self, model: nnx.Module | None = None) -> TrainState:
        """Parameters and model state from `model` (default: the one given at construction), optimizer state
        sharded. The step may be built from `sk.abstract_model(...)` (shapes only) to validate, lower or restore
        a checkpoint before any parameter exists; then pass the real model here.
        """
        require_runnable(self.mesh, "step.init_state")
        _, params, rest = split_params(model or self.source_model)
        params, rest = nnx.to_pure_dict(params), self.unwrap_keys(nnx.to_pure_dict(rest))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((params, rest))):
            raise ShardkitError(
                "this TrainStep was built from an abstract model (shapes only); pass the real model: "
                "step.init_state(sk.sharded_init(make_model, mesh, strategy))"
            )
        check_alive(params, "the model's parameters")
        # copies (may_alias=False): each step donates the state it is given, so the state must not share buffers
        # with the user's model, which would be deleted by the first step (issue #15)
        params = jax.device_put(_private(params, self.param_shardings), self.param_shardings, may_alias=False)
        rest = jax.device_put(_private(rest, self.model_state_shardings), self.model_state_shardings, may_alias=False)
        opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings.opt_state)(params)
        params = jax.device_put(params, self.state_shardings.params)  # host memory when offloaded
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        return TrainState(step=step, params=params, opt_state=opt_state, model_state=rest)

    def model(self, params: dict[str, Any] | TrainState, model_state: dict[str, Any] | None = None) -> nnx.Module:
        """The NNX module holding `params` (or a TrainState's parameters and model state), for evaluation."""
        if isinstance(params, TrainState):
            params, model_state = params.params, params.model_state
        if model_state is None:
            if self.has_model_state:
                raise ShardkitError("this model has state besides parameters: pass the TrainState, step.model(state)")
            model_state = self.initial_model_state
        if "params" in self.offload:  # offloaded parameters: back on the devices for eager use
            params = jax.device_put(params, self.param_shardings)
        return nnx.merge(self.graphdef, params, self.wrap_keys(model_state))

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with shardings: the target tree for restoring a checkpoint onto this mesh."""
        params = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(self.source_model)[1]))
        rest = jax.eval_shape(self.unwrap_keys, self.initial_model_state)
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, jax.eval_shape(self.tx.init, params), rest)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def unwrap_keys(self, tree: Any) -> Any:
        """Typed PRNG keys -> their raw uint32 data (how the state stores them)."""
        return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)

    def wrap_keys(self, tree: Any) -> Any:
        """The inverse of `unwrap_keys` for the model-state leaves that are keys."""
        return jax.tree.map(
            lambda x, k: jax.random.wrap_key_data(x) if k and not is_key(x) else x, tree, self.key_leaves
        )

    def check_state(self, state: TrainState) -> None:
        """The state is this step's model's: for other shapes jit would retrace and train another model."""
        leaves, treedef = jax.tree.flatten(state.params)
        if treedef == self._param_treedef and all(
            x.shape == s and x.dtype == d for x, (s, d) in zip(leaves, self._param_leaf_specs, strict=True)
        ):
            return
        expected = [jax.ShapeDtypeStruct(*spec) for spec in self._param_leaf_specs]
        want, got = _param_specs(jax.tree.unflatten(self._param_treedef, expected)), _param_specs(state.params)
        if got != want:
            bad = [
                f"{k} is {got.get(k, 'missing')}, the step's model has {w}" for k, w in want.items() if got.get(k) != w
            ]
            diff = bad[0] if bad else f"it has parameters the model lacks: {sorted(set(got) - set(want))}"
            raise ShardkitError(
                f"this TrainState's parameters are not this step's model's: {diff}. Build the state with "
                "step.init_state(), or restore a checkpoint onto step.abstract_state()"
            )

    # ----------------------------------------------------------------------------------------------- batch
    def batch_names(self, batch: Batch) -> Any:
        """Each batch leaf's logical names (padded with None to its rank), as a pytree like the batch."""
        return batching.leaf_names(batch, self.batch_axes)

    def batch_shardings(self, batch: Batch) -> Any:
        """NamedShardings for every batch leaf under the compute rules (divisibility: `check_batch`)."""
        return batching.shardings(batch, self.batch_names(batch), self.bound.compute_rules, self.mesh)

    @property
    def batch_sharding(self) -> NamedSharding:
        """The sharding of a batch leaf of rank >= len(batch_axes) when batch_axes is one tuple (e.g. the GPT's
        [batch, seq] tokens); for a pytree of batch_axes use `batch_shardings(batch)`."""
        if not batching.is_names(self.batch_axes):
            raise ShardkitError("batch_axes is a pytree: use step.batch_shardings(batch) for its shardings")
        return NamedSharding(self.mesh, logical_to_spec(self.batch_axes, self.bound.compute_rules, self.mesh))

    def check_batch(self, batch: Batch, microbatches: int | None = None, *, evaluation: bool = False) -> None:
        """The batch fits the mesh and the microbatches (shardkit/batch.py), before XLA sees it; `evaluation=True`:
        a batch for `evaluate`, which takes it whole (no microbatches)."""
        m = 1 if evaluation else self.microbatches if microbatches is None else microbatches
        batching.check(batch, self.batch_names(batch), self.bound.compute_rules, self.mesh, m)

    def prepared(self, batch: Batch, *, evaluation: bool = False) -> tuple[Any, Any]:
        """(jit key, shardings) of a checked training (or `evaluation`) batch; the check runs once per batch
        signature, not every step."""
        leaves, treedef = jax.tree.flatten(batch)
        shapes = tuple(tuple(getattr(x, "shape", ())) for x in leaves)
        signature = (treedef, shapes, tuple(str(getattr(x, "dtype", "")) for x in leaves), evaluation)
        first = signature not in self._checked
        # The model's own checks first (`validate_batch`: the keys, ranks and dtypes its loss reads, on any batch,
        # abstract ones included; the GPT's token ids in [0, vocab) on concrete ones; it knows what its loss needs
        # better than the names do): on a signature's first batch, and on every batch of host arrays (cheap;
        # reading device arrays back would stall the asynchronous dispatch).
        validate = getattr(self.source_model, "validate_batch", None)
        if validate is not None and (first or any(isinstance(x, np.ndarray) for x in leaves)):
            validate(batch)
        if first:  # a batch structure, shapes and dtypes not seen before: the layout checks, once
            self.check_batch(batch, evaluation=evaluation)
            self._checked[signature] = self.batch_shardings(batch)
        return (treedef, tuple(map(len, shapes))), self._checked[signature]

    def abstract_batch(self, shapes: Any) -> Any:
        """ShapeDtypeStructs placed as the step places a batch, from `{"inputs": ((8, 2048), jnp.int32), ...}` (any
        pytree whose leaves are (shape, dtype) pairs, ShapeDtypeStructs or arrays): what `lower` / `sk.explain` take
        to compile for a target without data. Checked against the mesh like a real batch."""

        structs = batching.structs(shapes)
        _, shardings = self.prepared(structs)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), structs, shardings)

    def prepare(self, batch: Batch) -> Batch:
        """The batch as the compiled step (`lower(...).compile()`) takes it: unchanged here; a step that lays the
        batch out its own way (hetero's per-device micro-batches) overrides this."""
        return batch

    # ------------------------------------------------------------------------------------------ compiling
    def jit(self, key: Any, shardings: Any) -> Any:
        """`step_fn` (and `eval_fn`) jitted for one batch structure and its shardings, cached under `key`."""
        if ("step", key) not in self.cache:

            def traced(state: TrainState, batch: Batch) -> Any:  # keeps what kernels report while traced
                with kernels.recording() as calls:
                    out = self.step_fn(state, batch)
                self.cache["kernel calls", key] = list(calls)
                return out

            self.cache["step", key] = jax.jit(
                traced,
                in_shardings=(self.state_shardings, shardings),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=(0,) if self.donate else (),
            )
            self.cache["eval", key] = jax.jit(
                lambda params, *rest: self.eval_fn(self.params_on_device(params), *rest),
                in_shardings=(self.state_shardings.params, self.model_state_shardings, shardings),
            )
        return self.cache["step", key]

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        if self.compile_only:
            require_runnable(self.mesh, "calling the train step")
        if self.donate:
            check_alive(state, "this TrainState")
        self.check_state(state)
        key, shardings = self.prepared(batch)
        return self.jit(key, shardings)(state, batching.place(batch, shardings))

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        return self.jit(*self.prepared(batch)).lower(state, batch)

    def compile(self, state: TrainState, batch: Batch) -> jax.stages.Compiled:
        """`lower(state, batch).compile()`; for a target's compile-only devices without JAX's persistent cache, whose
        entries for them cannot be read back (shardkit.targets.cache_off_for)."""
        with cache_off_for(self.mesh):
            return self.lower(state, batch).compile()

    def kernel_calls(self, batch: Batch) -> list[kernels.Traced]:
        """What the kernels reported while the step for `batch`'s signature was traced (its own collectives:
        spatial halos, ...); jax traces a step once per signature, so this outlives later lowerings' cache hits."""
        return list(self.cache.get(("kernel calls", self.prepared(batch)[0]), []))

    def params_on_device(self, params: Any) -> Any:
        """Inside the jitted step: the parameters in device memory (moved there when the strategy offloads them)."""
        return offload.to_device(params, self.param_shardings) if "params" in self.offload else params

    def opt_state_on_device(self, opt_state: Any) -> Any:
        """Inside the jitted step: the optimizer state in device memory (moved there when offloaded)."""
        return offload.to_device(opt_state, self.opt_shardings) if "opt_state" in self.offload else opt_state

    def eval_loss(self, params: dict[str, Any] | TrainState, batch: Batch) -> jax.Array:
        """The loss in evaluation mode (`model.eval()`: running BatchNorm statistics, no dropout)."""
        return self.evaluate(params, batch)[0]

    def evaluate(self, state: dict[str, Any] | TrainState, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) in evaluation mode, for a TrainState (or, for a model without other state, params)."""
        params, model_state = (state.params, state.model_state) if isinstance(state, TrainState) else (state, None)
        if model_state is None:
            if self.has_model_state:
                raise ShardkitError("this model has state besides parameters: pass the TrainState to evaluate")
            model_state = self.unwrap_keys(self.initial_model_state)
        require_runnable(self.mesh, "step.evaluate")
        check_alive((params, model_state), "this state")
        key, shardings = self.prepared(batch, evaluation=True)  # evaluation takes the batch whole
        self.jit(key, shardings)
        return self.cache["eval", key](params, model_state, batching.place(batch, shardings))

    # ------------------------------------------------------------------------------------------- the loss
    @contextlib.contextmanager
    def tracing(self, rules: dict[str, Any], local: bool = False) -> Iterator[None]:
        """shardkit's compute rules and kernels, and Flax's logical rules (for nn.with_logical_constraint).

        `local`: inside a `shard_map` manual over every mesh axis (subnetwork data parallelism, hetero), where
        each device computes on its own shard: every logical name replicated, on the abstract mesh."""
        if local:
            with use_rules(jax.sharding.get_abstract_mesh(), dict.fromkeys(rules), kernels=self.strategy.kernels):
                yield
            return
        with use_rules(self.mesh, rules, kernels=self.strategy.kernels, scopes=self.bound.scopes,
                       param_rules=self.bound.param_rules), flax_rules(self.mesh, rules):  # fmt: skip
            yield

    def apply(
        self, params: Any, model_state: Any, batch: Batch, rules: dict[str, Any] | None = None, train: bool = True,
        local: bool = False,
    ) -> tuple[jax.Array, tuple[dict[str, jax.Array], Any]]:  # fmt: skip
        """loss, (metrics, new model state) of loss_fn on the merged model."""
        with self.tracing(rules or self.bound.compute_rules, local):
            model = nnx.merge(self.graphdef, params, self.wrap_keys(model_state))
            model.train() if train else model.eval()
            try:
                out = self.loss_fn(model, batch)
            except NameError as e:  # JAX's "unbound axis name", raised while tracing: before XLA sees anything
                raise (unbound_axis_name(e, model) or e) from None
            except Exception as e:  # an explicit-mode model on Auto axes, or a GSPMD one in explicit mode
                raise (sharding_mode_error(e, self.strategy.name, self.explicit) or e) from None
            new_state = self.unwrap_keys(nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))
        loss, aux = out if isinstance(out, tuple) else (out, {})
        if not isinstance(aux, dict):
            raise ShardkitError(f"loss_fn returned {type(aux).__name__} as metrics; return (loss, dict of metrics)")
        if jnp.shape(loss) != ():
            raise ShardkitError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}")
        return loss, (aux, new_state)

    def eval_fn(self, params: Any, model_state: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, metrics) in evaluation mode: what `evaluate` jits."""
        loss, (aux, _) = self.apply(params, model_state, batch, train=False)
        return loss, aux

    @abc.abstractmethod
    def step_fn(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        """One training step, traced under jit: what a step class implements."""


__all__ = ["LossFn", "TrainState", "TrainStep", "check_alive", "require_one_axis"]
