"""Named parallelism strategies as data: parameter rules, optimizer-state rules, compute rules, kernels.

A strategy never edits the model. FSDP is just parameter rules that differ from the compute rules (Levanter's
`parameter_axis_mapping` vs `compute_axis_mapping`): parameters rest sharded over `fsdp` and XLA gathers them
where the compute rules want them replicated. ZeRO-1 differs only in the optimizer-state rules.

Define your own in a few lines:

    my = sk.strategy("fsdp").replace(name="fsdp_vocab", param_rules={**sk.strategy("fsdp").param_rules,
                                                                        "vocab": ("fsdp",), "embed": None})
    sk.register_strategy(my)

This module holds the class, the registry and the building blocks of the tables. Every parallelism registers its
strategies in its own folder of shardkit/parallel/: the GSPMD tables of data, ZeRO, FSDP and Megatron parallelism in
gspmd/strategies.py, context parallelism in context/strategies.py, spatial in spatial/kernels.py, tp3d in
tensor3d.py, the pipelines, SDP, MoE and hetero in theirs.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh

from shardkit.errors import ShardkitError
from shardkit.offload import parse as offload_names
from shardkit.rules import MESH_AXES as MESH_AXES  # re-exported: its home was this module
from shardkit.rules import MeshAxes, normalize_rules, restrict_to_mesh, with_mesh_axis_names

#: Logical names the models in models/ use (models/axes.py) — every strategy says what each one does: the
#: transformer's, then the CNNs' (`depth` is a volume's third spatial dimension; `classes` a classifier's output).
#: A model with names of its own extends a strategy: `sk.strategy("fsdp").extend(my_name=None)`.
#: "kv" is Flax's examples' name for the heads dimension of attention kernels (`('embed', 'kv')` on an
#: [embed, heads, head_dim] kernel): Megatron splits it like `heads`.
LOGICAL_AXES = ("batch", "seq", "res_seq", "embed", "heads", "kv_heads", "kv", "head_dim", "mlp", "vocab", "layers",
                "experts", "height", "width", "depth", "channels", "classes")  # fmt: skip
_REPLICATED: dict[str, MeshAxes] = dict.fromkeys(LOGICAL_AXES)
#: Mesh axis names the strategies use; a rule may name one the mesh lacks (it is then dropped: data parallelism
#: without a `data` axis is no data parallelism), but a name outside this list must be in the mesh.


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Rules tables + kernel choices. Mesh axes in `required_axes` must exist; others are used if present."""

    name: str
    param_rules: Mapping[str, MeshAxes]
    compute_rules: Mapping[str, MeshAxes]
    opt_rules: Mapping[str, MeshAxes] | None = None  # None: optimizer state sharded like the parameters
    required_axes: tuple[str, ...] = ()
    attention: str = "dense"  # shorthand for kernels["attention"]
    layers: str = "scan"  # shorthand for kernels["layers"]: "scan" or a pipeline kernel (shardkit/layers.py)
    description: str = ""
    collectives: str = ""  # what it compiles to, for docs/strategies.md's table and explain()
    #: slot -> kernel name (shardkit/kernels.py), e.g. {"attention": "ring:zigzag", "layers": "scan", "conv": ...}
    kernels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: the train step that runs this strategy (shardkit/step.py registry): "gspmd" (shardkit/parallel/gspmd/step.py,
    #: one jit partitioned by GSPMD from the tables) or a step of its own ("sdp", "hetero": shardkit/parallel/)
    step: str = "gspmd"
    #: that step's options (e.g. the SDP step's SDPConfig); None for the GSPMD step
    options: Any = None
    #: Whale-style scoped rules: module path pattern -> rules that override all three tables for the parameters
    #: under that path (fnmatch on "a/b/c" paths and their prefixes) and for the activations the model computes
    #: inside `with sk.scope("<path>"):`. E.g. {"head": {"classes": "data", "batch": None}}: the classifier split
    #: over the devices that hold the batch elsewhere (Whale's `split` inside `replicate`).
    scopes: Mapping[str, Mapping[str, MeshAxes]] = dataclasses.field(default_factory=dict)
    #: refuse parameters with fewer logical names than dimensions, or none, instead of replicating what is unnamed
    #: (Flax's meaning, the default; `--config.strict_names`)
    strict_names: bool = False
    #: parameters without logical names are split over the table's ZeRO axes (FSDP's: `shardkit.init.unnamed_splits`)
    #: along their largest divisible dimension when they have at least this many bytes; smaller ones stay replicated
    #: (0: every one, as PyTorch FSDP; Kauldron's FSDP keeps those under 4 MiB whole)
    unnamed_min_bytes: int = 0
    #: logical names by parameter path, ((regex, names), ...), first match wins (`re.search` over "a/b/c"), before
    #: the parameters' own metadata: names for a model library that carries none, without editing it
    path_rules: tuple[tuple[str, tuple[str | None, ...]], ...] = ()
    #: what rests in host memory between steps, brought to the devices by the step (ZeRO-Offload,
    #: shardkit/offload.py): () or any of "opt_state", "params" (a comma-separated string is accepted)
    offload: tuple[str, ...] = ()
    #: on a mesh with Explicit axes (jax.make_mesh's default), run the model in JAX's explicit sharding mode: its
    #: own `out_sharding=` / `jax.sharding.reshard` calls decide each layout (shardkit/mesh.py `step_mesh`). False:
    #: the strategy's tables decide, and Explicit axes are taken as Auto ones (GSPMD), said once
    explicit_axes: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", offload_names(self.offload))
        object.__setattr__(self, "param_rules", normalize_rules(self.param_rules))
        object.__setattr__(self, "compute_rules", normalize_rules(self.compute_rules))
        if self.opt_rules is not None:
            object.__setattr__(self, "opt_rules", normalize_rules(self.opt_rules))
        object.__setattr__(self, "scopes", {str(k): normalize_rules(v) for k, v in dict(self.scopes).items()})
        table = {"attention": self.attention, "layers": self.layers, **self.kernels}
        object.__setattr__(self, "kernels", table)
        object.__setattr__(self, "attention", table["attention"])
        object.__setattr__(self, "layers", table["layers"])

    def replace(self, **changes: Any) -> Strategy:
        """A copy with `changes`; `attention=` / `layers=` and `kernels=` stay one table."""
        shorthand = {k: changes[k] for k in ("attention", "layers") if k in changes}
        if shorthand or "kernels" in changes:
            table = {**self.kernels, **changes.get("kernels", {}), **shorthand}
            changes = {**changes, "kernels": table, "attention": table["attention"], "layers": table["layers"]}
        return dataclasses.replace(self, **changes)

    def extend(
        self, path_rules: Sequence[tuple[str, Sequence[str | None]]] = (), **rules: str | Sequence[str] | None
    ) -> Strategy:
        """The same strategy with rules for a model's own logical names, in all three tables, and logical names
        for parameters by their path.

        `sk.strategy("fsdp").extend(height=None, width=None, channels=None)` replicates them; a name may be
        sharded (`channels="tensor"`) like any other. `path_rules=[(r"attn/.*/kernel", ("embed", "heads")), ...]`
        names every parameter whose "a/b/c" path matches a pattern (`re.search`; the first match wins, before the
        parameter's own metadata), as EasyDeL's, t5x's and MaxText's partition rules do; the names then go through
        the tables like any others. Rules given here come before the strategy's earlier ones.
        """
        for pattern, names in path_rules:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ShardkitError(f"path_rules: {pattern!r} is not a regular expression ({e})") from None
            if isinstance(names, str):
                raise ShardkitError(f"path_rules: {pattern!r} -> {names!r}: give a tuple of names, one per dimension")
        paths = tuple((p, tuple(n)) for p, n in path_rules) + self.path_rules
        new = normalize_rules(rules)
        opt = None if self.opt_rules is None else {**self.opt_rules, **new}
        return self.replace(
            param_rules={**self.param_rules, **new}, compute_rules={**self.compute_rules, **new}, opt_rules=opt,
            path_rules=paths,
        )  # fmt: skip

    def mesh_axes(self) -> set[str]:
        """Every mesh axis any of the tables shards over."""
        tables = [self.param_rules, self.compute_rules, self.opt_rules or {}, *self.scopes.values()]
        return {a for t in tables for axes in t.values() for a in (axes or ())}

    def default_mesh(self, devices: int) -> dict[str, int]:
        """A mesh this strategy fits on `devices` devices, for when none is given (printed by the experiments).

        Every required axis gets 2, `data` (when the strategy uses it without requiring it) 2, and the first
        required data-like axis (fsdp, data, else the last required one) the rest: fsdp -> data=2,fsdp=4,
        tp -> data=2,tensor=4, fsdp_tp -> data=2,fsdp=2,tensor=2 on 8 devices; an odd factor of the device count
        goes to data, since model widths are powers of two (fsdp on 12: data=3,fsdp=4). Without required axes (tp3d)
        the axes the tables use get 2 each, in order, while devices remain.
        """
        used = [a for a in ("data", "fsdp", "tensor", "seq", "seq_u", "seq_r", "stage", "expert", "space",
                            "row", "col", "depth") if a in self.mesh_axes()]  # fmt: skip
        used += sorted(self.mesh_axes() - set(used))
        if not self.required_axes:
            out: dict[str, int] = {}
            for a in used:
                if devices // max(1, _prod(out.values())) >= 2:
                    out[a] = 2
            if out and devices % _prod(out.values()) == 0:
                out[next(iter(out))] *= devices // _prod(out.values())
            return out or {"data": devices}
        rest = next((a for a in ("fsdp", "data") if a in self.required_axes), self.required_axes[-1])
        out = {a: 2 for a in used if a in self.required_axes or a == "data"}
        out[rest] = 1
        if devices % _prod(out.values()):
            raise ShardkitError(f"strategy {self.name!r} needs mesh axes {list(out)}: {devices} devices do not split")
        out[rest] = devices // _prod(out.values())
        if rest != "data" and "data" in out:  # model widths are powers of two: an odd factor goes to data alone
            m = out[rest] * out["data"]
            odd = m // (m & -m)  # 12 devices, fsdp: data=3,fsdp=4, not data=2,fsdp=6
            if odd > 1:
                out["data"], out[rest] = odd, m // odd
        return {a: n for a, n in out.items() if n > 1 or a in self.required_axes}

    def bind(self, mesh: Mesh) -> BoundStrategy:
        """Checks the strategy against a mesh and drops optional axes the mesh lacks.

        An axis the mesh lacks may be dropped only if it is one of the known mesh axis names (MESH_AXES): any
        other name is a typo in a rule ('tensr'), which would silently replicate what it should shard."""
        unknown = sorted(a for a in self.mesh_axes() if a not in mesh.shape and a not in MESH_AXES)
        if unknown:
            rule = next(f"{t}[{n!r}]" for t, table in (("param_rules", self.param_rules),
                        ("compute_rules", self.compute_rules), ("opt_rules", self.opt_rules or {}))
                        for n, axes in table.items() if unknown[0] in (axes or ()))  # fmt: skip
            raise ShardkitError(
                f"strategy {self.name!r}: {rule} names mesh axis {unknown[0]!r}, which is neither in the mesh "
                f"{dict(mesh.shape)} nor a known mesh axis ({', '.join(MESH_AXES)}); fix the rule, or add the axis "
                "to the mesh"
            )
        unused = [a for a, n in mesh.shape.items() if n > 1 and a not in self.mesh_axes()]
        if unused:
            raise ShardkitError(
                f"strategy {self.name!r} does not use mesh axis {unused[0]!r} (size {mesh.shape[unused[0]]}): "
                f"every device along it would compute the same thing. Remove it from the mesh or pick a strategy "
                f"that uses it ({', '.join(s for s, v in STRATEGIES.items() if unused[0] in v.mesh_axes())})"
            )
        params = with_mesh_axis_names(restrict_to_mesh(self.param_rules, mesh, self.required_axes), mesh)
        opt = params if self.opt_rules is None else with_mesh_axis_names(restrict_to_mesh(self.opt_rules, mesh), mesh)
        return BoundStrategy(
            strategy=self,
            mesh=mesh,
            param_rules=params,
            opt_rules=opt,
            compute_rules=with_mesh_axis_names(restrict_to_mesh(self.compute_rules, mesh), mesh, place=False),
            scopes={k: restrict_to_mesh(v, mesh) for k, v in self.scopes.items()},
        )


@dataclasses.dataclass(frozen=True)
class BoundStrategy:
    """A strategy resolved against one mesh: the three rules tables contain only axes of that mesh.

    A run resolves its strategy once (`sk.strategy(name)`, then `bind(strategy, mesh)`) and hands this object down:
    `make_train_step`, the step, `sharded_init`, explain and the cost models take it as it is, with no second
    look-up or bind."""

    strategy: Strategy
    mesh: Mesh
    param_rules: dict[str, MeshAxes]
    opt_rules: dict[str, MeshAxes]
    compute_rules: dict[str, MeshAxes]
    scopes: dict[str, dict[str, MeshAxes]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def kernels(self) -> Mapping[str, str]:
        """slot -> kernel name (shardkit/kernels.py)."""
        return self.strategy.kernels


def bind(strategy: str | Strategy | BoundStrategy, mesh: Mesh) -> BoundStrategy:
    """`strategy` bound to `mesh`: a BoundStrategy already bound to this mesh passes through as it is, a Strategy is
    bound, a name is looked up first. Every step and `sharded_init` go through here, so a resolved strategy is never
    looked up or bound twice."""
    if isinstance(strategy, BoundStrategy) and strategy.mesh == mesh:
        return strategy
    return _resolve(strategy).bind(mesh)


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def table(**overrides: str | Sequence[str] | None) -> dict[str, MeshAxes]:
    """A rules table: every logical name replicated but the `overrides` (name -> mesh axis or axes)."""
    return {**_REPLICATED, **normalize_rules(overrides)}


#: Building blocks for the strategies each parallelism registers beside its code (shardkit/parallel/): Megatron's
#: tensor rules; FSDP's parameter rules, which rest a transformer's parameters on their `embed` dimension and a
#: CNN's on their (output) `channels`; the batch axes of data x fsdp.
TENSOR_RULES = {"heads": "tensor", "kv_heads": "tensor", "kv": "tensor", "mlp": "tensor", "vocab": "tensor"}
FSDP_RULES = {"embed": "fsdp", "channels": "fsdp"}
DATA_FSDP = ("data", "fsdp")

STRATEGIES: dict[str, Strategy] = {}


def register_strategy(s: Strategy) -> Strategy:
    """Makes `sk.strategy(s.name)` return `s` (replacing any strategy of that name)."""
    STRATEGIES[s.name] = s
    return s


#: Old names that keep working, each saying once per process that it is deprecated: the context-parallel
#: strategies were `sp_*`, which read as Megatron's sequence parallelism (`tp_sp`), a different thing.
DEPRECATED_NAMES: dict[str, str] = {
    "sp_ring": "cp_ring", "sp_zigzag": "cp_zigzag", "sp_striped": "cp_striped", "sp_ulysses": "cp_ulysses",
    "sp_usp": "cp_usp", "fsdp_sp_zigzag": "fsdp_cp_zigzag", "sp_zigzag_tp": "cp_zigzag_tp",
}  # fmt: skip
_warned: set[str] = set()


def strategy(name: str | Strategy | BoundStrategy) -> Strategy:
    """The registered strategy `name` (a Strategy passes through, a BoundStrategy gives its strategy; a deprecated
    name gives its new one's)."""
    return _resolve(name)


def _resolve(name: str | Strategy | BoundStrategy) -> Strategy:
    if isinstance(name, Strategy):
        return name
    if isinstance(name, BoundStrategy):
        return name.strategy
    if name in DEPRECATED_NAMES and name not in STRATEGIES:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"strategy {name!r} is now {DEPRECATED_NAMES[name]!r} (context parallelism); the old name "
                          "will be removed", FutureWarning, stacklevel=3)  # fmt: skip
        name = DEPRECATED_NAMES[name]
    if name not in STRATEGIES:
        close = difflib.get_close_matches(name, STRATEGIES, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ShardkitError(f"unknown strategy {name!r}{hint}; available: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
