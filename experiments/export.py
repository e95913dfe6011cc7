"""Export a run's checkpoint as a Hugging Face folder (config.json + safetensors) that transformers loads.

    python -m experiments.export --run runs/llama_tiny_finetune-fsdp --to /tmp/llama_ft [--step 60]
        [--model_type llama|mistral|qwen2] [--dtype bfloat16] [--max_shard_mb 2048] [--logits /tmp/ft_logits.npz]

The GPT is rebuilt from `<run>/config.json` and its checkpoint restored on one device, whatever mesh and strategy
wrote it (experiments/sample.py's `load`: parameters and optimizer state, so the host needs about 3x the model's
fp32 bytes); models/hf/save.py writes one safetensors file per `max_shard_mb` with an index. `model_type` defaults
to the family of the run's `init_from` folder, else qwen2 for a model with Q/K/V biases and llama otherwise; dtype
to the parameters' own. A model loaded from Hugging Face and exported unchanged is the same bytes (tests/test_hf.py).
`--logits` also writes the fp32 logits shardkit computes for two random token rows (int32 `tokens` [2, 12],
`logits`), which `experiments/reference/make_hf_assets.py --check <to> --logits <file>` compares with what
transformers computes from the export.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from absl import logging

import shardkit as sk
from models import hf
from models.gpt import GPTConfig


def source_family(config: dict) -> str | None:
    """The model_type of the folder the run was initialised from (`init_from=hf:<dir>`), if it is still there."""
    value = str(config.get("init_from") or "")
    folder = Path(value[3:]).expanduser() if value.startswith("hf:") else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    return json.loads((folder / "config.json").read_text()).get("model_type")


def export(run: str | Path, to: str | Path, step: int | None = None, model_type: str | None = None,
           dtype: str | None = None, max_shard_mb: float = 2048,
           logits: str | Path | None = None) -> list[Path]:  # fmt: skip
    """Writes the run's checkpoint (`step`, default the latest) to `to`; returns the files written."""
    from experiments.sample import load

    model, config, _ = load(run, step)
    cfg = GPTConfig(**config["model"])
    files = hf.save_pretrained(model, cfg, to, model_type=model_type or source_family(config), dtype=dtype,
                               max_shard_bytes=int(max_shard_mb * 2**20))  # fmt: skip
    if logits:
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
        np.savez(logits, tokens=tokens, logits=np.asarray(jax.jit(lambda m, t: m(t))(model, tokens), np.float32))
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m experiments.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (runs/<name>)")
    p.add_argument("--to", required=True, help="the Hugging Face folder to write (new or empty)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--model_type", default=None, choices=("llama", "mistral", "qwen2", "gemma"))
    p.add_argument("--dtype", default=None, help="tensor dtype on disk, e.g. bfloat16 (default: the parameters')")
    p.add_argument("--max_shard_mb", type=float, default=2048, help="largest safetensors file")
    p.add_argument("--logits", default=None, help="also write shardkit's logits of 2 random rows here (.npz)")
    a = p.parse_args(argv)
    logging.set_verbosity(logging.ERROR)  # orbax warns that a read-only checkpoint directory is read-only
    try:
        files = export(a.run, a.to, a.step, a.model_type, a.dtype, a.max_shard_mb, a.logits)
    except sk.ShardkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} files to {a.to}: {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
