"""`--config.init_from=hf:<dir>`: a language-model run that starts from a local Hugging Face folder's weights.

The folder's config.json fixes the architecture (models/hf/config.py); of `config.model` only the fields Hugging Face
does not describe apply (dtype, param_dtype, remat, logits_dot_in_fp32, loss_chunk): the architecture fields there
are ignored. A fresh run loads the weights straight into the step's shardings (models/hf/load.py); a rerun resumes
from the run's own checkpoints as any run does. `--config.compile_only` reads config.json only, no weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_collections

import shardkit as sk
from models.gpt import GPTConfig

#: config.model fields that still apply to a model whose architecture comes from a Hugging Face config
TRAINING_FIELDS = ("dtype", "param_dtype", "remat", "logits_dot_in_fp32", "loss_chunk")


def hf_dir(config: ml_collections.ConfigDict) -> Path | None:
    """The folder `init_from` names ("hf:<dir>"), None when it is empty; anything else is a ShardkitError."""
    value = str(config.get("init_from", "") or "")
    if not value:
        return None
    if not value.startswith("hf:") or not value[3:]:
        raise sk.ShardkitError(f"init_from={value!r}: give hf:<a local Hugging Face model folder>, or nothing")
    if config.get("task", "lm") != "lm":
        raise sk.ShardkitError(f"init_from={value!r} loads a language model: task={config.task!r} has none")
    return Path(value[3:]).expanduser()


def model_config(config: ml_collections.ConfigDict, data_vocab: int) -> GPTConfig | None:
    """The GPTConfig of the `init_from` folder with the run's training fields, checked against the data and
    seq_len; None without init_from."""
    path = hf_dir(config)
    if path is None:
        return None
    from models import hf

    cfg = hf.read_config(path, **{k: config.model[k] for k in TRAINING_FIELDS if k in config.model})
    if cfg.vocab_size < data_vocab:
        raise sk.ShardkitError(f"init_from={config.init_from}: its vocabulary ({cfg.vocab_size}) is smaller than the "
                               f"data's ({data_vocab})")  # fmt: skip
    if config.seq_len > cfg.max_seq_len:
        raise sk.ShardkitError(f"seq_len={config.seq_len} > {cfg.max_seq_len}, the longest sequence {path} was made "
                               "for (max_position_embeddings, or Mistral's sliding window)")  # fmt: skip
    return cfg


def initial_model(config: ml_collections.ConfigDict, run: Any, say: Any) -> Any:
    """The fresh run's model: the folder's weights placed with the step's shardings; None without init_from."""
    path = hf_dir(config)
    if path is None:
        return None
    from models import hf

    model = hf.load_params(path, run.model_cfg, run.mesh, run.step.strategy)
    say(f"initialised from {path} (Hugging Face weights, each device's shard read alone)")
    return model
