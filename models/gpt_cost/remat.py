"""The GPT's memory and recompute cost per remat policy: what `sk.plan` trades when a plan fits only with remat.

(A companion of models/gpt_cost/memory.py, which calls `saved_bytes` for the activations of its `memory`; the policies
are the `remat` kernel slot's, shardkit/layers.py and docs/memory.md.)

Saved activations of one block, elements per token on one device (e = d_model, n heads, k kv heads, hd head
dim, f mlp dim, s sequence; `es` / `hs` the splits of the embed / head-and-mlp names), after Korthikanti et al.
2205.05198 §4-5 (their "selective" and "full" recomputation):

- none: `memory.activation_bytes` (Korthikanti's Table 2 itemised for our block) for every block, + one
  block's worth for the backward's working set (the gradients of one block's activations).
- full: each block's input e/es (the scan's carry, Korthikanti's 2sbh per layer), plus ONE block's activations
  while its backward recomputes it (the working set, counted once, not per layer).
- dots_no_batch (the GPT's `remat="dots"`): the block input, and the outputs of the matmuls without batch
  dimensions that the backward reads: q/k/v (n + 2k)·hd, gate and up 2f (hs-split), the output projection e/es
  (the MLP's RMSNorm input is recomputed from it); attention (batched dots) recomputed: + one block's working set.
- dots: dots_no_batch + attention's two batched matmuls' outputs, scores n·s and values n·hd (hs-split).
- names:<a,b>: the block input and the tagged tensors (gpt.CHECKPOINT_NAMES: qkv_proj (n + 2k)·hd, attn_out
  n·hd, out_proj e, mlp_in e, mlp_hidden f); + one block's working set.
- offload:<a,b>: the block input (the tagged tensors go to host memory, not counted here); + the working set.

Recompute FLOPs, per device per step: what the backward re-runs. Matmuls at 2 FLOPs per multiply-add, counted as
the compiled step runs them (tests/test_plan_remat.py: equal to `shardkit.hlo.matmul_flops`' difference from
`none`), and elementwise work at a fixed count per element (RMSNorm 5, RoPE 6, causal softmax 5, SwiGLU's
silu(gate)·up 5). Per token and block:

- full: the block's forward matmuls except its last one, whose output the backward does not read (XLA drops it):
  q/k/v, the output projection, attention's 4·n·hd·s, and the MLP's gate and up (not its down projection); a MoE
  block its router, the dispatch einsum and the experts' three matmuls over their capacity slots (not the combine
  einsum). That is one forward (Korthikanti's +33% of a step), less the last matmul. Elementwise work not counted.
- names:<a,b> and offload:<a,b>: full, less the matmuls whose outputs the kept (or offloaded) tensors make
  unnecessary: qkv_proj the q/k/v projection, out_proj the output projection, attn_out attention's
  probabilities x values (2·n·hd·s; the scores still run: their softmax is what the backward reads); mlp_in and
  mlp_hidden none (the SwiGLU's backward reads gate and up). Elementwise work not counted.
- dots_no_batch: the elementwise work + the batched matmuls: attention's two, and a MoE block's experts (batched
  over the experts) and dispatch einsum. (A MoE block's routing masks, rebuilt elementwise, are not counted.)
- dots: the elementwise work only.

The embedding, the head and the loss are never recomputed (outside the layer scan). Total over the devices /
devices: every strategy the dense GPT formulas model splits the forward's FLOPs evenly. A MoE block under ep_tp
splits only its experts' MLPs over tensor (attention, router and dispatch are replicated there): `expert_split`.
"""

from __future__ import annotations

from typing import Any

from models.gpt_remat import REMAT_ALIASES
from shardkit.errors import ShardkitError
from shardkit.layers import REMAT_CHOICES, REMAT_POLICIES, remat_names
from shardkit.parallel.moe import capacity

#: elementwise FLOPs per element of the recomputed non-matmul work (the convention above)
NORM, ROPE, SOFTMAX, SWIGLU = 5, 6, 5, 5
POLICIES = REMAT_POLICIES  # + "names:<a,b>", "offload:<a,b>" (REMAT_CHOICES)


def alias_policy(cfg: Any) -> str:
    """The remat policy the config's `remat` alias means (models/gpt_remat.py REMAT_ALIASES; "none" without one)."""
    return REMAT_ALIASES.get(getattr(cfg, "remat", "none"), "none")


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
    `block_bytes` = one block's activations without remat (`memory.activation_bytes`)."""
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
    elif base in ("names", "offload"):
        tags = tagged_elements(cfg, es, hs)
        names = remat_names(policy)
        unknown = [t for t in names if t not in tags]
        if unknown:
            raise ShardkitError(f"remat policy {policy!r}: the GPT tags no {unknown}; it tags {', '.join(tags)}")
        per = inp + (sum(tags[t] for t in set(names)) if base == "names" else 0.0)  # offload: kept in host memory
    else:
        raise ShardkitError(f"remat policy {policy!r}: the GPT's cost model knows {', '.join(REMAT_CHOICES)}")
    return L * tokens * per * nbytes + block_bytes  # + one block's working set during its recompute


def moe_flops_per_token(cfg: Any, seq_len: int) -> dict[str, float]:
    """One MoE block's forward matmul FLOPs per token: the router, the dispatch and the combine einsums (2·E·C·d
    each), and the experts' SwiGLU over the E·C capacity slots of a sequence (about k·cf·S of them, E·S when
    dropless); and `hidden`, the experts' SwiGLU width per token (f·E·C / S)."""
    e, f, x = int(cfg.d_model), int(cfg.mlp_dim), int(cfg.num_experts)
    slots = x * capacity(seq_len, x, cfg.top_k, cfg.capacity_factor, cfg.dropless)  # per sequence
    return {"router": 2 * e * x, "dispatch": 2 * slots * e, "combine": 2 * slots * e,
            "experts": 6 * e * f * slots / seq_len, "hidden": f * slots / seq_len}  # fmt: skip


def recompute_per_token(cfg: Any, policy: str, seq_len: int, expert_split: int = 1) -> tuple[float, float]:
    """(matmul, elementwise) FLOPs per token that the backward re-runs under `policy`, all blocks (module doc).
    `expert_split`: the devices each expert's MLP is split over (ep_tp: tensor), the rest of the block not."""
    e, n, k, hd, f = _shape(cfg)
    L, base = int(cfg.num_layers), policy.partition(":")[0]
    qkv, out, attn = 2 * e * (n + 2 * k) * hd, 2 * n * hd * e, 4 * n * hd * seq_len
    if getattr(cfg, "num_experts", 0):
        moe = moe_flops_per_token(cfg, seq_len)
        experts = moe["experts"] / expert_split
        mlp_forward, mlp_batched = moe["router"] + moe["dispatch"] + experts, moe["dispatch"] + experts
        f = moe["hidden"] / expert_split  # the SwiGLU's elementwise work runs over every slot
    else:
        mlp_forward, mlp_batched = 4 * e * f, 0.0  # gate and up; the down projection is the block's last matmul
    if base in ("full", "names", "offload"):
        names = remat_names(policy)
        kept = qkv * ("qkv_proj" in names) + out * ("out_proj" in names) + attn / 2 * ("attn_out" in names)
        return L * (qkv + out + attn + mlp_forward - kept), 0.0
    elementwise = L * (2 * NORM * e + ROPE * (n + k) * hd + SOFTMAX * n * seq_len + SWIGLU * f)
    if base == "dots":
        return 0.0, elementwise
    if base == "dots_no_batch":
        return L * (attn + mlp_batched), elementwise
    if base == "none":
        return 0.0, 0.0
    raise ShardkitError(f"remat policy {policy!r}: the GPT's cost model knows {', '.join(REMAT_CHOICES)}")


def recompute_flops(
    cfg: Any, policy: str, global_tokens: float, seq_len: int, devices: int, expert_split: int = 1
) -> float:  # fmt: skip
    """FLOPs the backward re-runs per device per step under `policy` (module doc's convention); `devices`: those
    the tokens are split over, `expert_split` as in `recompute_per_token`."""
    return sum(recompute_per_token(cfg, policy, seq_len, expert_split)) * global_tokens / devices


__all__ = ["POLICIES", "alias_policy", "moe_flops_per_token", "recompute_flops", "recompute_per_token", "saved_bytes",
           "tagged_elements"]  # fmt: skip
