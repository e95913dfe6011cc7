"""Small shared pieces for the tests: a tiny GPT, a deterministic batch, a training loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardkit as sk
from models.gpt import GPT, GPTConfig

# 2 layers, width 64, 4 query heads over 2 KV heads (GQA), vocab 128: divisible by every 8-device mesh we use.
TINY = GPTConfig(
    num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=128, max_seq_len=32
)


def make_batch(batch: int = 16, seq: int = 32, vocab: int = 128, seed: int = 0) -> dict[str, jax.Array]:
    toks = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1))
    return {"inputs": jnp.asarray(toks[:, :-1], jnp.int32), "targets": jnp.asarray(toks[:, 1:], jnp.int32)}


def one_device_mesh():
    return sk.make_mesh("data=1", jax.devices()[:1])


def train(mesh, strategy, tx=None, steps=3, cfg=TINY, microbatches=1, batch=None, seed=0):
    """Runs `steps` steps from seed 0; returns (losses, params as numpy, step, final state)."""
    tx = tx or optax.sgd(0.5, momentum=0.9)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=seed)
    step = sk.make_train_step(model, tx, mesh, strategy, microbatches=microbatches)
    state = step.init_state()
    batch = make_batch(vocab=cfg.vocab_size) if batch is None else batch
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params), step, state


def run_steps(step: Any, batch: Any, steps: int) -> tuple[np.ndarray, Any]:
    """(the losses, the final state) of `steps` steps of `step` from its initial state on one batch."""
    state, losses = step.init_state(), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


def override(config: Any, values: dict[str, Any]) -> Any:
    """Sets dotted fields of an ml_collections config, as `--config.a.b=v` would: {"model.widths": (4, 8)}."""
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config
