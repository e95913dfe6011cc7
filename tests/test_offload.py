"""Host offload of the training state (`Strategy.offload`, shardkit/offload.py): the optimizer state and the
parameters rest in `pinned_host` memory between steps and train exactly as without offload; what cannot be
offloaded is refused before XLA.

Tolerance: none. Offload only moves arrays between memory kinds (the step's copies in and out, which XLA:CPU
compiles as copies between its two memory spaces); every arithmetic operation is the same, on the same values, in
the same order, so the losses and parameters are bit-identical to the run without offload (checked with
`array_equal`). The run without offload is itself checked against one device by tests/test_parity.py (fsdp).
"""

from __future__ import annotations

import functools
import types

import jax
import numpy as np
import optax
import pytest
from common import TINY, make_batch, train

import shardkit as sk
from experiments import runtime
from experiments.configs import base
from models.gpt import GPT

MESH = "data=2,fsdp=4"
HOST = sk.offload.HOST


@functools.cache
def run(offload: str) -> tuple[np.ndarray, dict, sk.TrainStep, sk.TrainState]:
    """3 AdamW steps of the tiny GPT under fsdp on 8 devices, with `offload` (its moments and count offloaded too)."""
    return train(sk.make_mesh(MESH), sk.strategy("fsdp").replace(offload=offload), tx=optax.adamw(1e-2))


def test_offloaded_state_trains_bit_identically_and_rests_in_host_memory():
    losses, params, step, state = run("opt_state,params")
    want_losses, want, _, _ = run("")
    np.testing.assert_array_equal(losses, want_losses)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), strict=True):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.params, state.opt_state))}
    assert kinds == {"pinned_host"}, kinds
    # the compiled program takes and returns them in host memory: its entry layout's S(5) bytes are the state's
    compiled = step.lower(state, make_batch()).compile()
    shard = lambda x: x.addressable_shards[0].data.nbytes
    state_bytes = sum(shard(x) for x in jax.tree.leaves((state.params, state.opt_state)))
    host = sk.offload.host_bytes(compiled)
    assert host["host_arguments"] == host["host_outputs"] == state_bytes, (host, state_bytes)
    # evaluation and the eager model read the offloaded parameters from host memory
    assert float(step.eval_loss(state, make_batch())) == float(run("")[2].eval_loss(run("")[3], make_batch()))


def test_offload_names_are_checked_and_the_config_field_reaches_the_strategy():
    assert sk.strategy("fsdp").replace(offload="params, opt_state").offload == ("params", "opt_state")
    with pytest.raises(sk.ShardkitError, match=r"'grads' cannot be offloaded; choose from opt_state, params"):
        sk.strategy("fsdp").replace(offload=("grads",))
    config = base.get_config()
    config.offload = "opt_state"
    assert runtime.strategy_of(config, 8).offload == ("opt_state",)


def test_offload_is_refused_by_steps_that_do_not_implement_it_and_by_backends_without_host_memory():
    model = sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs))
    sdp = sk.strategy("sdp").replace(offload="opt_state")
    with pytest.raises(sk.ShardkitError, match=r"the 'sdp' train step keeps its state on the devices"):
        sk.make_train_step(model, optax.sgd(0.1), sk.make_mesh("data=8"), sdp)
    memory = lambda kind: types.SimpleNamespace(kind=kind)
    device = types.SimpleNamespace(addressable_memories=lambda: [memory("device")],
                                   default_memory=lambda: memory("device"))  # fmt: skip
    assert sk.offload.unsupported([device]) == "its devices have memory kinds ['device'], no 'pinned_host'"
    assert sk.offload.unsupported(jax.devices()) == ""  # this CPU backend has pinned_host (jax >= 0.10)


def test_activation_offload_stays_refused_on_cpu_because_xla_cpu_compiles_the_moves_away():
    """The `offload:` remat policy's refusal (tests/test_remat.py) is the backend's behaviour, checked here: the
    policy compiles on XLA:CPU, but its program has no host memory space (S(5)) anywhere, unlike the state offload."""
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=("h",), offload_src="device", offload_dst=HOST
    )

    def layer(w: jax.Array, x: jax.Array) -> jax.Array:
        return (sk.layers.tag(jax.numpy.tanh(x @ w), "h") @ w).sum()

    w, x = jax.numpy.ones((8, 8)), jax.numpy.ones((4, 8))
    text = jax.jit(jax.grad(jax.checkpoint(layer, policy=policy))).lower(w, x).compile().as_text()
    assert "S(5)" not in text


def test_an_offloaded_state_checkpoints_and_restores_into_host_memory(tmp_path):
    """The checkpoint's checksums are computed on the devices (XLA computes on device memory only); the restored
    arrays are the saved ones, laid out by the step's abstract state: in host memory again."""
    _, _, step, state = run("opt_state,params")
    with sk.Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(state)
        ckpt.wait()
        restored, _ = ckpt.restore(step.abstract_state())
    for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state)), strict=True):  # fmt: skip
        assert a.sharding.memory_kind == HOST and np.array_equal(np.asarray(a), np.asarray(b))
