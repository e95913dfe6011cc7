"""The GPT's GPU terms: what XLA's CUDA compiler's programs keep, where they differ from the CPU formulas.

models/gpt_cost/memory.py and moe.py dispatch here for `backend="gpu"` with XLA's dense attention (the block
`planned` gives the dense strategies on GPU) and no remat (`none`: the layer loop keeps every block's
residuals); pure functions of the GPT's shape numbers (`c`: `shapes.shape`'s dict). Read from the programs
for h100-8 (GPT 4 x 512, 8 heads, mlp 2048, seq 1024, batch 16, bf16 and fp32 compute; experiments/bench/
bench_targets.py, docs/targets.md §8) with `XLA_FLAGS=--xla_dump_to=DIR`: the buffer assignment (every temporary
is one value at an offset of the single `preallocated-temp` allocation) and the live-range file's instruction
sequence, which together give the values live at each instruction. Their union at the busiest instruction is
`memory_analysis()`'s `temp_size_in_bytes` to 0.3% (dp, fsdp, tp, fsdp_tp, tp3d; ep 1.8%: the rest is layout).

Where the peak is: in the forward layer loop's body, at the layer's softmax (the `exp` of the scores) or just
after it, for every strategy measured. The backward loop's busiest instruction is 4% lower (dp 934 MiB against
975, tp 1123 against 1165): the residual stacks stay whole until the backward loop ends (XLA frees no slice of
them), the gradients' fp32 stacks are live there, the forward's two score buffers are not.
What is live there, by the program's own buffers (bf16 compute unless said):

- *the residual stacks* [L, ...] in the forward loop's tuple, per block and token (`block_bytes`): the two
  RMSNorms' fp32 input and normalised value (4e at the norm's width, fp32 or wider: models/gpt.py `rms_norm`
  upcasts), their outputs at the compute dtype (2e), q, k, v and the attention output (compute dtype), the
  SwiGLU's six [tokens, f] values (compute dtype), the scores at fp32 and the probabilities at the compute dtype
  per head and key, and the statistics: the norms' 4 fp32 and the softmax's max and sum (2 fp32 a head). No RoPE
  tables per block (one [tokens, hd/2] fp32 sin / cos pair, hoisted: not counted) and no mask per block;
- *the block weights at the compute dtype*, once, in the loop's tuple (the `astype(dt)` of every local block
  matrix, fsdp's shards too: [L, e/f, 2, mlp] bf16 under fsdp); none in fp32 compute (`astype` is a no-op);
- *the mask, hoisted* out of the layer loop: the causal mask (pred, 1 byte) and the `where`'s fill broadcast to
  the scores' shape (fp32), one [tokens, heads, s] each, shared by the layers (`scores` below counts a byte each);
- *the layer's forward working set*: the scores' dot output and its `exp`, both fp32 [tokens, heads, s];
  smaller buffers of the layer (the MLP's [tokens, 2f] gemm output, the attention's transposes: dp 15 MiB
  more, tp 12, fsdp 20) are not counted;
- *not counted*: under dp and ep one block-gradient stack ([L, e, 2, mlp] fp32, the zeros the backward
  accumulates into, 32 MiB) that the scheduler allocates before the forward loop; fsdp's gathered weights of
  one layer (7 MiB).

The backward phase is predicted too (`activations`): the stacks, the mask (pred only), the blocks' fp32
gradient stacks and the score gradient (fp32) with the layer's probabilities; where it is larger the peak is
there and the gradients count. At the bench shape the forward phase is the larger.

Collectives (comms.py, moe.py and `cp_comms` / `pp_comms` here; read per op from `compiled.as_text()`, bf16
compute): the matrices' gradients travel at the compute dtype (the all-reduce before the convert back to fp32:
`bf16[1048576]` over data under dp), but four things stay at the parameters' width (fp32): the embedding
table's gradient (a scatter-add into the fp32 table) and the norm scales' (one `f32[528897]` all-reduce under
dp), the experts' gradients (ep: `f32[3145728]` a layer over data), and the vocab-parallel embedding lookup's
all-reduce (tp over tensor: `f32[8,1024,512]`; tp3d over row). fsdp / fsdp_tp are ZeRO-3 as on TPU
(`tpu.zero3_comms` with `lo` = the compute dtype, `wide` = fp32: the matrices gathered at the compute dtype,
the table and norm scales at fp32, their gradients all-reduced over (data, fsdp) at once), with no collective
matmul (the GPU program gathers; it does not permute).
"""

from __future__ import annotations

from typing import Any

from models.gpt_cost.shapes import logit_tokens
from shardkit.costmodel import Comm, CommBuilder


def wide(nbytes: int) -> int:
    """The width of what the GPT computes in fp32 or wider whatever its compute dtype (norms, scores, logits)."""
    return max(nbytes, 4)


def block_bytes(c: dict[str, int], tokens: float, seq_len: int, es: int, hs: int, nbytes: int) -> float:
    """One block's residual stacks as the GPU program's forward layer loop carries them (module docstring), per
    device for `tokens` tokens, `es` / `hs` the embed and head / mlp splits, `nbytes` the compute dtype's width.
    Read from the loop's tuple (dp, bf16: 172 MiB a block at 2048 tokens, to the byte: 64 fp32 scores, 32 bf16
    probabilities, 6 x 8 SwiGLU, 4 x 4 fp32 + 2 x 2 bf16 norms, 4 x 2 q, k, v, output)."""
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    w = wide(nbytes)
    norms = (4 * e * w + 2 * e * nbytes) / es + 4 * 4  # + each norm's two fp32 statistics
    attn = ((n + 2 * k) * hd + n * hd) * nbytes / hs + n / hs * (seq_len * (w + nbytes) + 2 * 4)  # + max, sum
    return tokens * (norms + attn + 6 * f / hs * nbytes)


def scores(c: dict[str, int], tokens: float, seq_len: int, hs: int) -> float:
    """Elements of one layer's [tokens, heads, s] scores on a device (the unit of the mask and working sets)."""
    return tokens * c["num_heads"] / hs * seq_len


def activations(
    c: dict[str, int], block: float, tokens: float, seq_len: int, hs: int, nbytes: int,
    local_blocks: float, param_bytes: int, logits: float,
) -> tuple[float, float]:  # fmt: skip
    """(gradients, activations) live at the GPU program's peak under no remat (module docstring): every block's
    residuals (`block` bytes each), the block weights at the compute dtype (`local_blocks` elements) and the
    largest of three phases: the forward layer's (the hoisted mask and fill, the scores' dot and exp), the
    backward's (the mask, the score gradient and the layer's probabilities, the blocks' gradient stacks at
    `param_bytes`) and the head's (`logits` bytes: fp32 logits and softmax). The gradients count only where the
    backward phase is the largest."""
    w, s = wide(nbytes), scores(c, tokens, seq_len, hs)
    kept = c["num_layers"] * block + (local_blocks * nbytes if nbytes < param_bytes else 0.0)
    forward = s * (1 + w) + 2 * s * w
    grads = local_blocks * param_bytes
    backward = s * (1 + w + nbytes) + grads
    if backward > max(forward, logits):
        return grads, kept + backward - grads
    return 0.0, kept + max(forward, logits)


def logit_bytes(cfg: Any, tokens: float, seq_len: int, vocab_split: int = 1) -> float:
    """The head's fp32 logits and their softmax for a device's tokens (a chunk of them under a chunked loss)."""
    return logit_tokens(cfg, tokens, seq_len, "gpu", vocab_split) * int(cfg.vocab_size) / vocab_split * 4 * 2


def cp_comms(
    c: dict[str, int], mesh: dict[str, int], global_batch: int, seq_len: int, nbytes: int, grads: float
) -> list[Comm]:
    """Context parallelism on GPU (the ring over `seq` with the Pallas GPU block, the batch over `data`), as the
    program sends it (cp_zigzag on data=2, seq=4, 28 tuple permutes a step, 208 MiB in bf16, 320 in fp32, to the
    byte): per layer, forward, N - 1 hops of the device's K and V blocks at the compute dtype; backward, N - 1
    hops of K and V with the dK and dV accumulators (fp32) riding along, then one hop home of dK and dV at the
    compute dtype; `grads` bytes of gradients all-reduced over (data, seq) at once (as dp's over data)."""
    d, n, L = mesh.get("data", 1), mesh.get("seq", 1), c["num_layers"]
    b = CommBuilder(mesh, ("seq", "data"), "gpu")
    kv = 2 * global_batch / d * c["num_kv_heads"] * seq_len / n * c["head_dim"]  # one device's K and V blocks
    hops = L * (n - 1)
    b.add("collective-permute", "seq", hops * kv * nbytes, hops, "K, V around the ring fwd")
    b.add("collective-permute", "seq", hops * kv * (nbytes + wide(nbytes)), hops, "K, V and fp32 dK, dV bwd")
    b.add("collective-permute", "seq", L * kv * nbytes, L, "dK, dV home")
    b.add("all-reduce", "data,seq", grads, 1, "gradients over (data, seq)")
    return b.comms()


def cp_activations(
    c: dict[str, int], tokens: float, nbytes: int, local_blocks: float, param_bytes: int, logits: float
) -> tuple[float, float]:  # fmt: skip
    """(gradients, activations) at the cp program's peak (the ring with the Pallas GPU block, no remat; cp_zigzag
    on data=2, seq=4, bf16, 2048 tokens a device: 468 MiB), in the backward layer loop's ring: the residual
    stacks as `block_bytes` without the [s, s] terms (the kernel keeps q, k, v, its output and the log-sum-exp,
    4 bytes a head; 304 MiB), the bf16 weight copy (32), the blocks' fp32 gradient stacks (64), and the ring
    step's buffers: the hop in flight (K, V and fp32 dK, dV: 12), the step's dQ, dK, dV (fp32) and dQ's
    accumulator (16), the MLP's [tokens, 2f] gradient (16) and the RMSNorm backward's two fp32 [tokens, e] (8).
    The forward's peak is lower there (437 MiB): no [s, s] scores; the head's (`logits`) where larger."""
    e, n, k, hd, f, L = (c[x] for x in ("d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_layers"))
    w = wide(nbytes)
    block = tokens * (4 * e * w + 2 * e * nbytes + 16 + ((n + 2 * k) * hd + n * hd) * nbytes + n * 4 + 6 * f * nbytes)
    kept = L * block + (local_blocks * nbytes if nbytes < param_bytes else 0.0)
    ring = tokens * k * hd * 2 * (nbytes + w) + tokens * (n + 2 * k) * hd * w + tokens * n * hd * w
    grads = local_blocks * param_bytes
    backward = grads + ring + tokens * (2 * f * nbytes + 2 * e * w)
    return (grads, kept + backward - grads) if backward > logits else (0.0, kept + logits)


def pp_comms(mesh: dict[str, int], m: int, global_batch: int, seq_len: int, e: int, nbytes: int) -> list[Comm]:
    """GPipe over `stage` on GPU (pp on h100-4, stage=4, m = 4, bf16: 14 permutes, 56 MiB; 3 all-reduces, 72 MiB):
    a microbatch's [B/m, S, e] one hop a tick forward and backward (2 (m + p - 1) at the compute dtype, as on TPU),
    the last stage's output to every stage in fp32 (the final RMSNorm's upcast moves before the all-reduce) and
    its gradient back at the compute dtype (+ the loss's scalar)."""
    b, p = CommBuilder(mesh, ("stage",), "gpu"), mesh.get("stage", 1)
    act = global_batch * seq_len * e  # the whole batch's [B, S, e] (the batch is not split)
    n = 2 * (m + p - 1)
    b.add("collective-permute", "stage", n * act / m * nbytes, n, "a microbatch's activations one hop a tick")
    b.add("all-reduce", "stage", act * (wide(nbytes) + nbytes), 2, "the last stage's output (fp32), its gradient")
    return b.comms()


def pp_activations(
    c: dict[str, int], blk: int, p: int, m: int, global_batch: int, seq_len: int, nbytes: int, param_bytes: int
) -> tuple[float, float]:  # fmt: skip
    """(gradients, activations) at the GPipe program's peak on GPU (pp on h100-4, 4 layers, one a stage, m = 4,
    bf16: 2943.5 MiB, in the forward tick loop's body): the tick loop's stacks [m + p - 1, L/p, ...] of every
    tick's residuals (`block_bytes` at B/m x S tokens, bubble ticks too), of the stage's block weights at the
    compute dtype and of RoPE's sin / cos (2 x hd/2 fp32 a token), all per tick; the pipeline's input [B, S, e];
    and the largest phase of `activations` at one microbatch's scores (forward: 13 bytes a score, 416 MiB)."""
    e, L, hd = c["d_model"], c["num_layers"], c["head_dim"]
    tokens, ticks, k = global_batch / m * seq_len, m + p - 1, L / p
    block = block_bytes(c, tokens, seq_len, 1, 1, nbytes)
    weights = blk * nbytes if nbytes < param_bytes else 0.0
    stacks = ticks * k * (block + weights + tokens * hd * 4) + global_batch * seq_len * e * nbytes
    logits = global_batch * seq_len * c["vocab_size"] * 4 * 2  # every stage runs the head and loss, whole batch
    w, s = wide(nbytes), scores(c, tokens, seq_len, 1)
    grads = k * blk * param_bytes
    phases = {"forward": s * (1 + 3 * w), "backward": s * (1 + w + nbytes) + grads, "head": logits}
    top = max(phases, key=phases.get)
    return (grads, stacks + phases[top] - grads) if top == "backward" else (0.0, stacks + phases[top])


__all__ = [
    "activations",
    "block_bytes",
    "cp_activations",
    "cp_comms",
    "logit_bytes",
    "pp_activations",
    "pp_comms",
    "scores",
    "wide",
]
