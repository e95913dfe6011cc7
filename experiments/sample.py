"""Generate text from a run's latest checkpoint (byte-level runs), on one device.

    python -m experiments.sample --run runs/gpt_tiny-fsdp --prompt "def " [--max_new_tokens 300]
        [--temperature 0.8 --top_k 40 --seed 0 | --temperature 0 (greedy)] [--step 200]

The model is rebuilt from `<run>/config.json` and the checkpoint is restored onto a one-device mesh, whatever
mesh and strategy wrote it. Each new token runs the model on the last `max_seq_len` tokens, padded to that fixed
length (one compilation; causal attention makes the padding invisible): no KV cache, fine for small models.
An empty prompt starts a new document (the EOT token every training document ends with).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

import shardkit as sk
from experiments.data.text import EOT, VOCAB_SIZE
from experiments.train import make_optimizer
from models.gpt import GPT, GPTConfig
from shardkit.checkpoint import Checkpointer


def load(run_dir: str | Path, step: int | None = None, device: Any = None) -> tuple[GPT, dict[str, Any], int]:
    """(model holding the checkpoint's parameters on `device`, the run's config dict, the restored step)."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise sk.ShardkitError(f"{cfg_path} not found: give the directory of a run of experiments.train")
    config = json.loads(cfg_path.read_text())
    model_cfg = GPTConfig(**config["model"])
    tx, _ = make_optimizer(ml_collections.ConfigDict(config["optimizer"]), config["steps"])
    mesh = sk.make_mesh("data=1", [device or jax.devices()[0]])
    abstract = sk.abstract_model(lambda rngs: GPT(model_cfg, rngs=rngs))
    train_step = sk.make_train_step(abstract, tx, mesh, "dp")
    ckpt = Checkpointer(run_dir / "checkpoints", async_save=False, read_only=True)  # the run may still be training
    try:
        step = ckpt.latest_step() if step is None else step
        state, _ = ckpt.restore(train_step.abstract_state(), step)
    finally:
        ckpt.close()
    return train_step.model(state.params), config, int(state.step)


def generate(
    model: GPT,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    vocab: int = VOCAB_SIZE,
    stop_token: int | None = EOT,
) -> list[int]:
    """Token ids after `prompt`: greedy if temperature == 0, else softmax(logits / T) over the top_k (0 = all)."""
    window = model.cfg.max_seq_len
    graphdef, params = nnx.split(model)

    @jax.jit
    def next_token(params: Any, tokens: jax.Array, pos: jax.Array, key: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(tokens)[0, pos].astype(jnp.float32)
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)  # padded vocabulary
        if temperature == 0:
            return jnp.argmax(logits)
        if top_k:
            logits = jnp.where(logits >= jax.lax.top_k(logits, top_k)[0][-1], logits, -jnp.inf)
        return jax.random.categorical(key, logits / temperature)

    out, key = list(prompt) or [EOT], jax.random.key(seed)
    n_prompt = len(out)
    for i in range(max_new_tokens):
        ctx = out[-window:]
        tokens = np.zeros((1, window), np.int32)
        tokens[0, : len(ctx)] = ctx
        tok = int(next_token(params, jnp.asarray(tokens), jnp.asarray(len(ctx) - 1), jax.random.fold_in(key, i)))
        if tok == stop_token:
            break
        out.append(tok)
    return out[n_prompt:]


def sample(
    run_dir: str | Path,
    prompt: str = "",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    step: int | None = None,
) -> str:
    """The prompt followed by generated text (bytes decoded as UTF-8, invalid sequences replaced)."""
    model, config, _ = load(run_dir, step)
    data_vocab = config.get("info", {}).get("data_vocab_size", VOCAB_SIZE)
    if data_vocab != VOCAB_SIZE:
        raise sk.ShardkitError(f"{run_dir} was trained on {data_vocab}-token data: sample decodes byte-level runs only")
    ids = generate(model, list(prompt.encode("utf-8")), max_new_tokens, temperature, top_k, seed, VOCAB_SIZE)
    return prompt + bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m experiments.sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run directory (runs/<name>)")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=40, help="sample among the k most likely bytes (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    a = p.parse_args(argv)
    logging.set_verbosity(logging.ERROR)  # orbax warns that a read-only checkpoint directory is read-only
    try:
        text = sample(a.run, a.prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed, a.step)
    except sk.ShardkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
