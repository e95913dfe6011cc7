"""Predicts, before compiling, the communication and memory of a GPT training step under each strategy.

    plans = sk.plan(GPTConfig(...), devices=1024, hardware="perlmutter", global_batch=512, seq_len=2048)
    print(format_plans(plans[:5]))

Bytes are per device per step, ring volumes (ALGORITHMS.md §1; what `shardkit.hlo` counts from compiled HLO):
all-gather / reduce-scatter (p-1)/p·n, all-reduce 2(p-1)/p·n, n the full buffer. Time is alpha-beta per
collective, `count·steps·α + bytes/bandwidth` (steps: p-1, all-reduce 2(p-1)), with the link of each mesh axis
chosen by nesting: an axis whose group, times the sizes of the axes nested inside it, fits in one node uses
the preset's ICI link, else its DCN link. `variant="axonn"` uses AxoNN's published model instead (Singh et
al. 2305.13525 §5 and their public performance-model script; tables in meshes/perlmutter.toml, frontier.toml).

Backend: `backend="gpu"` (or "tpu") models reduce-scatters as reduce-scatters. `backend="cpu"` models what
XLA:CPU compiles: GSPMD's reduce-scatters (FSDP gradients, Megatron-SP's g) become a full all-reduce plus a
dynamic-slice (tests/test_structure.py); explicit `lax.psum_scatter` in shard_map kernels (tensor3d) stays
a reduce-scatter.

Memory per device: model state by the ZeRO formulas (16 bytes per parameter in mixed precision with Adam:
2 params + 2 grads + 12 fp32 master/m/v, divided by the degree each strategy shards it over; Rajbhandari et
al. 1910.02054) and activations per layer adapted from Korthikanti et al. 2205.05198 Table 2 to our block
(`activation_bytes`). A plan over `memory_fraction` of the device memory is rejected with the reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.mesh import HardwarePreset, Link, load_preset, preset_dirs

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
#: AxoNN's nesting order, innermost first: col (x) -> row (y) -> depth (z) -> data.
TP3D_ORDER = ("col", "row", "depth", "data")


@dataclasses.dataclass(frozen=True)
class Comm:
    """One kind of collective over one mesh axis in a step: bytes sent per device, summed over `count` calls."""

    kind: str
    axis: str
    group: int  # devices per group (the axis size)
    inner: int  # product of the sizes of the axes nested inside this one
    count: int
    bytes: float
    what: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
    """One (strategy, mesh) with its predicted communication, time and memory per device."""

    strategy: str
    mesh: dict[str, int]
    comms: tuple[Comm, ...]
    comm_time_s: float
    memory: dict[str, float]  # params, grads, optimizer, activations, total (bytes per device)
    fits: bool
    reason: str = ""

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.comms)

    def bytes_by(self) -> dict[tuple[str, str], float]:
        """(kind, axis) -> bytes sent per device per step."""
        out: dict[tuple[str, str], float] = {}
        for c in self.comms:
            out[c.kind, c.axis] = out.get((c.kind, c.axis), 0.0) + c.bytes
        return out

    @property
    def grid(self) -> str:
        return ",".join(f"{a}={n}" for a, n in self.mesh.items() if n > 1) or "1 device"


def ring_factor(kind: str, p: int) -> float:
    """Bytes sent per device as a fraction of the full buffer n (ALGORITHMS.md §1)."""
    if p <= 1:
        return 0.0
    return {"all-reduce": 2 * (p - 1) / p, "collective-permute": 1.0}.get(kind, (p - 1) / p)


def _steps(kind: str, p: int) -> int:
    return {"all-reduce": 2 * (p - 1), "collective-permute": 1}.get(kind, p - 1)


class _Builder:
    """Accumulates Comm rows; skips axes of size 1; CPU turns GSPMD reduce-scatters into all-reduces."""

    def __init__(self, mesh: dict[str, int], order: Sequence[str], backend: str):
        self.mesh, self.order, self.backend, self.rows = mesh, list(order), backend, []

    def add(self, kind: str, axis: str, n: float, count: int = 1, what: str = "", gspmd: bool = False) -> None:
        """`axis` may name several axes, "data,depth": one collective over their product (size-1 ones dropped;
        the row's axis lists the rest outermost first, as `shardkit.hlo` names them)."""
        names = sorted((a for a in axis.split(",") if self.mesh.get(a, 1) > 1), key=self.order.index, reverse=True)
        p = math.prod(self.mesh[a] for a in names)
        if p <= 1 or n <= 0:
            return
        if kind == "reduce-scatter" and gspmd and self.backend == "cpu":
            kind, what = "all-reduce", what + " (CPU: all-reduce + dynamic-slice)"
        axis = ",".join(names)
        i = self.order.index(names[-1])  # the innermost of the group's axes
        inner = math.prod(self.mesh.get(a, 1) for a in self.order[:i])
        self.rows.append(Comm(kind, axis, p, inner, count, ring_factor(kind, p) * n, what))


def _cfg(cfg: Any) -> dict[str, int]:
    """The GPT shape numbers the formulas use (models/gpt.py GPTConfig, or any object with those fields)."""
    names = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")
    try:
        return {n: int(getattr(cfg, n)) for n in names}
    except AttributeError as e:
        raise ShardkitError(f"model config {type(cfg).__name__} lacks {e.name!r}; give a GPTConfig-like object") from e


def fc_layers(cfg: Any) -> list[tuple[str, int, int, bool]]:
    """The four projections of one block as (name, H1 in, H2 out, transposed): AxoNN's FC1/FC2 alternation."""
    c = _cfg(cfg)
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    return [("qkv", e, (n + 2 * k) * hd, False), ("out", n * hd, e, True), ("mlp_in", e, 2 * f, False),
            ("mlp_out", f, e, True)]  # fmt: skip


def tp3d_layer_comms(
    b: _Builder, h1: int, h2: int, tokens: int, transpose: bool, nbytes: int, what: str, gspmd: bool = False
) -> None:
    """One `tensor3d.linear` fwd + bwd (ALGORITHMS.md §5): AR of y over G_in, AR of dx over G_out, AG / AG / RS
    of the weight block over depth, AR of the weight shard's gradient over data. `tokens` = global m."""
    gx, gy, gz, gd = (b.mesh.get(a, 1) for a in TP3D_ORDER)
    (ain, gin), (aout, gout) = (("row", gy), ("col", gx)) if transpose else (("col", gx), ("row", gy))
    rows = tokens / (gd * gz)
    b.add("all-reduce", ain, rows * h2 / gout * nbytes, 1, f"{what}: y = AR_{ain}(x w) fwd")
    b.add("all-reduce", aout, rows * h1 / gin * nbytes, 1, f"{what}: dx = AR_{aout}(dy wᵀ) bwd")
    block = h1 * h2 / (gin * gout) * nbytes
    if gspmd:  # inside the GPT's layer scan the backward gathers the block again (not saved as a residual)
        b.add("all-gather", "depth", 2 * block, 2, f"{what}: weight AG over depth, fwd and again bwd")
    else:  # a `tensor3d.linear` stack: the backward reuses the forward's gathered block (bytes counted once)
        b.add("all-gather", "depth", block, 2, f"{what}: weight AG over depth, fwd and bwd")
    b.add("reduce-scatter", "depth", block, 1, f"{what}: dW RS over depth", gspmd=gspmd)
    b.add("all-reduce", "data", block / gz, 1, f"{what}: dW shard AR over data")


#: shards of the parameters (and of gradients / optimizer state) per strategy, from (data, fsdp, tensor, 3D grid)
_STATE_DEGREE: dict[str, Callable[[int, int, int, int], int]] = {
    "dp": lambda d, f, t, g3: 1,
    "zero1": lambda d, f, t, g3: 1,
    "fsdp": lambda d, f, t, g3: f,
    "tp": lambda d, f, t, g3: t,
    "tp_sp": lambda d, f, t, g3: t,
    "fsdp_tp": lambda d, f, t, g3: f * t,
    "dp_fsdp_tp": lambda d, f, t, g3: f * t,
    "tp3d": lambda d, f, t, g3: g3,
}
MODELLED = tuple(_STATE_DEGREE)  #: the strategies the GPT formulas below cover
_MODELLED = ", ".join(MODELLED)


def strategy_comms(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    backend: str = "gpu", gspmd: bool = False,
) -> list[Comm]:  # fmt: skip
    """Per-device bytes per step of each collective of one GPT train step (no gradient accumulation).

    dp: AR of all gradients over data. fsdp: AG of the parameters fwd, of the block parameters again bwd, RS of
    the gradients (ZeRO-3). tp / tp_sp (Megatron, Korthikanti): (4L + 2) activation ARs over tensor (4 per
    block + vocab-parallel embedding fwd and head bwd), or as many AG + RS pairs; gradients of the 1/t shard
    all-reduced over data. tp3d: per block, `tp3d_layer_comms` for the four projections (AxoNN's model, exact
    for a stack of `tensor3d.linear` layers); `gspmd=True`: the whole GPT step under the `tp3d` GSPMD rules,
    the projections (whose depth reduce-scatter is an AR on CPU) + embedding, RMSNorms, head, vocab-parallel
    cross-entropy and the loss / grad-norm scalars (`costmodel_gpt.gpt_extra_comms`); rows may then name
    several axes ("data,depth": one collective over their product).
    """
    c = _cfg(cfg)
    e, L = c["d_model"], c["num_layers"]
    psi = num_params(cfg)
    blocks = L * sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg))
    if strategy == "tp3d":
        b = _Builder(mesh, TP3D_ORDER, backend)
        for name, h1, h2, tr in fc_layers(cfg):
            for _ in range(L):
                tp3d_layer_comms(b, h1, h2, global_batch * seq_len, tr, nbytes, name, gspmd)
        if gspmd:  # the whole GSPMD train step: embedding, norms, head, cross-entropy, scalars
            from shardkit.costmodel_gpt import gpt_extra_comms

            gpt_extra_comms(b, cfg, global_batch * seq_len, nbytes, gspmd)
        return _merge(b.rows)
    b = _Builder(mesh, ("tensor", "fsdp", "data"), backend)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    act = global_batch // (d * f) * seq_len * e * nbytes
    shard = psi * nbytes / (t * f)
    if strategy not in _STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {_MODELLED}")
    if strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp"):  # ZeRO-3 over fsdp (of the 1/t Megatron slice)
        b.add("all-gather", "fsdp", psi * nbytes / t, 1, "parameters fwd")
        b.add("all-gather", "fsdp", blocks * nbytes / t, 1, "block parameters bwd")
        b.add("reduce-scatter", "fsdp", psi * nbytes / t, 1, "gradients", gspmd=True)
    if strategy in ("tp", "tp_sp", "fsdp_tp", "dp_fsdp_tp"):
        n = 4 * L + 2
        if strategy != "tp_sp":
            b.add("all-reduce", "tensor", act * n, n, "Megatron f / g")
        else:
            b.add("all-gather", "tensor", act * n, n, "SP all-gathers")
            b.add("reduce-scatter", "tensor", act * n, n, "SP reduce-scatters", gspmd=True)
    if strategy == "zero1":  # gradients reduce-scattered onto the optimizer-state shards, parameters gathered back
        b.add("reduce-scatter", "data", shard, 1, "gradients onto optimizer-state shards", gspmd=True)
        b.add("all-gather", "data", shard, 1, "updated parameters")
    else:
        b.add("all-reduce", "data", shard, 1, "gradients over data")
    return _merge(b.rows)


def _merge(rows: Iterable[Comm]) -> list[Comm]:
    out: dict[tuple[str, str], Comm] = {}
    for r in rows:
        k = (r.kind, r.axis)
        out[k] = dataclasses.replace(r, count=out[k].count + r.count, bytes=out[k].bytes + r.bytes) if k in out else r
    return list(out.values())


def num_params(cfg: Any) -> int:
    """Parameters of the GPT: the config's own count when it has one (tied embeddings), else untied."""
    if callable(getattr(cfg, "num_params", None)):
        return int(cfg.num_params())
    c = _cfg(cfg)
    blocks = sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg)) + 2 * c["d_model"]
    return c["num_layers"] * blocks + c["d_model"] * (2 * c["vocab_size"] + 1)


def activation_bytes(cfg: Any, tokens: int, seq_len: int, embed_split: int, head_split: int, nbytes: int = 2) -> float:
    """Saved activations of one block for `tokens` tokens on one device, our layer (no dropout, SwiGLU, GQA).

    Korthikanti et al. (2205.05198, §4.1) itemised for our block, elements per token: 4e (both RMSNorms' inputs
    and outputs, split over the embed axis), (n + 2k)·hd (q, k, v) + n·hd (attention output) + 3f (gate, up,
    SiLU product; split over the head / mlp axis), 2·n·s (scores and probabilities). At 2 bytes, f = 4e,
    k = n: 40e + 4ns bytes per token, against Korthikanti's 34h + 5as (GELU MLP, dropout masks).
    """
    c = _cfg(cfg)
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    per_token = 4 * e / embed_split + ((n + 2 * k) * hd + n * hd + 3 * f + 2 * n * seq_len) / head_split
    return tokens * per_token * nbytes


def memory(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2
) -> dict[str, float]:
    """Bytes per device: params, grads, optimizer (ZeRO formulas), activations (all layers + fp32 logits)."""
    c = _cfg(cfg)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    gx, gy, gz, gd = (mesh.get(a, 1) for a in TP3D_ORDER)
    if strategy not in _STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {_MODELLED}")
    state_deg = _STATE_DEGREE[strategy](d, f, t, gx * gy * gz)
    batch_deg = {"tp3d": gd * gz}.get(strategy, d * f)
    embed_split, head_split = {"tp_sp": (t, t), "tp3d": (gx, gy)}.get(strategy, (1, t))
    psi = num_params(cfg) / state_deg
    tokens = global_batch / batch_deg * seq_len
    if getattr(cfg, "remat", "none") == "full":  # only each block's input is saved (Korthikanti: 2sbh)
        acts = c["num_layers"] * tokens * c["d_model"] / embed_split * nbytes
    else:
        acts = c["num_layers"] * activation_bytes(cfg, tokens, seq_len, embed_split, head_split, nbytes)
    acts += tokens * c["vocab_size"] / head_split * 4 * 2  # fp32 logits and their softmax
    opt = (16 - 2 * nbytes) * psi / (d if strategy == "zero1" else 1)  # ZeRO-1: optimizer state over data
    mem = {"params": nbytes * psi, "grads": nbytes * psi, "optimizer": opt, "activations": acts}
    return {**mem, "total": sum(mem.values())}


def _node_size(hw: HardwarePreset) -> int:
    return math.prod(hw.ici.values()) if hw.ici else 1


def comm_time(comms: Iterable[Comm], hw: HardwarePreset, variant: str = "alpha-beta") -> float:
    """Seconds of communication per step (no overlap): alpha-beta per link, or AxoNN's fitted model."""
    node, total = _node_size(hw), 0.0
    axonn = _axonn_tables(hw) if variant == "axonn" else None
    for c in comms:
        if axonn is not None:
            v = c.bytes * (2 if c.axis == "data" and c.kind == "all-reduce" else 1)  # their 2x data volume
            total += axonn["alpha"] * c.group / 1000 * c.count + v / 2**30 / _axonn_beta(axonn, c.inner, c.group)
            continue
        link: Link = hw.links["dcn"] if c.inner * c.group > node and "dcn" in hw.links else hw.links["ici"]
        total += c.count * _steps(c.kind, c.group) * link.latency + c.bytes / link.bandwidth
    return total


def _axonn_tables(hw: HardwarePreset) -> dict[str, Any]:
    import tomllib

    for d in preset_dirs():
        path = d / f"{hw.name}.toml"
        if path.is_file():
            with path.open("rb") as fh:
                raw = tomllib.load(fh)
            if "axonn" in raw:
                return raw["axonn"]
    raise ShardkitError(f"variant='axonn' needs an [axonn] table in meshes/{hw.name}.toml (see perlmutter.toml)")


def _axonn_beta(t: dict[str, Any], inner: int, g: int) -> float:
    """GB/s for a group of g nested inside `inner` devices: measured table, else inter-node bandwidth."""
    if inner * g <= t["node_size"]:
        return float(t["beta_intra"].get(f"{inner},{g}", t["beta_inter"]))
    return t["beta_inter"] / min(t["node_size"], inner)


def _pow2(n: int) -> list[int]:
    return [2**i for i in range(n.bit_length()) if n % 2**i == 0]


def candidates(devices: int, strategies: Sequence[str]) -> list[tuple[str, dict[str, int]]]:
    """Every power-of-two mesh for each strategy: tp3d over all (G_x, G_y, G_z, G_d) with product `devices`."""
    out: list[tuple[str, dict[str, int]]] = []
    for s in strategies:
        if s == "tp3d":
            for gx, gy, gz in itertools.product(_pow2(devices), repeat=3):
                if devices % (gx * gy * gz) == 0:
                    out.append((s, {"data": devices // (gx * gy * gz), "depth": gz, "row": gy, "col": gx}))
        elif s in ("tp", "tp_sp"):
            out += [(s, {"data": devices // t, "tensor": t}) for t in _pow2(devices) if t > 1]
        elif s in ("dp", "fsdp"):
            out.append((s, {"data" if s == "dp" else "fsdp": devices}))
        else:
            raise ShardkitError(f"plan: unknown strategy {s!r}; choose from dp, fsdp, tp, tp_sp, tp3d")
    return out


def _divisibility(strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
    c = _cfg(cfg)
    if strategy == "tp3d":
        gx, gy, gz, gd = (mesh.get(a, 1) for a in TP3D_ORDER)
        if global_batch % (gd * gz):
            return f"batch {global_batch} not divisible by G_d·G_z = {gd * gz}"
        for name, h1, h2, tr in fc_layers(cfg):
            gin, gout = (gy, gx) if tr else (gx, gy)
            if h1 % gin or h2 % (gout * gz):
                return f"{name} [{h1}, {h2}] not divisible by G_in={gin}, G_out·G_z={gout * gz}"
        return ""
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    if global_batch % (d * f):
        return f"batch {global_batch} not divisible by data·fsdp = {d * f}"
    if t > 1 and (c["num_heads"] % t or c["num_kv_heads"] % t or c["mlp_dim"] % t):
        return f"heads {c['num_heads']} / kv_heads {c['num_kv_heads']} / mlp {c['mlp_dim']} not divisible by tensor={t}"
    return ""


def plan(
    model_cfg: Any,
    devices: int,
    hardware: str | HardwarePreset,
    global_batch: int,
    seq_len: int,
    *,
    strategies: Sequence[str] = ("dp", "fsdp", "tp", "tp_sp", "tp3d"),
    variant: str = "alpha-beta",
    backend: str | None = None,
    nbytes: int = 2,
    memory_fraction: float = 0.9,
    include_rejected: bool = False,
) -> list[Plan]:
    """Ranks every power-of-two plan by predicted communication time per step (fitting plans first).

    Plans with indivisible shapes are dropped; plans over `memory_fraction` of HBM are rejected (kept, last,
    with the reason, when `include_rejected`). `backend` defaults to the preset's platform.
    """
    if devices < 1 or devices & (devices - 1):
        raise ShardkitError(f"plan: devices={devices} must be a power of two")
    if variant not in ("alpha-beta", "axonn"):
        raise ShardkitError(f"plan: variant={variant!r}; choose 'alpha-beta' or 'axonn'")
    hw = load_preset(hardware) if isinstance(hardware, str) else hardware
    backend = backend or hw.platform
    plans = []
    for s, mesh in candidates(devices, strategies):
        if _divisibility(s, model_cfg, mesh, global_batch):
            continue
        comms = strategy_comms(s, model_cfg, mesh, global_batch, seq_len, nbytes, backend)
        mem = memory(s, model_cfg, mesh, global_batch, seq_len, nbytes)
        cap = memory_fraction * hw.hbm_bytes
        reason = "" if mem["total"] <= cap else f"needs {mem['total'] / 2**30:.1f} GiB > {cap / 2**30:.1f} GiB usable"
        plans.append(Plan(s, mesh, tuple(comms), comm_time(comms, hw, variant), mem, not reason, reason))
    plans.sort(key=lambda p: (not p.fits, p.comm_time_s))
    return plans if include_rejected else [p for p in plans if p.fits]


def format_plans(plans: Sequence[Plan]) -> str:
    """A plain-text table of ranked plans."""
    head = f"{'#':>3} {'strategy':<8} {'mesh':<34} {'comm ms':>9} {'GiB sent':>9} {'mem GiB':>8}  note"
    lines = [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        lines.append(
            f"{i:>3} {p.strategy:<8} {p.grid:<34} {p.comm_time_s * 1e3:>9.2f} {p.comm_bytes / 2**30:>9.3f} "
            f"{p.memory['total'] / 2**30:>8.2f}  {p.reason}".rstrip()
        )
    return "\n".join(lines)


__all__ = [
    "Comm",
    "Plan",
    "activation_bytes",
    "candidates",
    "comm_time",
    "fc_layers",
    "format_plans",
    "memory",
    "num_params",
    "plan",
    "ring_factor",
    "strategy_comms",
    "tp3d_layer_comms",
]
