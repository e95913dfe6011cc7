"""The GPT's TPU terms: what XLA's TPU compiler's programs send and keep, where they differ from XLA:CPU's.

models/gpt_cost/comms.py and memory.py dispatch here for `backend="tpu"`; these are pure functions of the GPT's
shape numbers (`c`: `shapes.shape`'s dict) and of the mesh. Read from the TPU compiler's programs for a v5e-8
(fp32 GPT 4 x 512, seq 1024, batch 16; experiments/bench/bench_targets.py, tests/test_costmodel_tpu.py,
docs/targets.md §5).
XLA:TPU runs an fp32 matmul at default precision on bf16 operands, and converts a value that only feeds matmuls
to bf16 where it is produced (`lo = min(nbytes, 2)` below); so:
- fsdp's all-gathers of the weight matrices move bf16; the embedding table (read by a gather) and the RMSNorm
  scales stay at `nbytes` (tests/test_hlo_tpu.py reads the gathered shards' sizes);
- gradients that are not matmuls' (the embedding's scatter-add, the norm scales' reduce_sum) are all-reduced over
  (data, fsdp) at once, not reduce-scattered (without a data axis: the embedding's reduce-scattered over fsdp,
  the scales all-reduced); the matrices' gradients are reduce-scattered in fp32 and all-reduced over data (wo's
  and w_down's rows marked `last_dim`: a torus slice keeps some as all-reduces, shardkit/costmodel/torus.py);
- the backward re-gathers the blocks' norm scales too (fwd and bwd, like their matrices); the final norm's once;
- fsdp_tp (tensor > 1): XLA's collective matmul (windowed einsum, unrolled in the layer loop: its permutes'
  op_name is the dot_general they feed) replaces the forward gathers of the block matrices by f - 1 bf16 block
  transfers around the fsdp ring (the all-gather's own volume) and the reduce-scatters of the block and head
  matrices' gradients by f + 1 fp32 block transfers ((f + 1)/(f - 1) times the reduce-scatter's volume): counted
  as collective-permutes over fsdp, as the HLO has them. The backward's re-gathers stay all-gathers;
- context parallelism (cp_*: the ring kernel, tokens over seq): K and V blocks travel the ring in bf16 forward and
  again backward (4 (N - 1) transfers a layer), dK and dV in fp32 (2 N: they come home); every gradient is
  all-reduced over (data, seq) at once (shardkit/parallel/context/ring.py; tests/test_hlo_tpu.py);
- pipeline (pp: GPipe over stage, the batch not split): a microbatch's [B/m, S, e] one hop a tick, forward and
  backward (2 (m + p - 1) permutes, at `nbytes`: they feed RMSNorm), and two all-reduces over stage of the whole
  [B, S, e]: the last stage's output to every stage (each runs the head and loss) and its gradient back.
Memory: the residuals as the layer loops carry them (`block_bytes`), the bf16 copy of block weights that are not
gathered per layer, the backward's working set only where `working_set_in_hbm` (memory.py `memory`, `pp_activations`).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from models.gpt_cost.shapes import shape
from shardkit.costmodel import Comm, CommBuilder
from shardkit.layers import remat_names

#: TPU v5e's on-chip vector memory per core (128 MiB), the bound of `working_set_in_hbm`
VMEM_BYTES = 128 * 2**20


def zero3_comms(
    b: CommBuilder, c: dict[str, int], blk: int, t: int, f: int, nbytes: int, windowed: bool, local_rows: float = 0.0,
    ids: float = 0.0, lo: int | None = None, wide: int | None = None,
) -> None:  # fmt: skip
    """ZeRO-3 over fsdp as XLA:TPU compiles it (module docstring): matrices gathered in bf16, the embedding and norm
    scales at `nbytes`; non-matmul gradients all-reduced over (data, fsdp); with `windowed` (fsdp_tp) the block
    matrices' forward gathers and the matrices' reduce-scatters done by the collective matmul's permutes.
    `blk`: one block's matrix elements (shapes.blocks_per_layer), `t` the tensor degree, `f` fsdp's.
    `local_rows` > 0: the `local` embedding lookup (shardkit/embedding.py) instead of the table's gather: one
    all-to-all of a device's [batch, seq, embed] rows (`local_rows` bytes) forward and one backward, the token ids
    (`ids` bytes, the fsdp group's) all-gathered, and the table's gradient kept in each device's own columns
    (all-reduced over data only, where the data replicas of a column slice are summed).
    `lo` / `wide` (GPU, models/gpt_cost/gpu.py): the matrices' width as gathered (default: TPU's bf16 operand)
    and the embedding table's and norm scales' with their gradients (default `nbytes`)."""
    e, L, v = c["d_model"], c["num_layers"], c["vocab_size"]
    lo = min(nbytes, 2) if lo is None else lo  # a default-precision matmul's operand on TPU
    wide = nbytes if wide is None else wide
    blocks, head, emb, norms = L * blk / t, v * e / t, v * e / t, (2 * L + 1) * e
    table = 0.0 if local_rows else emb * wide
    b.add("all-gather", "fsdp", table + norms * wide + head * lo, 3 - bool(local_rows),
          "embedding, norm scales, head (bf16) fwd")  # fmt: skip
    if local_rows:
        b.add("all-to-all", "fsdp", 2 * local_rows, 2, "embedding rows to their tokens fwd, their gradients back bwd")
        b.add("all-gather", "fsdp", ids, 1, "the fsdp group's token ids (int32) for the local lookup")
    b.add("all-gather", "fsdp", blocks * lo + 2 * L * e * wide, 1, "block matrices (bf16) and norm scales again bwd")
    if windowed:
        b.add("collective-permute", "fsdp", blocks * lo * (f - 1) / f, L * 4 * (f - 1),
              "block matrices fwd: collective matmul's ring, f - 1 bf16 shards (TPU)")  # fmt: skip
        b.add("collective-permute", "fsdp", (blocks + head) * nbytes * (f + 1) / f, (4 * L + 1) * (f + 1),
              "matrix gradients: collective matmul's reduce-scatter ring, f + 1 fp32 shards (TPU)")  # fmt: skip
    else:
        b.add("all-gather", "fsdp", blocks * lo, 1, "block matrices (bf16) fwd")
        last = L * (c["num_heads"] * c["head_dim"] + c["mlp_dim"]) * e / t  # wo, w_down: embed is their last dim
        b.add("reduce-scatter", "fsdp", (blocks - last + head) * nbytes, 1, "matrix gradients (embed their first dim)")
        b.add("reduce-scatter", "fsdp", last * nbytes, 1, "wo, w_down gradients (embed their last dim)",
              last_dim=True)  # fmt: skip
    if local_rows:  # the table's gradient stays in each device's columns: summed over the data replicas only
        b.add("all-reduce", "data", emb / f * wide, 1, "embedding gradient's own columns over data")
        b.add("all-reduce", "data,fsdp", norms * wide, 1, "norm-scale gradients")
    elif b.mesh.get("data", 1) > 1:
        b.add("all-reduce", "data,fsdp", (emb + norms) * wide, 1, "embedding and norm-scale gradients (TPU)")
    else:
        b.add("reduce-scatter", "fsdp", emb * wide, 1, "embedding gradient")
        b.add("all-reduce", "fsdp", norms * wide, 1, "norm-scale gradients")


def cp_comms(
    c: dict[str, int],
    psi: int,
    mesh: dict[str, int],
    global_batch: int,
    seq_len: int,
    nbytes: int,
    backend: str,
    kv_bytes: int = 2,
) -> list[Comm]:
    """Context parallelism (the ring kernel over `seq`, the batch over `data`): per layer the K and V blocks around
    the ring, forward and again backward (4 (N - 1) transfers at `kv_bytes`: bf16 for the XLA scan, whose dots the
    TPU compiler feeds bf16, the inputs' own for a fused kernel), dK and dV home (2 N at `nbytes`); all `psi`
    parameters' gradients all-reduced over (data, seq) at once."""
    d, n = mesh.get("data", 1), mesh.get("seq", 1)
    b = CommBuilder(mesh, ("seq", "data"), backend)
    block = global_batch / d * c["num_kv_heads"] * seq_len / n * c["head_dim"]  # one device's K (or V) block
    L = c["num_layers"]
    b.add("collective-permute", "seq", L * 4 * (n - 1) * block * kv_bytes, L * 4 * (n - 1), "K, V around the ring")
    b.add("collective-permute", "seq", L * 2 * n * block * nbytes, L * 2 * n, "dK, dV home")
    b.add("all-reduce", "data,seq", psi * nbytes, 1, "gradients over (data, seq)")
    return b.comms()


def pp_comms(
    mesh: dict[str, int], m: int, global_batch: int, seq_len: int, e: int, nbytes: int, backend: str
) -> list[Comm]:
    """GPipe over `stage` with `m` microbatches: a microbatch's activations one hop a tick, forward and backward, and
    the last stage's output to every stage (and its gradient back) as two all-reduces of the whole [B, S, e]."""
    b, p = CommBuilder(mesh, ("stage",), backend), mesh.get("stage", 1)
    act = global_batch * seq_len * e * nbytes  # the whole batch's [B, S, e] (the batch is not split)
    n = 2 * (m + p - 1)
    b.add("collective-permute", "stage", n * act / m, n, "a microbatch's activations one hop a tick, fwd + bwd")
    b.add("all-reduce", "stage", 2 * act, 2, "the last stage's output to every stage fwd, its gradient bwd")
    return b.comms()


def block_bytes(
    c: dict[str, int],
    tokens: float,
    seq_len: int,
    es: int,
    hs: int,
    nbytes: int,
    attention: str = "scores",
) -> float:
    """One block's residuals as the TPU program's layer scan carries them from the forward to the backward (the
    residual stacks [L, ...] in the forward loop's tuple, read in `compiled.as_text()`; GPT 4 x 512 fp32, seq 1024 on
    a v5e-8 under dp, fsdp, tp: per block 212 MiB at 2048 tokens a device, to the byte), `es` / `hs` the embed and
    head splits. A value that only feeds matmuls is kept as their bf16 operand (`lo`): per token 4e at `nbytes` +
    2e at `lo` (the two RMSNorm outputs, the projections' inputs), q, k, v and the attention output at `lo`, 5f at
    `nbytes` + f at `lo` (the SwiGLU product, the down projection's input), per head and key the scores at `nbytes`
    and the probabilities at `lo` (6 bytes, not 13: the exp is not kept, the causal mask is one [s, s] buffer on
    chip), no RoPE tables (on chip): `attention="scores"` (XLA's dense attention). `"ring"` (the ring kernel, cp_*;
    its forward loop's tuple, same GPT on data=2, seq=4): no [s, s] term, q and the attention output at `nbytes` (the
    kernel's own residuals; k and v at `lo`), the log-sum-exp (4 bytes per head) on chip. `"fused"` (dense attention
    by splash, blocks.py; fsdp, GPT 2 x 256 fp32, seq 1024, read from the layer loop's tuple to the byte): splash's
    residuals, q, k, v and its output at `nbytes` in the kernel's layout, the output again at `lo` (the output
    projection's operand), the lse (4 bytes a head) on chip."""
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    lo = min(nbytes, 2)
    kept = (4 * e / es + 5 * f / hs) * nbytes + (2 * e / es + f / hs) * lo
    if attention == "fused":  # splash's residuals: q, k, v, o at nbytes; o at lo for the output projection
        attn = (2 * (n + k) * hd * nbytes + n * hd * lo) / hs
    elif attention == "scores":  # q, k, v, attention output as bf16 operands; scores fp32 + probabilities bf16
        attn = ((n + 2 * k) * hd + n * hd) / hs * lo + (nbytes + lo) * n * seq_len / hs
    else:  # the ring kernel: q and its output at nbytes, k and v at lo
        attn = (2 * n * hd * nbytes + 2 * k * hd * lo) / hs
    return tokens * (kept + attn)


#: the backward loop's working set of one layer under a remat policy, in blocks (`block_bytes`): measured 2.41-2.46
#: (gpt_7b, dots_no_batch, fsdp over v5p-128: three programs) and 2.24 (gpt_70b, full, tp3d over v5p-256)
RECOMPUTE_BLOCKS = 2.35


def low_precision(cfg: Any) -> bool:
    """Whether the GPT computes in a 16-bit dtype (`GPTConfig.dtype` bfloat16 / float16: mixed precision)."""
    return jnp.dtype(getattr(cfg, "dtype", "float32")).itemsize == 2


def remat_extra(policy: str, block: float, local_blocks: float, cfg: Any) -> float:
    """What the TPU program keeps beyond the residual stacks under a remat policy (not "none") with 16-bit compute,
    read from the 7B / 70B programs for v5p (docs/targets.md §6; compiled.as_text(), the layer loops' tuples and
    bodies; memory_analysis()'s temporaries):

    - the backward loop's working set, `RECOMPUTE_BLOCKS` x one block's activations (`block`): the layer's recomputed
      forward, its gradients and the next layer's residual slices are live at once; the body's buffers add up to
      8.8 GiB (7B) and 10.5 GiB (70B), and the temporaries exceed the loop's tuple plus the term below by 8.2 and
      10.1 GiB (one block: 3.39 and 4.53 GiB). The v5e bench shape's single block fits on chip; these do not.
    - the fp32 block gradients twice (`local_blocks` elements at the parameters' width): the backward loop carries
      the [L, ...] gradient stacks (counted as the state's gradients) and its dynamic-update-slice fusion writes a
      whole second stack; measured: the temporaries fall by 2.85 GiB from fsdp=4 to fsdp=8 (the gradients' stack
      shrinks by 3.02 GiB) and by 3.0 GiB from 32 layers to 16 (3.02 GiB), the rest unchanged to 0.2 GiB."""
    if policy == "none" or not low_precision(cfg):
        return 0.0
    return RECOMPUTE_BLOCKS * block + local_blocks * param_bytes(cfg)


def param_bytes(cfg: Any) -> int:
    """Bytes of one parameter value (`GPTConfig.param_dtype`; fp32 by default, whatever the compute dtype)."""
    return jnp.dtype(getattr(cfg, "param_dtype", "float32")).itemsize


def tp3d_recompute_comms(b: CommBuilder, cfg: Any, tokens: int, nbytes: int, policy: str) -> None:
    """tp3d's collectives that a remat policy's recomputed forward issues again, as XLA's TPU compiler emits them
    (gpt_70b, full remat, tp3d data=4,depth=16,row=2 on a v5p-256: all-reduces over row 100.75 GiB against 80.5
    without these, all-gathers over depth 126.1 against 120.0, 80 more of each):
    - the forward's partial-sum all-reduce of each recomputed projection (y = AR_in(x w): q/k/v over col, the output
      projection over row, the MLP's gate and up over col), not the MLP's down projection, the block's last matmul,
      whose output the backward does not read; a `names:` policy that keeps qkv_proj / out_proj spares those;
    - the q/k/v matrix gathered over depth a third time: the backward gathers it again rather than keep the
      recomputed forward's (the other matrices' gathers are shared by the recompute and the backward).
    Policies that keep every matmul's output (dots, dots_no_batch) recompute no projection: nothing added."""
    base = policy.partition(":")[0]
    if base not in ("full", "names", "offload"):
        return
    kept = set(remat_names(policy))
    gx, gy, gz, gd = (b.mesh.get(a, 1) for a in ("col", "row", "depth", "data"))
    rows = tokens / (gd * gz)
    c = shape(cfg)
    e, n, k, hd, f, L = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"], c["num_layers"]
    recomputed = [("qkv", "col", (n + 2 * k) * hd / gy, "qkv_proj"), ("out", "row", e / gx, "out_proj"),
                  ("mlp_in", "col", 2 * f / gy, None)]  # fmt: skip
    for what, axis, width, tag in recomputed:
        if tag not in kept:
            b.add("all-reduce", axis, L * rows * width * nbytes, L, f"{what}: y = AR_{axis}(x w) again, recomputed")
    if "qkv_proj" not in kept:
        block = e * (n + 2 * k) * hd / (gx * gy) * nbytes
        b.add("all-gather", "depth", L * block, L, "qkv weight AG over depth a third time (TPU, remat)")


def working_set_in_hbm(num_heads: int, tokens: float, seq_len: int, head_split: int, nbytes: int) -> bool:
    """Whether the TPU program keeps the backward's working set of one block in HBM (then counted, one block's
    activations, as on CPU) rather than on chip. Empirical, v5e: the temporaries exceed what the layer loops
    carry by less than 20 MiB where one layer's fp32 scores ([tokens, heads, s] of the device) are 64 MiB (dp,
    fsdp, tp, ep at the bench shape) and by one block's activations (+-3%) where they are 128 MiB (tp3d, pp's
    ticks): the buffers of the scores' backward no longer fit the core's VMEM (`VMEM_BYTES`)."""
    return tokens * num_heads / head_split * seq_len * nbytes >= VMEM_BYTES


def pp_activations(c: dict[str, int], blk: int, p: int, m: int, global_batch: int, seq_len: int, nbytes: int) -> float:
    """GPipe over `stage` on TPU: the tick loop keeps each of its m + p - 1 ticks' residuals (bubble ticks too:
    [ticks, L/p, B/m, ...] stacks in its tuple): the block's activations at B/m x S tokens, the bf16 copy of the
    stage's block weights (`blk` elements a layer) and RoPE's sin / cos (2 x hd/2 fp32 a token) per tick and layer;
    + one block's working set where `working_set_in_hbm`; the head and loss on every stage over the whole batch
    (fp32 logits and softmax); the pipeline's input and output [B, S, e]."""
    e, L, v, hd = c["d_model"], c["num_layers"], c["vocab_size"], c["head_dim"]
    tokens, ticks, k = global_batch / m * seq_len, m + p - 1, L / p
    block = block_bytes(c, tokens, seq_len, 1, 1, nbytes)
    per_tick = k * (block + blk * min(nbytes, 2) + tokens * 2 * hd / 2 * 4)
    acts = ticks * per_tick + (block if working_set_in_hbm(c["num_heads"], tokens, seq_len, 1, nbytes) else 0.0)
    return acts + global_batch * seq_len * (v * 4 * 2 + 2 * e * nbytes)


__all__ = ["RECOMPUTE_BLOCKS", "VMEM_BYTES", "block_bytes", "cp_comms", "low_precision", "param_bytes",
           "pp_activations", "pp_comms", "remat_extra", "tp3d_recompute_comms", "working_set_in_hbm",
           "zero3_comms"]  # fmt: skip
