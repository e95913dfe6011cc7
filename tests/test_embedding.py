"""shardkit/embedding.py: the `local` lookup (each device's own columns of the table, one all-to-all) and the `vocab`
lookup (each device's own rows, one all-reduce) train like one device, and compile to their collectives instead of
the table-sized all-gather and gradient reduction.

Tolerance: fp32, 3 SGD steps against one device, as tests/test_parity.py: the lookup is pure data movement (the
same rows, exactly), and the table's gradient is the same scatter-add summed in another order: 1e-5 relative on
losses and on every parameter relative to its scale; observed <= 3e-7.
"""

import dataclasses

import numpy as np
import pytest
from common import TINY, make_batch, one_device_mesh, train

import shardkit as sk
from shardkit import hlo

B, S = 16, 32  # make_batch's


@pytest.fixture(scope="module")
def one_device():
    return train(one_device_mesh(), "dp")


def _collectives(step, state, mesh):
    return hlo.collectives(step.lower(state, make_batch()).compile(), mesh)


def _sent(colls, kind):
    return sum(c.bytes_sent for c in colls if c.kind == kind)


@pytest.mark.parametrize(("strategy", "spec"), [("fsdp", "data=2,fsdp=4"), ("fsdp", "fsdp=8")])
def test_local_lookup_trains_like_one_device_and_trades_the_table_gather_for_two_all_to_alls(one_device, strategy,
                                                                                                 spec):  # fmt: skip
    mesh = sk.make_mesh(spec)
    local = sk.strategy(strategy).replace(kernels={"embed": "local"})
    losses, params, step, state = train(mesh, local)
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    for name in ("embed", "head"):
        ref = one_device[1][name]
        assert np.abs(params[name] - ref).max() <= 1e-5 * np.abs(ref).max(), name
    # against the same strategy with `gather` (auto on CPU): the table's fwd all-gather is gone, the fsdp group's
    # int32 ids are gathered instead, and one device's fp32 rows cross fsdp twice (fwd, and their gradients bwd)
    _, _, gstep, gstate = train(mesh, strategy, steps=1)
    colls, gathered = _collectives(step, state, mesh), _collectives(gstep, gstate, mesh)
    d, f = mesh.shape.get("data", 1), mesh.shape["fsdp"]
    rows = B // (d * f) * S * TINY.d_model * 4  # one device's fp32 [batch, seq, embed]
    a2a = [(c.axes, c.operand_bytes, c.count) for c in colls if c.kind == "all-to-all"]
    assert a2a == [(("fsdp",), rows, 2)] and not [c for c in gathered if c.kind == "all-to-all"], hlo.format_table(
        colls
    )
    table, ids = TINY.vocab_size * TINY.d_model * 4, B // d * S * 4  # fp32 [vocab, embed]; the group's int32 ids
    saved = _sent(gathered, "all-gather") - _sent(colls, "all-gather")
    assert saved == pytest.approx((table - ids) * (f - 1) / f), (hlo.format_table(gathered), hlo.format_table(colls))


def test_local_refuses_a_split_vocabulary():
    """tp splits the table's vocabulary rows over tensor: `local` says so (auto takes the gather)."""
    with pytest.raises(sk.ShardkitError, match=r"embed kernel 'local': the table's 'vocab' rows are split"):
        train(sk.make_mesh("data=4,tensor=2"), sk.strategy("tp").replace(kernels={"embed": "local"}), steps=1)


@pytest.mark.parametrize(
    ("strategy", "spec", "moe"),
    [("fsdp_cp_zigzag", "data=2,fsdp=2,seq=2", False), ("pp_fsdp", "data=2,fsdp=2,stage=2", False),
     ("ep_fsdp", "data=2,fsdp=2,expert=2", True)],
)  # fmt: skip
def test_local_equals_the_gather_wherever_auto_takes_it_on_tpu(strategy, spec, moe):
    """The other strategies whose TPU programs take `local` (sk.embedding.planned): the same loss and embedding after
    one step as `gather` on the same mesh (the forward's rows, then the table's gradient: pure data movement, and
    a scatter-add summed in another order: 1e-6)."""
    cfg = dataclasses.replace(TINY, num_experts=4, top_k=2, capacity_factor=2.0) if moe else TINY
    mesh = sk.make_mesh(spec)
    assert sk.embedding.planned(strategy, dict(mesh.shape), B, "tpu") == "local"
    runs = [train(mesh, sk.strategy(strategy).replace(kernels={**sk.strategy(strategy).kernels, "embed": k}),
                  steps=1, cfg=cfg) for k in ("gather", "local")]  # fmt: skip
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-6)
    ref = runs[0][1]["embed"]
    assert np.abs(runs[1][1]["embed"] - ref).max() <= 1e-6 * np.abs(ref).max()


@pytest.mark.parametrize("strategy", ["tp", "tp_sp"])
def test_vocab_parallel_lookup_trains_like_one_device(one_device, strategy):
    """`vocab` (Megatron's vocabulary-parallel embedding) under tp / tp_sp on data=4 x tensor=2: the same losses and
    parameters as one device (1e-5, the module's tolerance). It is what `auto` takes on a TPU there."""
    mesh = sk.make_mesh("data=4,tensor=2")
    assert sk.embedding.planned(strategy, dict(mesh.shape), B, "tpu") == "vocab"
    assert sk.embedding.planned(strategy, dict(mesh.shape), B, "cpu") == "gather"
    losses, params, _, _ = train(mesh, sk.strategy(strategy).replace(kernels={"embed": "vocab"}))
    np.testing.assert_allclose(losses, one_device[0], rtol=1e-5)
    for name in ("embed", "head"):
        ref = one_device[1][name]
        assert np.abs(params[name] - ref).max() <= 1e-5 * np.abs(ref).max(), name


def test_vocab_parallel_lookup_on_the_tpu_compiler_reduces_no_table_sized_gradient():
    """tp_sp compiled for a v5e-8 (data=4 x tensor=2) by XLA's TPU compiler: with GSPMD's gather, each device builds
    the whole table's fp32 gradient (its tokens are a sequence shard, not a vocabulary shard) and all-reduces it
    over data x tensor; with `vocab` (auto's choice there) no all-reduce over tensor is table-sized."""
    import jax.numpy as jnp
    import optax

    from models.gpt import GPT

    mesh, table = sk.make_mesh("data=4,tensor=2", target="v5e-8"), TINY.vocab_size * TINY.d_model * 4
    big = []
    for kernel in ("gather", "auto"):
        strategy = sk.strategy("tp_sp").replace(kernels={**sk.strategy("tp_sp").kernels, "embed": kernel})
        step = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.sgd(0.1), mesh, strategy)
        shape = ((B, S), jnp.int32)
        compiled = step.compile(step.abstract_state(), step.abstract_batch({"inputs": shape, "targets": shape}))
        colls = hlo.collectives(compiled, mesh)
        big.append([c for c in colls if c.kind == "all-reduce" and "tensor" in c.axes and c.operand_bytes >= table])
    assert big[0] and not big[1], big


def test_vocab_refuses_a_table_split_on_its_columns():
    with pytest.raises(sk.ShardkitError, match=r"embed kernel 'vocab': the table's 'vocab' rows are not split"):
        train(sk.make_mesh("data=2,fsdp=4"), sk.strategy("fsdp").replace(kernels={"embed": "vocab"}), steps=1)
