"""Logical axis names -> mesh axes: rules tables, spec resolution with checks, and activation constraints.

A rules table maps every logical name a model uses (`batch`, `embed`, `heads`, ...) to a tuple of mesh axes
or to None (replicated). Unlike Flax's rules, a name missing from the table is an error, not a pass-through,
and every resolved spec is checked for divisibility, so a bad plan fails here with the parameter's path.

Models call `constrain(x, ("batch", "seq", "embed"))`; inside `use_rules(mesh, rules)` (set by the train step
while tracing) that becomes `with_sharding_constraint` with the resolved spec, and outside it is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError

MeshAxes = tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

#: The mesh axis names shardkit's strategies use: a rule may name one the mesh lacks (it is dropped), and a
#: parameter annotated with one's own name is placed by `with_mesh_axis_names`.
MESH_AXES = ("data", "fsdp", "tensor", "seq", "seq_u", "seq_r", "stage", "expert", "space", "space_h", "space_w",
             "row", "col", "depth")  # fmt: skip


def with_mesh_axis_names(rules: Rules, mesh: Mesh, *, place: bool = True) -> dict[str, MeshAxes]:
    """`rules` plus a rule for each mesh axis name used as a logical name (a model annotated with mesh axes, as
    many libraries' models are: `nnx.with_partitioning(init, ("fsdp", "tensor"))`). Parameters (`place`): the axis
    itself where this table shards something over it, else replicated (`explain` lists those). Activations (`place`
    False): replicated, so that they follow the strategy's own names. A name the table maps keeps its rule."""
    used = {a for axes in rules.values() for a in (axes or ())} if place else set()
    extra = {a: ((a,) if a in used else None) for a in (*MESH_AXES, *mesh.shape) if a not in rules}
    return {**extra, **rules}


def normalize_rules(rules: Mapping[str, str | Sequence[str] | None]) -> dict[str, MeshAxes]:
    """{'batch': 'data', 'embed': ('fsdp',), 'vocab': None} -> every value a tuple of mesh axes or None."""
    out: dict[str, MeshAxes] = {}
    for name, axes in rules.items():
        if axes is None or axes == ():
            out[name] = None
        elif isinstance(axes, str):
            out[name] = (axes,)
        else:
            out[name] = tuple(axes)
    return out


def restrict_to_mesh(rules: Rules, mesh: Mesh, required: Sequence[str] = ()) -> dict[str, MeshAxes]:
    """Drops mesh axes the mesh lacks (allowed only for axes not in `required`)."""
    missing = [a for a in required if a not in mesh.shape]
    if missing:
        raise ShardkitError(
            f"this strategy needs mesh axes {missing} but the mesh has {dict(mesh.shape)}; "
            f"add them to the mesh (e.g. '{missing[0]}=2'), or choose a strategy for this mesh"
        )
    out: dict[str, MeshAxes] = {}
    for name, axes in rules.items():
        kept = tuple(a for a in (axes or ()) if a in mesh.shape)
        out[name] = kept or None
    return out


def logical_to_spec(
    names: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None, what: str = "array"
) -> PartitionSpec:
    """('batch', 'seq', 'embed') -> PartitionSpec(('data', 'fsdp'), None, None), checked against the mesh.

    Raises ShardkitError naming `what` (e.g. the parameter path) for an unmapped logical name, a mesh axis the
    mesh lacks, a mesh axis used twice, or a dimension of `shape` not divisible by its mesh axes.
    """
    spec: list[Any] = []
    used: dict[str, str | None] = {}
    for dim, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            hint = (f"; {name!r} is a mesh axis: a model annotated with mesh axes trains as annotated under strategy "
                    "'annotated'" if name in mesh.shape or name in MESH_AXES else "")  # fmt: skip
            raise ShardkitError(
                f"{what}: logical axis {name!r} has no rule in this strategy (known: {', '.join(sorted(rules))}); "
                f"add a rule {name!r}: None to replicate it or {name!r}: '<mesh axis>' to shard it{hint}"
            )
        axes = rules[name] or ()
        for axis in axes:
            if axis not in mesh.shape:
                raise ShardkitError(
                    f"{what}: logical axis {name!r} maps to mesh axis {axis!r}, which the mesh "
                    f"{dict(mesh.shape)} lacks; add {axis!r} to the mesh or change the rule"
                )
            if axis in used:
                raise ShardkitError(
                    f"{what} {tuple(names)}: mesh axis {axis!r} would shard both {used[axis]!r} and {name!r}; "
                    "one mesh axis can shard only one dimension of an array — change one of the two rules"
                )
            used[axis] = name
        degree = math.prod(mesh.shape[a] for a in axes)
        if shape is not None and shape[dim] % degree:
            raise ShardkitError(
                f"{what} of shape {tuple(shape)}: dimension {dim} ({name!r} = {shape[dim]}) is not divisible by "
                f"mesh axes {axes} of size {degree}; choose sizes divisible by {degree}, a smaller "
                f"{'x'.join(axes)} degree, or a rule {name!r}: None to replicate it"
            )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(
    names: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None, what: str = "array"
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape, what))


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """What `constrain` and the kernel slots (`shardkit.kernels`) consult while a step is traced."""

    mesh: Mesh
    rules: dict[str, MeshAxes]
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # slot -> kernel name
    scopes: dict[str, dict[str, MeshAxes]] = dataclasses.field(default_factory=dict)  # Strategy.scopes
    #: the concrete mesh of the program being traced: `mesh` itself, or, when `mesh` is the abstract mesh of a
    #: `shard_map` inside a step (pipeline stages), the enclosing context's; None when no concrete mesh is known
    devices_mesh: Mesh | None = None
    #: the strategy's parameter rules (how the parameters are laid out), for kernels that work on a parameter's own
    #: shards (shardkit/embedding.py); None outside a train step
    param_rules: dict[str, MeshAxes] | None = None

    @property
    def attention(self) -> str:
        return self.kernels.get("attention", "dense")

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """The kernel table as sorted items (older spelling of `kernels`)."""
        return tuple(sorted(self.kernels.items()))


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar("shardkit_rules", default=None)


@contextlib.contextmanager
def use_rules(
    mesh: Mesh, rules: Rules, attention: str | None = None, *, kernels: Mapping[str, str] | None = None,
    scopes: Mapping[str, Rules] | None = None, param_rules: Rules | None = None, **more: str,
) -> Iterator[ShardingContext]:  # fmt: skip
    """Activates compute rules and kernel choices for `constrain` and the kernel slots in this block.

    `kernels` maps slot -> kernel name (a strategy's `kernels` table); `attention=` and other keywords
    (`layers="pipeline:1f1b"`) are shorthands for entries of it.
    """
    table = {**(kernels or {}), **more, **({"attention": attention} if attention is not None else {})}
    outer = _CONTEXT.get()
    concrete = mesh if _is_concrete(mesh) else getattr(outer, "devices_mesh", None)
    ctx = ShardingContext(mesh, dict(rules), table, {k: dict(v) for k, v in (scopes or {}).items()}, concrete,
                          None if param_rules is None else dict(param_rules))  # fmt: skip
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def flax_rules(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Flax's logical-axis rules and an abstract mesh set from `rules`, while a step is traced.

    Without both, `flax.linen.with_logical_constraint` (in Linen modules and NNX ones alike) and Linen's
    `nn.with_logical_partitioning` boxes are silent no-ops; with them they pin activations like `constrain`.
    """
    from flax import linen as nn  # flax.linen only where it is needed

    with nn.logical_axis_rules(list(rules.items())), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


@contextlib.contextmanager
def scope(path: str) -> Iterator[None]:
    """Activations computed in this block take the active strategy's rules for module `path` (Whale's
    annotations as data: `Strategy.scopes`); a no-op when no strategy scopes `path`, or outside a train step.

        with sk.scope("head"):                     # the model names its own module, never a mesh axis
            x = sk.constrain(x, ("batch", "channels"))   # the layout change into the scope (e.g. an all-gather)
            logits = self.head(x)
    """
    ctx = _CONTEXT.get()
    if ctx is None or not ctx.scopes:
        yield
        return
    rules = dict(ctx.rules)
    for pattern, extra in ctx.scopes.items():
        if fnmatch.fnmatchcase(path, pattern):
            rules.update(extra)
    token = _CONTEXT.set(dataclasses.replace(ctx, rules=rules))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> ShardingContext | None:
    return _CONTEXT.get()


# ------------------------------------------------------------------------------------------------------------
# The platform a program is compiled for. A mesh may live on devices this host does not run: `sk.make_mesh(spec,
# target="v5e-8")` compiles a TPU program on a CPU host, so the host's backend ("cpu") says nothing about the
# program. Every platform decision (the ring's chunk, the grouped matmul, cuDNN, host offload of activations) asks
# `platform_family` instead, which reads the devices of the mesh being compiled for.

_COMPILING: contextvars.ContextVar[Any] = contextvars.ContextVar("shardkit_compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(mesh: Any) -> Iterator[None]:
    """Platform decisions in this block are made for `mesh`'s devices, outside any traced step: a strategy's
    kernel table checked up front for the step's mesh (`kernels.check`, e.g. whether `remat=offload:...` can
    offload on a TPU target compiled from a CPU host). Inside a step the sharding context's mesh comes first."""
    token = _COMPILING.set(mesh)
    try:
        yield
    finally:
        _COMPILING.reset(token)


def _is_concrete(mesh: Any) -> bool:
    return isinstance(mesh, Mesh) and mesh.devices.size > 0


def _platform_of(mesh: Any) -> str | None:
    """A concrete mesh's device platform; an abstract one's (a `shard_map` body's `get_abstract_mesh()`, or
    `mesh.abstract_mesh`) from the abstract device it carries; None when the mesh says nothing."""
    if _is_concrete(mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None) if isinstance(mesh, jax.sharding.AbstractMesh) else None
    return getattr(device, "platform", None)


def _program_meshes(mesh: Any = None) -> list[Any]:
    """The meshes that may say what the program is compiled for, most specific first: `mesh`, the traced step's
    concrete mesh and its (possibly abstract) mesh, `compiling_for`'s, and JAX's current abstract mesh."""
    ctx = _CONTEXT.get()
    found = [mesh, ctx.devices_mesh if ctx else None, ctx.mesh if ctx else None, _COMPILING.get()]
    return [*found, jax.sharding.get_abstract_mesh()]


#: A device platform's family: what every platform decision compares against. JAX's devices say "gpu" for NVIDIA
#: and AMD alike; a PJRT plugin may say "cuda" or "rocm"; anything else is its own family.
FAMILIES: dict[str, str] = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def family(platform: str) -> str:
    """The family ("cpu", "gpu", "tpu") of a device platform name ("cuda" and "rocm" are "gpu")."""
    return FAMILIES.get(platform, platform)


def platform_family(mesh: Any = None) -> str:
    """The platform family ("cpu", "gpu", "tpu") of the devices this program is being compiled for: `mesh`'s when
    given (a concrete mesh's devices, or an abstract mesh's abstract device), else the traced step's mesh
    (`use_rules`), else `compiling_for`'s, else the abstract mesh of an enclosing `shard_map`. With no mesh at all
    (eager use, a plain `jax.jit` outside any step) the program runs on JAX's first device, whose family it is.
    Every platform decision in shardkit asks this, never the host's own backend."""
    for m in _program_meshes(mesh):
        if (platform := _platform_of(m)) is not None:
            return family(platform)
    return family(jax.devices()[0].platform)  # no mesh: where an unsharded computation is placed


def compile_devices(mesh: Any = None) -> list[Any]:
    """The concrete devices of the family `platform_family(mesh)` names, from the first concrete mesh in the same
    search; [] when only an abstract mesh is known (inside a `shard_map` whose step set no concrete mesh: hetero,
    sdp) or no mesh at all."""
    platform = platform_family(mesh)
    for m in _program_meshes(mesh):
        if _is_concrete(m) and family(_platform_of(m) or "") == platform:
            return list(m.devices.flat)
    return []


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins activation `x` to the layout its logical names resolve to under the active compute rules."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return x
    if len(names) != x.ndim:
        raise ShardkitError(f"constrain: {len(names)} logical names {tuple(names)} for an array of shape {x.shape}")
    sharding = named_sharding(names, ctx.rules, ctx.mesh, x.shape, what=f"activation {tuple(names)}")
    if _all_manual(ctx.mesh):  # inside a shard_map manual over every axis (and maybe a vmap): nothing to pin
        return x
    return pin(x, sharding)


def local_shape(names: Sequence[str | None], shape: Sequence[int]) -> tuple[int, ...]:
    """The per-device shape of an activation of global `shape` whose dimensions are named `names`, as the active
    rules (and `scope`) lay it out while a step is traced: each dimension divided by the sizes of the mesh axes its
    name maps to (axes that are Manual here, inside a `shard_map`, are already divided out of `shape`). Outside a
    step, `shape` itself. For the size-dependent choices a model makes at trace time (e.g. the GPT's loss chunks)."""
    ctx = _CONTEXT.get()
    if ctx is None:
        return tuple(shape)
    mesh = ctx.mesh
    types = getattr(mesh, "axis_types", ()) or (None,) * len(mesh.axis_names)
    manual = {a for a, t in zip(mesh.axis_names, types, strict=True) if t == jax.sharding.AxisType.Manual}
    out = []
    for n, name in zip(shape, names, strict=True):
        axes = () if name is None else (ctx.rules.get(name) or ())
        out.append(-(-n // math.prod(mesh.shape[a] for a in axes if a in mesh.shape and a not in manual)))
    return tuple(out)


def pin(tree: Any, shardings: Any) -> Any:
    """Each array of `tree` laid out as its sharding says, while traced: `with_sharding_constraint` on Auto axes
    (GSPMD chooses), `jax.sharding.reshard` where the mesh has Explicit axes (explicit mode, where a constraint
    would only assert the layout the array already has)."""

    def one(x: Any, sharding: Any) -> Any:
        if any(t == jax.sharding.AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ())):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    return jax.tree.map(one, tree, shardings)


def _all_manual(mesh: Any) -> bool:
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == jax.sharding.AxisType.Manual for t in types)
