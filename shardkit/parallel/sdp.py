"""Subnetwork Data Parallelism (Singh, Khalid, Cagnasso, Oyallon, Belilovsky, arXiv 2507.09029).

Every worker (a device along the `data` mesh axis) trains a structured subnetwork on its own batch shard, and
each parameter is averaged every step over exactly the workers that hold it (HeteroFL's `combine`). No
activation crosses workers.

    strategy = sk.sdp.strategy(granularity="block", coverage=0.5, masking="forward", ownership="cyclic")
    step = sk.make_train_step(model, tx, sk.make_mesh({"data": 8}), strategy)
    owners = sk.sdp.ownership(num_blocks=8, workers=8, coverage=0.5)   # bool [workers, blocks]

What is split is found from the parameters' logical names, so no model is named here:
- `granularity="block"`: the leading `layers` dimension of a stack of identical blocks (the GPT's transformer
  layers, a ResNet stage's identity blocks). A worker holds k = coverage x L of the L blocks.
- `granularity="neuron"`: the hidden units of a logical dimension (`units`, default `mlp`), cut into G groups
  (default: one per worker); a worker holds k = coverage x G groups of every layer's units.
Parameters without that name (embedding, stem, head, norms) are shared: plain data parallelism.

Masking:
- `forward`: the subnetwork alone runs forward, backward and update. Each device *stores* only its k slots of
  every split parameter (a `[workers, k, ...]` array sharded over `data`), and so only their gradients and
  optimizer state: per-device bytes = shared + coverage x split. Holder averaging is a ring of `ppermute`s over
  the holder sets (`ring`: for a cyclic table, 2(h - 1) permutes of one slot-set per step with h holders per
  block, all split parameters packed into one buffer), or a masked `psum` over all groups (`psum`: any table).
- `backward`: the full network runs forward, gradients are kept only for the owned part and averaged over the
  holders (a masked `psum`). The paper leaves open how non-owned weights stay current for the forward; here
  every worker keeps a full replica and receives every group's holder-averaged gradient, so all replicas apply
  the same update. This keeps the paper's unbiased-gradient property; it saves no memory or bytes (those are
  forward masking's), and XLA computes every layer's weight gradient inside the scan before the mask.

Evaluation: `step.evaluate(state, batch)` under forward masking averages the subnetworks' losses (each worker its
own on its shard of the batch: what was trained; `eval="subnetworks"`, the default) or runs the full network
(`eval="full"`). The full network runs blocks together that never trained together: for a GPT (pre-norm) it
evaluates close to the subnetworks, for a post-activation ResNet with BatchNorm it does not (stochastic depth
rescales the residual branches at test time for this reason; the SDP paper's rule was not found). Backward
masking trains the full network and evaluates it. `step.model(state)` / `step.full_params(state)` give the full
network, each split array read from its first holder (all holders are bit-identical).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit import batch as batching
from shardkit.errors import ShardkitError
from shardkit.init import is_key, split_params, state_logical_axes
from shardkit.strategies import register_strategy
from shardkit.train import TrainState, TrainStep, _check_alive, global_norm, norm_weights

GRANULARITIES = ("block", "neuron")
MASKINGS = ("forward", "backward")
OWNERSHIPS = ("cyclic", "random")
REDUCTIONS = ("auto", "ring", "psum")


@dataclasses.dataclass(frozen=True)
class SDPConfig:
    """What `sk.sdp.strategy` builds a strategy from (validated on construction)."""

    granularity: str = "block"
    coverage: float = 0.5  # fraction of the blocks (or of each layer's unit groups) every worker holds
    masking: str = "forward"
    ownership: str = "cyclic"
    seed: int = 0  # for ownership="random"
    axis: str = "data"  # the mesh axis whose devices are the workers
    units: str = ""  # the split logical name: "" = "layers" for block, "mlp" for neuron
    groups: int = 0  # neuron: unit groups per layer (0 = one per worker)
    reduce: str = "auto"  # holder averaging: "ring" (cyclic tables), "psum", "auto" (ring when it applies)
    #: forward masking's evaluation: "subnetworks" (each worker's subnetwork on its shard of the batch, the mean:
    #: what was trained) or "full" (the whole network, every block; backward masking always evaluates it)
    eval: str = "subnetworks"

    def __post_init__(self) -> None:
        for field, allowed in (("granularity", GRANULARITIES), ("masking", MASKINGS), ("ownership", OWNERSHIPS),
                               ("reduce", REDUCTIONS), ("eval", ("subnetworks", "full"))):  # fmt: skip
            if getattr(self, field) not in allowed:
                raise ShardkitError(f"sdp {field}={getattr(self, field)!r}: choose one of {', '.join(allowed)}")
        if not 0 < self.coverage <= 1:
            raise ShardkitError(f"sdp coverage={self.coverage} must be in (0, 1] (the fraction each worker holds)")
        if self.groups < 0:
            raise ShardkitError(f"sdp groups={self.groups} must be >= 0 (0 = one group per worker)")
        if self.granularity == "block" and self.groups:
            raise ShardkitError("sdp groups= is for granularity='neuron' (blocks are the groups of 'block')")
        if not self.units:
            object.__setattr__(self, "units", "layers" if self.granularity == "block" else "mlp")


def strategy(
    granularity: str = "block", coverage: float = 0.5, masking: str = "forward", ownership: str = "cyclic",
    seed: int = 0, *, axis: str = "data", units: str = "", groups: int = 0, reduce: str = "auto",
    eval: str = "subnetworks",
) -> Any:  # fmt: skip
    """The `sdp` strategy: data parallelism's rules tables plus the subnetwork configuration (`Strategy.sdp`).

    `sk.make_train_step(model, tx, mesh, sk.sdp.strategy(...))` builds the SDP step (shardkit/parallel/sdp.py);
    `sk.strategy("sdp")` is this with its defaults (block, coverage 1/2, forward, cyclic)."""
    from shardkit.strategies import strategy as named

    cfg = SDPConfig(granularity, float(coverage), masking, ownership, int(seed), axis, units, int(groups), reduce,
                    eval)  # fmt: skip
    desc = (f"subnetwork data parallelism: {cfg.granularity}-level, coverage {cfg.coverage:g}, {cfg.masking} "
            f"masking, {cfg.ownership} ownership; shared parameters data-parallel")  # fmt: skip
    return named("dp").replace(
        name="sdp", sdp=cfg, description=desc,
        collectives="holder averaging: ring of collective-permutes (or a masked all-reduce); all-reduce of the "
        "shared gradients",
    )  # fmt: skip


# --------------------------------------------------------------------------------------------- ownership
def _slots_needed(num_blocks: int, coverage: float) -> int:
    k = coverage * num_blocks
    if abs(k - round(k)) > 1e-9 or round(k) < 1:
        raise ShardkitError(
            f"coverage {coverage:g} of {num_blocks} blocks (or unit groups) is {k:g} per worker; choose a coverage "
            f"that is a multiple of 1/{num_blocks} (e.g. {max(1, round(k)) / num_blocks:g})"
        )
    return round(k)


def _offsets(workers: int, num_blocks: int) -> list[int]:
    """Cyclic tables: worker w holds blocks offset_w .. offset_w + k - 1 (mod L)."""
    if workers <= num_blocks:
        return [w * num_blocks // workers for w in range(workers)]
    return [w % num_blocks for w in range(workers)]


def _components(table: np.ndarray) -> list[set[int]]:
    """Connected components (as sets of workers) of the bipartite worker-block graph."""
    workers = table.shape[0]
    seen: set[int] = set()
    comps = []
    for start in range(workers):
        if start in seen:
            continue
        comp, frontier = {start}, [start]
        while frontier:
            w = frontier.pop()
            for other in np.nonzero(table[:, table[w]].any(axis=1))[0]:
                if int(other) not in comp:
                    comp.add(int(other))
                    frontier.append(int(other))
        seen |= comp
        comps.append(comp)
    return comps


def check_ownership(table: np.ndarray, *, equal_holders: bool = False) -> None:
    """Every block has a holder and the worker-block graph is connected; ShardkitError otherwise.

    Why connected: holder averaging mixes a block only among its holders. If the workers fall into groups that
    share no block, each group trains its own blocks on its own share of the data only, never together with the
    other group's blocks, and the full network evaluated at the end is two separately trained halves stitched
    together (e.g. cyclic blocks {4w..4w+3} mod 8 on 8 workers: even and odd workers never meet). Connected,
    every block's updates reach every worker through chains of shared blocks.
    """
    table = np.asarray(table, bool)
    workers, blocks = table.shape
    orphans = np.nonzero(~table.any(axis=0))[0]
    if len(orphans):
        raise ShardkitError(
            f"blocks {orphans.tolist()} have no holder among {workers} workers: no one would train them. Each "
            f"block needs >= 1 holder (workers x held >= blocks: raise the coverage)"
        )
    counts = table.sum(axis=1)
    if len(set(counts.tolist())) > 1:
        raise ShardkitError(f"workers hold different numbers of blocks {counts.tolist()}; SDP gives each k slots")
    comps = _components(table)
    if len(comps) > 1:
        groups = [sorted(c) for c in comps]
        raise ShardkitError(
            f"the ownership splits the workers into {len(comps)} groups that share no block ({groups[:4]}): each "
            "group would train its blocks on its own data alone and the full network would be separately trained "
            "parts. Raise the coverage, or use ownership='random'"
        )
    holders = table.sum(axis=0)
    if equal_holders and len(set(holders.tolist())) > 1:
        raise ShardkitError(
            f"cyclic ownership of {blocks} blocks by {workers} workers gives holder counts {holders.tolist()}; "
            f"choose a coverage for which workers x k is a multiple of {blocks}, or ownership='random'"
        )


def ownership(num_blocks: int, workers: int, coverage: float, kind: str = "cyclic", seed: int = 0) -> np.ndarray:
    """bool [workers, blocks]: which worker holds which block (or unit group), checked (`check_ownership`).

    cyclic: worker w holds blocks o_w .. o_w + k - 1 mod L with o_w = w L / W (W <= L) or w mod L (W > L), so
    every block has the same number of holders W k / L; random: a seeded k-subset per worker, redrawn until every
    block is held and the graph is connected."""
    if num_blocks < 1 or workers < 1:
        raise ShardkitError(f"ownership of {num_blocks} blocks by {workers} workers: both must be >= 1")
    k = _slots_needed(num_blocks, coverage)
    if kind == "cyclic":
        table = np.zeros((workers, num_blocks), bool)
        for w, o in enumerate(_offsets(workers, num_blocks)):
            table[w, [(o + j) % num_blocks for j in range(k)]] = True
        check_ownership(table, equal_holders=True)
        return table
    if kind != "random":
        raise ShardkitError(f"ownership kind={kind!r}: choose one of {', '.join(OWNERSHIPS)}")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        table = np.zeros((workers, num_blocks), bool)
        for w in range(workers):
            table[w, rng.choice(num_blocks, size=k, replace=False)] = True
        if table.any(axis=0).all() and len(_components(table)) == 1:
            return table
    check_ownership(table)  # raises with the reason
    return table


def slots(table: np.ndarray) -> np.ndarray:
    """int [workers, k]: the blocks each worker holds, in network order (its stored slots, its forward order)."""
    return np.stack([np.nonzero(row)[0] for row in np.asarray(table, bool)])


@dataclasses.dataclass(frozen=True)
class Ring:
    """The holder ring of a cyclic table: offsets advance by `stride` slots per worker, `copies` disjoint rings."""

    stride: int  # s: slots by which consecutive workers' windows advance
    holders: int  # h: holders of a block within one ring
    copies: int  # r: rings (W > L: workers w and w + L hold the same blocks)
    size: int  # workers per ring

    def permutes(self) -> int:
        """Collective-permutes per step: h - 1 reduce, h - 1 broadcast, r - 1 between the copies."""
        return 2 * (self.holders - 1) + self.copies - 1


def ring_of(table: np.ndarray) -> Ring | None:
    """The ring a table admits (cyclic windows with even stride), or None (then holder averaging is a psum)."""
    workers, blocks = table.shape
    k = int(table[0].sum())
    if blocks % workers and workers % blocks:
        return None
    stride = max(1, blocks // workers)
    expect = np.zeros_like(table)
    for w, o in enumerate(_offsets(workers, blocks)):
        expect[w, [(o + j) % blocks for j in range(k)]] = True
    if not (expect == table).all() or k % stride:
        return None
    return Ring(stride, k // stride, max(1, workers // blocks), min(workers, blocks))


def _cyclic_order(table: np.ndarray) -> np.ndarray:
    """int [workers, k]: for each worker, the positions in its (sorted) slots of blocks o_w, o_w + 1, ..."""
    workers, blocks = table.shape
    k = int(table[0].sum())
    out = []
    for w, o in enumerate(_offsets(workers, blocks)):
        sorted_slots = list(np.nonzero(table[w])[0])
        out.append([sorted_slots.index((o + j) % blocks) for j in range(k)])
    return np.asarray(out, np.int32)


# ------------------------------------------------------------------------------------ holder averaging
def ring_average(buf: jax.Array, table: np.ndarray, axis: str) -> jax.Array:
    """[k, n] per worker -> [k, n]: each slot averaged over the block's holders, by a ring of ppermutes.

    Inside `shard_map` over `axis`. `buf` holds the worker's k slots in network order. The reduce chain passes
    the top `stride` slots of a window to the next worker, which adds its copy (h - 1 permutes); the full sums
    arrive at the window's start, copies of the ring are combined in a fixed order (r - 1 permutes), and a
    broadcast chain hands the means back along the ring (h - 1 permutes). Every holder receives the value
    computed at one place, so all holders stay bit-identical."""
    ring = ring_of(table)
    if ring is None:
        raise ShardkitError("ring holder averaging needs a cyclic ownership table; use reduce='psum'")
    workers = table.shape[0]
    s, h, r, size = ring.stride, ring.holders, ring.copies, ring.size
    k = h * s
    idx = lax_axis_index(axis)
    order = jnp.asarray(_cyclic_order(table))[idx]
    x = jnp.take(buf, order, axis=0)  # [k, n] in cyclic order: slot j = block o_w + j
    nxt = [(w, (w // size) * size + (w % size + 1) % size) for w in range(workers)]
    prv = [(b, a) for a, b in nxt]
    acc = x[k - s :]
    for t in range(1, h):
        acc = jax.lax.ppermute(acc, axis, nxt) + x[k - s - t * s : k - t * s]
    if r > 1:  # the same windows in the other rings: gather them, add in ring order (identical on every copy)
        parts = [acc] + [jax.lax.ppermute(acc, axis, [(w, (w + t * size) % workers) for w in range(workers)])
                         for t in range(1, r)]  # fmt: skip
        # parts[t] came from ring (c - t) mod r, c = this worker's ring: reorder to rings 0 .. r - 1, add in order
        ordered = jnp.take(jnp.stack(parts), (idx // size - jnp.arange(r)) % r, axis=0)
        acc = ordered[0]
        for c in range(1, r):
            acc = acc + ordered[c]
    mean = acc / (h * r)
    out, cur = [mean], mean
    for _ in range(1, h):
        cur = jax.lax.ppermute(cur, axis, prv)
        out.append(cur)
    y = jnp.concatenate(out, axis=0)
    inverse = jnp.asarray(np.argsort(_cyclic_order(table), axis=1).astype(np.int32))[idx]
    return jnp.take(y, inverse, axis=0)


def psum_average(buf: jax.Array, table: np.ndarray, axis: str) -> jax.Array:
    """[k, n] per worker -> [k, n]: each slot averaged over its holders by one masked all-reduce of [L, n]."""
    idx = lax_axis_index(axis)
    mine = jnp.asarray(slots(table).astype(np.int32))[idx]
    dense = jnp.zeros((table.shape[1], *buf.shape[1:]), buf.dtype).at[mine].set(buf)
    counts = jnp.asarray(table.sum(axis=0), buf.dtype)
    total = jax.lax.psum(dense, axis) / counts[:, None]
    return jnp.take(total, mine, axis=0)


def masked_average(full: jax.Array, table: np.ndarray, axis: str) -> jax.Array:
    """[L, n] per worker -> [L, n]: zero outside the worker's blocks, then the sum over holders / holder count."""
    idx = lax_axis_index(axis)
    mask = jnp.asarray(table)[idx]
    counts = jnp.asarray(table.sum(axis=0), full.dtype)
    return jax.lax.psum(jnp.where(mask[:, None], full, 0), axis) / counts[:, None]


def lax_axis_index(axis: str) -> jax.Array:
    return jax.lax.axis_index(axis)


# ----------------------------------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class Split:
    """How one array is split into groups: dimension `dim` of size N = groups x N / groups."""

    dim: int
    groups: int

    def to_groups(self, x: jax.Array, groups: int | None = None) -> jax.Array:
        """[..., N (dim), ...] -> [G, ..., N / G (dim), ...]; `groups=k` for a subnetwork's k groups."""
        shape, g = x.shape, groups or self.groups
        y = x.reshape(*shape[: self.dim], g, shape[self.dim] // g, *shape[self.dim + 1 :])
        return jnp.moveaxis(y, self.dim, 0)

    def from_groups(self, x: jax.Array) -> jax.Array:
        """[g, ..., n (dim), ...] -> [..., g n (dim), ...] (the inverse of to_groups for any number of groups g)."""
        y = jnp.moveaxis(x, 0, self.dim)
        shape = y.shape
        return y.reshape(*shape[: self.dim], shape[self.dim] * shape[self.dim + 1], *shape[self.dim + 2 :])


def find_splits(names: Any, shapes: Any, cfg: SDPConfig, workers: int, what: str) -> Any:
    """A pytree like `names`: a Split for every array whose logical names contain `cfg.units`, else None."""

    def one(path: Any, axes: tuple, shape: Any) -> Split | None:
        if cfg.units not in (axes or ()):
            return None
        dim = axes.index(cfg.units)
        n = shape.shape[dim]
        groups = n if cfg.granularity == "block" else (cfg.groups or workers)
        if n % groups:
            raise ShardkitError(
                f"{what} {jax.tree_util.keystr(path)}: its {cfg.units!r} dimension of {n} does not split into "
                f"{groups} unit groups; set sdp groups= to a divisor of {n}"
            )
        return Split(dim, groups)

    return jax.tree_util.tree_map_with_path(one, names, shapes, is_leaf=lambda x: isinstance(x, tuple))


def layout_sharding(mesh: Mesh, axis: str) -> NamedSharding:
    return NamedSharding(mesh, P(axis))


def pack(leaves: Sequence[jax.Array], lead: int) -> tuple[jax.Array, list[tuple[tuple[int, ...], Any]]]:
    """Arrays with `lead` leading slots -> one [lead, n] buffer (in their common dtype) and how to unpack it."""
    dtype = jnp.result_type(*leaves) if leaves else jnp.float32
    meta = [(x.shape, x.dtype) for x in leaves]
    flat = [x.reshape(lead, -1).astype(dtype) for x in leaves]
    return (jnp.concatenate(flat, axis=1) if flat else jnp.zeros((lead, 0), dtype)), meta


def unpack(buf: jax.Array, meta: list[tuple[tuple[int, ...], Any]]) -> list[jax.Array]:
    out, start = [], 0
    for shape, dtype in meta:
        n = math.prod(shape[1:])
        out.append(buf[:, start : start + n].reshape(shape).astype(dtype))
        start += n
    return out


def weighted_norm(tree: Any, weights: Any) -> jax.Array:
    """sqrt(sum w x^2): the norm of the logical gradient when the layout stores a block once per holder."""
    terms = jax.tree.leaves(jax.tree.map(lambda x, w: jnp.sum(w * jnp.square(x.astype(jnp.float32))), tree, weights))
    return jnp.sqrt(sum(terms)) if terms else jnp.zeros((), jnp.float32)


# ------------------------------------------------------------------------------------------------ the step
def _is_split(x: Any) -> bool:
    return isinstance(x, Split)


def _map(fn: Any, splits: Any, *trees: Any) -> Any:
    """fn(split or None, *leaves) over trees shaped like `splits` (whose leaves are Split or None)."""
    return jax.tree.map(fn, splits, *trees, is_leaf=lambda x: x is None or _is_split(x))


class SDPTrainStep(TrainStep):
    """`make_train_step` for an SDP strategy: `step(state, batch) -> (state, metrics)` like any TrainStep.

    Under forward masking `state.params` (and the optimizer state, and stacked BatchNorm statistics) store each
    split array as `[workers, k, ...]` sharded over the workers' axis, slot j of worker w being its j-th block
    (or unit group) in network order (`step.slots`); `step.full_params(state)` reassembles the full network.
    """

    def __init__(
        self, model: nnx.Module, optimizer: optax.GradientTransformation, mesh: Mesh, strategy: Any, *,
        loss_fn: Any = None, batch_axes: Any = None, microbatches: int = 1, donate: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(model, optimizer, mesh, strategy, loss_fn=loss_fn, batch_axes=batch_axes, donate=donate)
        cfg: SDPConfig = self.strategy.sdp
        self.cfg, axis = cfg, cfg.axis
        if microbatches != 1:
            raise ShardkitError(f"microbatches={microbatches}: the sdp step takes the batch whole (1) in this version")
        extra = {a: n for a, n in mesh.shape.items() if a != axis and n > 1}
        if axis not in mesh.shape or extra:
            raise ShardkitError(
                f"sdp runs over the mesh axis {axis!r} alone (its devices are the workers); the mesh "
                f"{dict(mesh.shape)} {'has ' + str(extra) if extra else 'lacks it'}: use e.g. --config.mesh={axis}=8"
            )
        self.workers = w = mesh.shape[axis]
        full = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(model)[1]))
        rest_state = split_params(model)[2]
        self.splits = find_splits(self.param_names, full, cfg, w, "parameter")
        forward = cfg.masking == "forward"
        names = state_logical_axes(rest_state, require=False)
        rest_shapes = jax.eval_shape(self._unwrap, nnx.to_pure_dict(rest_state))  # an abstract model's too
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
        lay, rep = layout_sharding(self.mesh, self.cfg.axis), self._replicated
        shard = lambda s, _: lay if s is not None else rep
        self.layout_params = _map(shard, self.splits, full)
        self.layout_state = _map(shard, self.state_splits, rest_shapes)
        abstract = jax.eval_shape(lambda p: self.to_layout(p, self.splits), full)
        self._layout_abstract = abstract
        self.opt_shardings = optax.tree_utils.tree_map_params(
            self.tx, lambda _, s: s, jax.eval_shape(self.tx.init, abstract), self.layout_params,
            transform_non_params=lambda _: rep,
        )  # fmt: skip
        self.state_shardings = TrainState(
            step=rep, params=self.layout_params, opt_state=self.opt_shardings, model_state=self.layout_state
        )
        leaves, self._param_treedef = jax.tree.flatten(abstract)
        self._param_leaf_specs = [(tuple(x.shape), x.dtype) for x in leaves]

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
        _check_alive((params, model_state), "this state")
        if self.cfg.masking == "backward":
            return params, model_state
        full = jax.jit(lambda p: self.from_layout(p, self.splits), out_shardings=self.param_shardings)(params)
        if model_state is not None:
            fn = lambda m: self.from_layout(m, self.state_splits)
            model_state = jax.jit(fn, out_shardings=self.model_state_shardings)(model_state)
        return full, model_state

    # ------------------------------------------------------------------------------------------- state
    def init_state(self, model: nnx.Module | None = None) -> TrainState:
        if self.cfg.masking == "backward":
            return super().init_state(model)
        _, params, rest = split_params(model or self._model)
        params, rest = nnx.to_pure_dict(params), self._unwrap(nnx.to_pure_dict(rest))
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves((params, rest))):
            raise ShardkitError("this step was built from an abstract model; pass the real one to init_state")
        params = jax.jit(lambda p: self.to_layout(p, self.splits), out_shardings=self.layout_params)(params)
        rest = jax.jit(lambda m: self.to_layout(m, self.state_splits), out_shardings=self.layout_state)(rest)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
        return TrainState(step=step, params=params, opt_state=opt_state, model_state=rest)

    def abstract_state(self) -> TrainState:
        if self.cfg.masking == "backward":
            return super().abstract_state()
        rest = jax.eval_shape(lambda r: self.to_layout(self._unwrap(r), self.state_splits), self._rest)
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
            _check_alive(state, "this state")
            key, shardings = self._prepared(batch, microbatches=1)
            if ("sub", key) not in self._evals:
                specs = jax.tree.map(lambda s: s.spec, shardings)
                fn = jax.shard_map(
                    self._local_eval, mesh=self.mesh, check_vma=False, out_specs=P(),
                    in_specs=(self._specs(self.splits, state.params), self._specs(self.state_splits,
                              state.model_state), specs),
                )  # fmt: skip
                self._evals["sub", key] = jax.jit(fn)
            return self._evals["sub", key](state.params, state.model_state, batching.place(batch, shardings))
        if isinstance(state, TrainState):
            _check_alive(state, "this state")
            params, model_state = self.full_params(state)
            state = TrainState(state.step, params, None, model_state)
        elif self.cfg.masking == "forward":
            state = self.full_params(state)[0]
        return super().evaluate(state, batch)

    # -------------------------------------------------------------------------------------------- step
    def _specs(self, splits: Any, tree: Any) -> Any:
        forward = self.cfg.masking == "forward"
        return _map(lambda s, _: P(self.cfg.axis) if s is not None and forward else P(), splits, tree)

    def _local(self, params: Any, model_state: Any, batch: Any) -> tuple[Any, Any, dict[str, jax.Array]]:
        """One worker: its subnetwork's loss and gradient on its batch shard, then holder / data averaging."""
        axis, w, forward = self.cfg.axis, self.workers, self.cfg.masking == "forward"
        idx = lax_axis_index(axis)
        if forward:  # [1, k, ...] slots -> the subnetwork's arrays (k blocks, or k unit groups)
            params = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.splits, params)
            model_state = _map(lambda s, x: x if s is None else s.from_groups(x[0]), self.state_splits, model_state)
        keys = jax.tree.map(lambda k, x: k and not is_key(x), self._keys, model_state)
        fold = lambda k, x: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(x), idx)) if k else x
        local_state = jax.tree.map(fold, keys, model_state)  # each worker its own dropout bits
        grad_fn = jax.value_and_grad(lambda p, m, b: self._apply(p, m, b, local=True), has_aux=True)
        (loss, (aux, new_state)), grads = grad_fn(params, local_state, batch)
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
            buf, meta = pack(lead, lead[0].shape[0])
            if not forward:
                buf = masked_average(buf, self.tables[g], axis)
            elif self.reduction[g] == "ring":
                buf = ring_average(buf, self.tables[g], axis)
            else:
                buf = psum_average(buf, self.tables[g], axis)
            for (key, _, s), y in zip(entries, unpack(buf, meta), strict=True):
                done[key] = y[None] if forward else s.from_groups(y)

        # shared arrays, float statistics of shared layers and the metrics: one all-reduce, / workers
        shared = [(k, x) for k, x, s in flat_g if s is None]
        shared += [(k, x) for k, x, s in flat_s if s is None and jnp.issubdtype(x.dtype, jnp.floating)]
        if not forward:
            shared += [(k, x) for k, x in _flat(new_state, "s") if jnp.issubdtype(x.dtype, jnp.floating)]
        metrics = {"loss": loss, **aux}
        shared += [(f"m{name}", jnp.asarray(v, jnp.float32)) for name, v in metrics.items()]
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
        loss, (aux, _) = self._apply(params, model_state, batch, train=False, local=True)
        out = jax.lax.pmean({"loss": loss, **aux}, self.cfg.axis)
        return out.pop("loss"), out

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        batch_specs = jax.tree.map(lambda s: s.spec, self.batch_shardings(batch))
        param_specs = self._specs(self.splits, state.params)
        state_specs = self._specs(self.state_splits, state.model_state)
        local = jax.shard_map(
            self._local, mesh=self.mesh, in_specs=(param_specs, state_specs, batch_specs),
            out_specs=(param_specs, state_specs, P()), check_vma=False,
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

    # ------------------------------------------------------------------------------------------- costs
    def describe(self, say: Any = print) -> None:
        """Prints the ownership and what a device stores and sends per step (the CLI's header)."""
        c = self.bytes_per_step()
        split, shared = c["split_elements"], c["shared_elements"]
        for g, table in self.tables.items():
            held = ", ".join(f"w{w}:{list(map(int, s))}" for w, s in enumerate(self.slots[g][:4]))
            more = ", ..." if self.workers > 4 else ""
            what = "blocks" if self.cfg.granularity == "block" else "unit groups"
            say(f"  sdp: {g} {what}, {table.sum(axis=0)[0]} holders each; worker: {what} held {held}{more}; holder "
                f"averaging by {self.reduction[g]}")  # fmt: skip
        frac = (shared + split * self.cfg.coverage) / (shared + split) if self.cfg.masking == "forward" else 1.0
        say(f"  sdp: {split / 1e6:.2f}M split + {shared / 1e6:.2f}M shared parameters; a device stores {frac:.0%} "
            f"of them; sends {(c['permute_bytes'] + c['ring_all_reduce_bytes']) / 2**20:.2f} MiB per step")  # fmt: skip
        if self.cfg.masking == "forward":
            say("  sdp: MFU below counts the full network's FLOPs; each device computes only its subnetwork")

    def predict_costs(self, state: TrainState, backend: str) -> tuple[dict, dict[str, float], str]:
        """`sk.explain`'s prediction: {(kind, axis): (count, bytes sent per device)}, memory per device, source.

        Collectives by `bytes_per_step`'s closed form; parameter and gradient memory = shared + k / G of each split
        array (forward masking) or everything (backward); optimizer state from its layout."""
        nbytes = int(np.dtype(jax.tree.leaves(state.params)[0].dtype).itemsize)
        c = self.bytes_per_step(nbytes)
        axis = self.cfg.axis
        comms = {("all-reduce", axis): (1, c["ring_all_reduce_bytes"])}
        if c["permutes"]:
            comms["collective-permute", axis] = (c["permutes"], float(c["permute_bytes"]))
        k = self.cfg.coverage if self.cfg.masking == "forward" else 1.0
        params = nbytes * (c["shared_elements"] + k * c["split_elements"])
        deg = lambda sh: self.workers if sh.spec and sh.spec[0] == axis else 1
        opt = sum(x.size * x.dtype.itemsize / deg(sh) for x, sh in
                  zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(self.opt_shardings), strict=True))  # fmt: skip
        how = "/".join(sorted(set(self.reduction.values())))
        source = (f"shardkit.parallel.sdp ({self.cfg.granularity}, coverage {self.cfg.coverage:g}, "
                  f"{self.cfg.masking}, {how} holder averaging)")  # fmt: skip
        return comms, {"params": params, "grads": params, "optimizer": opt}, source

    def bytes_per_step(self, dtype_bytes: int = 4) -> dict[str, Any]:
        """Per-device collectives of one step by formula: {"permutes", "permute_bytes", "all_reduce_bytes", ...}."""
        full = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(self._model)[1]))
        shared = split = 0
        per_group: dict[int, int] = {}
        for s, x in zip(jax.tree.leaves(self.splits, is_leaf=lambda v: v is None or _is_split(v)),
                        jax.tree.leaves(full), strict=True):  # fmt: skip
            if s is None:
                shared += x.size
            else:
                split += x.size
                per_group[s.groups] = per_group.get(s.groups, 0) + x.size // s.groups
        out = {"shared_elements": shared, "split_elements": split, "permutes": 0, "permute_bytes": 0,
               "all_reduce_elements": shared + 1, "ring_all_reduce_bytes": 0}  # fmt: skip
        for g, slot_elems in per_group.items():
            table = self.tables[g]
            if self.reduction[g] == "ring":
                ring = ring_of(table)
                out["permutes"] += ring.permutes()
                out["permute_bytes"] += ring.permutes() * ring.stride * slot_elems * dtype_bytes
            else:
                out["all_reduce_elements"] += g * slot_elems
        n = out["all_reduce_elements"] * dtype_bytes
        out["ring_all_reduce_bytes"] = 2 * (self.workers - 1) / self.workers * n
        return out


def _flat(tree: Any, tag: str) -> list[tuple[str, jax.Array]]:
    return [(tag + jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)]


def _leaves_with_split(splits: Any, tree: Any, tag: str) -> list[tuple[str, jax.Array, Split | None]]:
    paired = _map(lambda s, x: (s, x), splits, tree)
    leaves = jax.tree_util.tree_leaves_with_path(paired, is_leaf=lambda v: isinstance(v, tuple) and len(v) == 2)
    return [(tag + jax.tree_util.keystr(p), x, s) for p, (s, x) in leaves]


def _unflat(tree: Any, tag: str, done: dict[str, jax.Array]) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, x: done.get(tag + jax.tree_util.keystr(p), x), tree)


__all__ = [
    "SDPConfig",
    "SDPTrainStep",
    "Split",
    "check_ownership",
    "masked_average",
    "ownership",
    "psum_average",
    "ring_average",
    "ring_of",
    "slots",
    "strategy",
]


register_strategy(strategy())
