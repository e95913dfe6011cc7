"""models/resnet.py on scikit-learn's digits: sharded = one device under dp, fsdp and tp_channels; train.py end to end.

Parity tolerance. The ResNet has BatchNorm (batch statistics in training, running statistics updated by the step)
and dropout (0.25, on the pooled features). The sharded and single-device programs compute the same function and
differ only in the order fp32 partial sums are reduced: per shard, then an all-reduce (convolutions' weight
gradients and BatchNorm's means and variances over the batch; under fsdp / tp_channels also the channel-sharded
contractions). Measured: losses agree to ~2e-7 relative, kernels and BatchNorm statistics to ~1e-7 - 3e-7 of their
scale; the largest relative gap, ~2e-6, is in BatchNorm biases, which start at 0 and after 3 steps are ~0.01: their
gradient sums terms that nearly cancel, so the same ~1e-8 absolute noise is a larger fraction of a small array.
3 SGD steps (momentum 0.9) do not amplify it. We assert 1e-5 on the losses and on every parameter and statistic
relative to its array's scale (the bound of tests/test_any_model.py; 5x above the worst case).
Dropout draws the same mask on every mesh because threefry is partitionable (jax_threefry_partitionable, jax's
default): a random bit depends on its global index, not on which device draws it, and the key itself is replicated
model state advanced identically by every step.

End to end: `experiments.train.train` on the resnet_digits config with tiny widths; an interrupted run resumed from
its checkpoint (parameters, optimizer state, BatchNorm statistics, dropout's RNG counter) executes the same XLA
program on the same batches, so its losses equal the uninterrupted run's (held to 1e-6 as in test_experiments.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import one_device_mesh, override
from flax import nnx
from test_experiments import metrics

import shardkit as sk
from experiments import plot
from experiments import train as tr
from experiments.configs import resnet_digits
from experiments.data import images
from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss

CFG = ResNetConfig(widths=(4, 8), blocks=(1, 1), dropout=0.25)  # stage 2: stride 2 + 1x1 projection
MESHES = {"dp": "data=8", "fsdp": "data=2,fsdp=4", "tp_channels": "data=4,tensor=2"}


@pytest.fixture(scope="module")
def digits() -> images.ImageDataset:
    return images.load_digits()


def _run(mesh: Any, strategy: str, batch: dict[str, np.ndarray], steps: int = 3) -> dict[str, Any]:
    model = sk.sharded_init(lambda rngs: ResNet(CFG, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(model, optax.sgd(0.1, momentum=0.9), mesh, strategy, loss_fn=classification_loss,
                              batch_axes=BATCH_AXES)  # fmt: skip
    state, losses = step.init_state(), []
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    eval_loss, aux = step.evaluate(state, batch)
    as_np = lambda tree: jax.tree.map(np.asarray, tree)
    return dict(losses=np.array(losses), params=as_np(state.params), stats=as_np(state.model_state),
                eval=(float(eval_loss), float(aux["accuracy"])), state=state)  # fmt: skip


def _assert_close(got: Any, want: Any, rtol: float = 1e-5) -> float:
    worst = 0.0

    def rel(path: Any, a: np.ndarray, b: np.ndarray) -> None:
        nonlocal worst
        err = float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-12))
        worst = max(worst, err)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: max |diff| / max |ref| = {err:.3g} > {rtol}"

    jax.tree_util.tree_map_with_path(rel, got, want)
    return worst


@pytest.fixture(scope="module")
def reference(digits: images.ImageDataset) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    batch = images.host_batch(digits, 0, 16)
    return batch, _run(one_device_mesh(), "dp", batch)


@pytest.mark.parametrize("strategy", list(MESHES))
def test_resnet_matches_one_device(strategy: str, reference: tuple) -> None:
    batch, want = reference
    mesh = sk.make_mesh(MESHES[strategy])
    got = _run(mesh, strategy, batch)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    assert want["losses"][-1] < want["losses"][0]  # it trains
    _assert_close(got["params"], want["params"])
    _assert_close(got["stats"], want["stats"])  # BatchNorm running statistics and the dropout RNG counter
    assert int(got["stats"]["dropout"]["rngs"]["count"]) == 3  # dropout drew a mask in each training step
    np.testing.assert_allclose(got["eval"], want["eval"], rtol=1e-5)
    kernel = got["state"].params["stages"][1]["first"]["conv2"]["kernel"]  # [3, 3, 8, 8], output channels named
    axis = {"dp": None, "fsdp": "fsdp", "tp_channels": "tensor"}[strategy]
    want_spec = jax.sharding.PartitionSpec(None, None, None, axis) if axis else jax.sharding.PartitionSpec()
    assert kernel.sharding.spec == want_spec


def test_stacked_blocks_scan_equals_the_blocks_one_by_one(digits: images.ImageDataset) -> None:
    """Each stage's identity blocks are one stacked module (leading `layers` dimension) run by `lax.scan`: in train
    mode its logits, gradients and updated BatchNorm statistics are those of the same blocks applied one at a time."""
    cfg = ResNetConfig(widths=(8, 16), blocks=(3, 2), dropout=0.0)  # stacks of 2 and 1 blocks, fp32
    with nnx.use_eager_sharding(False):
        model = ResNet(cfg, rngs=nnx.Rngs(0))
    batch = images.host_batch(digits, 0, 16)
    for i, stage in enumerate(model.stages):
        assert stage.stack.conv1.kernel.shape[0] == cfg.blocks[i] - 1
    for axes in (sk.param_logical_axes(model), sk.state_logical_axes(nnx.state(model, nnx.BatchStat), require=False)):
        for path, names in jax.tree_util.tree_leaves_with_path(axes, is_leaf=lambda x: isinstance(x, tuple)):
            stacked = jax.tree_util.keystr(path).startswith("['stages']") and "['stack']" in jax.tree_util.keystr(path)
            assert (names[:1] == ("layers",)) == stacked, (jax.tree_util.keystr(path), names)

    def unrolled(m: ResNet, x: jax.Array) -> jax.Array:  # the reference: block l of a stack merged from slice l
        x = nnx.relu(m.stem_norm(m.stem(x)))
        for stage in m.stages:
            x = stage.first(x)
            graphdef, stacked = nnx.split(stage.stack)
            new = []
            for layer in range(jax.tree.leaves(stacked)[0].shape[0]):
                block = nnx.merge(graphdef, jax.tree.map(lambda a, layer=layer: a[layer], stacked))
                x = block(x)
                new.append(nnx.state(block, nnx.BatchStat))
            nnx.update(stage.stack, jax.tree.map(lambda *a: jnp.stack(a), *new))
        return m.head(m.dropout(x.mean(axis=(1, 2))))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def run(forward: Any) -> tuple:
        def loss(params: nnx.State, rest: nnx.State) -> tuple:
            m = nnx.merge(graphdef, params, rest, copy=True)  # fresh variables of this trace
            logits = forward(m, batch["image"])
            return sk.cross_entropy(logits, batch["label"]), (logits, nnx.state(m, nnx.BatchStat))

        (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, rest)
        return jax.tree.map(np.asarray, (logits, nnx.to_pure_dict(grads), nnx.to_pure_dict(stats)))

    got, want = run(lambda m, x: m(x)), run(unrolled)
    # Same ops on the same values, only scan (a while loop) vs unrolled code. Forward (logits, statistics): 1e-6 of
    # each array's scale (measured: bit-equal). Gradients: the scan's transpose (stacked weight gradients, the loop
    # run backwards) is another program than the unrolled backward, and XLA reorders its fp32 sums over the
    # batch x height x width terms: measured up to 9.4e-7 of an array's scale (~6e-8 absolute, stages/0/stack/conv1),
    # so 5e-6 (5x the worst case, as the parity bound above).
    _assert_close(got[0], want[0], rtol=1e-6)
    _assert_close(got[1], want[1], rtol=5e-6)
    _assert_close(got[2], want[2], rtol=1e-6)
    before = nnx.to_pure_dict(rest)["stages"][0]["stack"]["norm1"]["mean"]
    assert np.abs(got[2]["stages"][0]["stack"]["norm1"]["mean"] - before).max() > 1e-3  # train mode: updated

    model.eval()  # running statistics used and left unchanged
    stats = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
    model(batch["image"])
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), stats)


def test_batches_are_a_function_of_seed_and_step(digits: images.ImageDataset) -> None:
    n = len(digits.train_labels)
    epoch = np.concatenate([images.batch_indices(n, s, 7, seed=3) for s in range(-(-n // 7))])[:n]
    assert sorted(epoch) == list(range(n))  # every train image once per epoch, batches straddling epochs
    np.testing.assert_array_equal(images.batch_indices(n, 40, 16, 3), images.batch_indices(n, 40, 16, 3))
    assert not np.array_equal(images.batch_indices(n, 40, 16, 3), images.batch_indices(n, 40, 16, 4))
    assert len(digits.val_labels) == 320 and len(digits.train_labels) == 1477
    assert digits.train_images.dtype == np.float32 and 0.0 <= digits.train_images.min() < digits.train_images.max() <= 1
    assert not set(map(bytes, digits.val_images)) & set(map(bytes, digits.train_images[:200]))  # held out


# ----------------------------------------------------------------------------------- experiments.train end to end
TINY = {
    "model.widths": (4, 8), "batch_size": 16, "steps": 8, "eval_every": 4, "ckpt_every": 4, "eval_batches": 1,
    "optimizer.lr": 1e-2, "optimizer.warmup_steps": 2, "optimizer.decay_steps": 8, "progress": False,
    "jax_cache_dir": "", "peak_flops": 1e9,
}  # fmt: skip


def make_config(tmp: Path, name: str, **overrides: Any) -> Any:
    return override(resnet_digits.get_config(), {**TINY, "run_dir": str(tmp / "runs"), "name": name, **overrides})


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resnet_digits")


def test_train_logs_val_accuracy_and_resumes_exactly(tmp: Path) -> None:
    full = tr.train(make_config(tmp, "full"))
    m = metrics(full["run_dir"])
    assert sorted(m) == list(range(1, 9)) and full["step"] == 8
    assert {"loss", "accuracy", "grad_norm", "lr", "examples", "examples_per_s", "mfu", "step_time"} <= m[1].keys()
    assert "tokens_per_s" not in m[1] and m[1]["examples"] == 16 and m[1]["mfu"] > 0
    assert [k for k in m if "val_accuracy" in m[k]] == [4, 8] and 0 <= m[8]["val_accuracy"] <= 1
    assert full["val_accuracy"] == m[8]["val_accuracy"] and full["examples_per_s"] > 0
    config = json.loads((Path(full["run_dir"]) / "config.json").read_text())
    assert config["task"] == "image_classification" and config["model"]["widths"] == [4, 8]

    first = tr.train(make_config(tmp, "halves", steps=4))  # same schedule (decay_steps=8), stopped at 4
    shutil.copytree(tmp / "runs" / "halves", tmp / "at4")
    second = tr.train(make_config(tmp, "halves"))
    assert (first["step"], second["start_step"], second["step"]) == (4, 4, 8)
    got = metrics(second["run_dir"])
    assert sorted(got) == list(range(1, 9))
    for key in ("loss", "grad_norm", "accuracy"):
        np.testing.assert_allclose([got[k][key] for k in got], [m[k][key] for k in got], rtol=1e-6, err_msg=key)
    np.testing.assert_allclose([got[8]["val_loss"], got[8]["val_accuracy"]], [m[8]["val_loss"], m[8]["val_accuracy"]],
                               rtol=1e-6)  # fmt: skip

    out = tmp / "digits.png"
    assert plot.main([full["run_dir"], second["run_dir"], "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_image_config_errors_name_the_fix(tmp: Path) -> None:
    cases = {
        "320 validation images do not split into 3 equal batches": {"eval_batches": 3},
        "(3, 3, 4, 4): dimension 3 ('channels' = 4) is not divisible by mesh axes ('fsdp',) of size 8": {
            "strategy": "fsdp",
            "mesh": "fsdp=8",
        },
        "task='video'; available: lm, image_classification": {"task": "video"},
    }
    for message, overrides in cases.items():
        with pytest.raises(sk.ShardkitError, match=re.escape(message)):
            tr.build(make_config(tmp, "bad", **overrides))


def test_default_warmup_follows_the_run_length() -> None:
    """warmup_steps = -1 (base.py's default) is min(30, steps // 10): `--config.steps=30` runs with 3 warmup steps."""
    opt = resnet_digits.get_config().optimizer
    assert opt.warmup_steps == -1
    for steps, warmup in ((30, 3), (400, 30), (5, 0)):
        _, schedule = tr.make_optimizer(opt, steps)
        lrs = np.asarray(schedule(np.arange(steps + 1)))
        assert int(np.argmax(lrs)) == warmup and np.isclose(lrs.max(), opt.lr)
    opt.warmup_steps = 30  # set explicitly: kept, and checked against the run length
    with pytest.raises(sk.ShardkitError, match=re.escape("warmup_steps=30 must be < 30")):
        tr.make_optimizer(opt, 30)
