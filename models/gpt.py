"""A decoder-only transformer in Flax NNX, annotated with logical axis names only.

Token embedding -> L x [RMSNorm -> grouped-query attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP ->
residual] -> RMSNorm -> output projection (optionally tied to the embedding). The L blocks are one module
whose parameters carry a leading `layers` dimension and are applied with `lax.scan`, so compile time does not
grow with depth. Every parameter has `logical_axes` metadata and every major activation is passed through
`shardkit.constrain`; a strategy decides what those names mean on a mesh. Attention goes through
`shardkit.attention.attend`, so a strategy can swap the kernel without touching this file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk
from models.axes import BATCH, EMBED, EXPERTS, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MLP, RES_SEQ, SEQ, VOCAB
from models.gpt_loss import chunked_cross_entropy, head_settings, logits_dot_in_fp32
from models.gpt_remat import REMAT_ALIASES
from models.rope import checked_scaling, rope_frequencies

#: The values every block tags for the `names:` / `offload:` remat policies (docs/memory.md): the fused Q/K/V projection
#: [b, s, kv_heads, g + 2, head_dim], the attention kernel's output [b, s, heads, head_dim] and its output projection
#: [b, s, embed], the MLP's (normed) input [b, s, embed] and its hidden activation silu(gate) * up [b, s, mlp].
CHECKPOINT_NAMES = ("qkv_proj", "attn_out", "out_proj", "mlp_in", "mlp_hidden")
#: `GPTConfig.mlp_activation` -> the gate's activation: SwiGLU (Llama) or GeGLU with tanh's GELU (Gemma)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 384  # byte-level 257 tokens padded to a multiple of 128
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int = 32
    mlp_dim: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10_000.0
    #: RoPE frequency scaling as Hugging Face configs give it (models/hf.py): () none, ("linear", factor), or
    #: ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple = ()
    qkv_bias: bool = False  # biases on the Q, K and V projections (Qwen2)
    # Gemma (models/hf): embeddings times sqrt(d_model), norms scaled by (offset + weight), GeGLU ("gelu_tanh")
    scale_embeddings: bool = False
    norm_offset: float = 0.0
    mlp_activation: str = "silu"
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    dtype: str = "float32"  # compute dtype ("bfloat16" for mixed precision)
    param_dtype: str = "float32"
    #: an alias of the `remat` kernel slot (docs/memory.md, models/gpt_remat.py REMAT_ALIASES): "none" (the strategy's
    #: slot decides), "full", or "dots" (= the slot's "dots_no_batch": the projections' outputs kept); a slot naming
    #: another policy is an error
    remat: str = "none"
    init_std: float = 0.02
    #: the output projection's dot accumulated and returned in fp32 (True), or returned in the compute dtype and
    #: cast to fp32 for the loss, as MaxText's default (False): with bf16 compute the logits buffer and the head's
    #: gradient (and its reduce-scatter) are halved, the logits rounded to bf16. No effect with fp32 compute.
    #: None (auto): False on a TPU or GPU with 16-bit compute, True otherwise (models/gpt_loss.py `auto_head`).
    #: docs/performance.md, "Lean by default on a target"
    logits_dot_in_fp32: bool | None = None
    #: > 0: the output projection and the cross-entropy run over the sequence in chunks of this many positions, each
    #: chunk's gradients computed as soon as its loss is (a custom VJP), so the [batch, seq, vocab] logits never
    #: exist at once and nothing is recomputed; 0 = whole. The same loss, summed in another order. None (auto): on
    #: a TPU or GPU with 16-bit compute, chunks once a device's fp32 logits would pass 128 MiB, else whole.
    #: docs/performance.md, "The loss in chunks"
    loss_chunk: int | None = None
    # mixture of experts (shardkit/parallel/moe/routing.py): every block's MLP becomes `num_experts` SwiGLU experts
    num_experts: int = 0  # 0 = dense
    top_k: int = 2  # 1 = Switch, 2 = GShard (second choices queue behind first choices)
    capacity_factor: float = 1.25  # tokens per expert per sequence = ceil(top_k x seq x factor / experts)
    dropless: bool = False  # capacity = seq: no token is ever dropped (the `moe=ragged` kernel is dropless anyway)
    aux_loss_weight: float = 0.01  # load-balancing loss (1.0 when balanced), added to the loss
    z_loss_weight: float = 1e-3  # router z-loss mean(logsumexp(logits)^2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_scaling", checked_scaling(self.rope_scaling))  # a list from config.json too
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
            if int(getattr(self, name)) < 1:
                raise sk.ShardkitError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("dtype", "param_dtype"):
            try:
                ok = jnp.issubdtype(jnp.dtype(getattr(self, name)), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                what = f"{name}={getattr(self, name)!r}"
                raise sk.ShardkitError(f"{what}: give a float dtype, e.g. 'float32' or 'bfloat16'")
        if self.num_heads % self.num_kv_heads:
            raise sk.ShardkitError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise sk.ShardkitError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.num_experts < 0 or (self.num_experts and self.top_k not in (1, 2)):
            raise sk.ShardkitError(f"num_experts={self.num_experts}, top_k={self.top_k}: experts >= 0, top_k 1 or 2")
        if self.num_experts and self.top_k > self.num_experts:
            raise sk.ShardkitError(f"top_k={self.top_k} needs at least that many experts, not {self.num_experts}")
        if self.loss_chunk is not None and self.loss_chunk < 0:
            raise sk.ShardkitError(f"loss_chunk={self.loss_chunk}: positions per chunk (> 0), 0 for the whole loss, "
                                   "or None to choose from the target")  # fmt: skip
        if self.mlp_activation not in ACTIVATIONS or (self.num_experts and self.mlp_activation != "silu"):
            raise sk.ShardkitError(f"mlp_activation={self.mlp_activation!r}: choose one of {', '.join(ACTIVATIONS)} "
                                   "(experts: silu)")  # fmt: skip
        if self.remat not in REMAT_ALIASES:
            choices = ", ".join(REMAT_ALIASES)
            raise sk.ShardkitError(f"remat={self.remat!r}: choose one of {choices} (any other policy: the strategy's "
                                   "remat kernel, kernels={'remat': ...}, docs/memory.md)")  # fmt: skip

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count; without the embedding table it is the N of FLOPs = 6N per token."""
        e, h = self.d_model, self.head_dim
        attn = e * h * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += (self.num_heads + 2 * self.num_kv_heads) * h if self.qkv_bias else 0
        block = attn + 3 * e * self.mlp_dim * max(1, self.num_experts) + 2 * e + e * self.num_experts
        head = 0 if self.tie_embeddings else e * self.vocab_size
        emb = e * self.vocab_size if include_embedding else 0
        return self.num_layers * block + e + head + emb

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N (N without the embedding lookup; the tied or untied output projection is
        a matmul and counts) + 12 L d s for attention scores and values, fwd + bwd, causal mask NOT halved
        (PaLM appendix B convention; our dense kernel computes the masked half too)."""
        n = self.num_params(include_embedding=False) + (self.d_model * self.vocab_size if self.tie_embeddings else 0)
        if self.num_experts:  # a token runs top_k of the experts: the active parameters
            n -= self.num_layers * 3 * self.d_model * self.mlp_dim * (self.num_experts - self.top_k)
        return 6 * n + 12 * self.num_layers * self.num_heads * self.head_dim * seq_len


def _param(rngs: nnx.Rngs, shape: Sequence[int], axes: tuple[str, ...], cfg: GPTConfig, std: float) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.dtype(cfg.param_dtype))
    return nnx.Param(value, logical_axes=axes)


def _ones(shape: Sequence[int], axes: tuple[str, ...], cfg: GPTConfig) -> nnx.Param:
    return nnx.Param(jnp.ones(tuple(shape), jnp.dtype(cfg.param_dtype)), logical_axes=axes)


def _f32(dtype: jnp.dtype) -> jnp.dtype:
    """At least fp32 for norms, RoPE and logits (bf16 compute stays accurate; fp64 under x64 stays fp64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    x32 = x.astype(_f32(x.dtype))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = scale.astype(x32.dtype) + offset if offset else scale.astype(x32.dtype)  # Gemma: (1 + w), in fp32
    return (y * scale).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float, scaling: tuple = ()) -> jax.Array:
    """Rotary embedding of x [b, s, heads, d] at integer positions [b, s] (Su et al. 2104.09864), the two halves of
    the last dimension rotated together (GPT-NeoX's and Hugging Face Llama's layout)."""
    half = x.shape[-1] // 2
    f32 = _f32(x.dtype)
    freq = rope_frequencies(half, theta, scaling, f32)
    angle = positions.astype(f32)[..., None, None] * freq  # [b, s, 1, d/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    x1, x2 = x[..., :half].astype(f32), x[..., half:].astype(f32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    """One pre-norm transformer block: GQA attention with RoPE, then a SwiGLU MLP."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        e, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
        std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5  # GPT-2 residual scaling
        self.cfg = cfg
        g = n // k  # query heads per key/value head
        self.attn_norm = _ones((e,), (EMBED,), cfg)
        # Q, K and V of one KV group side by side: [embed, kv_heads, g queries + 1 key + 1 value, head_dim]. One
        # matmul means one partial-sum for dX in backward, so tensor parallelism all-reduces once (Megatron's f).
        self.wqkv = _param(rngs, (e, k, g + 2, h), (EMBED, KV_HEADS, None, HEAD_DIM), cfg, std)
        if cfg.qkv_bias:
            self.bqkv = nnx.Param(
                jnp.zeros((k, g + 2, h), jnp.dtype(cfg.param_dtype)), logical_axes=(KV_HEADS, None, HEAD_DIM)
            )
        self.wo = _param(rngs, (n, h, e), (HEADS, HEAD_DIM, EMBED), cfg, out_std)
        self.mlp_norm = _ones((e,), (EMBED,), cfg)
        if cfg.num_experts:  # the experts' SwiGLU weights stacked on a leading `experts` dimension, and a router
            x = cfg.num_experts
            self.router = _param(rngs, (e, x), (EMBED, EXPERTS), cfg, std)
            self.w_gate_up = _param(rngs, (x, e, 2, f), (EXPERTS, EMBED, None, MLP), cfg, std)
            self.w_down = _param(rngs, (x, f, e), (EXPERTS, MLP, EMBED), cfg, out_std)
        else:
            self.w_gate_up = _param(rngs, (e, 2, f), (EMBED, None, MLP), cfg, std)  # SwiGLU gate and up, fused
            self.w_down = _param(rngs, (f, e), (MLP, EMBED), cfg, out_std)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        # x: [batch, res_seq, embed]
        h = sk.constrain(rms_norm(x, self.attn_norm[...], cfg.norm_eps, cfg.norm_offset), (BATCH, RES_SEQ, EMBED))
        h = sk.constrain(h, (BATCH, SEQ, EMBED))  # Megatron-SP's all-gather of the sequence (no-op without SP)
        qkv = jnp.einsum("bse,ekgh->bskgh", h, self.wqkv[...].astype(dt))
        if cfg.qkv_bias:
            qkv = qkv + self.bqkv[...].astype(dt)
        qkv = sk.layers.tag(sk.constrain(qkv, (BATCH, SEQ, KV_HEADS, None, HEAD_DIM)), "qkv_proj")
        b, s, kv, g2, hd = qkv.shape
        q = sk.constrain(qkv[:, :, :, : g2 - 2].reshape(b, s, kv * (g2 - 2), hd), (BATCH, SEQ, HEADS, HEAD_DIM))
        kv_axes = (BATCH, SEQ, KV_HEADS, HEAD_DIM)
        k, v = sk.constrain(qkv[:, :, :, g2 - 2], kv_axes), sk.constrain(qkv[:, :, :, g2 - 1], kv_axes)
        q = sk.constrain(rope(q, positions, cfg.rope_theta, cfg.rope_scaling), (BATCH, SEQ, HEADS, HEAD_DIM))
        k = sk.constrain(rope(k, positions, cfg.rope_theta, cfg.rope_scaling), kv_axes)
        o = sk.attention.attend(q, k, v, causal=True, segment_ids=segment_ids)
        o = sk.layers.tag(sk.constrain(o, (BATCH, SEQ, HEADS, HEAD_DIM)), "attn_out")
        proj = sk.constrain(jnp.einsum("bsnh,nhe->bse", o, self.wo[...].astype(dt)), (BATCH, RES_SEQ, EMBED))
        x = x + sk.layers.tag(proj, "out_proj")

        h = sk.constrain(rms_norm(x, self.mlp_norm[...], cfg.norm_eps, cfg.norm_offset), (BATCH, RES_SEQ, EMBED))
        h = sk.layers.tag(sk.constrain(h, (BATCH, SEQ, EMBED)), "mlp_in")
        if cfg.num_experts:
            return self._moe(x, h)
        gu = sk.constrain(jnp.einsum("bse,etf->bstf", h, self.w_gate_up[...].astype(dt)), (BATCH, SEQ, None, MLP))
        gate = ACTIVATIONS[cfg.mlp_activation]
        act = sk.layers.tag(sk.constrain(gate(gu[:, :, 0]) * gu[:, :, 1], (BATCH, SEQ, MLP)), "mlp_hidden")
        y = jnp.einsum("bsf,fe->bse", act, self.w_down[...].astype(dt))
        return x + sk.constrain(y, (BATCH, RES_SEQ, EMBED))

    def _moe(self, x: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x + MoE(h) and this layer's [aux loss, z-loss, dropped fraction]; each sequence is a group of tokens.

        The `moe` kernel decides the dispatch: capacity slots (`einsum`, `all_to_all`: `experts`) or, dropless,
        tokens sorted by expert through grouped matmuls (`ragged`: `grouped`, capacity and `dropless` unused)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        logits = jnp.einsum("bse,ex->bsx", h, self.router[...].astype(dt), preferred_element_type=_f32(dt))
        cap = None
        if not sk.moe.is_grouped():
            cap = sk.moe.capacity(h.shape[1], cfg.num_experts, cfg.top_k, cfg.capacity_factor, cfg.dropless)
        r = sk.moe.route(logits, cfg.top_k, cap)

        def experts(w: tuple[jax.Array, jax.Array], xe: jax.Array) -> jax.Array:  # [E, N, C, M] -> [E, N, C, M]
            gu = jnp.einsum("encm,emtf->enctf", xe, w[0].astype(dt))
            return jnp.einsum("encf,efm->encm", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w[1].astype(dt))

        def grouped(w: tuple[jax.Array, jax.Array], xs: jax.Array, sizes: jax.Array) -> jax.Array:  # [N, M] -> same
            # grouped matmuls (ragged_dot on GPU / TPU, tiles padded to 16 rows on CPU: FLOPs ~ the routed rows')
            gate = sk.moe.grouped_dot(xs, w[0][:, :, 0].astype(dt), sizes)  # gate and up apart: mlp may be split
            up = sk.moe.grouped_dot(xs, w[0][:, :, 1].astype(dt), sizes)
            return sk.moe.grouped_dot(jax.nn.silu(gate) * up, w[1].astype(dt), sizes)

        w = (self.w_gate_up[...], self.w_down[...])
        y, dropped = sk.moe.apply(h, r, experts, w, grouped_fn=grouped, with_dropped=True)
        aux = jnp.stack([r["aux_loss"], r["z_loss"], dropped.astype(r["aux_loss"].dtype)]).astype(jnp.float32)
        return x + sk.constrain(y.astype(x.dtype), (BATCH, RES_SEQ, EMBED)), aux


def _stack_blocks(cfg: GPTConfig, rngs: nnx.Rngs) -> Block:
    """L blocks as one Block whose parameters have a leading `layers` dimension (created under vmap)."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))))
    keys = jax.random.split(rngs.params(), cfg.num_layers)
    states = jax.vmap(lambda key: nnx.split(Block(cfg, nnx.Rngs(params=key)))[1])(keys)
    blocks = nnx.merge(graphdef, states)
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable) and "logical_axes" in var.get_metadata():
            var.set_metadata("logical_axes", (LAYERS, *var.get_metadata()["logical_axes"]))
    return blocks


def lm_loss(model: GPT, batch: dict[str, jax.Array]) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy (nats) of {"inputs", "targets"[, "positions", "segment_ids"]}, all [B, T].

    With experts: (cross-entropy + the weighted load-balancing and z-losses, {"ce", "moe_aux", "moe_z",
    "moe_dropped"}), the MoE terms averaged over layers."""
    extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    cfg = model.cfg
    _, chunk = head_settings(cfg, batch["targets"].shape)  # GPTConfig.loss_chunk, or the target's choice
    out, aux = model(batch["inputs"], **extra, return_aux=True, return_hidden=bool(chunk))
    if chunk:  # the head and the loss chunk by chunk: no [batch, seq, vocab] buffer (GPTConfig.loss_chunk)
        ce = chunked_cross_entropy(model.logits, model.head_weight(), out, batch["targets"], chunk)
    else:
        ce = sk.cross_entropy(out, batch["targets"])
    if not cfg.num_experts:
        return ce
    loss = ce + cfg.aux_loss_weight * aux[0] + cfg.z_loss_weight * aux[1]
    return loss, {"ce": ce, "moe_aux": aux[0], "moe_z": aux[1], "moe_dropped": aux[2]}


class GPT(nnx.Module):
    """GPT(config, rngs=nnx.Rngs(0))(tokens int32[batch, seq]) -> logits float32[batch, seq, vocab].

    `sk.make_train_step(gpt, ...)` trains it with `GPT.loss` (= `lm_loss`) on batches whose entries are all
    [batch, seq] (`batch_axes`); a context-parallel strategy shards their `seq` dimension too.
    """

    batch_axes = (BATCH, SEQ)

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED), cfg, cfg.init_std)
        self.blocks = _stack_blocks(cfg, rngs)
        self.final_norm = _ones((cfg.d_model,), (EMBED,), cfg)
        if not cfg.tie_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB), cfg, cfg.init_std)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
        return_aux: bool = False, return_hidden: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:  # fmt: skip
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = sk.embedding.lookup(self.embed[...], tokens, (VOCAB, EMBED), dt)  # the `embed` kernel slot
        if cfg.scale_embeddings:
            x = x * jnp.asarray(math.sqrt(cfg.d_model), dt)
        x = sk.constrain(x, (BATCH, RES_SEQ, EMBED))

        graphdef, layer_state = nnx.split(self.blocks)
        if cfg.num_experts:  # the carry is (x, the layers' summed MoE terms)

            def block(state: nnx.State, carry: tuple, positions: jax.Array, segment_ids: jax.Array | None) -> tuple:
                y, aux = nnx.merge(graphdef, state)(carry[0], positions, segment_ids)
                return y, carry[1] + aux

            x, aux = sk.layers.apply_stack(block, layer_state, (x, jnp.zeros(3, jnp.float32)), positions, segment_ids,
                                           remat=REMAT_ALIASES[cfg.remat])  # fmt: skip
            aux = aux / cfg.num_layers
        else:
            block = lambda state, x, positions, segment_ids: nnx.merge(graphdef, state)(x, positions, segment_ids)
            x = sk.layers.apply_stack(block, layer_state, x, positions, segment_ids, remat=REMAT_ALIASES[cfg.remat])
            aux = None

        x = rms_norm(x, self.final_norm[...], cfg.norm_eps, cfg.norm_offset)
        out = x if return_hidden else self.logits(x)  # return_hidden: the final normed activations, no head
        return (out, aux) if return_aux else out

    def logits(self, x: jax.Array, w: jax.Array | None = None) -> jax.Array:
        """The output projection of the final normed activations x [batch, seq, embed]: fp32 [batch, seq, vocab].
        `w`: the head's weight as `head_weight` gives it (the chunked loss lays it out once, outside its loop)."""
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        with sk.scope("head"):  # a strategy may give the output projection rules of its own (Strategy.scopes)
            w = self.head_weight() if w is None else w
            fp32 = logits_dot_in_fp32(cfg, sk.platform_family())  # False: MaxText's default, then cast to fp32
            out = _f32(dt) if fp32 else dt
            logits = jnp.einsum("bse,ev->bsv", x, w, preferred_element_type=out).astype(_f32(dt))
            return sk.constrain(logits, (BATCH, SEQ, VOCAB))

    def head_weight(self) -> jax.Array:
        """The output projection's weight [embed, vocab] in the compute dtype (the embedding's, tied)."""
        w = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return w.astype(jnp.dtype(self.cfg.dtype))

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        return lm_loss(self, batch)

    def validate_batch(self, batch: dict[str, jax.Array]) -> None:
        """What `lm_loss` reads, checked before XLA (the train step calls this, shardkit/step.py): integer
        `inputs` and `targets` of one [batch, seq] shape (`positions` / `segment_ids` too where given), and, on
        concrete arrays, token ids in [0, vocab_size): outside, they would wrap (negative) or read past the
        embedding (NaN loss) silently inside jit."""
        seq = (2, "integer")
        sk.batch.expect(batch, "GPT", {"inputs": seq, "targets": seq}, {"positions": seq, "segment_ids": seq},
                        same_shape=("inputs", "targets", "positions", "segment_ids"))  # fmt: skip
        for key in ("inputs", "targets"):
            sk.batch.expect_ids(
                batch,
                "GPT",
                key,
                self.cfg.vocab_size,
                f"vocab_size={self.cfg.vocab_size}",
                "use a model vocab_size above the data's largest id (or fix the tokenizer)",
            )
