"""The GPT's GPU terms: what XLA's CUDA compiler's programs keep, where they differ from the CPU formulas.

models/gpt_cost/memory.py and moe.py dispatch here for `backend="gpu"` with XLA's dense attention (the block
`planned` gives the dense strategies on GPU) and no remat (`none`: the layer loop keeps every block's
residuals); pure functions of the GPT's shape numbers (`c`: `shapes.shape`'s dict). Read from the programs
for h100-8 (GPT 4 x 512, 8 heads, mlp 2048, seq 1024, batch 16, bf16 and fp32 compute; experiments/bench/
bench_targets.py, docs/targets.md §8) with `XLA_FLAGS=--xla_dump_to=DIR`: the buffer assignment (every temporary
is one value at an offset of the single `preallocated-temp` allocation) and the live-range file's instruction
sequence, which together give the values live at each instruction. Their union at the busiest instruction is
`memory_analysis()`'s `temp_size_in_bytes` to 0.2% (dp, fsdp, tp, fsdp_tp, tp3d; ep 1.8%: the rest is layout).

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
"""

from __future__ import annotations

from typing import Any

from models.gpt_cost.shapes import logit_tokens


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
    cfg: Any, c: dict[str, int], block: float, tokens: float, seq_len: int, hs: int, nbytes: int,
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


__all__ = ["activations", "block_bytes", "logit_bytes", "scores", "wide"]
