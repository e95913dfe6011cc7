"""Load a local Hugging Face folder straight into a sharded GPT: each device's shard read from the files alone.

The shardings are the ones `sk.sharded_init` (and so the train step) gives the GPT's parameters under the strategy.
For every parameter, each distinct shard this process's devices hold is read (only its byte ranges, through
`safetensors.safe_open(..., framework="numpy").get_slice`, models/hf/layout.py), converted to the parameter dtype,
put on the devices that hold it, and dropped, before the next one is read: the host never holds more than one
shard beside what the devices hold, and no process reads what its devices do not hold. Each read opens the file and
closes it again, so no file stays memory-mapped (its touched pages would count against the process's memory).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open

from models.gpt import GPT, GPTConfig
from models.hf import config as hf_config
from models.hf import layout
from shardkit.errors import ShardkitError
from shardkit.init import abstract_model, split_params, state_shardings
from shardkit.mesh import step_mesh
from shardkit.strategies import Strategy
from shardkit.strategies import strategy as get_strategy
from shardkit.targets import require_runnable

#: tensors some checkpoints carry that the forward pass does not read (Llama 2's precomputed RoPE frequencies)
UNUSED = (".rotary_emb.inv_freq",)


class Reader:
    """The tensors of a Hugging Face folder (one `model.safetensors`, or the files `model.safetensors.index.json`
    maps); `read(name, slices)` reads one box of one tensor. `bytes_read` counts what was read, per tensor, and
    `reads` lists every read as (name, slices, bytes)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: self.path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            found = sorted(self.path.glob("model*.safetensors"))
            if len(found) != 1:
                raise ShardkitError(f"{self.path}: expected model.safetensors or model.safetensors.index.json, found "
                                    f"{[f.name for f in found] or 'no safetensors file'}")  # fmt: skip
            with safe_open(found[0], framework="numpy") as f:
                self.files = dict.fromkeys(f.keys(), found[0])
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in sorted(set(self.files.values())):
            if not file.is_file():
                raise ShardkitError(f"{file} (named in the index) is missing: an incomplete download?")
            with safe_open(file, framework="numpy") as f:
                for k in f.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                    s = f.get_slice(k)
                    self.shapes[k], self.dtypes[k] = tuple(s.get_shape()), s.get_dtype()
        self.bytes_read: collections.Counter[str] = collections.Counter()
        self.reads: list[tuple[str, tuple[slice, ...], int]] = []

    def read(self, name: str, slices: tuple[slice, ...]) -> np.ndarray:
        with safe_open(self.files[name], framework="numpy") as f:
            x = f.get_slice(name)[slices]
        self.bytes_read[name] += x.nbytes
        self.reads.append((name, slices, x.nbytes))
        return x

    def check(self, cfg: GPTConfig) -> None:
        """Every tensor `cfg` needs is there with its shape, and nothing the GPT would not read (e.g. o_proj.bias)."""
        want = layout.hf_shapes(cfg)
        for name, shape in want.items():
            if name not in self.shapes:
                raise ShardkitError(f"{self.path}: tensor {name} {shape} is missing (config.json and weights disagree)")
            if self.shapes[name] != shape:
                raise ShardkitError(f"{self.path}: tensor {name} has shape {self.shapes[name]}, config.json implies "
                                    f"{shape}")  # fmt: skip
        tied = {"lm_head.weight"} if cfg.tie_embeddings else set()  # a tied head saved anyway: the embedding's copy
        extra = sorted(k for k in self.shapes if k not in want and k not in tied and not k.endswith(UNUSED))
        if extra:
            more = " ..." if len(extra) > 5 else ""
            raise ShardkitError(f"{self.path}: tensors the GPT has no place for: {', '.join(extra[:5])}{more} (an "
                                "architecture variant shardkit does not load)")  # fmt: skip


def read_config(path: str | Path, **overrides: Any) -> GPTConfig:
    """The GPTConfig of the Hugging Face folder `path` (its config.json; models/hf/config.py)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ShardkitError(f"{file} not found: give a local Hugging Face model folder (config.json + safetensors)")
    return hf_config.to_gpt(json.loads(file.read_text()), **overrides)


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> layout.Box:
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))


def load_params(path: str | Path, cfg: GPTConfig, mesh: Mesh, strategy: str | Strategy,
                reader: Reader | None = None) -> GPT:  # fmt: skip
    """A GPT(cfg) whose parameters are the folder's, sharded as `sk.sharded_init` shards them under `strategy`."""
    require_runnable(mesh, "models.hf.load_params")
    strategy = get_strategy(strategy)
    mesh = step_mesh(mesh, strategy.explicit_axes, "models.hf.load_params")
    bound = strategy.bind(mesh)
    reader = reader or Reader(path)
    reader.check(cfg)
    graphdef, abs_params, abs_rest = split_params(abstract_model(lambda rngs: GPT(cfg, rngs=rngs)))
    shardings = state_shardings(abs_params, bound.param_rules, mesh, require=True, scopes=bound.scopes,
                                strict=bound.strategy.strict_names, unnamed_min_bytes=bound.strategy.unnamed_min_bytes,
                                path_rules=bound.strategy.path_rules)  # fmt: skip

    def place(path: tuple[Any, ...], sds: Any, sharding: jax.sharding.NamedSharding) -> jax.Array:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        shards: dict[layout.Box, list[Any]] = {}
        for device, index in sharding.addressable_devices_indices_map(sds.shape).items():
            shards.setdefault(_box(index, sds.shape), []).append(device)
        arrays = []
        for box, devices in shards.items():  # one read per distinct shard, dropped once on its devices
            host = layout.block(name, cfg, reader.read, box).astype(sds.dtype, copy=False)
            arrays += [jax.device_put(host, d) for d in devices]
            del host
        return jax.make_array_from_single_device_arrays(sds.shape, sharding, arrays)

    if jax.tree.leaves(abs_rest):
        raise ShardkitError("the GPT has state besides its parameters; models.hf loads parameters only")
    params = jax.tree_util.tree_map_with_path(place, nnx.to_pure_dict(abs_params), shardings)
    with nnx.use_eager_sharding(False):
        return nnx.merge(graphdef, params, abs_rest)


def from_pretrained(path: str | Path, mesh: Mesh, strategy: str | Strategy, **overrides: Any) -> tuple[GPT, GPTConfig]:
    """(the GPT with the folder's weights, sharded under `strategy` on `mesh`; its GPTConfig). `overrides`: GPTConfig
    fields config.json does not describe (dtype="bfloat16", param_dtype, remat, loss_chunk, max_seq_len, ...)."""
    cfg = read_config(path, **overrides)
    return load_params(path, cfg, mesh, strategy), cfg
