"""The GPT's cost model: per-device communication and memory of one train step of models/gpt.py, per strategy.

(The one file in models/ that names mesh axes: its formulas are per strategy and mesh, the model-side terms
that shardkit's cost machinery asks the model for; the GPT itself, gpt.py, names none.)

These are the model-specific terms `shardkit` leaves to the model: `GPTConfig.cost_model` (what `sk.explain`
and `sk.plan` ask) calls `strategy_comms` and `memory` below. The generic machinery — ring volumes, the
alpha-beta time per link, AxoNN's fitted model, the planner, and the tensor3d linear's own collectives — stays
in `shardkit.costmodel`; parameter traffic of any model under any rules table is `shardkit.costmodel_rules`.

Bytes are per device per step, ring volumes (docs/algorithms.md §1): all-gather / reduce-scatter (p-1)/p·n,
all-reduce 2(p-1)/p·n, n the full buffer. `backend="cpu"` models what XLA:CPU compiles: GSPMD's
reduce-scatters (FSDP gradients, Megatron-SP's g) become a full all-reduce plus a dynamic-slice.

Memory per device: model state by the ZeRO formulas (16 bytes per parameter in mixed precision with Adam:
2 params + 2 grads + 12 fp32 master/m/v, divided by the degree each strategy shards it over; Rajbhandari et
al. 1910.02054) and activations per layer adapted from Korthikanti et al. 2205.05198 Table 2 to our block
(`activation_bytes`).

The tp3d GSPMD step (`strategy_comms("tp3d", ..., gspmd=True)`) = the projections (AxoNN's model,
`shardkit.costmodel.tp3d_layer_comms`) + `gpt_extra_comms`, derived from models/gpt.py, the GSPMD
step and the `tp3d` rules (shardkit/parallel/tensor3d.py): parameters embed -> (col, depth), heads / kv_heads / mlp /
vocab -> row; compute batch -> (data, depth), embed -> col, heads / mlp / vocab -> row. Each term below was
matched, by the op_name metadata of `compiled.as_text()`, to the collective XLA emits for it
(tests/test_costmodel.py, all 20 factorisations of 8 CPU devices). Notation: r = tokens / (G_d·G_z) local token
rows, e_l = d_model / G_x, V_l = vocab / G_y.

What XLA chooses and we follow: weight-gradient matmuls (dW = xᵀ dy) reduce over depth as a reduce-scatter
(CPU: all-reduce of the full block) then the shard over data, like `tensor3d.linear`; gradients that are not
matmuls (the embedding's scatter-add, RMSNorm scales' reduce_sum) are all-reduced over (data, depth) at once.
TPU (`backend="tpu"`): the terms XLA's TPU compiler's programs need (bf16 weight gathers, the collective matmul's
permutes, the ring's and the pipeline's transfers, the residuals as the TPU layer loop carries them) are
`models/gpt_tpu_cost.py`'s, each with the evidence it was read from; this file dispatches to them.

Known exception: on some small meshes (G_x = 2, G_y = 1, G_z = 2, G_d = 2 for the tiny test GPT) XLA's
partitioner prefers all-gathering activations over col and weights over (depth, col) to the partial-sum
all-reduces; that choice depends on XLA's cost heuristics and is not modelled (listed in the test).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import shardkit as sk
from models import gpt_remat_cost, gpt_tpu_cost
from shardkit.costmodel import TP3D_ORDER, Comm, CommBuilder, tp3d_layer_comms
from shardkit.errors import ShardkitError


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
MODELLED = tuple(_STATE_DEGREE)  #: the formulas below (named after the built-in strategies they describe)
_MODELLED = ", ".join(MODELLED)
_TENSOR_NAMES = ("heads", "kv_heads", "kv", "mlp", "vocab")  # Megatron's split names (kv: Flax's heads)
_PLAIN_KERNELS = {"attention": ("dense", "cudnn"), "layers": ("scan", "unrolled")}


def formula(strategy: Any) -> str | None:
    """Which formula describes `strategy` (a Strategy or a registered name), read from its tables and kernels
    (`Strategy.traits()`), never from its name; None when none does (context or pipeline parallelism, a step of
    its own, scoped rules, kernels the formulas do not model)."""
    from shardkit.strategies import strategy as named

    t = named(strategy).traits()
    if t.step != "gspmd" or t.scoped or t.sequence or t.stage or t.axes("experts", "depth", "height", "width"):
        return None
    if any(t.kernels.get(slot, ok[0]) not in ok for slot, ok in _PLAIN_KERNELS.items()):
        return None
    if set(t.compute) - {"batch", "res_seq", "embed", *_TENSOR_NAMES}:
        return None  # splits names the GPT does not have (a CNN's channels): not what the formulas describe
    tensor, batch = t.axes(*_TENSOR_NAMES), set(t.batch)
    if t.axes("embed"):  # AxoNN: embed over col, heads / mlp / vocab over row, weights over depth too
        ok = t.axes("embed") == ("col",) and tensor == ("row",) and t.gathered == ("depth",)
        return "tp3d" if ok and batch <= {"data", "depth"} and "depth" in batch else None
    if tensor not in ((), ("tensor",)) or t.gathered not in ((), ("fsdp",)):
        return None
    fsdp = bool(t.gathered)
    want = ("tensor",) if tensor else ()
    if any(t.params.get(n, ()) != want for n in _TENSOR_NAMES) or t.params.get("embed", ()) != (
        ("fsdp",) if fsdp else ()
    ):
        return None  # the formulas assume Megatron's weights split as the activations, ZeRO-3's on embed
    if batch != ({"data", "fsdp"} if fsdp else {"data"}):
        return None
    if t.optimizer_only:
        return "zero1" if t.optimizer_only == ("data",) and not (fsdp or tensor) else None
    if t.residual_sequence:
        return "tp_sp" if t.residual_sequence == ("tensor",) and tensor and not fsdp else None
    return ("fsdp_tp" if tensor else "fsdp") if fsdp else ("tp" if tensor else "dp")


def cp_formula(strategy: Any) -> str | None:
    """Returns "cp" when `strategy` is context parallelism the TPU terms describe (the ring kernel over `seq`, the batch
    over `data`, nothing else split, GSPMD step), else None. Verified on TPU only (GPTConfig.cost_model asks it
    for backend "tpu"; on CPU such strategies keep the rules tables' prediction)."""
    from shardkit.strategies import strategy as named

    t = named(strategy).traits()
    ring = str(t.kernels.get("attention", "")).startswith("ring")
    plain = t.step == "gspmd" and not (t.scoped or t.stage or t.gathered or t.axes(*_TENSOR_NAMES, "experts"))
    return "cp" if ring and plain and t.sequence == ("seq",) and set(t.batch) <= {"data"} else None


def tpu_formula(strategy: Any, mesh: dict[str, int]) -> str | None:
    """The TPU-only families (`cp_formula`, `pp_formula`), verified against the TPU compiler only; None if neither."""
    return cp_formula(strategy) or pp_formula(strategy, mesh)


def pp_formula(strategy: Any, mesh: dict[str, int]) -> str | None:
    """Returns "pp:<m>" (m microbatches) for a GPipe pipeline over `stage` with the batch not split, nothing else split
    (the `pp` strategy): the TPU terms below describe it; else None."""
    from shardkit.parallel.pipeline.schedules import parse
    from shardkit.strategies import strategy as named

    t = named(strategy).traits()
    layers = str(t.kernels.get("layers", ""))
    plain = t.step == "gspmd" and not (t.scoped or t.gathered or t.batch or t.sequence)
    if not (plain and t.stage == ("stage",) and layers.startswith("pipeline:")) or "@" in layers:
        return None
    if t.axes(*_TENSOR_NAMES, "experts", "embed"):
        return None
    kind, m, _ = parse(layers.partition(":")[2], mesh.get("stage", 1))
    return f"pp:{m}" if kind == "gpipe" else None


def strategy_comms(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    backend: str = "gpu", gspmd: bool = False, fused_attention: bool = False, local_embedding: bool = False,
) -> list[Comm]:  # fmt: skip
    """Per-device bytes per step of each collective of one GPT train step (no gradient accumulation).

    dp: AR of all gradients over data. fsdp: AG of the parameters fwd, of the block parameters again bwd, RS of
    the gradients (ZeRO-3). tp / tp_sp (Megatron, Korthikanti): (4L + 2) activation ARs over tensor (4 per
    block + vocab-parallel embedding fwd and head bwd), or as many AG + RS pairs; gradients of the 1/t shard
    all-reduced over data. tp3d: per block, `tp3d_layer_comms` for the four projections (AxoNN's model, exact
    for a stack of `tensor3d.linear` layers); `gspmd=True`: the whole GPT step under the `tp3d` GSPMD rules,
    the projections (whose depth reduce-scatter is an AR on CPU) + embedding, RMSNorms, head, vocab-parallel
    cross-entropy and the loss / grad-norm scalars (`gpt_extra_comms`); rows may then name
    several axes ("data,depth": one collective over their product). `fused_attention`: the ring's blocks are a
    fused kernel's (splash), which K and V reach in their own dtype (the XLA scan's dots take them in bf16 on TPU).
    """
    c = _cfg(cfg)
    e, L = c["d_model"], c["num_layers"]
    psi = num_params(cfg)
    blocks = L * blocks_per_layer(cfg)
    if strategy == "tp3d":
        b = CommBuilder(mesh, TP3D_ORDER, backend)
        for name, h1, h2, tr in fc_layers(cfg):
            for _ in range(L):
                tp3d_layer_comms(b, h1, h2, global_batch * seq_len, tr, nbytes, name, gspmd)
        if gspmd:  # the whole GSPMD train step: embedding, norms, head, cross-entropy, scalars
            gpt_extra_comms(b, cfg, global_batch * seq_len, nbytes, gspmd)
        return b.comms()
    b = CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    act = global_batch // (d * f) * seq_len * e * nbytes
    shard = psi * nbytes / (t * f)
    if strategy == "cp" and backend == "tpu":  # the ring kernel's permutes, gradients over (data, seq)
        kv_bytes = nbytes if fused_attention else min(nbytes, 2)
        return gpt_tpu_cost.cp_comms(c, psi, mesh, global_batch, seq_len, nbytes, backend, kv_bytes)
    if strategy.startswith("pp:") and backend == "tpu":  # GPipe over stage
        return gpt_tpu_cost.pp_comms(mesh, int(strategy[3:]), global_batch, seq_len, e, nbytes, backend)
    if strategy not in _STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {_MODELLED}")
    tpu_zero3 = backend == "tpu" and not getattr(cfg, "tie_embeddings", False)
    if strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp") and tpu_zero3:
        gpt_tpu_cost.zero3_comms(b, c, blocks_per_layer(cfg), t, f, nbytes, windowed=t > 1,
                                 local_rows=act if local_embedding else 0.0,
                                 ids=global_batch // d * seq_len * 4)  # fmt: skip
    elif strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp"):  # ZeRO-3 over fsdp (of the 1/t Megatron slice)
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
    elif strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp") and tpu_zero3:  # the matrices' shards (the rest: above)
        mats = (L * blocks_per_layer(cfg) + c["vocab_size"] * e) / t
        b.add("all-reduce", "data", mats * nbytes / f, 1, "matrix gradients' shards over data (TPU)")
    else:
        b.add("all-reduce", "data", shard, 1, "gradients over data")
    return b.comms()


def blocks_per_layer(cfg: Any) -> int:
    """Elements of one block's four projection matrices."""
    return sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg))


@functools.lru_cache(maxsize=4096)
def cached_comms(
    family: str, cfg: Any, mesh: tuple[tuple[str, int], ...], global_batch: int, seq_len: int, nbytes: int,
    backend: str, fused_attention: bool = False, local_embedding: bool = False,
) -> tuple[Comm, ...]:  # fmt: skip
    """`strategy_comms` memoised (the GSPMD step's for tp3d): `sk.plan` asks once per remat policy it tries, and
    the collectives do not depend on the policy (a recomputed forward's collectives are not modelled)."""
    return tuple(strategy_comms(family, cfg, dict(mesh), global_batch, seq_len, nbytes, backend, family == "tp3d",
                                fused_attention, local_embedding))  # fmt: skip


def num_params(cfg: Any) -> int:
    """Parameters of the GPT: the config's own count when it has one (tied embeddings), else untied."""
    if callable(getattr(cfg, "num_params", None)):
        return int(cfg.num_params())
    c = _cfg(cfg)
    blocks = sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg)) + 2 * c["d_model"]
    return c["num_layers"] * blocks + c["d_model"] * (2 * c["vocab_size"] + 1)


def activation_bytes(
    cfg: Any, tokens: int, seq_len: int, embed_split: int, head_split: int, nbytes: int = 2, backend: str = "cpu",
    attention: str = "scores",
) -> float:  # fmt: skip
    """Saved activations of one block for `tokens` tokens on one device, our layer (no dropout, SwiGLU, GQA, RoPE).

    Korthikanti et al. (2205.05198, §4.1, Table 2) itemised for our block as JAX's autodiff saves it
    (`jax.ad_checkpoint.print_saved_residuals` of models/gpt.py's Block), per token, at `nbytes` unless stated:
    5e (the first RMSNorm's normalised input and output, the residual after attention, the second's normalised
    input and output; split over the embed axis), (n + 2k)·hd (RoPE'd q, k and v) + n·hd (attention output)
    + 6f (gate, up, SiLU's three intermediates, their product; split over the head / mlp axis), per head and
    key: the masked scores and their exp in fp32 (jax.nn's softmax), the probabilities at `nbytes` and the
    causal mask's byte, and RoPE's sin / cos (2·hd fp32). Korthikanti's GELU block with dropout counts 34h +
    5as bytes at 2 bytes per value; ours at f = 4e, k = n, nbytes = 2: 66e + 11ns + 8hd
    (33 values of e at 2 bytes).

    `backend="tpu"`: `gpt_tpu_cost.block_bytes` (bf16 matmul operands, no exp kept); `attention` there: "scores"
    (XLA's dense attention), "ring" (the ring kernel's residuals, no [s, s] term) or "fused" (splash's residuals).
    """
    c = _cfg(cfg)
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    if backend == "tpu":  # as the TPU program's layer loop carries them (models/gpt_tpu_cost.py)
        return gpt_tpu_cost.block_bytes(c, tokens, seq_len, embed_split, head_split, nbytes, attention)
    values = 5 * e / embed_split + ((n + 2 * k) * hd + n * hd + 6 * f) / head_split
    scores = (4 + 4 + nbytes + 1) * n * seq_len / head_split
    return tokens * (values * nbytes + scores + 2 * hd * 4)


def _default_remat(cfg: Any) -> str:
    """The remat policy the config's `remat` alias means (models/gpt.py REMAT_ALIASES)."""
    from models.gpt import REMAT_ALIASES

    return REMAT_ALIASES.get(getattr(cfg, "remat", "none"), "none")


def _state(psi: float, nbytes: int, acts: float, optimizer_split: int = 1) -> dict[str, float]:
    """Memory per device of `psi` parameters (their gradients and Adam state, the latter over `optimizer_split`:
    ZeRO-1) and `acts` bytes of activations, with the total."""
    mem = {"params": nbytes * psi, "grads": nbytes * psi, "optimizer": (16 - 2 * nbytes) * psi / optimizer_split,
           "activations": acts}  # fmt: skip
    return {**mem, "total": sum(mem.values())}


def memory(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    remat: str | None = None, backend: str = "cpu", fused_attention: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Bytes per device: params, grads, optimizer (ZeRO formulas), activations (all layers + fp32 logits).

    `remat`: the remat policy the activations are saved under (models/gpt_remat_cost.py); None = the config's
    `remat` alias (models/gpt.py REMAT_ALIASES).

    `backend="tpu"`: the blocks' activations as the TPU program keeps them (`activation_bytes`), without the
    backward's working set: on a v5e it lives in on-chip VMEM, which `temp_size_in_bytes` does not count (fsdp,
    GPT 4 x 512: the temporaries exceed the backward loop's carried tuple by 19 MiB, less than one block's score
    gradient, 64 MiB). Where the block weights are not gathered per layer (every strategy but the fsdp family),
    + their bf16 copy, `lo` x the device's block matrices, made once before the layer loops (the [L, ...] bf16
    stacks in the loops' tuples: dp 32 MiB, tp3d 7.5 MiB, cp 32 MiB). Strategy "cp" (TPU only): the ring kernel's
    blocks (`activation_bytes(attention="ring")`) over data x seq, the parameters replicated.
    Not itemised (the misses, experiments/bench/results/bench_targets.json): the backward's working set where the
    TPU program keeps it in HBM (tp3d: one block's worth; dp: about 100 MiB), the ring kernel's mask tiles and
    its backward's buffers (cp).
    `fused_attention` (TPU: the attention block kernel is splash or flash, shardkit/attention/blocks.py): the block
    keeps the kernel's residuals (`attention="fused"`) and the backward's working set is the kernel's,
    on chip.
    """
    c = _cfg(cfg)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    gx, gy, gz, gd = (mesh.get(a, 1) for a in TP3D_ORDER)
    tpu = backend == "tpu"
    if strategy == "cp" and tpu:
        psi, tokens = num_params(cfg), global_batch / d * seq_len / mesh.get("seq", 1)
        block = activation_bytes(cfg, tokens, seq_len, 1, 1, nbytes, backend, attention="ring")
        remat = remat or _default_remat(cfg)
        acts = gpt_remat_cost.saved_bytes(cfg, remat, tokens, seq_len, 1, 1, nbytes, block) - block
        acts += logit_tokens(cfg, tokens, seq_len) * c["vocab_size"] * 4 * 2
        acts += c["num_layers"] * blocks_per_layer(cfg) * min(nbytes, 2)
        return _state(psi, nbytes, acts)
    if strategy.startswith("pp:") and tpu:  # the stage's blocks, the embedding, head and final norm
        p, blk = mesh.get("stage", 1), blocks_per_layer(cfg)
        acts = gpt_tpu_cost.pp_activations(c, blk, p, int(strategy[3:]), global_batch, seq_len, nbytes)
        stack = c["num_layers"] * (blk + 2 * c["d_model"])
        return _state(stack / p + num_params(cfg) - stack, nbytes, acts)
    if strategy not in _STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {_MODELLED}")
    state_deg = _STATE_DEGREE[strategy](d, f, t, gx * gy * gz)
    batch_deg = {"tp3d": gd * gz}.get(strategy, d * f)
    embed_split, head_split = {"tp_sp": (t, t), "tp3d": (gx, gy)}.get(strategy, (1, t))
    psi = num_params(cfg) / state_deg
    tokens = global_batch / batch_deg * seq_len
    remat = remat or _default_remat(cfg)
    fused = tpu and fused_attention
    block = activation_bytes(cfg, tokens, seq_len, embed_split, head_split, nbytes, "tpu" if tpu else "cpu",
                             attention="fused" if fused else "scores")  # fmt: skip
    acts = gpt_remat_cost.saved_bytes(cfg, remat, tokens, seq_len, embed_split, head_split, nbytes, block)
    if tpu:  # the backward's working set on chip (unless too large); the bf16 copy of the unsplit block weights
        in_hbm = not fused and gpt_tpu_cost.working_set_in_hbm(c["num_heads"], tokens, seq_len, head_split, nbytes)
        acts -= 0.0 if in_hbm else block
        gathered = strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp")
        acts += 0.0 if gathered else c["num_layers"] * blocks_per_layer(cfg) / state_deg * min(nbytes, 2)
    acts += logit_tokens(cfg, tokens, seq_len) * c["vocab_size"] / head_split * 4 * 2  # fp32 logits and softmax
    return _state(psi, nbytes, acts, d if strategy == "zero1" else 1)  # ZeRO-1: optimizer state over data


def logit_tokens(cfg: Any, tokens: float, seq_len: int) -> float:
    """How many positions' logits live at once: all of a device's `tokens`, or one chunk of each sequence under
    `GPTConfig.loss_chunk` (the chunked loss keeps each chunk's gradients, not its logits)."""
    chunk = getattr(cfg, "loss_chunk", 0) or 0
    return tokens * min(1.0, chunk / seq_len) if chunk else tokens


def divisibility(strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
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


def sdp_options(strategy: Any) -> Any:
    """The SDP options `sdp_terms` covers (block-level, forward masking, cyclic ownership over data), else None."""
    s = sk.strategy(strategy)
    wanted = {"granularity": "block", "masking": "forward", "ownership": "cyclic", "axis": "data"}
    ok = all(getattr(s.options, k, None) == v for k, v in wanted.items())
    return s.options if s.step == "sdp" and ok else None


def sdp_divisibility(strategy: Any, cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
    """What the SDP step would refuse ("" if nothing): fsdp and tensor both inside a worker, no ownership table
    for the data workers, or the worker's shapes not dividing fsdp x tensor."""
    if mesh.get("fsdp", 1) > 1 and mesh.get("tensor", 1) > 1:
        return "sdp spans fsdp or tensor inside a worker, not both (shardkit/parallel/sdp/compose.py)"
    try:
        sk.sdp.ownership(cfg.num_layers, mesh.get("data", 1), sdp_options(strategy).coverage)
    except ShardkitError as err:
        return str(err)
    return divisibility("fsdp_tp", cfg, mesh, global_batch)


def sdp_terms(
    cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, coverage: float, nbytes: int = 2,
    backend: str = "gpu", remat: str | None = None,
) -> tuple[list[Comm], dict[str, float]]:  # fmt: skip
    """(collectives, memory per device) of one GPT step under block-level, forward-masked SDP (Singh et al.,
    2507.09029; shardkit/parallel/sdp/) with cyclic ownership over `data`, fsdp / tensor inside each worker.

    A worker holds k = coverage x L blocks: its devices store shared + coverage x blocks parameters, each array
    over its fsdp x tensor degree (sdp_compose.py's formula; the RMSNorm scales over fsdp only), run k blocks'
    activations, and fsdp's gathers and Megatron's 4k + 2 all-reduces over them. Holder averaging: the ring's
    2(h - 1) (+ r - 1) collective-permutes of a slot set (each device its shard of a block per stride), array by
    array when fsdp / tensor split them; coverage 1 (every block everywhere) is one all-reduce. The shared
    parameters' gradients: one all-reduce over data. tests/test_sdp_compose.py checks the permute bytes and the
    parameter memory against the compiled step."""
    c = _cfg(cfg)
    e, L = c["d_model"], c["num_layers"]
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    mats = sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg))
    block = mats + 2 * e  # one block's parameters (+ its 2 norms)
    shared, k = num_params(cfg) - L * block, round(coverage * L)
    # per device: matrices (and the vocab tables) over fsdp x tensor, RMSNorm scales over fsdp only
    block_dev, shared_dev = (mats / t + 2 * e) / f, ((shared - e) / t + e) / f
    sub = shared_dev + k * block_dev  # sdp_compose.state_bytes's formula, for the GPT
    b = CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)
    tokens = global_batch / (d * f) * seq_len
    if f > 1:  # ZeRO-3 of the worker's subnetwork
        b.add("all-gather", "fsdp", sub * f * nbytes, 1, "subnetwork parameters fwd")
        b.add("all-gather", "fsdp", k * block_dev * f * nbytes, 1, "its blocks again bwd")
        b.add("reduce-scatter", "fsdp", sub * f * nbytes, 1, "gradients", gspmd=True)
    if t > 1:
        n = 4 * k + 2
        b.add("all-reduce", "tensor", tokens * e * nbytes * n, n, "Megatron f / g of the worker's blocks")
    ring = sk.sdp.ring_of(sk.sdp.ownership(L, d, coverage))
    if ring is not None and k < L:
        arrays = len(fc_layers(cfg)) + 2 if f * t > 1 else 1  # array by array, or one packed buffer
        n = ring.permutes() * ring.stride * block_dev * nbytes
        b.add("collective-permute", "data", n, ring.permutes() * arrays, "holder averaging (ring)")
    else:
        b.add("all-reduce", "data", L * block_dev * nbytes, 1, "holder averaging (masked all-reduce)")
    b.add("all-reduce", "data", shared_dev * nbytes, 1, "shared gradients over data")
    remat = remat or _default_remat(cfg)
    worker = dataclasses.replace(cfg, num_layers=k)  # its k blocks (cfg: a GPTConfig)
    block_acts = activation_bytes(cfg, tokens, seq_len, 1, t, nbytes)
    acts = gpt_remat_cost.saved_bytes(worker, remat, tokens, seq_len, 1, t, nbytes, block_acts)
    acts += logit_tokens(cfg, tokens, seq_len) * c["vocab_size"] / t * 4 * 2  # fp32 logits and their softmax
    return b.comms(), _state(sub, nbytes, acts)


def gpt_extra_comms(b: Any, cfg: Any, tokens: int, nbytes: int, gspmd: bool = True) -> None:
    """Adds to `b` (a shardkit.costmodel.CommBuilder) the collectives of one GPT step besides the block projections.

    Each `b.add(kind, axes, n, count)`: n = full buffer bytes summed over the `count` collectives."""
    gx, gy, gz, gd = (b.mesh.get(a, 1) for a in ("col", "row", "depth", "data"))
    e, v, L = int(cfg.d_model), int(cfg.vocab_size), int(cfg.num_layers)
    r, el, vl, nb = tokens / (gd * gz), e / gx, v / gy, nbytes
    tied = bool(getattr(cfg, "tie_embeddings", False))
    bd = "data,depth"  # the batch axes of the compute rules

    # RMSNorm (gpt.rms_norm): mean(x²) over embed, sharded over col -> AR over col of one value per token, in the
    # forward and again in the backward (d/dx needs sum(dy·scale·x) over embed). Two norms per block + final.
    b.add("all-reduce", "col", (4 * L + 2) * r * nb, 4 * L + 2, "RMSNorm mean-square / its grad: AR_col, fwd + bwd")
    # Norm scales rest on (col, depth), compute wants col only: AG over depth of e_l, fwd and again in the bwd of
    # the layer scan (it re-gathers like the projection weights); the final norm's fwd + bwd (outside the scan).
    b.add("all-gather", "depth", (4 * L + 2) * el * nb, 4 * L + 2, "RMSNorm scale AG over depth, fwd and bwd")
    # Scale gradients: reduce_sum of (dy·x̂) over the tokens -> AR over (data, depth); 2 per block + final.
    b.add("all-reduce", bd, (2 * L + 1) * el * nb, L + 1, "RMSNorm scale grads AR over (data, depth)")

    # Embedding (vocab -> row, embed -> (col, depth)): the (vocab, embed) constraint gathers the depth shard,
    # the lookup is a masked local gather summed over the vocab shards, and the scatter-add gradient is reduced
    # over the batch axes.
    b.add("all-gather", "depth", vl * el * nb, 1, "embedding table AG over depth")
    b.add("all-reduce", "row", r * el * nb, 1, "embedding lookup: AR_row of the masked gathers")
    b.add("all-reduce", bd, vl * el * nb, 1, "embedding grad (scatter-add) AR over (data, depth)")

    # Output head (embed -> (col, depth), vocab -> row), logits = x w: like a tensor3d linear with one weight
    # gather (no scan, so the backward reuses it). Tied: the same weight as the embedding, gathered once.
    if not tied:
        b.add("all-gather", "depth", vl * el * nb, 1, "head weight AG over depth")
    b.add("all-reduce", "col", r * vl * nb, 1, "logits = AR_col(x w) fwd")
    b.add("all-reduce", "row", r * el * nb, 1, "head dx = AR_row(dlogits wᵀ) bwd")
    b.add("reduce-scatter", "depth", vl * el * nb, 1, "head dW RS over depth", gspmd=gspmd)
    b.add("all-reduce", "data", vl * el / gz * nb, 1, "head dW shard AR over data")

    # Vocab-parallel cross-entropy (optax softmax_cross_entropy_with_integer_labels, vocab over row): max,
    # sum of exp and the target logit (take_along_axis), one value per token each, all-reduced over row.
    b.add("all-reduce", "row", 3 * r * nb, 3, "cross-entropy max / sum-exp / target logit AR_row")

    # Scalars (train.py): the mean loss over the batch axes; grad_norm = optax.tree.norm: one sum of squares per
    # leaf, reduced over the axes the leaf is sharded on. XLA reduces the row part of the matrix leaves (embed,
    # head, wqkv, wo, w_gate_up, w_down) and the (depth, col) part of all leaves (+ the 3 norm scales) apart.
    mats = 5 if tied else 6
    b.add("all-reduce", bd, nb, 1, "loss: sum over the batch")
    b.add("all-reduce", "row", mats * nb, 1, "grad_norm: matrix leaves' sums of squares over row")
    b.add("all-reduce", "depth,col", (mats + 3) * nb, 2, "grad_norm: all leaves' sums of squares over (depth, col)")


__all__ = ["MODELLED", "activation_bytes", "blocks_per_layer", "cached_comms", "cp_formula",
           "divisibility", "fc_layers", "formula", "gpt_extra_comms", "memory", "num_params", "pp_formula",
           "sdp_divisibility", "sdp_options", "sdp_terms", "strategy_comms", "tpu_formula"]  # fmt: skip
