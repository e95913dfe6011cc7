"""Where each GPT parameter's values sit in a Hugging Face Llama-family checkpoint, both ways.

Hugging Face keeps one tensor per projection and layer, torch's `Linear` layout [out, in]:
`model.layers.{l}.self_attn.{q,k,v,o}_proj.weight` (+ Qwen2's q/k/v biases), `mlp.{gate,up,down}_proj.weight`,
`input_layernorm` / `post_attention_layernorm`, `model.embed_tokens`, `model.norm`, `lm_head` (absent when tied).
The GPT (models/gpt.py) stacks the layers on a leading `layers` dimension and fuses projections:
`wqkv` [L, embed, kv_heads, g + 2, head_dim] (query head j = kv * g + i reads key/value head j // g, as HF's
`repeat_kv` does), `w_gate_up` [L, embed, 2, mlp], `wo` [L, heads, head_dim, embed], `w_down` [L, mlp, embed],
`head` [embed, vocab].

`block(name, cfg, read, index)` builds any box `index` (one (start, stop) per dimension) of a GPT parameter from
reads of only the HF rows and columns that box needs: a device's shard reads its own byte ranges, whatever the
strategy. Reads are exact when the split dimensions are the ones strategies split (layers, embed, kv_heads,
heads, mlp, vocab); a box that cuts head_dim or the g + 2 / gate-up axis (no rules table does) reads the whole
heads it touches. `hf_tensors(cfg, layer)` is the inverse, one layer at a time, for export: the same numbers,
bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from models.gpt import GPTConfig

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension
Read = Callable[[str, tuple[slice, ...]], np.ndarray]  # (HF tensor name, slices) -> those values
L = "model.layers.{i}."


def _sl(r: tuple[int, int]) -> slice:
    return slice(r[0], r[1])


def _in_out(read: Read, name: str, e: tuple[int, int], split: tuple[int, ...], box: Box) -> np.ndarray:
    """GPT [embed, *split][e, *box] from a Linear weight [prod(split), embed] (rows = the flattened `split`)."""
    inner = math.prod(split[1:])
    w = read(name, (slice(box[0][0] * inner, box[0][1] * inner), _sl(e)))  # only the leading split dim's rows
    w = w.reshape(box[0][1] - box[0][0], *split[1:], e[1] - e[0])[(slice(None), *map(_sl, box[1:]))]
    return np.moveaxis(w, -1, 0)


def _out_in(read: Read, name: str, split: tuple[int, ...], box: Box, e: tuple[int, int]) -> np.ndarray:
    """GPT [*split, embed][*box, e] from a Linear weight [embed, prod(split)] (columns = the flattened `split`)."""
    inner = math.prod(split[1:])
    w = read(name, (_sl(e), slice(box[0][0] * inner, box[0][1] * inner)))
    w = w.reshape(e[1] - e[0], box[0][1] - box[0][0], *split[1:])[(slice(None), slice(None), *map(_sl, box[1:]))]
    return np.moveaxis(w, 0, -1)


def _vec(read: Read, name: str, split: tuple[int, ...], box: Box) -> np.ndarray:
    """GPT [*split][box] from a vector [prod(split)]."""
    inner = math.prod(split[1:])
    v = read(name, (slice(box[0][0] * inner, box[0][1] * inner),))
    return v.reshape(box[0][1] - box[0][0], *split[1:])[(slice(None), *map(_sl, box[1:]))]


def _concat(axis: int, parts: list[tuple[int, Callable[[Box], np.ndarray]]], box: Box) -> np.ndarray:
    """The box of a concatenation along `axis` of parts (width, box -> values): each part read for its overlap."""
    out, offset = [], 0
    for width, part in parts:
        lo, hi = max(box[axis][0], offset), min(box[axis][1], offset + width)
        if lo < hi:
            out.append(part((*box[:axis], (lo - offset, hi - offset), *box[axis + 1 :])))
        offset += width
    return np.concatenate(out, axis=axis)


def _layer(name: str, cfg: GPTConfig, read: Read, layer: int, box: Box) -> np.ndarray:
    """That layer's box of a `blocks/<name>` parameter (without the layers dimension)."""
    k, h, f = cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    g, p = cfg.num_heads // cfg.num_kv_heads, L.format(i=layer)
    att, mlp = p + "self_attn.", p + "mlp."
    if name in ("attn_norm", "mlp_norm"):
        return read(p + ("input_layernorm" if name == "attn_norm" else "post_attention_layernorm") + ".weight",
                    tuple(map(_sl, box)))  # fmt: skip
    if name == "wqkv":
        qkv = [(g, lambda b: _in_out(read, att + "q_proj.weight", b[0], (k, g, h), b[1:]))]
        qkv += [(1, lambda b, x=x: _in_out(read, att + f"{x}_proj.weight", b[0], (k, 1, h), b[1:])) for x in "kv"]
        return _concat(2, qkv, box)
    if name == "bqkv":
        qkv = [(g, lambda b: _vec(read, att + "q_proj.bias", (k, g, h), b))]
        qkv += [(1, lambda b, x=x: _vec(read, att + f"{x}_proj.bias", (k, 1, h), b)) for x in "kv"]
        return _concat(1, qkv, box)
    if name == "wo":
        return _out_in(read, att + "o_proj.weight", (cfg.num_heads, h), box[:2], box[2])
    if name == "w_gate_up":
        gu = [(1, lambda b, x=x: _in_out(read, mlp + f"{x}_proj.weight", b[0], (f,), b[2:])[:, None]) for x in
              ("gate", "up")]  # fmt: skip
        return _concat(1, gu, box)
    if name == "w_down":
        return _out_in(read, mlp + "down_proj.weight", (f,), box[:1], box[1])
    raise KeyError(name)


def block(path: str, cfg: GPTConfig, read: Read, box: Box) -> np.ndarray:
    """The values of `box` of the GPT parameter at `path` ("embed", "blocks/wqkv", ...), read through `read`."""
    if path == "embed":
        return read("model.embed_tokens.weight", tuple(map(_sl, box)))
    if path == "final_norm":
        return read("model.norm.weight", tuple(map(_sl, box)))
    if path == "head":
        return _in_out(read, "lm_head.weight", box[0], (cfg.vocab_size,), box[1:])
    name = path.removeprefix("blocks/")
    return np.stack([_layer(name, cfg, read, i, box[1:]) for i in range(*box[0])])


def hf_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `cfg` holds, with its shape, in Hugging Face's order and names."""
    e, n, k, h, f, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, e)}
    for i in range(cfg.num_layers):
        p = L.format(i=i)
        out[p + "input_layernorm.weight"] = (e,)
        for x, rows in (("q", n * h), ("k", k * h), ("v", k * h)):
            out[p + f"self_attn.{x}_proj.weight"] = (rows, e)
            if cfg.qkv_bias:
                out[p + f"self_attn.{x}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (e, n * h)
        out[p + "post_attention_layernorm.weight"] = (e,)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (f, e)
        out[p + "mlp.down_proj.weight"] = (e, f)
    out["model.norm.weight"] = (e,)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, e)
    return out


def hf_layer(cfg: GPTConfig, i: int, p: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Layer i's HF tensors from its GPT arrays `p` (the `blocks/*` parameters at index i, on the host)."""
    e, g, pre = cfg.d_model, cfg.num_heads // cfg.num_kv_heads, L.format(i=i)
    yield pre + "input_layernorm.weight", p["attn_norm"]
    for x, cols in (("q", slice(0, g)), ("k", slice(g, g + 1)), ("v", slice(g + 1, g + 2))):
        yield pre + f"self_attn.{x}_proj.weight", p["wqkv"][:, :, cols].reshape(e, -1).T
        if cfg.qkv_bias:
            yield pre + f"self_attn.{x}_proj.bias", p["bqkv"][:, cols].reshape(-1)
    yield pre + "self_attn.o_proj.weight", p["wo"].reshape(-1, e).T
    yield pre + "post_attention_layernorm.weight", p["mlp_norm"]
    yield pre + "mlp.gate_proj.weight", p["w_gate_up"][:, 0].T
    yield pre + "mlp.up_proj.weight", p["w_gate_up"][:, 1].T
    yield pre + "mlp.down_proj.weight", p["w_down"].T


def hf_tensors(cfg: GPTConfig, get: Callable[[str, Any], np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Every HF tensor, in `hf_shapes` order; `get(path, index)` fetches a GPT parameter (index None: whole; an int:
    that layer of a stacked one) to the host. One layer is on the host at a time."""
    yield "model.embed_tokens.weight", get("embed", None)
    names = ["attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"] + (["bqkv"] if cfg.qkv_bias else [])
    for i in range(cfg.num_layers):
        yield from hf_layer(cfg, i, {n: get(f"blocks/{n}", i) for n in names})
    yield "model.norm.weight", get("final_norm", None)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", get("head", None).T
