"""A model written in JAX's explicit sharding mode trains under strategy 'annotated' on jax.make_mesh's mesh.

Explicit mode (JAX's "Explicit sharding" guide, Flax's current style): the mesh's axes are `AxisType.Explicit`,
parameters carry `out_sharding=` over mesh axes, every array's layout is part of its type, and the model says
where a layout changes (`jax.sharding.reshard`: FSDP's all-gather of a weight) and where a contraction over a
sharded dimension lands (`jnp.einsum(..., out_sharding=...)`: tensor parallelism's all-reduce). Under
'annotated' shardkit keeps those axes and runs the model as written; every other strategy takes the axes as Auto
(tests/test_parity.py) and refuses such a model with the fix.

Tolerance: as tests/test_any_model.py, the sharded program differs from one device's only in the order of fp32
partial sums (contractions of <= 64 terms split over 2 devices): 1e-5 relative on losses and parameters.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import run_steps
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

import shardkit as sk

VOCAB, EMBED, HEADS, HEAD_DIM, MLP, SEQ = 64, 32, 4, 8, 64, 8
NAMES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the batch's mesh axes: 'annotated' puts it over data x fsdp


class ExplicitLM(nnx.Module):
    """One causal attention block and an MLP, as JAX's explicit-sharding guide writes FSDP x tensor parallelism:
    weights rest split over fsdp (and heads / hidden units over tensor), gathered with `reshard` before use; the
    two contractions over tensor-split dimensions say where their sums land."""

    def __init__(self, rngs: nnx.Rngs):
        init, normal = nnx.initializers.lecun_normal(), nnx.initializers.normal(1.0)
        param = lambda f, shape, spec: nnx.Param(f(rngs.params(), shape), out_sharding=spec)
        self.embed = param(normal, (VOCAB, EMBED), P(None, "fsdp"))
        self.qkv = param(init, (EMBED, 3, HEADS, HEAD_DIM), P("fsdp", None, "tensor", None))
        self.out = param(init, (HEADS, HEAD_DIM, EMBED), P("tensor", None, "fsdp"))
        self.up = param(init, (EMBED, MLP), P("fsdp", "tensor"))
        self.down = param(init, (MLP, EMBED), P("tensor", "fsdp"))
        self.scale = param(nnx.initializers.ones_init(), (EMBED,), P())
        self.head = param(init, (EMBED, VOCAB), P("fsdp", None))

    def norm(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * self.scale[...]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        rows = P(BATCH, None, None)  # [batch, seq, embed]: the batch split, the rest whole
        x = reshard(self.embed[...], P()).at[tokens].get(out_sharding=rows)
        q, k, v = jnp.unstack(jnp.einsum("bsd,dthk->tbshk", self.norm(x), reshard(self.qkv[...], P())), axis=0)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
        o = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1), v)
        out = reshard(self.out[...], P("tensor", None, None))  # heads stay on tensor: the sum over them lands
        x = x + jnp.einsum("bqhk,hkd->bqd", o, out, out_sharding=rows)
        h = jax.nn.gelu(self.norm(x) @ reshard(self.up[...], P(None, "tensor")))
        x = x + jnp.einsum("bsh,hd->bsd", h, reshard(self.down[...], P("tensor", None)), out_sharding=rows)
        return self.norm(x) @ reshard(self.head[...], P())

    def loss(self, batch: dict) -> jax.Array:
        return sk.cross_entropy(self(batch["tokens"][:, :-1]), batch["tokens"][:, 1:])


def tokens():
    return {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (16, SEQ + 1)), jnp.int32)}


def run(mesh, strategy="annotated", steps=3, microbatches=1):
    model = sk.sharded_init(ExplicitLM, mesh, strategy)
    step = sk.make_train_step(model, optax.sgd(0.3, momentum=0.9), mesh, strategy, microbatches=microbatches)
    losses, state = run_steps(step, tokens(), steps)
    return losses, state, step


@pytest.fixture(scope="module")
def one_device():
    return run(jax.make_mesh((1, 1, 1), NAMES, devices=jax.devices()[:1]))


def test_an_explicit_mode_model_trains_under_annotated_at_parity_and_is_explained(one_device):
    mesh = jax.make_mesh((2, 2, 2), NAMES)  # JAX's default: Explicit axes
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    losses, state, step = run(mesh)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    assert losses[-1] < losses[0]
    flat_got = jax.tree_util.tree_leaves_with_path(state.params)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(one_device[1].params))
    for path, got in flat_got:
        ref = np.asarray(flat_ref[path])
        err = np.abs(np.asarray(got) - ref).max() / np.abs(ref).max()
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)
    # the layouts are the model's own, on the user's mesh, and stay so after the updates
    up, qkv = state.params["up"], state.params["qkv"]
    assert up.sharding.mesh.axis_types == mesh.axis_types and tuple(up.sharding.spec) == ("fsdp", "tensor")
    assert qkv.addressable_shards[0].data.shape == (EMBED // 2, 3, HEADS // 2, HEAD_DIM)
    two = run(mesh, steps=1, microbatches=2)  # gradient accumulation: a sequential scan in explicit mode
    np.testing.assert_allclose(two[0], one_device[0][:1], rtol=1e-5)
    report = sk.explain(step, step.abstract_state(), tokens())
    kinds = {r["kind"] for r in report.rows()}
    assert report.strategy == "annotated" and {"all-gather", "all-reduce"} <= kinds, kinds  # reshard; out_sharding


def test_each_sharding_mode_refuses_a_model_written_for_the_other():
    """An explicit-mode model under a strategy that runs on Auto axes; a GSPMD-style model (its layouts left to
    the compiler) under 'annotated' on Explicit axes: each a ShardkitError naming the fix, from the trace."""
    mesh = jax.make_mesh((2, 2, 2), NAMES)
    refused = r"explicit sharding mode.*strategy 'fsdp_tp' runs on Auto axes.*under strategy 'annotated'"
    with pytest.warns(UserWarning, match="Explicit"), pytest.raises(sk.ShardkitError, match=refused):
        run(mesh, "fsdp_tp", steps=1)

    class GSPMDStyle(nnx.Module):  # Flax's GSPMD guide: annotated weights, the compiler places the rest
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(
                VOCAB,
                EMBED,
                rngs=rngs,
                embedding_init=nnx.with_partitioning(nnx.initializers.normal(), ("tensor", "fsdp")),
            )
            self.head = nnx.Linear(
                EMBED,
                VOCAB,
                rngs=rngs,
                kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", None)),
            )

        def loss(self, batch: dict) -> jax.Array:
            logits = self.head(nn.with_logical_constraint(self.embed(batch["tokens"][:, :-1]), ("batch", None, None)))
            return sk.cross_entropy(logits, batch["tokens"][:, 1:])

    model = sk.sharded_init(GSPMDStyle, mesh, "annotated")
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, "annotated")
    with pytest.raises(sk.ShardkitError, match=r"explicit sharding mode, where this op's layout is ambiguous.*"
                                               r"AxisType.Auto"):  # fmt: skip
        step(step.init_state(), tokens())
