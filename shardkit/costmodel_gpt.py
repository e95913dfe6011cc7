"""The rest of a GPT train step under the `tp3d` GSPMD rules: everything but the four block projections.

`costmodel.strategy_comms("tp3d", ..., gspmd=True)` = the projections (`costmodel.tp3d_layer_comms`, AxoNN's
model) + `gpt_extra_comms`. Derived from models/gpt.py, shardkit/train.py and the `tp3d` rules
(strategies.py): parameters embed -> (col, depth), heads / kv_heads / mlp / vocab -> row; compute batch ->
(data, depth), embed -> col, heads / mlp / vocab -> row. Each term below was matched, by the op_name metadata
of `compiled.as_text()`, to the collective XLA emits for it (tests/test_costmodel.py, all 20 factorisations
of 8 CPU devices). Notation: r = tokens / (G_d·G_z) local token rows, e_l = d_model / G_x, V_l = vocab / G_y.

What XLA chooses and we follow: weight-gradient matmuls (dW = xᵀ dy) reduce over depth as a reduce-scatter
(CPU: all-reduce of the full block) then the shard over data, like `tensor3d.linear`; gradients that are not
matmuls (the embedding's scatter-add, RMSNorm scales' reduce_sum) are all-reduced over (data, depth) at once.
Known exception: on some small meshes (G_x = 2, G_y = 1, G_z = 2, G_d = 2 for the tiny test GPT) XLA's
partitioner prefers all-gathering activations over col and weights over (depth, col) to the partial-sum
all-reduces; that choice depends on XLA's cost heuristics and is not modelled (listed in the test).
"""

from __future__ import annotations

from typing import Any


def gpt_extra_comms(b: Any, cfg: Any, tokens: int, nbytes: int, gspmd: bool = True) -> None:
    """Adds to builder `b` (costmodel._Builder) the collectives of one GPT step besides the block projections.

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


__all__ = ["gpt_extra_comms"]
