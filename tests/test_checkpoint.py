"""shardkit.checkpoint: round trip, keep-last-k, resharding restore, atomicity, refusal of non-finite states."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import TINY

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit.checkpoint import TMP_MARKER, Checkpointer, NonFiniteError, all_finite, tmp_dirs

CFG = GPTConfig(**{**TINY.__dict__, "num_kv_heads": 4})  # kv_heads divisible by tensor=4


def make_step(mesh_spec: str, strategy: str, cfg: GPTConfig = CFG) -> sk.TrainStep:
    mesh = sk.make_mesh(mesh_spec)
    model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=0)
    return sk.make_train_step(model, optax.adamw(1e-3), mesh, strategy)


@pytest.fixture(scope="module")
def fsdp_state() -> tuple[sk.TrainStep, sk.TrainState]:
    step = make_step("fsdp=8", "fsdp")
    state = step.init_state()
    # Distinct values everywhere (also in the optimizer state), so a mixed-up leaf cannot pass.
    leaves, treedef = jax.tree.flatten(state)
    leaves = [x + i if jnp.issubdtype(x.dtype, jnp.floating) else x for i, x in enumerate(leaves)]
    return step, jax.tree.unflatten(treedef, leaves)


def assert_trees_equal(a: object, b: object) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_keeps_the_last_k(tmp_path: Path, fsdp_state: tuple) -> None:
    step, state = fsdp_state
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for k in (1, 2, 3):
            assert ckpt.save(state.replace(step=jnp.asarray(k, jnp.int32)), meta={"k": k})
        assert not ckpt.save(state.replace(step=jnp.asarray(3, jnp.int32)))  # already saved: a no-op
        ckpt.wait()
        assert ckpt.steps() == [2, 3] and ckpt.latest_step() == 3
        restored, meta = ckpt.restore(step.abstract_state())
    assert meta == {"k": 3} and int(restored.step) == 3
    assert_trees_equal(restored.params, state.params)
    assert_trees_equal(restored.opt_state, state.opt_state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    with Checkpointer(tmp_path, keep=2) as again:  # a new process sees the same committed steps
        assert again.steps() == [2, 3] and again.read_meta(2) == {"k": 2}


def test_restore_onto_another_mesh_and_strategy(tmp_path: Path, fsdp_state: tuple) -> None:
    _, state = fsdp_state
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
    tp = make_step("data=2,tensor=4", "tp")
    target = tp.abstract_state()
    with Checkpointer(tmp_path) as ckpt:
        restored, _ = ckpt.restore(target)
    assert_trees_equal(restored, state)
    jax.tree.map(
        lambda r, t: r.sharding.is_equivalent_to(t.sharding, r.ndim) or pytest.fail(str(r.sharding)), restored, target
    )
    assert restored.params["blocks"]["wo"].sharding.spec != state.params["blocks"]["wo"].sharding.spec


def test_interrupted_save_is_ignored_then_cleaned(tmp_path: Path, fsdp_state: tuple, monkeypatch) -> None:
    step, state = fsdp_state
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
    # What a SIGKILL mid-save leaves (tests/test_experiments.py kills a real save): a half-written tmp dir.
    junk = tmp_path / f"7{TMP_MARKER}" / "state"
    junk.mkdir(parents=True)
    (junk / "half_written").write_bytes(b"\0" * 10)
    with Checkpointer(tmp_path, read_only=True) as reader:  # a sampler next to a live run: touches nothing
        assert reader.latest_step() == 0
        with pytest.raises(sk.ShardkitError, match="read-only"):
            reader.save(state.replace(step=jnp.asarray(1, jnp.int32)))
    assert tmp_dirs(tmp_path) == [f"7{TMP_MARKER}"]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 0 and ckpt.steps() == [0]
        restored, _ = ckpt.restore(step.abstract_state())
        # a save still in flight (orbax lists it from the start) is not the latest good step before it commits: a
        # peer dying now must not make a survivor name it (tests/test_multiprocess.py kills one inside a save)
        ckpt.save(state.replace(step=jnp.asarray(3, jnp.int32)))
        with monkeypatch.context() as m:
            m.setattr(ckpt._manager, "is_saving_in_progress", lambda: True)
            assert ckpt.latest_step() == 0 and ckpt.steps() == [0]
        ckpt.wait()
        assert ckpt.latest_step() == 3 and ckpt.steps() == [0, 3]
    assert_trees_equal(restored.params, state.params)
    assert tmp_dirs(tmp_path) == []  # deleted by the new Checkpointer (in the background, awaited by close)


def test_non_finite_state_is_never_saved(tmp_path: Path, fsdp_state: tuple) -> None:
    _, state = fsdp_state
    bad = state.replace(
        step=jnp.asarray(5, jnp.int32), params=jax.tree.map(lambda x: x.at[0].set(jnp.nan), state.params)
    )
    assert all_finite(state) and not all_finite(bad)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state)
        with pytest.raises(NonFiniteError, match=r"step 5.*last good checkpoint is step 0"):
            ckpt.save(bad)
        assert ckpt.steps() == [0]
    assert sorted(os.listdir(tmp_path)) == ["0"]


def test_restore_errors_name_the_problem(tmp_path: Path, fsdp_state: tuple) -> None:
    _, state = fsdp_state
    with Checkpointer(tmp_path / "empty") as ckpt, pytest.raises(sk.ShardkitError, match="no checkpoint"):
        ckpt.restore(make_step("fsdp=8", "fsdp").abstract_state())
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(state)
    wider = make_step("fsdp=8", "fsdp", GPTConfig(**{**CFG.__dict__, "d_model": 128}))
    with Checkpointer(tmp_path / "run") as ckpt, pytest.raises(sk.ShardkitError, match="different model"):
        ckpt.restore(wider.abstract_state())
    with pytest.raises(sk.ShardkitError, match="keep"):
        Checkpointer(tmp_path / "x", keep=0)
