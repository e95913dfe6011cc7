"""A Linen transformer that names nothing, as model libraries ship one, trains under shardkit unmodified.

Written the way Flax's lm1b example writes its decoder (nn.Embed, pre-norm blocks of self-attention and a Dense
MLP, the output through the embedding's `attend`), with no partitioning metadata at all. Under `fsdp` every
parameter is split along its largest dimension divisible by the fsdp degree (PyTorch FSDP's rule); under tp and
fsdp_tp, which need names, path rules give them without editing the model. Each at parity with one device.

Tolerance: as tests/test_any_model.py (fp32 partial sums reduced in another order, 3 SGD steps): 1e-5 relative
to each parameter's scale, with a floor of 1e-3 on the scale: the key projection's bias has a zero gradient
(softmax does not change when one query's scores all shift by q.b), so its value is rounding noise (~3e-9, both
runs), where every other parameter's scale is >= 1e-2. Observed: losses and parameters within 2e-7.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import one_device_mesh, run_steps

import shardkit as sk

VOCAB, EMBED, HEADS, MLP, SEQ, LAYERS = 64, 32, 4, 64, 8, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, deterministic=True, name="attn")(h, mask=mask)
        h = nn.Dense(MLP, name="mlp_in")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(EMBED, name="mlp_out")(nn.gelu(h))


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, EMBED, name="embed")
        x = embed(tokens)
        for i in range(LAYERS):
            x = Block(name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_f")(x))


#: names by path, as EasyDeL / t5x / MaxText users write partition rules for a library's model (first match wins)
PATH_RULES = [
    (r"embed/embedding$", ("vocab", "embed")),
    (r"attn/(query|key|value)/kernel$", ("embed", "heads", None)),
    (r"attn/(query|key|value)/bias$", ("heads", None)),
    (r"attn/out/kernel$", ("heads", None, "embed")),
    (r"mlp_in/kernel$", ("embed", "mlp")),
    (r"mlp_in/bias$", ("mlp",)),
    (r"mlp_out/kernel$", ("mlp", "embed")),
]


def loss(model, batch):
    logits = model(batch["tokens"][:, :-1])
    return sk.cross_entropy(logits, batch["tokens"][:, 1:])


def tokens():
    return {"tokens": jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (16, SEQ + 1)), jnp.int32)}


def run(mesh, strategy, steps=3):
    model = sk.from_linen(Decoder(), jnp.zeros((2, SEQ), jnp.int32), mesh, strategy)
    step = sk.make_train_step(model, optax.sgd(0.3, momentum=0.9), mesh, strategy, loss_fn=loss)
    losses, state = run_steps(step, tokens(), steps)
    return losses, state, step


def assert_close(got, want, rtol=1e-5):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-3)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: {err:.3g}"


@pytest.fixture(scope="module")
def one_device():
    return run(one_device_mesh(), "dp")


def test_fsdp_splits_every_unnamed_parameter_at_parity(one_device):
    losses, state, step = run(sk.make_mesh("data=2,fsdp=4"), "fsdp")
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert losses[-1] < losses[0]
    assert_close(state.params, one_device[1].params)
    leaves = jax.tree.leaves(state.params)
    local = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    total = sum(x.nbytes for x in leaves)
    assert local <= 0.6 * total, (local, total)  # measured 0.25: every dimension here divides by 4
    query = state.params["block_0"]["attn"]["query"]["kernel"]  # [embed 32, heads 4, head_dim 8]: the first largest
    assert tuple(query.sharding.spec) == ("fsdp", None, None)
    report = sk.explain(step, step.abstract_state(), tokens())
    assert any("have no logical names and are split" in n for n in report.notes), report.notes


@pytest.mark.parametrize(("strategy", "spec"), [("tp", "data=2,tensor=4"), ("fsdp_tp", "data=2,fsdp=2,tensor=2")])
def test_path_rules_give_tensor_parallelism_its_names_at_parity(one_device, strategy, spec):
    with pytest.raises(sk.ShardkitError, match="tensor"):  # nothing named, nothing for tensor to shard: refused
        run(sk.make_mesh(spec), strategy, steps=1)
    named = sk.strategy(strategy).extend(path_rules=PATH_RULES)
    losses, state, step = run(sk.make_mesh(spec), named)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert_close(state.params, one_device[1].params)
    query = state.params["block_1"]["attn"]["query"]["kernel"]
    assert tuple(query.sharding.spec)[:2] == ("fsdp" if strategy == "fsdp_tp" else None, "tensor")
    assert state.params["block_1"]["mlp_out"]["kernel"].sharding.spec[0] == "tensor"
    # what the rules leave unnamed is the norms' scales and biases and the output biases: 1-D, small
    left = {p.rsplit("/", 2)[-2] + "/" + p.rsplit("/", 1)[-1] for p, *_ in step.unnamed_params}
    assert left == {"ln1/bias", "ln1/scale", "ln2/bias", "ln2/scale", "ln_f/bias", "ln_f/scale", "out/bias",
                    "mlp_out/bias"}, left  # fmt: skip
