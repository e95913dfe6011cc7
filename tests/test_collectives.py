"""Collective decompositions vs their plain-lax references inside shard_map on 8 CPU devices, and their HLO.

Data movement is checked exactly with rank-coded inputs (small integers in fp32: sums of them are exact too).
With random inputs the decomposition sums in another order than the reference, so results differ by rounding;
they are held, element by element, to the bound any two summation orders obey (`assert_order_close`), not to a
tolerance tuned on one CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import collectives as coll
from shardkit import hlo

MESH = sk.make_mesh("data=2,tensor=4")
BOTH = ("data", "tensor")
U = 2.0**-24  # fp32 unit roundoff


def assert_order_close(got, want, n: int, abs_terms) -> None:
    """got == want up to summation order, element by element. Two fp32 evaluations of a sum or dot product of n
    terms, in any order, with or without FMA, differ by at most 2 gamma_n sum|terms| (gamma_n = n u / (1 - n u);
    Higham, Accuracy and Stability of Numerical Algorithms, 3.1): a bound that holds on every machine and for every
    reduction tree, so no tolerance tuned on one CPU. Observed here: <= 0.12 of it."""
    bound = 2 * n * U / (1 - n * U) * np.asarray(abs_terms, np.float64)
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert (err <= bound).all(), f"max |diff| / bound = {(err / bound).max():.3g}"


def per_device(fn, *args, in_specs):
    """Runs fn on every device's blocks; returns [8, *out] (one row per device, data-major)."""
    body = lambda *a: fn(*a)[None]
    return jax.jit(jax.shard_map(body, mesh=MESH, in_specs=in_specs, out_specs=P(BOTH)))(*args)


def rank_coded(shape):
    """Element value = device-block id * 1000 + position: any misplaced element changes the result."""
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) % 997


@pytest.mark.parametrize("shape", [(8, 6), (5, 3)])  # (5, 3): 15 elements, not divisible by 4: padded
def test_hierarchical_psum_equals_psum(shape):
    x = rank_coded((8, *shape))
    got = per_device(lambda b: coll.hierarchical_psum(b[0], inner="tensor", outer="data"), x, in_specs=P(BOTH))
    want = per_device(lambda b: lax.psum(b[0], BOTH), x, in_specs=P(BOTH))
    np.testing.assert_array_equal(got, want)
    rand = jax.random.normal(jax.random.key(0), (8, *shape))
    got = per_device(lambda b: coll.hierarchical_psum(b[0], "tensor", "data"), rand, in_specs=P(BOTH))
    want = per_device(lambda b: lax.psum(b[0], BOTH), rand, in_specs=P(BOTH))
    assert_order_close(got, want, 8, jnp.abs(rand).sum(0))  # 8 terms per element


def test_hierarchical_psum_compiles_to_reduce_scatter_all_reduce_all_gather():
    f = jax.shard_map(
        lambda b: coll.hierarchical_psum(b, "tensor", "data"), mesh=MESH, in_specs=P(BOTH), out_specs=P(BOTH)
    )
    c = jax.jit(f).lower(jnp.zeros((8 * 16, 4))).compile()
    kinds = {(x.kind, x.axes): x.operand_bytes for x in hlo.collectives(c, MESH)}
    assert kinds == {
        ("reduce-scatter", ("tensor",)): 16 * 4 * 4,
        ("all-reduce", ("data",)): 4 * 4 * 4,  # only 1/p_inner crosses the outer axis
        ("all-gather", ("tensor",)): 4 * 4 * 4,
    }


@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_2d_and_all_gather_2d_equal_the_flat_collectives(dim):
    x = rank_coded((8, 16, 8))
    got = per_device(lambda b: coll.reduce_scatter_2d(b[0], "tensor", "data", dim), x, in_specs=P(BOTH))
    want = per_device(lambda b: lax.psum_scatter(b[0], BOTH, scatter_dimension=dim, tiled=True), x, in_specs=P(BOTH))
    np.testing.assert_array_equal(got, want)
    y = rank_coded((8, 2, 3)) + 1000 * jnp.arange(8.0)[:, None, None]  # rank-coded blocks
    got = per_device(lambda b: coll.all_gather_2d(b[0], "tensor", "data", dim), y, in_specs=P(BOTH))
    want = per_device(lambda b: lax.all_gather(b[0], BOTH, axis=dim, tiled=True), y, in_specs=P(BOTH))
    np.testing.assert_array_equal(got, want)


def test_2d_forms_reject_indivisible_sizes():
    with pytest.raises(sk.ShardkitError, match="not divisible by the 8"):
        per_device(lambda b: coll.reduce_scatter_2d(b[0], "tensor", "data"), jnp.zeros((8, 12)), in_specs=P(BOTH))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_gather_matmul_equals_all_gather_then_matmul(bidirectional):
    x = jax.random.normal(jax.random.key(1), (8, 4, 16))  # per device: 4 rows of the tensor-split x
    w = jax.random.normal(jax.random.key(2), (16, 8))
    f = lambda b, w: coll.all_gather_matmul(b[0], w, "tensor", bidirectional=bidirectional)
    ref = lambda b, w: lax.all_gather(b[0], "tensor", tiled=True) @ w
    got = per_device(f, x, w, in_specs=(P(BOTH), P()))
    abs_terms = per_device(ref, jnp.abs(x), jnp.abs(w), in_specs=(P(BOTH), P()))  # |x| @ |w|, k = 16
    assert_order_close(got, per_device(ref, x, w, in_specs=(P(BOTH), P())), 16, abs_terms)
    # data movement exactly: with w = I the result is the gathered x itself
    xr, eye = rank_coded((8, 4, 16)), jnp.eye(16)
    got = per_device(
        lambda b, w: coll.all_gather_matmul(b[0], w, "tensor", bidirectional), xr, eye, in_specs=(P(BOTH), P())
    )
    np.testing.assert_array_equal(got, per_device(ref, xr, eye, in_specs=(P(BOTH), P())))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_matmul_reduce_scatter_equals_matmul_then_psum_scatter(bidirectional):
    x = jax.random.normal(jax.random.key(3), (8, 16, 4))  # per device: all 16 rows, 4 of the contracted columns
    w = jax.random.normal(jax.random.key(4), (8, 4, 8))
    f = lambda b, w: coll.matmul_reduce_scatter(b[0], w[0], "tensor", bidirectional=bidirectional)
    ref = lambda b, w: lax.psum_scatter(b[0] @ w[0], "tensor", tiled=True)
    got = per_device(f, x, w, in_specs=(P(BOTH), P(BOTH)))
    abs_terms = per_device(ref, jnp.abs(x), jnp.abs(w), in_specs=(P(BOTH), P(BOTH)))  # 4 devices x 4 columns: k = 16
    assert_order_close(got, per_device(ref, x, w, in_specs=(P(BOTH), P(BOTH))), 16, abs_terms)
    xr, eye = rank_coded((8, 16, 4)), jnp.broadcast_to(jnp.eye(4), (8, 4, 4))
    got = per_device(lambda b, w: coll.matmul_reduce_scatter(b[0], w[0], "tensor", bidirectional), xr, eye,
                     in_specs=(P(BOTH), P(BOTH)))  # fmt: skip
    np.testing.assert_array_equal(got, per_device(ref, xr, eye, in_specs=(P(BOTH), P(BOTH))))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("which", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_collective_matmul_compiles_to_permutes_only(which, bidirectional):
    fn = getattr(coll, which)
    if which == "all_gather_matmul":
        x, w, block = jnp.zeros((8 * 4, 16)), jnp.zeros((16, 8)), 4 * 16 * 4
    else:
        x, w, block = jnp.zeros((2 * 16, 4 * 8)), jnp.zeros((4 * 8, 8)), 16 // 4 * 8 * 4
    w_spec = P() if which == "all_gather_matmul" else P("tensor")
    body = lambda x, w: fn(x, w, "tensor", bidirectional=bidirectional)[None]
    f = jax.shard_map(body, mesh=MESH, in_specs=(P(BOTH) if which == "all_gather_matmul" else P("data", "tensor"),
                                                 w_spec), out_specs=P(BOTH))  # fmt: skip
    c = jax.jit(f).lower(x, w).compile()
    colls = hlo.collectives(c, MESH)
    assert {x.kind for x in colls} == {"collective-permute"}, hlo.format_table(colls)
    assert {x.axes for x in colls} == {("tensor",)}
    steps = 3 * (2 if bidirectional else 1)
    assert sum(x.count for x in colls) == steps
    assert sum(x.bytes_sent for x in colls) == 3 * block  # p - 1 blocks (two half blocks when bidirectional)


def test_collective_matmul_rejects_bad_shapes():
    with pytest.raises(sk.ShardkitError, match="x \\[m, k\\]"):
        per_device(lambda b: coll.all_gather_matmul(b[0], b[0], "tensor"), jnp.zeros((8, 4, 3)), in_specs=P(BOTH))
