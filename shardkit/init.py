"""Sharded initialisation: eval_shape -> logical specs -> mesh shardings -> jit(out_shardings).

The unsharded model never exists: every device computes only its own shard of every parameter, and the
values equal a single-device initialisation from the same seed (threefry is partitionable).

Logical names are read from a variable's metadata as shardkit writes them (`nnx.Param(v, logical_axes=...)`)
or as Flax writes them (`nnx.with_partitioning(init, ("embed", "mlp"))` -> `out_sharding`; `sharding_names` /
`sharding` are Flax's older spellings; Linen's `nn.with_logical_partitioning` arrives as `out_sharding` through
`nnx.bridge`). Flax would shard such variables eagerly, at creation, taking the logical names for mesh axes;
shardkit builds models with eager sharding off and resolves the names through the strategy's rules instead.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.mesh import step_mesh
from shardkit.rules import Rules, named_sharding
from shardkit.strategies import BoundStrategy, Strategy, bind
from shardkit.strategies import strategy as get_strategy
from shardkit.targets import require_runnable

#: Metadata keys that may hold a variable's logical names, in the order they are looked up.
NAME_KEYS = ("logical_axes", "out_sharding", "sharding_names", "sharding")


def _key(k: Any) -> Any:
    return getattr(k, "key", getattr(k, "idx", k))


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(_key(k)) for k in path)


def _no_eager() -> Any:
    """Flax's eager sharding off: names are resolved by shardkit's rules, not taken as mesh axes."""
    return nnx.use_eager_sharding(False)


def abstract_model(make_model: Callable[[nnx.Rngs], nnx.Module], seed: int = 0) -> nnx.Module:
    """The model with ShapeDtypeStruct leaves: shapes and metadata, no memory."""
    with _no_eager():
        return nnx.eval_shape(lambda: make_model(nnx.Rngs(seed)))


def logical_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """A variable's logical axis names from its metadata (shardkit's or Flax's key), or None if it has none."""
    meta = var.get_metadata()
    for key in NAME_KEYS:
        names = meta.get(key)
        if names:
            if isinstance(names, jax.sharding.PartitionSpec):
                names = tuple(names)
            return tuple(names)
    return None


PathRules = tuple[tuple[str, tuple[str | None, ...]], ...]  # ((regex over "a/b/c" paths, logical names), ...)


def path_names(path: str, var: nnx.Variable, path_rules: PathRules = ()) -> tuple[str | None, ...] | None:
    """A parameter's logical names: the first of `path_rules` whose pattern matches its path (`re.search`, as
    EasyDeL's and t5x's partition rules match), else its metadata's (`logical_names`)."""
    if isinstance(var, nnx.Param):
        for pattern, names in path_rules:
            if re.search(pattern, path):
                return tuple(names)
    return logical_names(var)


def _variables(state: nnx.State) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    return jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _nest(out: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node = out
    for key in path[:-1]:
        node = node.setdefault(_key(key), {})
    node[_key(path[-1])] = value


def is_key(x: Any) -> bool:
    """A typed PRNG key array (an RNG stream's state); the train step stores its raw data instead."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, parameters, the rest): BatchNorm statistics, RNG streams, any other nnx.Variable."""
    return nnx.split(model, nnx.Param, ...)


def state_logical_axes(
    state: nnx.State, *, require: bool = True, strict: bool = False, path_rules: PathRules = ()
) -> dict[str, Any]:
    """A pure dict (the structure of `nnx.to_pure_dict(state)`) of each variable's logical axis names.

    Names mean what they mean to Flax and JAX (`nnx.with_partitioning`, a `PartitionSpec`): fewer names than
    dimensions name the leading ones and replicate the rest (`('embed', 'kv')` on an [embed, heads, head_dim]
    kernel is `('embed', 'kv', None)`), and a variable with no names is replicated. More names than dimensions
    is a ShardkitError naming the variable. With `strict` (`Strategy.strict_names`), a parameter (`require`)
    must have exactly one name (or None) per dimension (scalars need none): nothing is replicated silently.
    `path_rules` (`Strategy.path_rules`) name parameters by their path, before their metadata (`path_names`).
    """
    out: dict[str, Any] = {}
    for path, var in _variables(state):
        shape = tuple(getattr(var.get_value(), "shape", ()))
        names = path_names(_path_str(path), var, path_rules)
        if (names is not None and len(names) > len(shape)) or (
            strict and require and shape and (names is None or len(names) != len(shape))
        ):
            raise ShardkitError(
                f"{type(var).__name__} {_path_str(path)!r} of shape {shape} has logical names {names!r}; give every "
                "parameter one logical name (or None) per dimension: nnx.with_partitioning(init, ('embed', 'mlp')) "
                "as Flax writes it, or nnx.Param(value, logical_axes=('embed', 'mlp'))"
                + ("" if names is not None and len(names) > len(shape) else
                   " (strict_names=True: fewer names, or none, are refused rather than replicated)")
            )  # fmt: skip
        names = tuple(names or ()) + (None,) * (len(shape) - len(names or ()))
        _nest(out, path, names)
    return out


def unnamed_parameters(state: nnx.State, path_rules: PathRules = ()) -> list[tuple[str, tuple[int, ...], int]]:
    """(path, shape, bytes) of every parameter without logical names: replicated on every device under any
    strategy (`sk.explain` lists them; `Strategy.strict_names` refuses them)."""
    out = []
    for path, var in _variables(state):
        value = var.get_value()
        shape = tuple(getattr(value, "shape", ()))
        if isinstance(var, nnx.Param) and shape and path_names(_path_str(path), var, path_rules) is None:
            out.append((_path_str(path), shape, int(math.prod(shape)) * jax.numpy.dtype(value.dtype).itemsize))
    return out


def param_logical_axes(model_or_state: nnx.Module | nnx.State) -> dict[str, Any]:
    """Logical names of the parameters (nnx.Param) of a model or state, as a pure dict; see state_logical_axes."""
    if isinstance(model_or_state, nnx.Module):
        model_or_state = split_params(model_or_state)[1]
    params = nnx.filter_state(model_or_state, nnx.Param) if _has_other(model_or_state) else model_or_state
    return state_logical_axes(params, require=True)


def _has_other(state: nnx.State) -> bool:
    return any(not isinstance(v, nnx.Param) for _, v in _variables(state))


def scoped_rules(path: str, rules: Rules, scopes: Mapping[str, Rules] | None) -> Rules:
    """`rules` with the overrides of every scope pattern matching `path` ("head/kernel") or one of its prefixes
    ("head"), in the scopes' order."""
    if not scopes:
        return rules
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = dict(rules)
    for pattern, extra in scopes.items():
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            out.update(extra)
    return out


def zero_axes(rules: Rules, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes (size > 1) a rules table rests parameters on, ZeRO's way: those FSDP's `embed` (a CNN's
    `channels`) maps to; () for a table that shards no parameter that way (dp, tp)."""
    axes = rules.get("embed") or rules.get("channels") or ()
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def unnamed_splits(
    state: nnx.State, rules: Rules, mesh: Mesh, min_bytes: int = 0, scopes: Mapping[str, Rules] | None = None,
    path_rules: PathRules = (),
) -> dict[str, tuple[int, tuple[str, ...]]]:  # fmt: skip
    """path -> (dimension, mesh axes) for each parameter without logical names that is split anyway, as PyTorch
    FSDP and Kauldron's FSDP sharding split one: along its largest dimension divisible by the degree of the table's
    ZeRO axes (`zero_axes`; ties: the first), if it has `min_bytes` or more (Kauldron keeps those under 4 MiB
    replicated; the default, 0, splits every one, as PyTorch FSDP does). The rest stay replicated."""
    out = {}
    for path, shape, nbytes in unnamed_parameters(state, path_rules):
        axes = zero_axes(scoped_rules(path, rules, scopes), mesh)
        degree = math.prod(mesh.shape[a] for a in axes)
        dims = [d for d, n in enumerate(shape) if n % degree == 0]
        if degree > 1 and nbytes >= min_bytes and dims:
            out[path] = (max(dims, key=lambda d: (shape[d], -d)), axes)
    return out


def warn_idle_parameter_axes(strategy: str, shardings: Any, rules: Rules, mesh: Mesh, abs_params: Any) -> None:
    """Warns where a mesh axis the strategy rests parameters on (a rule other than a mesh axis's own name) shards none
    of this model's: the axis still splits the batch, but every parameter byte is replicated along it (fsdp over a
    model whose every parameter carries names the table replicates; an ep strategy over a model with no experts)."""
    used = {a for s in jax.tree.leaves(shardings) for e in s.spec if e for a in ((e,) if isinstance(e, str) else e)}
    meant = {a for name, axes in rules.items() if axes != (name,) for a in (axes or ()) if mesh.shape.get(a, 1) > 1}
    total = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(abs_params))
    for axis in sorted(meant - used):
        warnings.warn(
            f"strategy {strategy!r} rests parameters on mesh axis {axis!r} (size {mesh.shape[axis]}), but no parameter "
            f"of this model is sharded over it: all {total / 2**20:.2f} MiB are replicated along it (it still splits "
            "the batch). Give the parameters names the strategy shards, or path rules "
            "(Strategy.extend(path_rules=...)), or use a strategy without it",
            UserWarning,
            stacklevel=4,
        )


def state_shardings(
    state: nnx.State,
    rules: Rules,
    mesh: Mesh,
    *,
    require: bool = True,
    scopes: Mapping[str, Rules] | None = None,
    strict: bool = False,
    unnamed_min_bytes: int | None = None,
    path_rules: PathRules = (),
) -> dict[str, Any]:
    """A pure dict of NamedShardings for `state`, checked (path, shape, axis) against the mesh; a variable under a
    scope pattern (Strategy.scopes) takes that scope's rules over `rules`. `unnamed_min_bytes` (parameters only):
    split the parameters without logical names that have that many bytes over the table's ZeRO axes
    (`unnamed_splits`); None: they stay replicated."""
    shapes = nnx.to_pure_dict(state)
    logical = state_logical_axes(state, require=require, strict=strict, path_rules=path_rules)
    kind = "parameter" if require else "variable"
    split = (
        unnamed_splits(state, rules, mesh, unnamed_min_bytes, scopes, path_rules)
        if require and unnamed_min_bytes is not None
        else {}
    )

    def one(path: Any, names: tuple, sds: Any) -> NamedSharding:
        where = _path_str(path)
        if where in split:  # no names: split as FSDP splits an unnamed parameter
            dim, axes = split[where]
            spec = [None] * len(sds.shape)
            spec[dim] = axes[0] if len(axes) == 1 else axes
            return NamedSharding(mesh, PartitionSpec(*spec))
        return named_sharding(names, scoped_rules(where, rules, scopes), mesh, sds.shape, what=f"{kind} {where!r}")

    return jax.tree_util.tree_map_with_path(one, logical, shapes, is_leaf=lambda x: isinstance(x, tuple))


def param_shardings(abstract: nnx.Module | nnx.State, rules: Rules, mesh: Mesh) -> dict[str, Any]:
    """A pure dict of NamedShardings for the parameters, checked (path, shape, axis) against the mesh."""
    state = split_params(abstract)[1] if isinstance(abstract, nnx.Module) else abstract
    if _has_other(state):
        state = nnx.filter_state(state, nnx.Param)
    return state_shardings(state, rules, mesh, require=True)


def sharded_init(
    make_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh, strategy: str | Strategy | BoundStrategy, seed: int = 0
) -> nnx.Module:
    """Builds `make_model(nnx.Rngs(seed))` directly sharded by the strategy's parameter rules.

    Parameters take the parameter rules; other state (BatchNorm statistics, RNG streams) the same rules where
    it has logical names, else it is replicated.
    """
    require_runnable(mesh, "sk.sharded_init")  # a target's devices: the abstract path instead, said so
    chosen = get_strategy(strategy)  # a Strategy or BoundStrategy as it is: no second look-up
    mesh = step_mesh(mesh, chosen.explicit_axes, "sk.sharded_init")  # as make_train_step takes it
    bound = bind(strategy if isinstance(strategy, BoundStrategy) else chosen, mesh)
    strategy = chosen
    graphdef, abs_params, abs_rest = split_params(abstract_model(make_model, seed))
    shardings = (
        state_shardings(
            abs_params,
            bound.param_rules,
            mesh,
            require=True,
            scopes=bound.scopes,
            strict=bound.strategy.strict_names,
            unnamed_min_bytes=bound.strategy.unnamed_min_bytes,
            path_rules=bound.strategy.path_rules,
        ),
        state_shardings(abs_rest, bound.param_rules, mesh, require=False, scopes=bound.scopes),
    )

    def create() -> tuple[dict[str, Any], dict[str, Any]]:
        with _no_eager():
            _, params, rest = split_params(make_model(nnx.Rngs(seed)))
        return nnx.to_pure_dict(params), nnx.to_pure_dict(rest)

    params, rest = jax.jit(create, out_shardings=shardings)()
    with _no_eager():
        return nnx.merge(graphdef, params, rest)


class LinenModel(nnx.bridge.ToNNX):
    """`sk.from_linen`'s model: Flax's `nnx.bridge.ToNNX`, whose calls return what Linen's `apply` returns.

    `model(x)` -> `out`; `model(x, mutable=["batch_stats"])` -> `(out, updates)`, `updates` the mutated
    collections as Linen gives them (`{"batch_stats": {...}}`), which the model also keeps (the train step carries
    them). `ToNNX` itself returns `out` alone in both cases; the usual Linen line `logits, updates = ...` needs
    the pair.
    """

    def __call__(self, *args: Any, mutable: Any = None, **kwargs: Any) -> Any:
        out = super().__call__(*args, mutable=mutable, **kwargs)
        if mutable is None or mutable is False or self._pytree__state.initializing:
            return out
        variables = nnx.bridge.variables.nnx_attrs_to_linen_vars(
            {k: v for k, v in vars(self).items() if not k.startswith(("to_nnx__", "_pytree__"))}
        )
        names = [mutable] if isinstance(mutable, str) else None if mutable is True else list(mutable)
        updates = {c: v for c, v in variables.items() if c != "params" and (names is None or c in names)}
        return out, updates


def from_linen(
    module: Any, example_inputs: Any, mesh: Mesh, strategy: str | Strategy, *, seed: int = 0, **call_kwargs: Any
) -> nnx.Module:
    """A Linen module as a sharded NNX model (a `LinenModel`, Flax's `nnx.bridge.ToNNX`), for `make_train_step`.

    `example_inputs` (an array or a tuple of positional arguments) and `call_kwargs` are what the module's
    `__call__` takes; they fix the shapes of the variables, as `module.init` would. Names from Linen's
    `nn.with_logical_partitioning` are honoured (they arrive as Flax's `out_sharding` metadata); Linen's
    collections other than `params` (`batch_stats`, ...) become model state. Call the model inside `loss_fn` as
    Linen's `apply` is called: `logits, updates = model(x, train=True, mutable=["batch_stats"])` returns the
    output and the updated collections (and keeps them: the step carries them); `model(x, train=False)` returns
    the output alone. Linen RNG streams (dropout) come from the bridge's own counter, advanced per call.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)

    def make(rngs: nnx.Rngs) -> nnx.Module:
        model = LinenModel(module, rngs=rngs)
        nnx.bridge.lazy_init(model, *args, **call_kwargs)
        return model

    return sharded_init(make, mesh, strategy, seed=seed)
