"""The MoE GPT's cost model under expert parallelism (ep, ep_gspmd, ep_tp, ep_fsdp): the all-to-alls, the
memory per remat policy and the divisibility of its shapes; the companion of the dense formulas (comms.py,
memory.py) for a GPT with `num_experts` > 0 (models/gpt_cost/model.py calls these). The mesh axes come from the
strategy's tables (`Layout.of`: where the experts, the batch, each expert's mlp and the gathered parameters go),
never its name.
Measured against the compiled step: tests/test_moe.py (the all-to-alls), tests/test_plan_remat.py
(the all-to-alls under remat, and what each remat policy frees: measured -1% to +5%, asserted within 10%).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from models.gpt_cost import gpu
from models.gpt_cost.memory import activation_bytes
from models.gpt_cost.remat import alias_policy, moe_flops_per_token, saved_bytes
from models.gpt_cost.shapes import logit_tokens, shape
from models.gpt_cost.tpu import param_bytes, working_set_in_hbm
from shardkit.costmodel import Comm, CommBuilder
from shardkit.layers import remat_names
from shardkit.parallel.moe import capacity
from shardkit.traits import Traits


@dataclasses.dataclass(frozen=True)
class Layout:
    """An ep-family strategy's mesh axes, read from its tables: the experts' (ep: `expert`), the batch's, each
    expert's mlp split (ep_tp: tensor) and the parameters' ZeRO-3 axes (ep_fsdp: fsdp, the embed dimension's)."""

    experts: tuple[str, ...]
    batch: tuple[str, ...]
    mlp: tuple[str, ...]
    gathered: tuple[str, ...]

    @classmethod
    def of(cls, strategy: Any) -> Layout:
        t = Traits.of(strategy)
        experts = t.axes("experts")
        return cls(experts, t.batch, tuple(a for a in t.axes("mlp") if a not in experts), t.gathered)

    @staticmethod
    def size(mesh: dict[str, int], axes: tuple[str, ...]) -> int:
        return math.prod(mesh.get(a, 1) for a in axes)

    def order(self) -> tuple[str, ...]:
        """The axes innermost first, as `CommBuilder` takes them."""
        rest = tuple(a for a in self.batch if a not in self.experts + self.gathered)
        return tuple(dict.fromkeys(self.mlp + self.gathered + self.experts + rest))


def _expert_params(cfg: Any) -> int:
    """The experts' SwiGLU weights, all layers: L x 3 d f x E."""
    return cfg.num_layers * 3 * cfg.d_model * cfg.mlp_dim * cfg.num_experts


def comms(
    cfg: Any, strategy: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 4,
    remat: str = "none", backend: str = "gpu",
) -> list[Comm]:  # fmt: skip
    """The collectives of one MoE GPT step under an ep-family strategy (its `Layout`), per device:

    - the all-to-alls over the experts' axes: per MoE layer 2 forward + 2 backward, and under any remat policy but
      `none` the 2 forward ones again (no policy keeps their outputs, which are no matmul's), each of the
      [E, G_l, C, d_model] buffer (G_l = sequences per device, C = the capacity per sequence);
    - each expert's mlp split (ep_tp): per layer the all-reduce of the experts' output (Megatron's g) forward, its
      f backward, and g again when remat re-runs the forward (not under `dots`, which keeps the experts' outputs);
    - gathered parameters (ep_fsdp, ZeRO-3; every weight has an embed dimension): the local parameters
      all-gathered forward and the blocks' again backward, the gradients reduce-scattered;
    - the gradients: the replicated weights' all-reduced over the batch's other axes, the experts' over those
      that are not the experts' either.

    Not modelled: the scalars' and the router's small exchanges (about 1% of the bytes at the tested sizes). XLA
    may group some reductions differently (ep_fsdp: part of the replicated weights' over fsdp and expert at once);
    tests/test_moe.py compares each kind's bytes with the compiled step's."""
    lay = Layout.of(strategy)
    x, t, f = (lay.size(mesh, a) for a in (lay.experts, lay.mlp, lay.gathered))
    cap = capacity(seq_len, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.dropless)
    # TPU: the dispatched tokens only feed the experts' matmuls, so they travel as their bf16 operand
    # (tests/test_hlo_tpu.py: [experts, batch, capacity, d] in bf16 from an fp32 GPT)
    a2a = min(nbytes, 2) if backend == "tpu" else nbytes
    buffer = cfg.num_experts * (global_batch // lay.size(mesh, lay.batch)) * cap * cfg.d_model * a2a
    b = CommBuilder(mesh, lay.order(), backend)
    remat_note = f", the forward's again under remat {remat}" if remat != "none" else ""
    n = (4 if remat == "none" else 6) * cfg.num_layers
    b.add("all-to-all", ",".join(lay.experts), buffer * n, n, f"MoE dispatch / combine, fwd and bwd{remat_note}")
    n = (2 if remat.partition(":")[0] in ("none", "dots") else 3) * cfg.num_layers  # dots keeps the g's input
    g = buffer / a2a * nbytes  # the experts' output at `nbytes`
    b.add("all-reduce", ",".join(lay.mlp), g * n, n, f"the experts' output g fwd, f bwd{remat_note}")
    expert_params = _expert_params(cfg)
    head = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)  # embedding and head: not in the blocks
    replicated = (cfg.num_params() - expert_params) * nbytes / f  # per device, after the gathered axes' split
    experts = expert_params * nbytes / (x * t * f)  # this device's experts' slice
    if backend == "gpu":  # the experts', the table's and the norm scales' gradients at their own width (gpu.py)
        pb = param_bytes(cfg)
        tables = cfg.vocab_size * cfg.d_model + (2 * cfg.num_layers + 1) * cfg.d_model
        replicated += tables * (pb - nbytes) / f
        experts *= pb / nbytes
    gathered = ",".join(lay.gathered)
    if f > 1:
        local = replicated + experts  # this device's shard of every weight, gathered
        b.add("all-gather", gathered, local * f, 1, "parameters fwd")
        b.add("all-gather", gathered, (local - head * nbytes / f) * f, 1, "block parameters bwd")
        b.add("reduce-scatter", gathered, local * f, 1, "gradients", gspmd=True)
    over = [a for a in lay.batch if a not in lay.gathered]
    b.add("all-reduce", ",".join(over), replicated, 1, "gradients of the replicated weights")
    b.add("all-reduce", ",".join(a for a in over if a not in lay.experts), experts, 1, "the experts' gradients")
    return b.comms()


def divisibility(cfg: Any, strategy: Any, mesh: dict[str, int], global_batch: int) -> str:
    """Why a MoE GPT does not split over `mesh` under an ep-family strategy ("" if it does): the experts over their
    axes, the batch over its."""
    lay = Layout.of(strategy)
    if cfg.num_experts % lay.size(mesh, lay.experts) or global_batch % lay.size(mesh, lay.batch):
        return f"{cfg.num_experts} experts / batch {global_batch} do not split over {mesh}"
    return ""


def memory(
    cfg: Any, strategy: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    remat: str | None = None, backend: str = "cpu", fused_attention: bool = False, attention: str = "xla",
) -> dict[str, float]:  # fmt: skip
    """Bytes per device under an ep-family strategy: the experts' weights over their axes (and each expert's mlp
    split), the rest replicated or over the gathered axes (ZeRO's 16 bytes per parameter in mixed precision).
    Activations under the `remat` policy: models/gpt_cost/remat.py's rules for the dense block with the width of
    the experts' capacity slots per token (about k·f; over the mlp split under ep_tp), and per
    block the MoE's own tensors, the routing's dispatch and combine masks ([G_l, S, E, C], fp32) and the
    dispatched and combined tokens ([E, G_l, C, d]). Under `none` every block keeps them all; under `full` only
    the recomputed block holds them; under `dots` the tokens are kept (the dispatch einsums are batched matmuls)
    and the masks recomputed; under `dots_no_batch` and `names:` both are recomputed (nothing in them is tagged).
    `remat` None: the config's `remat` alias (models/gpt_remat.py REMAT_ALIASES), as `memory.memory`.
    `backend="tpu"`: the dense part of each block as the TPU program keeps it (`memory.activation_bytes`, bf16
    matmul operands), the working set where `tpu.working_set_in_hbm`, and the bf16 copy of the block
    weights, as `memory.memory`; the dispatched tokens at bf16 (the experts' operands) and the masks both in
    fp32 and as the einsums' bf16 operands
    (the forward loop's [L, ...] stacks for ep on data=2, expert=4: [G_l, S, E, C] f32 x 2 and bf16 x 2,
    [E, G_l, C, d] bf16 x 2; the experts' SwiGLU 5 x f32 + 1 x bf16 of [E_l, G, C, f]).
    `backend="gpu"` with XLA's attention and no remat (models/gpt_cost/gpu.py): the dense part of each block
    as the GPU program keeps it (`gpu.block_bytes` at the experts' width), the dispatched tokens at the compute
    dtype and the masks in fp32 and again at the compute dtype (fp32 compute: 4 fp32 stacks) (the forward loop's
    tuple for ep on data=2, expert=4, bf16: [L, G_l, S, E, C] f32 x 2 and bf16 x 2, [L, E_l, G, C, d] bf16 x 2,
    the experts' SwiGLU 6 x bf16 [L, E_l, G, C, f]), and the phases of `gpu.activations`."""
    remat = alias_policy(cfg) if remat is None else remat

    lay = Layout.of(strategy)
    x, t, f, devices = (lay.size(mesh, a) for a in (lay.experts, lay.mlp, lay.gathered, lay.batch))
    experts = _expert_params(cfg)
    psi = (cfg.num_params() - experts) / f + experts / (x * t * f)
    groups, tokens = global_batch / devices, global_batch / devices * seq_len
    cap = capacity(seq_len, cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.dropless)
    width = round(moe_flops_per_token(cfg, seq_len)["hidden"] / t)  # the experts' SwiGLU per token
    active = dataclasses.replace(cfg, num_experts=0, mlp_dim=width)
    dispatched = 2 * cfg.num_experts * groups * cap * cfg.d_model * nbytes  # [E, G_l, C, d] in and out
    masks = 2 * groups * seq_len * cfg.num_experts * cap * 4  # dispatch and combine, fp32
    tpu, lo = backend == "tpu", min(nbytes, 2)
    if tpu:  # the dispatched tokens as the experts' bf16 operands; the masks in fp32 and as the einsums' bf16 operands
        dispatched, masks = dispatched * lo / nbytes, masks * (4 + lo) / 4
    if backend == "gpu" and remat == "none" and attention == "xla":  # models/gpt_cost/gpu.py
        masks *= (4 + nbytes) / 4  # fp32 and again at the compute dtype (fp32 compute too: 4 fp32 stacks)
        block = gpu.block_bytes(shape(active), tokens, seq_len, 1, 1, nbytes) + dispatched + masks
        tables = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
        grads, acts = gpu.activations(shape(cfg), block, tokens, seq_len, 1, nbytes, psi - tables / f,
                                      param_bytes(cfg), gpu.logit_bytes(cfg, tokens, seq_len))  # fmt: skip
        mem = {"params": nbytes * psi, "grads": grads, "optimizer": (16 - 2 * nbytes) * psi, "activations": acts}
        return {**mem, "total": sum(mem.values())}
    fused = tpu and fused_attention  # splash's residuals, its working set on chip (memory.memory)
    dense = activation_bytes(active, tokens, seq_len, 1, 1, nbytes, "tpu" if tpu else "cpu",
                             attention="fused" if fused else "scores")  # fmt: skip
    block = dense + dispatched + masks
    base, names = remat.partition(":")[0], remat_names(remat)
    hidden = tokens * active.mlp_dim * nbytes  # one [tokens, k f] tensor of the active experts
    moe = {"dots": dispatched,  # per block, beyond the dense rules: the batched dispatch einsums' outputs kept,
           "dots_no_batch": -2 * hidden,  # the experts' gate and up recomputed (batched over E: not "no batch")
           "names": -hidden if "mlp_hidden" in names else 0.0}  # fmt: skip  # the MoE block tags no mlp_hidden
    acts = saved_bytes(active, remat, tokens, seq_len, 1, 1, nbytes, block)
    if tpu:  # the backward's working set on chip; the bf16 copy of the block weights (memory.memory)
        tables = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
        on_chip = fused or not working_set_in_hbm(cfg.num_heads, tokens, seq_len, 1, nbytes)
        acts += (psi - tables / f) * lo - (block if on_chip else 0.0)
    acts += cfg.num_layers * moe.get(base, 0.0) + logit_tokens(cfg, tokens, seq_len) * cfg.vocab_size * 4 * 2
    mem = {"params": nbytes * psi, "grads": nbytes * psi, "optimizer": (16 - 2 * nbytes) * psi, "activations": acts}
    return {**mem, "total": sum(mem.values())}


__all__ = ["Layout", "comms", "divisibility", "memory"]
