"""Context parallelism, in one file: the kernels and the strategies that use them.

Part 1, context-parallel attention (ring, Ulysses, USP) against dense attention on one device, layouts, errors, HLO.

Tolerance: outputs and gradients of q, k, v within 5e-5 of the reference's largest magnitude (fp32; the kernels
accumulate in fp32 whatever the input dtype, so float64 is no way out). The online softmax adds the same terms as
dense softmax in a different order and with a running rescale per chunk. Rounding grows with the number of terms
in a sum (up to 64 keys per output row; up to 64 queries x 2 heads per dK / dV row) plus one rescale per chunk
(up to 16): to first order 2 x (128 + 16) u ~ 2e-5 of the scale between any two summation orders. Measured: 9e-7
worst over the 22 cases (4e-7 median), 6e-7 with XLA's own CPU emitters at AVX2 instead of YNNPACK. A real defect
is far larger: one key of 64 wrongly masked moves an output by ~1/64 of its scale.
Shapes are tiny (b=2, S=48 or 64, 4 heads of 8) and chunks smaller than a block, so every kernel runs its
chunk loops, skips and ring steps; S=48 over a ring of 4 is not a power of two (zigzag chunks of 6).

Part 2, context-parallel strategies train the GPT exactly like one device (the batch laid out for the ring).

The sharded run sees the batch in its strategy's layout (tokens, targets and positions permuted together, by
`layout_batch`); the reference sees it in natural order. The loss is a mean over tokens, so both optimise
the same function; what differs is summation order. This stays fp32 (the ring kernels accumulate in fp32 whatever
the dtype), so the tolerances are fp32 ones, measured over every case here with the suite's compile flags and at
XLA's default optimisation, with YNNPACK's kernels and with XLA's own CPU emitters at AVX2:
- parameters: <= 3.6e-7 of a leaf's scale after 3 SGD-momentum steps; held to 1e-5 (as in test_parity.py).
- losses: <= 7.4e-7 relative (2.1e-7 optimised), too close to 1e-5. A loss is the mean of 512 positive token
  cross-entropies: without cancellation its rounding is <= 511 u ~ 3e-5 relative per evaluation to first order
  (+ ~2e-6 from each token's 128-way logsumexp), so two summation orders differ by <= ~6.4e-5 (typically
  ~sqrt(512) u ~ 1.4e-6, as seen); held to LOSS_RTOL = 1e-4. A defect the loss can see at all (a wrong mask,
  targets out of step with inputs) moves it by >= 1e-2; subtler ones show in the parameters.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import TINY, make_batch, one_device_mesh, train
from test_parity import assert_params_close

import shardkit as sk
from models.gpt import GPT
from shardkit import hlo
from shardkit.parallel.context.layouts import block_positions, layout_perm

B, D, HEADS = 2, 8, 4
TOL = 5e-5  # see the module docstring


def qkv(seq: int, kv_heads: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, seq, HEADS, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, seq, kv_heads, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, seq, kv_heads, D), jnp.float32)
    # packed documents of random lengths (sorted ids), different per row
    seg = jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 4, (B, seq)), axis=1), jnp.int32)
    return q, k, v, seg


def assert_matches_dense(kernel, layout_axis, layout, mesh, seq, kv_heads, causal, segments):
    """kernel(q, k, v, seg) on laid-out inputs == dense on natural order: output and d(q, k, v), one jit each."""
    q, k, v, seg = qkv(seq, kv_heads)
    seg = seg if segments else None
    to = lambda x: sk.attention.to_layout(x, layout, mesh, layout_axis)
    back = lambda x: sk.attention.from_layout(x, layout, mesh, layout_axis)
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def run(fn):
        o, vjp = jax.vjp(fn, q, k, v)
        return (o, *vjp(cot))

    sharded = lambda q, k, v: back(kernel(to(q), to(k), to(v), None if seg is None else to(seg)))
    dense = lambda q, k, v: sk.attention.dense_attention(q, k, v, causal=causal, segment_ids=seg)
    got, want = jax.jit(lambda: run(sharded))(), jax.jit(lambda: run(dense))()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float(jnp.abs(a - b).max() / jnp.abs(b).max())
        assert err <= TOL, f"{name}: max |diff| / max |ref| = {err:.3g}"


# ----------------------------------------------------------------------------------------------------- layouts
def test_layout_maps_equal_the_algorithms_table():
    zigzag = layout_perm("zigzag", 16, 4).reshape(4, 4)
    assert zigzag.tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    striped = layout_perm("striped", 16, 4).reshape(4, 4)
    assert striped.tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout_perm("contiguous", 16, 4).tolist() == list(range(16))


@pytest.mark.parametrize("layout", sk.attention.LAYOUTS)
def test_layout_round_trip_is_exact_and_positions_follow_the_formula(layout):
    mesh = sk.make_mesh("data=2,seq=4")
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)  # rank-coded: every element distinct
    laid = sk.attention.to_layout(x, layout, mesh, axis="seq")
    np.testing.assert_array_equal(sk.attention.from_layout(laid, layout, mesh, axis="seq"), x)
    perm = layout_perm(layout, 48, 4)
    np.testing.assert_array_equal(laid, x[:, perm])
    for r in range(4):  # what the kernel computes inside shard_map = where to_layout put the tokens
        np.testing.assert_array_equal(block_positions(layout, 4, r, 12), perm[r * 12 : (r + 1) * 12])


def test_layout_batch_moves_every_entry_together_and_adds_positions():
    batch = {"inputs": np.arange(32).reshape(2, 16), "targets": np.arange(32).reshape(2, 16) + 1}
    out = sk.attention.layout_batch(batch, "zigzag", 4)
    perm = layout_perm("zigzag", 16, 4)
    np.testing.assert_array_equal(out["positions"][0], perm)
    np.testing.assert_array_equal(out["targets"] - out["inputs"], 1)  # (input, target) pairs stay aligned
    np.testing.assert_array_equal(out["inputs"], batch["inputs"][:, perm])


# ------------------------------------------------------------------------------------------------- numerics
def ring(layout, chunk, **kw):
    return lambda mesh, causal: (
        lambda q, k, v, seg: sk.attention.ring_attention(
            q, k, v, mesh=mesh, axis="seq", causal=causal, layout=layout, segment_ids=seg, chunk=chunk, **kw
        )
    )


@pytest.mark.parametrize("segments", [False, True], ids=["noseg", "seg"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", sk.attention.LAYOUTS)
def test_ring_gqa_matches_dense(layout, causal, segments):
    mesh = sk.make_mesh("seq=4", jax.devices()[:4])
    assert_matches_dense(ring(layout, 3)(mesh, causal), "seq", layout, mesh, 48, 2, causal, segments)


@pytest.mark.parametrize(
    ("layout", "spec", "seq", "chunk", "kw"),
    [
        ("contiguous", "seq=8", 64, 4, {}),
        ("zigzag", "seq=8", 64, 2, {}),  # ring of 8, chunk 2 inside halves of 4
        ("striped", "data=2,seq=4", 48, 12, {"batch_axes": "data"}),  # one chunk per block; batch sharded too
        ("zigzag", "seq=4", 64, None, {}),  # the default chunk (chunking.default_chunk), as a strategy runs it
    ],
)
def test_ring_mha_matches_dense(layout, spec, seq, chunk, kw):
    mesh = sk.make_mesh(spec, jax.devices()[: 4 if spec == "seq=4" else 8])
    assert_matches_dense(ring(layout, chunk, **kw)(mesh, True), "seq", layout, mesh, seq, HEADS, True, True)


@pytest.mark.parametrize(("causal", "segments"), [(True, True), (True, False), (False, True)])
def test_ulysses_matches_dense_with_kv_heads_repeated(causal, segments):
    mesh = sk.make_mesh("seq=4", jax.devices()[:4])  # kv_heads 2 < 4 devices: each kv head repeated twice
    kernel = lambda q, k, v, seg: sk.attention.ulysses_attention(
        q, k, v, mesh=mesh, causal=causal, segment_ids=seg, chunk=8
    )
    assert_matches_dense(kernel, "seq", "contiguous", mesh, 48, 2, causal, segments)


def test_ulysses_mha_with_batch_and_heads_sharded():
    mesh = sk.make_mesh("data=2,seq=2,tensor=2")
    kernel = lambda q, k, v, seg: sk.attention.ulysses_attention(
        q, k, v, mesh=mesh, segment_ids=seg, batch_axes="data", head_axes="tensor"
    )
    assert_matches_dense(kernel, "seq", "contiguous", mesh, 48, HEADS, True, True)


@pytest.mark.parametrize(
    ("layout", "causal", "kv_heads"), [("zigzag", True, 2), ("striped", True, 4), ("contiguous", False, 2)]
)
def test_usp_matches_dense(layout, causal, kv_heads):
    mesh = sk.make_mesh("seq_u=2,seq_r=4")
    kernel = lambda q, k, v, seg: sk.attention.usp_attention(
        q, k, v, mesh=mesh, ulysses_axis="seq_u", ring_axis="seq_r", causal=causal, layout=layout,
        segment_ids=seg, chunk=3,
    )  # fmt: skip
    assert_matches_dense(kernel, "seq_r", layout, mesh, 48, kv_heads, causal, True)


def test_ring_type_checks_under_check_vma(monkeypatch):
    """The kernels ship with check_vma=False (see ring.CHECK_VMA); their carries are typed right regardless."""
    from shardkit.parallel.context import ring as ring_module

    monkeypatch.setattr(ring_module, "CHECK_VMA", True)
    mesh = sk.make_mesh("data=2,seq=4")
    kernel = ring("zigzag", 3, batch_axes="data")(mesh, True)
    assert_matches_dense(kernel, "seq", "zigzag", mesh, 48, 2, True, True)


# --------------------------------------------------------------------------------------------------- errors
def test_bad_input_is_refused_with_the_numbers_and_the_fix():
    mesh = sk.make_mesh("seq=8")
    q, k, v, seg = qkv(48, 2)
    with pytest.raises(sk.ShardkitError, match=r"40 is not divisible by 16 \(2 x ring size 8.*e\.g\. 48"):
        sk.attention.ring_attention(*qkv(40, 2)[:3], mesh=mesh, layout="zigzag")
    with pytest.raises(sk.ShardkitError, match=r"segment_ids shape \(2, 47\) must be \[batch, seq\] = \(2, 48\)"):
        sk.attention.ring_attention(q, k, v, mesh=mesh, segment_ids=seg[:, :47])
    with pytest.raises(sk.ShardkitError, match=r"mesh axis 'seq_r' is not in the mesh"):
        sk.attention.usp_attention(q, k, v, mesh=mesh, ulysses_axis="seq")
    with pytest.raises(sk.ShardkitError, match=r"4 query heads .* not divisible by the Ulysses degree 8"):
        sk.attention.ulysses_attention(q, k, v, mesh=mesh)
    with pytest.raises(sk.ShardkitError, match=r"length 50 is not divisible by 4"):
        sk.attention.to_layout(jnp.zeros((1, 50)), "striped", n=4)
    with (
        pytest.raises(sk.ShardkitError, match=r"needs the compute rule seq"),
        sk.use_rules(mesh, {"seq": None}, attention="ring:zigzag"),
    ):
        sk.attention.attend(q, k, v)


# ------------------------------------------------------------------------------------------------ structure
def block_bytes(seq, n, kv_heads, b=B):
    return b * (seq // n) * kv_heads * D * 4


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_compiles_to_n_minus_1_permutes_of_k_and_v_and_skips_masked_blocks(layout):
    mesh, n, seq = sk.make_mesh("data=2,seq=4"), 4, 64
    q, k, v, _ = qkv(seq, 2)
    fwd = lambda q, k, v: sk.attention.ring_attention(q, k, v, mesh=mesh, layout=layout, chunk=4, batch_axes="data")
    c = jax.jit(fwd).lower(q, k, v).compile()
    colls = hlo.collectives(c, mesh)
    assert {(x.kind, x.axes) for x in colls} == {("collective-permute", ("seq",))}  # no all-gather of K/V
    blk = block_bytes(seq, n, 2, b=B // 2)
    assert sum(x.count * x.operand_bytes for x in colls) == 2 * (n - 1) * blk  # K and V, N-1 hops each
    assert "conditional" in c.as_text()  # fully masked chunk pairs are branched around, not masked

    grad = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).sum(), (0, 1, 2))).lower(q, k, v).compile()
    moved = sum(x.count * x.operand_bytes for x in hlo.collectives(grad, mesh) if x.kind == "collective-permute")
    # forward K, V: 2(N-1); backward K, V: 2(N-1); dK, dV: 2N (the last hop brings them home)
    assert moved == (4 * (n - 1) + 2 * n) * blk


def test_non_causal_ring_has_no_branches():
    mesh = sk.make_mesh("seq=4", jax.devices()[:4])
    q, k, v, _ = qkv(48, 2)
    fwd = lambda q, k, v: sk.attention.ring_attention(q, k, v, mesh=mesh, causal=False, chunk=4)
    assert "conditional" not in jax.jit(fwd).lower(q, k, v).compile().as_text()


def test_ulysses_compiles_to_all_to_alls_only():
    mesh = sk.make_mesh("data=2,seq=4")
    q, k, v, _ = qkv(64, 2)
    fwd = lambda q, k, v: sk.attention.ulysses_attention(q, k, v, mesh=mesh, batch_axes="data")
    colls = hlo.collectives(jax.jit(fwd).lower(q, k, v).compile(), mesh)
    assert {(x.kind, x.axes) for x in colls} == {("all-to-all", ("seq",))}
    assert sum(x.count for x in colls) == 4  # q, k, v in; out back


def test_ring_in_bfloat16_keeps_fp32_softmax_and_accumulators():
    """bf16 inputs (the GPU path): P and dS enter the products in bf16, the softmax and accumulators stay fp32.
    Against fp32 dense attention the error is bf16's own: inputs, P and dS rounded at u = 2^-8 relative, in sums
    that average the rounding, so about u of the scale; asserted 2e-2 (5u), observed 4.7e-3 (dQ)."""
    q, k, v, _ = qkv(64, 2)
    mesh = sk.make_mesh("seq=4", jax.devices()[:4])
    ring = lambda q, k, v: sk.attention.ring_attention(q, k, v, mesh=mesh, layout="zigzag", chunk=4)
    lay = lambda x: sk.attention.to_layout(x, "zigzag", mesh, "seq")
    unlay = lambda x: sk.attention.from_layout(x, "zigzag", mesh, "seq")

    def fwd_bwd(attn, dtype, inputs):
        qq, kk, vv = (x.astype(dtype) for x in inputs)
        out, vjp = jax.vjp(attn, qq, kk, vv)
        return [x.astype(jnp.float32) for x in (out, *vjp(jnp.ones_like(out)))]

    got = [unlay(x) for x in jax.jit(lambda *a: fwd_bwd(ring, jnp.bfloat16, a))(lay(q), lay(k), lay(v))]
    want = jax.jit(lambda *a: fwd_bwd(sk.attention.dense_attention, jnp.float32, a))(q, k, v)
    assert got[0].dtype == jnp.float32
    for g, w in zip(got, want, strict=True):
        assert float(jnp.abs(g - w).max() / jnp.abs(w).max()) < 2e-2


def test_cudnn_kernel_refuses_what_cudnn_cannot_run_before_xla():
    q, k, v, seg = qkv(16, 2)
    with pytest.raises(sk.ShardkitError, match=r"bfloat16 or float16 inputs, got float32.*dtype=.bfloat16."):
        sk.attention.cudnn_attention(q, k, v)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    with pytest.raises(sk.ShardkitError, match=r"segment_ids.*attention=dense"):
        sk.attention.cudnn_attention(q, k, v, segment_ids=seg)
    with pytest.raises(sk.ShardkitError, match=r"NVIDIA GPUs only.*attention=dense"):
        sk.attention.cudnn_attention(q, k, v)
    assert "cudnn" in sk.kernels.available("attention")


# ------------------------------------------------------------------------------------------------------------
# Part 2: the strategies train the GPT like one device

LOSS_RTOL = 1e-4  # see the module docstring
MESHES = {
    "cp_ring": "data=2,seq=4",
    "cp_zigzag": "data=2,seq=4",
    "cp_striped": "data=2,seq=4",
    "cp_ulysses": "data=2,seq=4",  # TINY's 2 kv heads < 4: repeated inside the kernel
    "cp_usp": "data=2,seq_u=2,seq_r=2",
    "fsdp_cp_zigzag": "fsdp=2,seq=4",
    "cp_zigzag_tp": "data=2,seq=2,tensor=2",
}


def laid_out(batch, strategy, mesh):
    return sk.attention.layout_batch(batch, *sk.attention.strategy_layout(sk.strategy(strategy).attention, mesh))


@pytest.fixture(scope="module")
def reference():
    return train(one_device_mesh(), "dp", batch=make_batch())[:2]


def test_every_context_parallel_strategy_is_covered():
    # context parallelism: the sequence split everywhere and a context-parallel attention kernel ('annotated'
    # shards whatever a model names `seq`, with dense attention)
    cp = {s for s, v in sk.STRATEGIES.items() if sk.Traits.of(v).sequence and v.kernels["attention"] != "dense"}
    assert cp == set(MESHES)


def test_the_old_sp_names_still_work_and_say_once_that_they_are_deprecated(monkeypatch):
    monkeypatch.setattr(sk.strategies, "_warned", set())
    for old, new in sk.strategies.DEPRECATED_NAMES.items():
        with pytest.warns(FutureWarning, match=f"strategy '{old}' is now '{new}'"):
            assert sk.strategy(old) is sk.strategy(new)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sk.strategy(old)  # once per process: no second warning


@pytest.mark.parametrize("name", list(MESHES))
def test_cp_strategy_matches_one_device(name, reference):
    mesh = sk.make_mesh(MESHES[name])
    losses, params, _, _ = train(mesh, name, batch=laid_out(make_batch(), name, mesh))
    np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL)
    assert losses[-1] < losses[0]
    assert_params_close(params, reference[1], rtol=1e-5)


def test_packed_documents_match_one_device():
    batch = make_batch()
    batch["segment_ids"] = np.repeat(np.arange(4, dtype=np.int32), 8)[None].repeat(16, 0)  # 4 documents of 8
    ref_losses, ref_params, _, _ = train(one_device_mesh(), "dp", batch=batch)
    mesh = sk.make_mesh(MESHES["cp_zigzag"])
    losses, params, _, _ = train(mesh, "cp_zigzag", batch=laid_out(batch, "cp_zigzag", mesh))
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert_params_close(params, ref_params, rtol=1e-5)


def test_a_jax_make_mesh_default_trains_cp_zigzag_like_one_device(reference):
    """jax.make_mesh's Explicit axes, taken as Auto (shardkit/mesh.py auto_axes), under a context-parallel kernel."""
    axes = sk.mesh.parse_spec(MESHES["cp_zigzag"])
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # said once per mesh shape (tests/test_parity.py checks it)
        losses, params, _, _ = train(mesh, "cp_zigzag", batch=laid_out(make_batch(), "cp_zigzag", mesh))
    np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL)
    assert_params_close(params, reference[1], rtol=1e-5)


def test_microbatches_vmap_the_kernels_and_match_one_device(reference):
    mesh = sk.make_mesh(MESHES["cp_usp"])
    losses, params, _, _ = train(mesh, "cp_usp", batch=laid_out(make_batch(), "cp_usp", mesh), microbatches=2)
    np.testing.assert_allclose(losses, reference[0], rtol=LOSS_RTOL)
    assert_params_close(params, reference[1], rtol=1e-5)


def test_strategy_layout_names_the_data_layout():
    mesh = sk.make_mesh(MESHES["cp_usp"])
    assert sk.attention.strategy_layout("usp:zigzag", mesh) == ("zigzag", 2)
    assert sk.attention.strategy_layout("ring:striped", sk.make_mesh("seq=8")) == ("striped", 8)
    assert sk.attention.strategy_layout("dense", mesh) == ("contiguous", 1)


def test_zigzag_train_step_rings_k_and_v_and_never_gathers_them():
    mesh = sk.make_mesh("seq=8")
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, "cp_zigzag")
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, "cp_zigzag")
    batch = laid_out(make_batch(2, 32), "cp_zigzag", mesh)
    colls = hlo.collectives(step.lower(step.init_state(), batch).compile(), mesh)
    blk = 2 * (32 // 8) * TINY.num_kv_heads * TINY.head_dim * 4  # one K (or V) block of a device
    permuted = sum(c.count * c.operand_bytes for c in colls if c.kind == "collective-permute")
    # per layer: fwd K, V over N-1 hops; bwd K, V over N-1 hops and dK, dV over N (XLA may not fuse them)
    assert permuted == TINY.num_layers * (4 * 7 + 2 * 8) * blk
    assert not [c for c in colls if c.kind == "all-gather" and c.result_bytes >= 8 * blk]
