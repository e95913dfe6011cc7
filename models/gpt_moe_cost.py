"""The MoE GPT's cost model under expert parallelism (ep, ep_gspmd, ep_tp, ep_fsdp): the all-to-alls, the
memory per remat policy and the divisibility of its shapes; the companion of models/gpt_cost.py for a GPT with
`num_experts` > 0 (`GPTConfig.cost_model` calls these). Like it, the formulas are per strategy and mesh and name
mesh axes. Measured against the compiled step: tests/test_moe.py (the all-to-alls), tests/test_plan_remat.py
(the all-to-alls under remat, and what each remat policy frees: measured -1% to +5%, asserted within 10%).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models import gpt_remat_cost
from models.gpt_cost import activation_bytes
from shardkit.costmodel import Comm, CommBuilder


def comms(
    cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 4, remat: str = "none",
    backend: str = "gpu",
) -> list[Comm]:  # fmt: skip
    """The collectives of one MoE GPT step under the ep family (ep, ep_gspmd; ep_tp with `tensor`, ep_fsdp with
    `fsdp` in `mesh`), per device:

    - the all-to-alls over `expert`: per MoE layer 2 forward + 2 backward, and under any remat policy but `none`
      the 2 forward ones again (no policy keeps their outputs, which are no matmul's), each of the
      [E, G_l, C, d_model] buffer (G_l = sequences per device, C = the capacity per sequence);
    - ep_tp: per layer the all-reduce over `tensor` of the experts' output (Megatron's g) forward, its f backward,
      and g again when remat re-runs the forward (not under `dots`, which keeps the experts' outputs);
    - ep_fsdp: ZeRO-3 over `fsdp` (every weight has an embed dimension): the local parameters all-gathered forward
      and the blocks' again backward, the gradients reduce-scattered;
    - the gradients: the replicated weights' all-reduced over (data, expert), the experts' over data.

    Not modelled: the scalars' and the router's small exchanges (about 1% of the bytes at the tested sizes). XLA
    may group some reductions differently (ep_fsdp: part of the replicated weights' over fsdp and expert at once);
    tests/test_moe.py compares each kind's bytes with the compiled step's."""
    from shardkit.parallel.moe import capacity

    x, t, f = mesh.get("expert", 1), mesh.get("tensor", 1), mesh.get("fsdp", 1)
    devices = math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))  # the batch axes of ep*
    cap = capacity(seq_len, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.dropless)
    buffer = cfg.num_experts * (global_batch // devices) * cap * cfg.d_model * nbytes
    b = CommBuilder(mesh, ("tensor", "fsdp", "expert", "data"), backend)
    remat_note = f", the forward's again under remat {remat}" if remat != "none" else ""
    n = (4 if remat == "none" else 6) * cfg.num_layers
    b.add("all-to-all", "expert", buffer * n, n, f"MoE dispatch / combine, forward and backward{remat_note}")
    n = (2 if remat.partition(":")[0] in ("none", "dots") else 3) * cfg.num_layers  # dots keeps the g's input
    b.add("all-reduce", "tensor", buffer * n, n, f"ep_tp: the experts' output g fwd, f bwd{remat_note}")
    expert_params = cfg.num_layers * 3 * cfg.d_model * cfg.mlp_dim * cfg.num_experts
    head = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)  # embedding and head: not in the blocks
    replicated = (cfg.num_params() - expert_params) * nbytes / f  # per device, after fsdp's split
    experts = expert_params * nbytes / (x * t * f)  # this device's experts' slice
    if f > 1:
        local = replicated + experts  # this device's shard of every weight, gathered over fsdp
        b.add("all-gather", "fsdp", local * f, 1, "parameters fwd")
        b.add("all-gather", "fsdp", (local - head * nbytes / f) * f, 1, "block parameters bwd")
        b.add("reduce-scatter", "fsdp", local * f, 1, "gradients", gspmd=True)
    b.add("all-reduce", "data,expert", replicated, 1, "gradients of the replicated weights")
    b.add("all-reduce", "data", experts, 1, "gradients of the experts' weights")
    return b.comms()


def divisibility(cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
    """Why a MoE GPT does not split over `mesh` under ep* ("" if it does): experts over expert, batch over the rest."""
    batch = math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
    if cfg.num_experts % mesh.get("expert", 1) or global_batch % batch:
        return f"{cfg.num_experts} experts / batch {global_batch} do not split over {mesh}"
    return ""


def memory(
    cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2, remat: str | None = None
) -> dict[str, float]:  # fmt: skip
    """Bytes per device under ep: the experts' weights over `expert`, the rest replicated (ZeRO's 16 bytes per
    parameter in mixed precision). Activations under the `remat` policy: models/gpt_remat_cost.py's rules for the
    dense block with the width of the experts' capacity slots per token (about k·f; / tensor under ep_tp), and per
    block the MoE's own tensors, the routing's dispatch and combine masks ([G_l, S, E, C], fp32) and the
    dispatched and combined tokens ([E, G_l, C, d]). Under `none` every block keeps them all; under `full` only
    the recomputed block holds them; under `dots` the tokens are kept (the dispatch einsums are batched matmuls)
    and the masks recomputed; under `dots_no_batch` and `names:` both are recomputed (nothing in them is tagged).
    `remat` None: the config's `remat` alias (models/gpt.py REMAT_ALIASES), as `gpt_cost.memory`."""
    from models.gpt import REMAT_ALIASES
    from shardkit.parallel.moe import capacity

    remat = REMAT_ALIASES.get(getattr(cfg, "remat", "none"), "none") if remat is None else remat

    x, devices = mesh.get("expert", 1), math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
    shard = mesh.get("tensor", 1) * mesh.get("fsdp", 1)  # ep_tp: experts' mlp over tensor; ep_fsdp: embed over fsdp
    experts = cfg.num_layers * 3 * cfg.d_model * cfg.mlp_dim * cfg.num_experts
    psi = (cfg.num_params() - experts) / mesh.get("fsdp", 1) + experts / (x * shard)
    groups, tokens = global_batch / devices, global_batch / devices * seq_len
    cap = capacity(seq_len, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.dropless)
    t = mesh.get("tensor", 1)  # ep_tp: the experts' mlp over tensor, nothing else
    width = round(gpt_remat_cost.moe_flops_per_token(cfg, seq_len)["hidden"] / t)  # the experts' SwiGLU per token
    active = dataclasses.replace(cfg, num_experts=0, mlp_dim=width)
    dispatched = 2 * cfg.num_experts * groups * cap * cfg.d_model * nbytes  # [E, G_l, C, d] in and out
    masks = 2 * groups * seq_len * cfg.num_experts * cap * 4  # dispatch and combine, fp32
    block = activation_bytes(active, tokens, seq_len, 1, 1, nbytes) + dispatched + masks
    base, names = remat.partition(":")[0], {t.strip() for t in remat.partition(":")[2].split(",")}
    hidden = tokens * active.mlp_dim * nbytes  # one [tokens, k f] tensor of the active experts
    moe = {"dots": dispatched,  # per block, beyond the dense rules: the batched dispatch einsums' outputs kept,
           "dots_no_batch": -2 * hidden,  # the experts' gate and up recomputed (batched over E: not "no batch")
           "names": -hidden if "mlp_hidden" in names else 0.0}  # fmt: skip  # the MoE block tags no mlp_hidden
    acts = gpt_remat_cost.saved_bytes(active, remat, tokens, seq_len, 1, 1, nbytes, block)
    acts += cfg.num_layers * moe.get(base, 0.0) + tokens * cfg.vocab_size * 4 * 2  # + fp32 logits and softmax
    mem = {"params": nbytes * psi, "grads": nbytes * psi, "optimizer": (16 - 2 * nbytes) * psi, "activations": acts}
    return {**mem, "total": sum(mem.values())}


__all__ = ["comms", "divisibility", "memory"]
