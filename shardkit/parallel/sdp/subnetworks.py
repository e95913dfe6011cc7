"""Subnetwork Data Parallelism (Singh, Khalid, Cagnasso, Oyallon, Belilovsky, arXiv 2507.09029).

One idea at a little over 400 lines: the paper's algorithm (ownership, masks, the holders' averages) and the
strategy it makes; its step, costs and composition with fsdp / tensor are the files beside this one.

Every worker (a coordinate of the `data` mesh axis: a device, or its fsdp / tensor group) trains a structured
subnetwork on its own batch shard, and each parameter is averaged every step over exactly the workers that hold
it (HeteroFL's `combine`). No activation crosses workers.

    strategy = sk.sdp.make_strategy(granularity="block", coverage=0.5, masking="forward", ownership="cyclic")
    step = sk.make_train_step(model, tx, sk.make_mesh({"data": 8}), strategy)
    owners = sk.sdp.ownership(num_blocks=8, workers=8, coverage=0.5)   # bool [workers, blocks]

What is split is found from the parameters' logical names, so no model is named here:
- `granularity="block"`: the leading `layers` dimension of a stack of identical blocks (the GPT's transformer
  layers, a ResNet stage's identity blocks). A worker holds k = coverage x L of the L blocks.
- `granularity="neuron"`: the hidden units of a logical dimension (`units`, default `mlp`), cut into G groups
  (default: one per worker); a worker holds k = coverage x G groups of every layer's units.
Parameters without that name (embedding, stem, head, norms) are shared: plain data parallelism.

With `fsdp` / `tensor` in the mesh as well, each worker is the devices sharing its `data` coordinate, and FSDP's
and Megatron's rules (this strategy's tables) split its subnetwork among them (sdp_compose.py).

Masking:
- `forward`: the subnetwork alone runs forward, backward and update. Each device *stores* only its k slots of
  every split parameter (a `[workers, k, ...]` array sharded over `data`), and so only their gradients and
  optimizer state: per-device bytes = shared + coverage x split. Holder averaging is a ring of `ppermute`s over
  the holder sets (`ring`: for a cyclic table, 2(h - 1) permutes of one slot-set per step with h holders per
  block, all split parameters packed into one buffer; array by array under fsdp / tensor), or a masked `psum`
  over all groups (`psum`: any table).
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

from shardkit.deprecation import renamed
from shardkit.errors import ShardkitError
from shardkit.strategies import register_strategy
from shardkit.strategies import strategy as named

GRANULARITIES = ("block", "neuron")
MASKINGS = ("forward", "backward")
OWNERSHIPS = ("cyclic", "random")
REDUCTIONS = ("auto", "ring", "psum")
EVALS = ("subnetworks", "full")


@dataclasses.dataclass(frozen=True)
class SDPConfig:
    """What `sk.sdp.make_strategy` builds a strategy from (validated on construction)."""

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

    tag = property(lambda self: f"sdp@{self.coverage:.3g}", doc="sk.plan's label: sdp and the coverage")

    def __post_init__(self) -> None:
        for field, allowed in (("granularity", GRANULARITIES), ("masking", MASKINGS), ("ownership", OWNERSHIPS),
                               ("reduce", REDUCTIONS), ("eval", EVALS)):  # fmt: skip
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


def make_strategy(
    granularity: str = "block", coverage: float = 0.5, masking: str = "forward", ownership: str = "cyclic",
    seed: int = 0, *, axis: str = "data", units: str = "", groups: int = 0, reduce: str = "auto",
    eval: str = "subnetworks",
) -> Any:  # fmt: skip
    """The `sdp` strategy: data parallelism's rules tables plus the subnetwork configuration (`Strategy.options`,
    run by the `sdp` step: sdp_step.py).

    `sk.make_train_step(model, tx, mesh, sk.sdp.make_strategy(...))` builds the SDP step (step.py beside this file);
    `sk.strategy("sdp")` is this with its defaults (block, coverage 1/2, forward, cyclic)."""
    from shardkit.strategies import DATA_FSDP, FSDP_RULES, TENSOR_RULES, table

    cfg = SDPConfig(granularity, float(coverage), masking, ownership, int(seed), axis, units, int(groups), reduce,
                    eval)  # fmt: skip
    desc = (f"subnetwork data parallelism: {cfg.granularity}-level, coverage {cfg.coverage:g}, {cfg.masking} "
            f"masking, {cfg.ownership} ownership; shared parameters data-parallel; fsdp / tensor inside each "
            "worker")  # fmt: skip
    # fsdp / tensor (when the mesh has them) inside each worker: FSDP's and Megatron's tables (sdp_compose.py)
    return named("dp").replace(
        name="sdp", step="sdp", options=cfg, description=desc,
        param_rules=table(**FSDP_RULES, **TENSOR_RULES), compute_rules=table(batch=DATA_FSDP, **TENSOR_RULES),
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
    """[k, ...] per worker -> [k, ...]: each slot averaged over the block's holders, by a ring of ppermutes.

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
    idx = jax.lax.axis_index(axis)
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
    """[k, ...] per worker -> [k, ...]: each slot averaged over its holders by one masked all-reduce of [L, n]."""
    idx = jax.lax.axis_index(axis)
    mine = jnp.asarray(slots(table).astype(np.int32))[idx]
    dense = jnp.zeros((table.shape[1], *buf.shape[1:]), buf.dtype).at[mine].set(buf)
    counts = jnp.asarray(table.sum(axis=0), buf.dtype)
    total = jax.lax.psum(dense, axis) / counts.reshape(-1, *[1] * (buf.ndim - 1))
    return jnp.take(total, mine, axis=0)


def masked_average(full: jax.Array, table: np.ndarray, axis: str) -> jax.Array:
    """[L, ...] per worker -> [L, ...]: zero outside the worker's blocks, then the sum over holders / holder count."""
    idx = jax.lax.axis_index(axis)
    mask = jnp.asarray(table)[idx]
    counts = jnp.asarray(table.sum(axis=0), full.dtype)
    lead = (-1, *[1] * (full.ndim - 1))
    return jax.lax.psum(jnp.where(mask.reshape(lead), full, 0), axis) / counts.reshape(lead)


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


#: the name `make_strategy` had until it was named as a builder (it returns a new Strategy)
strategy = renamed(make_strategy, "sk.sdp.strategy", "sk.sdp.make_strategy")

__all__ = [
    "EVALS",
    "GRANULARITIES",
    "MASKINGS",
    "OWNERSHIPS",
    "REDUCTIONS",
    "Ring",
    "SDPConfig",
    "Split",
    "check_ownership",
    "make_strategy",
    "masked_average",
    "ownership",
    "psum_average",
    "ring_average",
    "ring_of",
    "slots",
    "strategy",
]


register_strategy(make_strategy())
