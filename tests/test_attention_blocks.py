"""The attention block kernel (shardkit/attention/blocks.py, ring_fused.py): Pallas's TPU kernels run here in Pallas's
interpret mode on CPU devices and are held to dense attention on one device.

Tolerance (fp32): outputs and gradients of q, k, v within 5e-5 of the reference's largest magnitude, as in
test_context_parallel.py. Splash sums a row's keys in 128-key tiles with a running rescale per tile, and the ring
merges up to 2 blocks by their lse: two summation orders of <= 512 terms differ by about 2 x 512 u ~ 6e-5 of the
scale at worst, ~sqrt(512) u ~ 3e-6 typically; measured <= 3e-6 here. A wrong mask (one key of the ~100 a row sees
in its document) moves an output by ~1e-2 of its scale; a merge that ignored a block's lse, by far more.

Shapes: splash's key tile is a multiple of 128 (Mosaic's lane width), so a zigzag ring of 2 ranks needs 512 tokens
(halves of 128). 4 query heads over 2 kv heads (grouped), 3 packed documents whose boundaries fall inside blocks.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from common import TINY, one_device_mesh, train
from test_parity import assert_params_close

import shardkit as sk
from shardkit.attention import blocks, dense_attention, ring_attention, to_layout, ulysses_attention, usp_attention
from shardkit.parallel.context.layouts import LAYOUTS, block_positions
from shardkit.parallel.context.ring_fused import plans

B, S, H, KV, D = 1, 512, 4, 2, 16
TOL = 5e-5


@pytest.fixture(scope="module")
def data():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, S, H, D)), jnp.float32)
    k, v, w = (jnp.asarray(r.normal(size=(B, S, n, D)), jnp.float32) for n in (KV, KV, H))
    seg = jnp.asarray(np.repeat([0, 1, 2], [100, 300, 112])[None], jnp.int32)
    ref = jax.value_and_grad(lambda q, k, v: (dense_attention(q, k, v, segment_ids=seg) * w).sum(), (0, 1, 2))
    return q, k, v, w, seg, ref(q, k, v)


def _assert_close(got, want):
    (value, grads), (ref_value, ref_grads) = got, want
    scale = max(float(jnp.abs(g).max()) for g in ref_grads)
    assert abs(float(value) - float(ref_value)) <= TOL * abs(float(ref_value)) + 1e-3
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=TOL * scale)


def _check(fn, data):
    """fn(q, k, v, seg) -> o, against dense: the weighted sum of outputs and its gradients for q, k, v."""
    q, k, v, w, seg, ref = data
    got = jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v, seg) * w).sum(), (0, 1, 2)))(q, k, v)
    _assert_close(got, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_over_splash_matches_dense(layout, data):
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    lay = lambda x: to_layout(x, layout, mesh)
    unlay = lambda x: sk.attention.from_layout(x, layout, mesh)
    _check(lambda q, k, v, s: unlay(ring_attention(lay(q), lay(k), lay(v), mesh=mesh, layout=layout,
                                                   segment_ids=lay(s), block="splash")), data)  # fmt: skip


@pytest.mark.parametrize("layout", ["zigzag"])  # its plans: full, causal, half-blocks (contiguous adds only a skip)
def test_ring_over_pallas_gpu_matches_dense(layout, data):
    """Pallas's GPU (Triton) kernel in interpret mode: its lse is base 2, its backward takes the merged lse and output;
    no segment ids inside a ring (its kernel takes one array for queries and keys), so none here."""
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    q, k, v, w, _, _ = data
    ref = jax.value_and_grad(lambda q, k, v: (dense_attention(q, k, v) * w).sum(), (0, 1, 2))(q, k, v)
    lay = lambda x: to_layout(x, layout, mesh)
    unlay = lambda x: sk.attention.from_layout(x, layout, mesh)
    _check(lambda q, k, v, s: unlay(ring_attention(lay(q), lay(k), lay(v), mesh=mesh, layout=layout,
                                                   block="pallas_gpu")), (q, k, v, w, None, ref))  # fmt: skip


def test_ulysses_and_usp_over_splash_match_dense(data):
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    _check(lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, segment_ids=s, block="splash"), data)
    mesh = sk.make_mesh("seq_r=2,seq_u=2", jax.devices()[:4])
    lay = lambda x: to_layout(x, "zigzag", mesh, "seq_r")
    unlay = lambda x: sk.attention.from_layout(x, "zigzag", mesh, "seq_r")
    _check(lambda q, k, v, s: unlay(usp_attention(lay(q), lay(k), lay(v), mesh=mesh, layout="zigzag",
                                                  segment_ids=lay(s), block="splash")), data)  # fmt: skip


def test_flash_and_pallas_gpu_local_attention_match_dense(data):
    """flash on one device (its kernel takes no interpret flag: Pallas's TPU interpreter runs it); pallas_gpu as
    Ulysses' local attention (segment ids: one array serves queries and keys there)."""
    _check(lambda q, k, v, s: blocks.local_attention("flash", q, k, v, s, True, "cpu"), data)
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    _check(lambda q, k, v, s: ulysses_attention(q, k, v, mesh=mesh, segment_ids=s, block="pallas_gpu"), data)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_ring_plans_are_the_layouts_masks_for_every_rank_pair(layout):
    """The static mask per (before / at / after) is exactly what the layout's positions give, for every r, r'."""
    for n in (2, 4, 8):
        c = 16
        for r in range(n):
            q = np.asarray(block_positions(layout, n, r, c))
            for r2 in range(n):
                want = q[:, None] >= np.asarray(block_positions(layout, n, r2, c))[None]
                plan = plans(layout, n, c, True)[int(np.sign(r2 - r)) + 1]
                got = np.zeros((c, c), bool)
                if plan is not None:
                    i, j = np.arange(c)[plan.rows][:, None], np.arange(c)[plan.cols][None]
                    local = {"full": np.ones_like(i >= j), "causal": i >= j, "strict": i > j}[plan.mask]
                    got[plan.rows, plan.cols] = local
                np.testing.assert_array_equal(got, want, err_msg=f"{layout} n={n} r={r} r'={r2}")


def test_a_kernel_that_cannot_run_is_refused_with_the_reason():
    q = jnp.zeros((1, 192, 4, 16))
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    with pytest.raises(sk.ShardkitError, match="returns no log-sum-exp"):
        ring_attention(q, q, q, mesh=mesh, block="flash")
    with pytest.raises(sk.ShardkitError, match="multiples of 128"):
        ring_attention(q, q, q, mesh=mesh, block="splash")  # blocks of 96 tokens
    with pytest.raises(sk.ShardkitError, match="NVIDIA GPUs"):
        ulysses_attention(q, q, q, mesh=mesh, block="cudnn")
    with pytest.raises(sk.ShardkitError, match="TPU interpreter"):
        ulysses_attention(jnp.zeros((1, 256, 4, 16)), *[jnp.zeros((1, 256, 4, 16))] * 2, mesh=mesh, block="flash")
    with pytest.raises(sk.ShardkitError, match="not one of"):
        ring_attention(q, q, q, mesh=mesh, block="splsh")
    q2 = jnp.zeros((1, 512, 4, 16))
    with pytest.raises(sk.ShardkitError, match="strictly causal"):
        ring_attention(q2, q2, q2, mesh=mesh, layout="striped", block="pallas_gpu")
    with pytest.raises(sk.ShardkitError, match="packed documents"):
        ring_attention(q2, q2, q2, mesh=mesh, segment_ids=jnp.zeros((1, 512), jnp.int32), block="pallas_gpu")
    gpu = functools.partial(blocks.resolve, None, "gpu", dtype=jnp.bfloat16, what="")
    assert gpu(lengths=(256,), ring=True, segment_ids=False) == "pallas_gpu"
    assert gpu(lengths=(256,), ring=True, segment_ids=True) == "xla"  # auto falls back where the kernel cannot run
    assert gpu(lengths=(256,), ring=True, segment_ids=False, strict=True) == "xla"
    # cuDNN for local attention where its library loads (JAX reads its version while tracing the call); a host
    # without it (the dev extras' CUDA compile set has none) traces XLA's attention for GPU targets
    assert gpu(lengths=(4096,), ring=False, segment_ids=False) == ("cudnn" if blocks.cudnn_loadable() else "xla")
    # auto: xla on CPU devices, splash on TPU ones where the blocks suit it
    assert blocks.resolve(None, "cpu", lengths=(256,), ring=True, dtype=jnp.float32, segment_ids=True, what="") == "xla"
    assert blocks.resolve(None, "tpu", lengths=(256, 128), ring=True, dtype=jnp.float32, segment_ids=True,
                          what="") == "splash"  # fmt: skip
    assert blocks.resolve(None, "tpu", lengths=(96,), ring=True, dtype=jnp.float32, segment_ids=True, what="") == "xla"


_PACKED_REF = {}


def _packed_reference(cfg, batch):
    """One device's 2 steps on the packed batch (the same for both strategies: computed once)."""
    if "ref" not in _PACKED_REF:
        _PACKED_REF["ref"] = train(one_device_mesh(), "dp", cfg=cfg, batch=batch, steps=2)[:2]
    return _PACKED_REF["ref"]


@pytest.mark.parametrize("name", ["cp_zigzag", "cp_ulysses"])
def test_packed_documents_train_under_splash_as_on_one_device(name, monkeypatch):
    """A packed batch (documents cut inside ring blocks) through the GPT: 2 SGD steps under the strategy with
    attention_block=splash equal one device's dense attention (losses within 1e-5 relative, parameters within 1e-5 of
    a leaf's scale, as in test_context_parallel.py)."""
    cfg = dataclasses.replace(TINY, max_seq_len=S)
    toks = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, S + 1))
    seg = np.repeat(np.arange(5, dtype=np.int32), [90, 130, 70, 200, 22])[None].repeat(2, 0)
    batch = {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32), "segment_ids": seg}
    ref_losses, ref_params = _packed_reference(cfg, batch)
    mesh = sk.make_mesh("seq=2", jax.devices()[:2])
    strategy = sk.strategy(name)
    strategy = strategy.replace(kernels={**strategy.kernels, "attention_block": "splash"})
    laid = sk.attention.layout_batch(batch, *sk.kernels.batch_layout(strategy, mesh))
    made = []
    build = blocks.splash_kernel
    monkeypatch.setattr(blocks, "splash_kernel", lambda *a: made.append(a) or build(*a))
    losses, params, _, _ = train(mesh, strategy, cfg=cfg, batch=laid, steps=2)
    assert made, "the step never built a splash kernel"
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(params, ref_params, rtol=1e-5)
