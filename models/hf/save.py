"""Write a GPT as a Hugging Face folder transformers loads: config.json + safetensors (split, with an index, above
`max_shard_bytes`), the inverse of models/hf/load.py bit for bit.

The parameters are fetched one tensor (one layer of a stacked one) at a time, so the host holds at most one
safetensors file's worth of tensors; in a multi-process run every process takes part in the gathers (call it
from all of them) and process 0 writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from models.gpt import GPT, GPTConfig
from models.hf import config as hf_config
from models.hf import layout
from shardkit.errors import ShardkitError


def _host(x: jax.Array) -> np.ndarray:
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _files(sizes: list[int], max_bytes: int) -> list[int]:
    """The file index of each tensor, in order: a new file when the next tensor would pass max_bytes."""
    out, file, used = [], 0, 0
    for n in sizes:
        if used and used + n > max_bytes:
            file, used = file + 1, 0
        out.append(file)
        used += n
    return out


def save_pretrained(model: GPT, cfg: GPTConfig, out_dir: str | Path, *, model_type: str | None = None,
                    dtype: str | None = None, max_shard_bytes: int = 2 * 2**30) -> list[Path]:  # fmt: skip
    """Writes `out_dir`/config.json and the weights; returns the files written (process 0; [] elsewhere).
    `model_type`: llama | mistral | qwen2 | gemma (default: qwen2 with Q/K/V biases, gemma with its options,
    else llama);
    `dtype`: the tensors' dtype on disk (default: the parameters')."""
    out = Path(out_dir)
    if out.exists() and any(out.glob("*.safetensors")):
        raise ShardkitError(f"{out} already holds safetensors files: export into a new or empty folder")
    target = jnp.dtype(dtype or cfg.param_dtype)
    meta = hf_config.to_hf(cfg, model_type, str(target))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def get(path: str, index: Any) -> np.ndarray:
        node = params
        for key in path.split("/"):
            node = node[key]
        return _host(node if index is None else node[index])

    shapes = layout.hf_shapes(cfg)
    which = _files([int(np.prod(s)) * target.itemsize for s in shapes.values()], max_shard_bytes)
    n = which[-1] + 1
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    main = jax.process_index() == 0
    written: list[Path] = []
    if main:
        out.mkdir(parents=True, exist_ok=True)
    pending: dict[str, np.ndarray] = {}
    tensors: Iterator[tuple[str, np.ndarray]] = layout.hf_tensors(cfg, get)
    for i, (name, value) in enumerate(tensors):
        if tuple(value.shape) != shapes[name]:
            raise AssertionError(f"{name}: {value.shape} != {shapes[name]}")  # layout.py and hf_shapes disagree
        pending[name] = np.ascontiguousarray(value.astype(target, copy=False))
        if i + 1 == len(which) or which[i + 1] != which[i]:
            if main:
                written.append(out / names[which[i]])
                save_file(pending, str(written[-1]), metadata={"format": "pt"})
            pending = {}
    if main:
        if n > 1:
            total = sum(int(np.prod(s)) * target.itemsize for s in shapes.values())
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: names[f] for k, f in zip(shapes, which, strict=True)}}  # fmt: skip
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            written.append(out / "model.safetensors.index.json")
        (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        written.append(out / "config.json")
    return written
