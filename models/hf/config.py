"""Hugging Face `config.json` <-> `GPTConfig` for the Llama family: Llama 2 / 3 / 3.1, Mistral, Qwen2 / 2.5, Gemma.

They are one architecture to the GPT (RMSNorm, GQA, gated MLP, half-split RoPE): Qwen2 adds biases to Q, K and
V and usually ties its embeddings, Llama 3.1 scales RoPE's low frequencies, Mistral v0.1 attends within a sliding
window (exact here for sequences up to the window, so `max_seq_len` is capped at it), Gemma (1) scales its tied
embeddings by sqrt(hidden), scales its norms by (1 + w) and gates with tanh's GELU (`scale_embeddings`,
`norm_offset`, `mlp_activation`). Every field is checked: a
value the GPT cannot reproduce (another activation, biases on the output projection, sliding windows per layer,
quantization, a RoPE type other than default / linear / llama3, ...) and any field this module does not know is a
`ShardkitError` naming it: a checkpoint loads exactly or not at all.

RoPE comes in two spellings, both accepted: transformers 5 writes `rope_parameters` ({"rope_type", "rope_theta",
...}); 4.x (most checkpoints on the Hub) writes top-level `rope_theta` and `rope_scaling` ({"rope_type" or "type",
...}). `to_hf` writes the 4.x spelling, which transformers 4.x and 5.x both read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.gpt import GPTConfig
from shardkit.errors import ShardkitError

FAMILIES = ("llama", "mistral", "qwen2", "gemma")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gemma": "GemmaForCausalLM"}  # fmt: skip
#: the GPTConfig fields that make a Gemma
GEMMA = dict(scale_embeddings=True, norm_offset=1.0, mlp_activation="gelu_tanh")
#: fields that do not change the forward pass (token ids, generation, bookkeeping, initialisation)
IGNORED = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "_name_or_path", "return_dict", "output_hidden_states",
    "output_attentions", "tokenizer_class", "max_window_layers", "generation_config", "_attn_implementation_autoset",
})  # fmt: skip
#: field -> the only value(s) the GPT reproduces (absent = fine too)
REQUIRED: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_dropout": (0, 0.0),
    "pretraining_tp": (1,),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "use_bidirectional_attention": (None, False),
    "hidden_activation": (None, "gelu_pytorch_tanh"),  # Gemma configs of transformers 4.x
}
SHAPE = {"hidden_size": "d_model", "intermediate_size": "mlp_dim", "num_hidden_layers": "num_layers",
         "num_attention_heads": "num_heads", "vocab_size": "vocab_size"}  # fmt: skip
OTHER = {"num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
         "rope_parameters", "tie_word_embeddings", "attention_bias", "sliding_window", "layer_types"}  # fmt: skip


def _bad(field: str, value: Any, why: str) -> ShardkitError:
    return ShardkitError(f"Hugging Face config field {field}={value!r}: {why} (models/hf/config.py)")


def _rope(hf: dict[str, Any]) -> tuple[float, tuple]:
    """(rope_theta, GPTConfig.rope_scaling) from either spelling (module docstring)."""
    params = hf.get("rope_parameters")
    field = "rope_parameters" if params else "rope_scaling"
    params = dict(params or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10_000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        scaling: tuple = ()
    elif kind == "linear":
        scaling = ("linear", float(params.pop("factor")))
    elif kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in params]
        if missing:
            raise _bad(field, hf.get(field), f"llama3 RoPE scaling without {', '.join(missing)}")
        scaling = ("llama3", *(float(params.pop(k)) for k in keys[:3]), int(params.pop(keys[3])))
    else:
        raise _bad(f"{field}.rope_type", kind, "supported: default, linear, llama3")
    if params.get("attention_factor", 1.0) in (None, 1, 1.0):  # transformers 5 may spell out the default
        params.pop("attention_factor", None)
    if params:
        k = next(iter(params))
        raise _bad(f"{field}.{k}", params[k], f"not part of {kind} RoPE as shardkit implements it")
    return float(theta), scaling


def to_gpt(hf: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The GPTConfig of a Hugging Face config.json (a dict); `overrides` set the fields HF does not describe
    (dtype, param_dtype, remat, loss_chunk, ...) or cap max_seq_len."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise _bad("model_type", family, f"supported: {', '.join(FAMILIES)}")
    gemma = family == "gemma"
    required = {**REQUIRED, "hidden_act": ("gelu_pytorch_tanh",) if gemma else ("silu",)}
    for field, value in hf.items():
        if field in IGNORED or field in SHAPE or field in OTHER:
            continue
        if field not in required:
            raise _bad(field, value, "a field shardkit's loader does not know; it may change the model, so nothing is "
                       "loaded (models/hf/config.py lists the fields it reads and ignores)")  # fmt: skip
        if value not in required[field] and not (gemma and field == "hidden_act" and hf.get("hidden_activation")):
            raise _bad(field, value, f"{family} as the GPT reproduces it has {required[field][-1]!r}")
    missing = [k for k in SHAPE if k not in hf]
    if missing:
        raise ShardkitError(f"Hugging Face config.json lacks {', '.join(missing)}: not a complete {family} config")
    bias = bool(hf.get("attention_bias", family == "qwen2"))
    if bias != (family == "qwen2"):  # Llama's attention_bias also puts a bias on o_proj; Qwen2's q/k/v always have one
        raise _bad("attention_bias", hf.get("attention_bias"), f"{family} with attention_bias={bias} is not supported")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise _bad("layer_types", hf["layer_types"], "only full_attention layers are supported")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    max_len = int(hf.get("max_position_embeddings", 2048))
    window = hf.get("sliding_window") if family == "mistral" else None
    fields = {v: int(hf[k]) for k, v in SHAPE.items()}
    fields.update(
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        max_seq_len=min(max_len, int(window)) if window else max_len,
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        **(GEMMA if gemma else {}),
    )
    return GPTConfig(**{**fields, **overrides})


def to_hf(cfg: GPTConfig, model_type: str | None = None, dtype: str = "float32") -> dict[str, Any]:
    """A config.json transformers loads as `model_type` (default: qwen2 with q/k/v biases, else llama)."""
    gemma = {k: getattr(cfg, k) for k in GEMMA}
    model_type = model_type or ("qwen2" if cfg.qkv_bias else "gemma" if gemma == GEMMA else "llama")
    if model_type not in FAMILIES or cfg.qkv_bias != (model_type == "qwen2"):
        raise ShardkitError(f"model_type={model_type!r} with qkv_bias={cfg.qkv_bias}: export as one of {FAMILIES} "
                            "(qwen2 exactly when the Q/K/V projections have biases)")  # fmt: skip
    plain = {"scale_embeddings": False, "norm_offset": 0.0, "mlp_activation": "silu"}
    if gemma != (GEMMA if model_type == "gemma" else plain):
        raise ShardkitError(f"model_type={model_type!r} with {gemma}: transformers has no such model ({model_type} "
                            f"is {GEMMA if model_type == 'gemma' else plain})")  # fmt: skip
    if cfg.num_experts:
        raise ShardkitError(f"num_experts={cfg.num_experts}: a mixture-of-experts GPT has no Llama-family export")
    out: dict[str, Any] = dict(architectures=[ARCHITECTURES[model_type]], model_type=model_type)
    out.update({k: getattr(cfg, v) for k, v in SHAPE.items()})
    out.update(
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="gelu_pytorch_tanh" if model_type == "gemma" else "silu", attention_dropout=0.0, torch_dtype=dtype,
    )  # fmt: skip
    s = cfg.rope_scaling
    if s:
        keys = ("factor",) if s[0] == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                      "original_max_position_embeddings")  # fmt: skip
        out["rope_scaling"] = {"rope_type": s[0], **dict(zip(keys, s[1:], strict=True))}
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif model_type == "mistral":
        out.update(sliding_window=None)
    elif model_type == "gemma":
        out.update(attention_bias=False)
    else:
        out.update(use_sliding_window=False)
    return out


def architecture(cfg: GPTConfig) -> dict[str, Any]:
    """The GPTConfig fields a Hugging Face config describes (what `to_gpt` sets), for comparing two configs."""
    keys = set(SHAPE.values()) | set(GEMMA) | {"num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "qkv_bias",
                                               "tie_embeddings", "norm_eps"}  # fmt: skip
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k in keys}
