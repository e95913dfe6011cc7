"""The GPT's memory and recompute cost per remat policy: what `sk.plan` trades when a plan fits only with remat.

(A companion of models/gpt_cost.py, which calls `saved_bytes` for the activations of its `memory`; the policies
are the `remat` kernel slot's, shardkit/layers.py and docs/memory.md.)

Saved activations of one block, elements per token on one device (e = d_model, n heads, k kv heads, hd head
dim, f mlp dim, s sequence; `es` / `hs` the splits of the embed / head-and-mlp names), after Korthikanti et al.
2205.05198 §4-5 (their "selective" and "full" recomputation):

- none: `gpt_cost.activation_bytes` (Korthikanti's Table 2 itemised for our block) for every block, + one
  block's worth for the backward's working set (the gradients of one block's activations).
- full: each block's input e/es (the scan's carry, Korthikanti's 2sbh per layer), plus ONE block's activations
  while its backward recomputes it (the working set, counted once, not per layer).
- dots_no_batch (the GPT's `remat="dots"`): the block input, and the outputs of the matmuls without batch
  dimensions that the backward reads: q/k/v (n + 2k)·hd, gate and up 2f (hs-split), the output projection e/es
  (the MLP's RMSNorm input is recomputed from it); attention (batched dots) recomputed: + one block's working set.
- dots: dots_no_batch + attention's two batched matmuls' outputs, scores n·s and values n·hd (hs-split).
- names:<a,b>: the block input and the tagged tensors (gpt.CHECKPOINT_NAMES: qkv_proj (n + 2k)·hd, attn_out
  n·hd, out_proj e, mlp_in e, mlp_hidden f); + one block's working set.

Recompute FLOPs, per device per step, convention: matmuls 2 FLOPs per multiply-add, elementwise work at a fixed
count per element (RMSNorm 5, RoPE 6, causal softmax 5, SwiGLU's silu(gate)·up 5): what the backward re-runs.
full = one extra forward of the blocks (2·P_blocks + 4·n·hd·s per token: Korthikanti's +33% of a step without
recompute); dots = the elementwise work only; dots_no_batch = elementwise + attention's two batched matmuls;
names = one forward (an upper bound: whatever is not tagged may be recomputed). The embedding, the head and the
loss are never recomputed (outside the layer scan). Total over the devices / devices: every strategy the GPT
formulas model splits the forward's FLOPs evenly.
"""

from __future__ import annotations

from typing import Any

from shardkit.errors import ShardkitError
from shardkit.layers import REMAT_POLICIES

#: elementwise FLOPs per element of the recomputed non-matmul work (the convention above)
NORM, ROPE, SOFTMAX, SWIGLU = 5, 6, 5, 5
POLICIES = REMAT_POLICIES  # + "names:<a,b>"


def _shape(cfg: Any) -> tuple[int, int, int, int, int]:
    return (int(cfg.d_model), int(cfg.num_heads), int(cfg.num_kv_heads), int(cfg.head_dim), int(cfg.mlp_dim))


def tagged_elements(cfg: Any, es: int, hs: int) -> dict[str, float]:
    """Elements per token of each tensor a block tags (models/gpt.py CHECKPOINT_NAMES), on one device."""
    e, n, k, hd, f = _shape(cfg)
    return {"qkv_proj": (n + 2 * k) * hd / hs, "attn_out": n * hd / hs, "out_proj": e / es, "mlp_in": e / es,
            "mlp_hidden": f / hs}  # fmt: skip


def saved_bytes(
    cfg: Any, policy: str, tokens: float, seq_len: int, es: int, hs: int, nbytes: int, block_bytes: float
) -> float:
    """Activation bytes all `cfg.num_layers` blocks keep for the backward under remat `policy` (module doc);
    `block_bytes` = one block's activations without remat (`gpt_cost.activation_bytes`)."""
    e, n, k, hd, f = _shape(cfg)
    L, base = int(cfg.num_layers), policy.partition(":")[0]
    if base == "none":
        return (L + 1) * block_bytes  # + the backward's working set, as for every policy
    inp = e / es  # the block's input (the scan carry), saved under every policy
    if base == "full":
        per = inp
    elif base in ("dots", "dots_no_batch"):
        per = inp + ((n + 2 * k) * hd + 2 * f) / hs + e / es
        if base == "dots":
            per += (n * seq_len + n * hd) / hs
    elif base == "names":
        tags = tagged_elements(cfg, es, hs)
        names = [t.strip() for t in policy.partition(":")[2].split(",") if t.strip()]
        unknown = [t for t in names if t not in tags]
        if unknown:
            raise ShardkitError(f"remat policy {policy!r}: the GPT tags no {unknown}; it tags {', '.join(tags)}")
        per = inp + sum(tags[t] for t in set(names))
    else:
        raise ShardkitError(f"remat policy {policy!r}: the GPT's cost model knows {', '.join(POLICIES)}, names:<a,b>")
    return L * tokens * per * nbytes + block_bytes  # + one block's working set during its recompute


def forward_flops_per_token(cfg: Any, seq_len: int) -> float:
    """One forward of the blocks, per token: 2 x the block matmuls' parameters + attention's 4·n·hd·s."""
    e, n, k, hd, f = _shape(cfg)
    matmul = e * (n + 2 * k) * hd + n * hd * e + 3 * e * f
    return int(cfg.num_layers) * (2 * matmul + 4 * n * hd * seq_len)


def elementwise_flops_per_token(cfg: Any, seq_len: int) -> float:
    """The non-matmul forward work of the blocks, per token (the convention's counts per element)."""
    e, n, k, hd, f = _shape(cfg)
    return int(cfg.num_layers) * (2 * NORM * e + ROPE * (n + k) * hd + SOFTMAX * n * seq_len + SWIGLU * f)


def recompute_flops(cfg: Any, policy: str, global_tokens: float, seq_len: int, devices: int) -> float:
    """FLOPs the backward re-runs per device per step under `policy` (module doc's convention)."""
    base = policy.partition(":")[0]
    n, hd = int(cfg.num_heads), int(cfg.head_dim)
    per_token = {
        "none": 0.0,
        "full": forward_flops_per_token(cfg, seq_len),
        "names": forward_flops_per_token(cfg, seq_len),
        "dots": elementwise_flops_per_token(cfg, seq_len),
        "dots_no_batch": elementwise_flops_per_token(cfg, seq_len) + int(cfg.num_layers) * 4 * n * hd * seq_len,
    }
    if base not in per_token:
        raise ShardkitError(f"remat policy {policy!r}: the GPT's cost model knows {', '.join(POLICIES)}, names:<a,b>")
    return per_token[base] * global_tokens / devices


__all__ = ["POLICIES", "elementwise_flops_per_token", "forward_flops_per_token", "recompute_flops", "saved_bytes",
           "tagged_elements"]  # fmt: skip
