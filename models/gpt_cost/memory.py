"""The GPT's memory per device in one train step: model state by the ZeRO formulas, activations per block.

Model state: 16 bytes per parameter in mixed precision with Adam (2 params + 2 grads + 12 fp32 master / m / v),
divided by the degree each formula family shards it over (Rajbhandari et al. 1910.02054; `STATE_DEGREE`,
models/gpt_cost/classify.py). Activations: per block adapted from Korthikanti et al. 2205.05198 Table 2 to our
block (`activation_bytes`), kept per remat policy as models/gpt_cost/remat.py says, + the fp32 logits; on TPU as
the TPU program's layer loops carry them (models/gpt_cost/tpu.py).
"""

from __future__ import annotations

from typing import Any

from models.gpt_cost import gpu
from models.gpt_cost.classify import MODELLED, STATE_DEGREE
from models.gpt_cost.remat import alias_policy, saved_bytes
from models.gpt_cost.shapes import blocks_per_layer, logit_tokens, num_params, shape
from models.gpt_cost.tpu import (
    block_bytes,
    low_precision,
    param_bytes,
    pp_activations,
    remat_extra,
    working_set_in_hbm,
)
from shardkit.costmodel import TP3D_ORDER
from shardkit.errors import ShardkitError


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

    `backend="tpu"`: `block_bytes` (bf16 matmul operands, no exp kept); `attention` there: "scores"
    (XLA's dense attention), "ring" (the ring kernel's residuals, no [s, s] term) or "fused" (splash's residuals).
    """
    c = shape(cfg)
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    if backend == "tpu":  # as the TPU program's layer loop carries them (models/gpt_cost/tpu.py)
        return block_bytes(c, tokens, seq_len, embed_split, head_split, nbytes, attention)
    values = 5 * e / embed_split + ((n + 2 * k) * hd + n * hd + 6 * f) / head_split
    scores = (4 + 4 + nbytes + 1) * n * seq_len / head_split
    return tokens * (values * nbytes + scores + 2 * hd * 4)


def state_bytes(psi: float, nbytes: int, acts: float, optimizer_split: int = 1) -> dict[str, float]:
    """Memory per device of `psi` parameters (their gradients and Adam state, the latter over `optimizer_split`:
    ZeRO-1) and `acts` bytes of activations, with the total."""
    mem = {"params": nbytes * psi, "grads": nbytes * psi, "optimizer": (16 - 2 * nbytes) * psi / optimizer_split,
           "activations": acts}  # fmt: skip
    return {**mem, "total": sum(mem.values())}


def memory(
    strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int = 2,
    remat: str | None = None, backend: str = "cpu", fused_attention: bool = False, attention: str = "xla",
) -> dict[str, float]:  # fmt: skip
    """Bytes per device: params, grads, optimizer (ZeRO formulas), activations (all layers + fp32 logits).

    `remat`: the remat policy the activations are saved under (models/gpt_cost/remat.py); None = the config's
    `remat` alias (models/gpt_remat.py REMAT_ALIASES).

    `backend="tpu"`: the blocks' activations as the TPU program keeps them (`activation_bytes`), without the
    backward's working set: on a v5e it lives in on-chip VMEM, which `temp_size_in_bytes` does not count (fsdp,
    GPT 4 x 512: the temporaries exceed the backward loop's carried tuple by 19 MiB, less than one block's score
    gradient, 64 MiB). Where the block weights are not gathered per layer (every strategy but the fsdp family),
    + their bf16 copy, `lo` x the device's block matrices, made once before the layer loops (the [L, ...] bf16
    stacks in the loops' tuples: dp 32 MiB, tp3d 7.5 MiB, cp 32 MiB). Strategy "cp" (TPU only): the ring kernel's
    blocks (`activation_bytes(attention="ring")`) over data x seq, the parameters replicated.
    With a 16-bit compute dtype (the 7B / 70B programs, docs/targets.md §6) fsdp's shards get the same bf16 copy,
    and under a remat policy the backward's working set and a second fp32 block-gradient stack are added
    (tpu.py `remat_extra`).
    Not itemised (the misses, experiments/bench/results/bench_targets.json): the backward's working set where the
    TPU program keeps it in HBM (tp3d: one block's worth; dp: about 100 MiB), the ring kernel's mask tiles and
    its backward's buffers (cp).
    `fused_attention` (TPU: the attention block kernel is splash or flash, shardkit/attention/blocks.py): the block
    keeps the kernel's residuals (`attention="fused"`) and the backward's working set is the kernel's,
    on chip.
    `backend="gpu"` with XLA's attention (`attention`, the block kernel `planned` names) and no remat: the
    residuals, weights and phases as XLA's CUDA compiler's program keeps them (models/gpt_cost/gpu.py; the
    gradients count only where the backward phase is the peak); other GPU cases keep the formulas above.
    """
    c = shape(cfg)
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    gx, gy, gz, gd = (mesh.get(a, 1) for a in TP3D_ORDER)
    tpu = backend == "tpu"
    if strategy == "cp" and tpu:
        psi, tokens = num_params(cfg), global_batch / d * seq_len / mesh.get("seq", 1)
        block = activation_bytes(cfg, tokens, seq_len, 1, 1, nbytes, backend, attention="ring")
        remat = remat or alias_policy(cfg)
        acts = saved_bytes(cfg, remat, tokens, seq_len, 1, 1, nbytes, block) - block
        acts += logit_tokens(cfg, tokens, seq_len, backend) * c["vocab_size"] * 4 * 2
        acts += c["num_layers"] * blocks_per_layer(cfg) * min(nbytes, 2)
        return state_bytes(psi, nbytes, acts)
    if strategy == "cp" and backend == "gpu":  # the ring with the Pallas GPU block (gpu.py)
        psi, tokens = num_params(cfg), global_batch / mesh.get("data", 1) * seq_len / mesh.get("seq", 1)
        logits = gpu.logit_bytes(cfg, tokens, seq_len)
        grads, acts = gpu.cp_activations(c, tokens, nbytes, c["num_layers"] * blocks_per_layer(cfg), param_bytes(cfg),
                                         logits)  # fmt: skip
        return {**state_bytes(psi, nbytes, acts), "grads": grads}
    if strategy.startswith("pp:") and backend == "gpu":
        p, blk = mesh.get("stage", 1), blocks_per_layer(cfg)
        grads, acts = gpu.pp_activations(c, blk, p, int(strategy[3:]), global_batch, seq_len, nbytes, param_bytes(cfg))
        stack = c["num_layers"] * (blk + 2 * c["d_model"])
        return {**state_bytes(stack / p + num_params(cfg) - stack, nbytes, acts), "grads": grads}
    if strategy.startswith("pp:") and tpu:  # the stage's blocks, the embedding, head and final norm
        p, blk = mesh.get("stage", 1), blocks_per_layer(cfg)
        acts = pp_activations(c, blk, p, int(strategy[3:]), global_batch, seq_len, nbytes)
        stack = c["num_layers"] * (blk + 2 * c["d_model"])
        return state_bytes(stack / p + num_params(cfg) - stack, nbytes, acts)
    if strategy not in STATE_DEGREE:
        raise ShardkitError(f"the cost model has no formula for strategy {strategy!r}; it covers {', '.join(MODELLED)}")
    state_deg = STATE_DEGREE[strategy](d, f, t, gx * gy * gz)
    batch_deg = {"tp3d": gd * gz}.get(strategy, d * f)
    embed_split, head_split = {"tp_sp": (t, t), "tp3d": (gx, gy)}.get(strategy, (1, t))
    psi = num_params(cfg) / state_deg
    tokens = global_batch / batch_deg * seq_len
    remat = remat or alias_policy(cfg)
    if backend == "gpu" and remat == "none" and attention == "xla":  # models/gpt_cost/gpu.py
        block = gpu.block_bytes(c, tokens, seq_len, embed_split, head_split, nbytes)
        local_blocks = c["num_layers"] * blocks_per_layer(cfg) / state_deg
        logits = gpu.logit_bytes(cfg, tokens, seq_len, head_split)
        grads, acts = gpu.activations(c, block, tokens, seq_len, head_split, nbytes, local_blocks,
                                      param_bytes(cfg), logits)  # fmt: skip
        mem = {**state_bytes(psi, nbytes, acts, d if strategy == "zero1" else 1), "grads": grads}
        return {**mem, "total": sum(v for k, v in mem.items() if k != "total")}
    fused = tpu and fused_attention
    block = activation_bytes(cfg, tokens, seq_len, embed_split, head_split, nbytes, "tpu" if tpu else "cpu",
                             attention="fused" if fused else "scores")  # fmt: skip
    acts = saved_bytes(cfg, remat, tokens, seq_len, embed_split, head_split, nbytes, block)
    if tpu:  # the backward's working set on chip (unless too large); the bf16 copy of the unsplit block weights
        in_hbm = not fused and working_set_in_hbm(c["num_heads"], tokens, seq_len, head_split, nbytes)
        acts -= 0.0 if in_hbm else block
        gathered = strategy in ("fsdp", "fsdp_tp", "dp_fsdp_tp")
        local_blocks = c["num_layers"] * blocks_per_layer(cfg) / state_deg  # the device's block-matrix elements
        copy = not gathered or low_precision(cfg)  # bf16 compute: fsdp's shards converted once, before the loops
        acts += local_blocks * min(nbytes, 2) if copy else 0.0
        acts += remat_extra(remat, block, local_blocks, cfg)  # a remat policy's backward, bf16 compute (tpu.py)
    acts += (
        logit_tokens(cfg, tokens, seq_len, backend, head_split) * c["vocab_size"] / head_split * 4 * 2
    )  # fp32 logits and softmax
    return state_bytes(psi, nbytes, acts, d if strategy == "zero1" else 1)  # ZeRO-1: optimizer state over data


__all__ = ["activation_bytes", "memory", "state_bytes"]
