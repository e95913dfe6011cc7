"""hetero_dp with model state (shardkit/parallel/hetero/step.py, shardkit/batch_layers.py): the ResNet's BatchNorm
and dropout under uneven per-device micro-batch counts.

- Global statistics (the default `norm` kernel): each device runs its micro-batch slots as the lanes of one vmap,
  padding masked out of every BatchNorm's sums, which are all-reduced before normalising: 3 fp32 SGD steps equal
  one device and even dp in the losses, every parameter and every BatchNorm running statistic (relative to its
  array's scale, 1e-5: the matrix's bound; reduction order only, per-lane sums then the all-reduce; observed
  <= 1.1e-6). The RNG counters are compared exactly.
- `norm=group`: per-micro-batch statistics in the per-device loops = one device with `norm=group:G` (G micro-batches
  of the global batch, in order), running statistics averaged over them as that kernel averages its groups'.
- Dropout: example i's mask comes from fold_in(key, i), i its global row, on any split (checked bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk
from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss

CFG = ResNetConfig(widths=(8, 16), blocks=(1, 2), num_classes=8, dropout=0.25)  # stage 2 has a scanned stack
COUNTS, MB = [3, 2, 2, 1, 1, 1, 1, 1], 2  # 12 micro-batches of 2 = 24 images (3 per device under even dp)
RTOL = 1e-5


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = sum(COUNTS) * MB
    return {"image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32), "label": rng.integers(0, 8, n)}


def _run(mesh, strategy, steps: int = 3) -> dict:
    model = sk.sharded_init(lambda rngs: ResNet(CFG, rngs=rngs), mesh, "dp", seed=0)
    step = sk.make_train_step(model, optax.sgd(0.1, momentum=0.9), mesh, strategy, loss_fn=classification_loss,
                              batch_axes=BATCH_AXES)  # fmt: skip
    state, losses = step.init_state(), []
    for _ in range(steps):
        state, metrics = step(state, _batch())
        losses.append(float(metrics["loss"]))
    as_np = lambda t: jax.tree.map(np.asarray, t)
    return {"losses": np.array(losses), "params": as_np(state.params), "stats": as_np(state.model_state)}


def _gap(got: dict, want: dict) -> float:
    worst = float(np.max(np.abs(got["losses"] - want["losses"]) / np.abs(want["losses"])))
    for part in ("params", "stats"):
        for a, b in zip(jax.tree.leaves(got[part]), jax.tree.leaves(want[part]), strict=True):
            if not np.issubdtype(b.dtype, np.floating):  # RNG counters: the same number of draws
                np.testing.assert_array_equal(a, b)
                continue
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)))
    return worst


@pytest.fixture(scope="module")
def one_device() -> dict:
    return _run(sk.make_mesh("data=1", jax.devices()[:1]), "dp")


def test_hetero_resnet_equals_one_device_and_even_dp(one_device):
    mesh = sk.make_mesh({"data": 8})
    hetero = _run(mesh, sk.hetero.make_strategy(COUNTS, microbatch=MB))
    assert _gap(hetero, one_device) <= RTOL
    assert _gap(hetero, _run(mesh, "dp")) <= RTOL
    assert not np.allclose(hetero["stats"]["stem_norm"]["mean"], 0)  # the running statistics did move


def test_per_microbatch_statistics_equal_one_device_with_as_many_groups():
    groups = sk.strategy("dp").replace(kernels={"norm": f"group:{sum(COUNTS)}"})
    want = _run(sk.make_mesh("data=1", jax.devices()[:1]), groups, steps=2)
    per_mb = sk.hetero.make_strategy(COUNTS, microbatch=MB).replace(kernels={"norm": "group"})
    got = _run(sk.make_mesh({"data": 8}), per_mb, steps=2)
    assert _gap(got, want) <= RTOL


def test_dropout_masks_are_per_example_and_independent_of_the_split():
    fresh = lambda: sk.layers.Dropout(0.5, rngs=nnx.Rngs(dropout=3))
    key = fresh().rngs()  # the key the layer's first call draws from its stream
    x = jnp.ones((6, 32))
    y = fresh()(x)  # outside any step: rows 0..5
    for i in range(6):  # example i's mask is bernoulli(fold_in(key, i)), whatever its neighbours
        np.testing.assert_array_equal(y[i] != 0, jax.random.bernoulli(jax.random.fold_in(key, i), 0.5, (32,)))
    assert len({tuple(np.asarray(r != 0)) for r in y}) == 6  # every example its own mask
    rows = jnp.array([4, 1])
    with sk.layers.local_batch(rows):  # two of the examples, as a device of hetero_dp sees them
        np.testing.assert_array_equal(fresh()(x[:2]), y[rows])


class _Flax(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, bn: bool):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs) if bn else nnx.data(None)
        self.drop = nnx.Dropout(0.1, rngs=rngs) if not bn else nnx.data(None)


class _Cache(nnx.Variable):
    pass


def test_model_state_it_cannot_carry_is_named():
    mesh, strategy = sk.make_mesh({"data": 8}), sk.hetero.make_strategy([1] * 8)
    make = lambda model: sk.make_train_step(model, optax.sgd(0.1), mesh, strategy, loss_fn=lambda m, b: 0.0)
    with nnx.use_eager_sharding(False):
        with pytest.raises(sk.ShardkitError, match=r"bn is Flax's nnx.BatchNorm.*sk.layers.BatchNorm"):
            make(_Flax(nnx.Rngs(0), bn=True))
        with pytest.raises(sk.ShardkitError, match=r"drop is Flax's nnx.Dropout.*sk.layers.Dropout"):
            make(_Flax(nnx.Rngs(0), bn=False))
        model = _Flax(nnx.Rngs(0), bn=False)
        model.drop, model.cache = nnx.data(None), _Cache(jnp.zeros(3))
        with pytest.raises(sk.ShardkitError, match=r"model state cache \(_Cache\)"):
            make(model)
        model = ResNet(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(sk.ShardkitError, match=r"norm='group:4'.*drop the count"):
        sk.make_train_step(model, optax.sgd(0.1), mesh, strategy.replace(kernels={"norm": "group:4"}),
                           loss_fn=classification_loss, batch_axes=BATCH_AXES)  # fmt: skip


def test_batchnorm_options_its_statistics_do_not_implement_are_refused():
    """Outside a partial batch it is Flax's layer with every option; on a part, the options it would ignore raise."""
    x = jnp.arange(24.0).reshape(6, 4)
    for options in ({"use_bias": False}, {"use_scale": False}, {"use_fast_variance": False}):
        bn = sk.layers.BatchNorm(4, rngs=nnx.Rngs(0), **options)
        ref = nnx.BatchNorm(4, rngs=nnx.Rngs(0), **options)
        np.testing.assert_array_equal(bn(x), ref(x))  # the whole batch: Flax's own code
        with sk.layers.local_batch(jnp.arange(6), lanes=True), pytest.raises(sk.ShardkitError, match="drop these"):
            jax.vmap(bn)(x[None])  # one lane of a vmapped part: its own statistics
