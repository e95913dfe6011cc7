"""AxoNN's 3D tensor x data linear layer vs the unsharded matmul, for all 20 factorisations of 8 devices.

fp32 forward and gradients to 1e-5 of each tensor's largest magnitude (the sharded layer sums the contraction in
G_x partial sums and the weight gradient in G_d G_z partial sums: reduction-order noise only, which scales with the
summed terms, not with an element that happens to cancel to ~0). Measured over all 20 factorisations: <= 2.2e-7
with YNNPACK's kernels, <= 2.9e-7 with XLA's own CPU emitters at AVX2 (the worst: dW1). One jit per
factorisation checks both `transpose` values and the FC1 -> FC2 chain (whose compiled HLO must hold no collective
between the two).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import hlo, tensor3d

B, S, K, N = 8, 2, 16, 16


def factorisations(n: int = 8) -> list[tuple[int, int, int, int]]:
    """All ordered (G_x, G_y, G_z, G_d) of powers of two with product n (20 for n = 8)."""
    pows = [2**i for i in range(n.bit_length()) if n % 2**i == 0]
    return [f for f in itertools.product(pows, repeat=4) if np.prod(f) == n]


def grid_mesh(gx: int, gy: int, gz: int, gd: int):
    """Axes outermost first in AxoNN's nesting order: data, depth, row, col (col innermost)."""
    return sk.make_mesh(f"data={gd},depth={gz},row={gy},col={gx}")


FACTS = factorisations()


def assert_close_to_scale(got, want, rtol=1e-5):
    err = float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())
    assert err <= rtol, f"max |diff| / max |ref| = {err:.3g} > {rtol}"


def reference(x, w1, w2, r1, r2):
    y1 = x @ w1
    y2 = jnp.tanh(y1) @ w2
    return jnp.sum(y1 * r1) + jnp.sum(y2 * r2)


def test_twenty_factorisations():
    assert len(FACTS) == 20 and (2, 2, 2, 1) in FACTS and (1, 1, 1, 8) in FACTS


@pytest.mark.parametrize("grid", FACTS, ids=lambda f: "x{}y{}z{}d{}".format(*f))
def test_linear_and_transposed_linear_equal_the_matmul(grid):
    mesh = grid_mesh(*grid)
    assert tensor3d.Grid.of(mesh) == tensor3d.Grid(*grid)
    keys = jax.random.split(jax.random.key(sum(g * 10**i for i, g in enumerate(grid))), 5)
    x = jax.random.normal(keys[0], (B, S, K))
    w1, w2 = jax.random.normal(keys[1], (K, N)) / 4, jax.random.normal(keys[2], (N, K)) / 4
    r1, r2 = jax.random.normal(keys[3], (B, S, N)), jax.random.normal(keys[4], (B, S, K))

    def sharded(x, w1, w2, r1, r2):
        y1 = tensor3d.linear(x, w1, mesh=mesh)
        y2 = tensor3d.linear(jnp.tanh(y1), w2, mesh=mesh, transpose=True)
        return jnp.sum(y1 * r1) + jnp.sum(y2 * r2), (y1, y2)

    def both(x, w1, w2, r1, r2):
        (_, (y1, y2)), grads = jax.value_and_grad(sharded, argnums=(0, 1, 2), has_aux=True)(x, w1, w2, r1, r2)
        return y1, y2, grads

    placed = (
        jax.device_put(w1, tensor3d.weight_sharding(mesh)),
        jax.device_put(w2, tensor3d.weight_sharding(mesh, True)),
    )
    y1, y2, grads = jax.jit(both)(x, *placed, r1, r2)
    ref_y1 = x @ w1
    assert_close_to_scale(y1, ref_y1)
    assert_close_to_scale(y2, jnp.tanh(ref_y1) @ w2)
    ref_grads = jax.grad(reference, argnums=(0, 1, 2))(x, w1, w2, r1, r2)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert_close_to_scale(g, rg)
    assert grads[1].sharding.is_equivalent_to(tensor3d.weight_sharding(mesh), 2)  # dW rests like W


def test_fc1_to_fc2_needs_no_relayout():
    mesh = grid_mesh(2, 2, 2, 1)
    x_spec, w_spec, y_spec = tensor3d.specs(mesh, ndim=3)
    _, w2_spec, _ = tensor3d.specs(mesh, transpose=True, ndim=3)
    assert y_spec == tensor3d.specs(mesh, transpose=True, ndim=3)[0]
    f = lambda x, w1, w2: tensor3d.linear(tensor3d.linear(x, w1, mesh=mesh), w2, mesh=mesh, transpose=True)
    sh = lambda spec: jax.sharding.NamedSharding(mesh, spec)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh(p)) for s, p in
            (((B, S, K), x_spec), ((K, N), w_spec), ((N, K), w2_spec))]  # fmt: skip
    colls = hlo.collectives(jax.jit(f).lower(*args).compile(), mesh)
    got = {(c.kind, c.axes): c.count for c in colls}
    # forward only: one weight gather per layer over depth, one all-reduce over col (FC1) and row (FC2)
    assert got == {("all-gather", ("depth",)): 2, ("all-reduce", ("col",)): 1, ("all-reduce", ("row",)): 1}


def test_bad_inputs_raise_shardkit_error():
    w = jnp.zeros((K, N))
    with pytest.raises(sk.ShardkitError, match="data, row, col, depth"):
        tensor3d.linear(jnp.zeros((B, K)), w, mesh=sk.make_mesh("data=2,tensor=4"))
    mesh = grid_mesh(2, 2, 2, 1)
    with pytest.raises(sk.ShardkitError, match="not divisible by 4"):
        tensor3d.linear(jnp.zeros((B, K)), jnp.zeros((K, 6)), mesh=mesh)  # n over row x depth
    with pytest.raises(sk.ShardkitError, match="batch"):
        tensor3d.linear(jnp.zeros((3, K)), w, mesh=mesh)
    with pytest.raises(sk.ShardkitError, match="needs x"):
        tensor3d.linear(jnp.zeros((B, K + 1)), w, mesh=mesh)


# ---------------------------------------------------------------------------------------------------------- GPT
# The `tp3d` strategy: 3 SGD-momentum steps of the tiny GPT on 8 devices equal one device, in float64 (as
# tests/test_pipeline.py's parity: fp32 losses were 8.8e-7 apart with the suite's compile flags, 11x under a 1e-5
# tolerance). float64 reduction-order noise: measured <= 6e-16 on losses and parameters; asserted 1e-10.
def gpt64():
    from common import TINY

    from models.gpt import GPTConfig

    return GPTConfig(**{**TINY.__dict__, "dtype": "float64", "param_dtype": "float64"})


@pytest.fixture(scope="module")
def one_device_run():
    from common import one_device_mesh, train

    with jax.enable_x64(True):
        return train(one_device_mesh(), "dp", cfg=gpt64())[:2]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["data=2,row=2,col=2", "depth=2,row=2,col=2", "data=2,depth=2,col=2"])
def test_gpt_training_under_tp3d_matches_one_device(spec, one_device_run):
    from common import train

    with jax.enable_x64(True):
        losses, params, _, _ = train(sk.make_mesh(spec), "tp3d", cfg=gpt64())
    np.testing.assert_allclose(losses, one_device_run[0], rtol=1e-10)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_device_run[1]), strict=True):
        assert a.dtype == np.float64 and np.abs(a - b).max() <= 1e-10 * max(np.abs(b).max(), 1e-12)
