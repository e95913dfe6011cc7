"""The GPT's collectives: per-device bytes of each collective of one train step, per formula family.

Bytes are per device per step, ring volumes (docs/algorithms.md §1): all-gather / reduce-scatter (p-1)/p·n,
all-reduce 2(p-1)/p·n, n the full buffer. `backend="cpu"` models what XLA:CPU compiles: GSPMD's
reduce-scatters (FSDP gradients, Megatron-SP's g) become a full all-reduce plus a dynamic-slice.

The tp3d GSPMD step (`strategy_comms("tp3d", ..., gspmd=True)`) = the projections (AxoNN's model,
`shardkit.costmodel.tp3d_layer_comms`) + `gpt_extra_comms`, derived from models/gpt.py, the GSPMD step and
the `tp3d` rules (shardkit/parallel/tensor3d.py): parameters embed -> (col, depth), heads / kv_heads / mlp /
vocab -> row; compute batch -> (data, depth), embed -> col, heads / mlp / vocab -> row. Each term below was
matched, by the op_name metadata of `compiled.as_text()`, to the collective XLA emits for it
(tests/test_costmodel.py, all 20 factorisations of 8 CPU devices). Notation: r = tokens / (G_d·G_z) local token
rows, e_l = d_model / G_x, V_l = vocab / G_y.

What XLA chooses and we follow: weight-gradient matmuls (dW = xᵀ dy) reduce over depth as a reduce-scatter
(CPU: all-reduce of the full block) then the shard over data, like `tensor3d.linear`; gradients that are not
matmuls (the embedding's scatter-add, RMSNorm scales' reduce_sum) are all-reduced over (data, depth) at once.
TPU (`backend="tpu"`): the terms XLA's TPU compiler's programs need (bf16 weight gathers, the collective matmul's
permutes, the ring's and the pipeline's transfers) are models/gpt_cost/tpu.py's, each with the evidence it was
read from; this file dispatches to them.

Known exception: on some small meshes (G_x = 2, G_y = 1, G_z = 2, G_d = 2 for the tiny test GPT) XLA's
partitioner prefers all-gathering activations over col and weights over (depth, col) to the partial-sum
all-reduces; that choice depends on XLA's cost heuristics and is not modelled (listed in the test).
"""

from __future__ import annotations

import functools
from typing import Any

from models.gpt_cost import gpu
from models.gpt_cost.classify import MODELLED, STATE_DEGREE
from models.gpt_cost.shapes import blocks_per_layer, fc_layers, num_params, shape
from models.gpt_cost.tpu import cp_comms, param_bytes, pp_comms, tp3d_recompute_comms, zero3_comms
from shardkit.costmodel import TP3D_ORDER, Comm, CommBuilder, tp3d_layer_comms
from shardkit.errors import ShardkitError


def strategy_comms(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    backend: str = "gpu", gspmd: bool = False, fused_attention: bool = False, local_embedding: bool = False,
    remat: str = "none", vocab_embedding: bool = False,
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
    `remat`: the remat policy; on TPU, tp3d's recomputed forward issues its collectives again (tpu.py
    `tp3d_recompute_comms`); elsewhere the collectives do not depend on it. `local_embedding` /
    `vocab_embedding`: the `embed` slot runs `local` / `vocab` (shardkit/embedding.py), not GSPMD's gather.
    """
    c = shape(cfg)
    e, L = c["d_model"], c["num_layers"]
    psi = num_params(cfg)
    blocks = L * blocks_per_layer(cfg)
    if strategy == "tp3d":
        b = CommBuilder(mesh, TP3D_ORDER, backend)
        for name, h1, h2, tr in fc_layers(cfg):
            for _ in range(L):
                tp3d_layer_comms(b, h1, h2, global_batch * seq_len, tr, nbytes, name, gspmd)
        if gspmd:  # the whole GSPMD train step: embedding, norms, head, cross-entropy, scalars
            gpt_extra_comms(b, cfg, global_batch * seq_len, nbytes, gspmd, backend)
        if backend == "tpu":
            tp3d_recompute_comms(b, cfg, global_batch * seq_len, nbytes, remat)
        return b.comms()
    b = CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    act = global_batch // (d * f) * seq_len * e * nbytes
    shard = psi * nbytes / (t * f)
    if strategy == "cp" and backend == "tpu":  # the ring kernel's permutes, gradients over (data, seq)
        kv_bytes = nbytes if fused_attention else min(nbytes, 2)
        return cp_comms(c, psi, mesh, global_batch, seq_len, nbytes, backend, kv_bytes)
    if strategy.startswith("pp:") and backend == "tpu":  # GPipe over stage
        return pp_comms(mesh, int(strategy[3:]), global_batch, seq_len, e, nbytes, backend)
    if strategy == "cp" and backend == "gpu":  # the ring with the Pallas GPU block (gpu.py); table, norms at fp32
        wide_grads = (c["vocab_size"] * e + (2 * L + 1) * e) * (param_bytes(cfg) - nbytes)
        return gpu.cp_comms(c, mesh, global_batch, seq_len, nbytes, psi * nbytes + wide_grads)
    if strategy.startswith("pp:") and backend == "gpu":
        return gpu.pp_comms(mesh, int(strategy[3:]), global_batch, seq_len, e, nbytes)
    if strategy not in STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {', '.join(MODELLED)}")
    tpu_zero3 = backend in ("tpu", "gpu") and not getattr(cfg, "tie_embeddings", False)
    on_gpu, pb = backend == "gpu", param_bytes(cfg)
    wide = pb if on_gpu else nbytes  # GPU: the table and the norm scales (and their gradients) at their own width
    if strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp") and tpu_zero3:
        zero3_comms(b, c, blocks_per_layer(cfg), t, f, nbytes, windowed=t > 1 and not on_gpu,
                    local_rows=act if local_embedding else 0.0, ids=global_batch // d * seq_len * 4,
                    lo=nbytes if on_gpu else None, wide=wide)  # fmt: skip
    elif strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp"):  # ZeRO-3 over fsdp (of the 1/t Megatron slice)
        b.add("all-gather", "fsdp", psi * nbytes / t, 1, "parameters fwd")
        b.add("all-gather", "fsdp", blocks * nbytes / t, 1, "block parameters bwd")
        b.add("reduce-scatter", "fsdp", psi * nbytes / t, 1, "gradients", gspmd=True)
    if strategy in ("tp", "tp_sp", "fsdp_tp", "dp_fsdp_tp"):
        n = 4 * L + 2
        if strategy != "tp_sp" and on_gpu and not vocab_embedding:  # GSPMD's lookup: partial rows at the table's width
            b.add("all-reduce", "tensor", act * (n - 1), n - 1, "Megatron f / g")
            b.add("all-reduce", "tensor", act / nbytes * pb, 1, "embedding lookup at the table's width")
        elif strategy != "tp_sp":
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
    else:  # GPU: the embedding table's (vocab-split over tensor) and norm scales' gradients at their own width
        tables = (c["vocab_size"] * e / t + (2 * L + 1) * e) * (wide - nbytes) / f
        b.add("all-reduce", "data", shard + tables, 1, "gradients over data")
    return b.comms()


@functools.lru_cache(maxsize=4096)
def cached_comms(
    family: str, cfg: Any, mesh: tuple[tuple[str, int], ...], global_batch: int, seq_len: int, nbytes: int,
    backend: str, fused_attention: bool = False, local_embedding: bool = False, remat: str = "none",
    vocab_embedding: bool = False,
) -> tuple[Comm, ...]:  # fmt: skip
    """`strategy_comms` memoised (the GSPMD step's for tp3d): `sk.plan` asks once per (plan, remat policy). The
    policy matters only where a recomputed forward issues collectives again (tp3d on TPU)."""
    remat = remat if family == "tp3d" and backend == "tpu" else "none"  # (one cache entry where it does not)
    return tuple(strategy_comms(family, cfg, dict(mesh), global_batch, seq_len, nbytes, backend, family == "tp3d",
                                fused_attention, local_embedding, remat, vocab_embedding))  # fmt: skip


def gpt_extra_comms(b: Any, cfg: Any, tokens: int, nbytes: int, gspmd: bool = True, backend: str = "cpu") -> None:
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
    lookup = param_bytes(cfg) if backend == "gpu" else nb  # GPU: at the table's width (models/gpt_cost/gpu.py)
    b.add("all-reduce", "row", r * el * lookup, 1, "embedding lookup: AR_row of the masked gathers")
    # TPU: the table is fp32 (the parameters') and its gradient too, whatever the compute dtype (gpt_70b, tp3d
    # data=4,depth=16,row=2 on a v5p-256: 1.45 GiB over (data, depth), twice the bf16 figure + the norm scales')
    eb = param_bytes(cfg) if backend in ("tpu", "gpu") else nb  # GPU too (models/gpt_cost/gpu.py)
    b.add("all-reduce", bd, vl * el * eb, 1, "embedding grad (scatter-add) AR over (data, depth)")

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


__all__ = ["cached_comms", "gpt_extra_comms", "strategy_comms"]
