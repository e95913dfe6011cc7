"""The GPT itself: shapes, parameter count, causality, GQA attention, the layer scan, RoPE."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from common import TINY, make_batch, one_device_mesh, train
from flax import nnx

import shardkit as sk
from models.gpt import GPT, GPTConfig, rms_norm, rope
from shardkit import hlo


@pytest.fixture(scope="module")
def model():
    return GPT(TINY, rngs=nnx.Rngs(0))


def test_logits_shape_and_parameter_count(model):
    tokens = jnp.zeros((2, 16), jnp.int32)
    assert model(tokens).shape == (2, 16, TINY.vocab_size)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == TINY.num_params()
    assert model.blocks.wqkv[...].shape[0] == TINY.num_layers  # stacked on `layers`


def test_every_parameter_has_logical_axes(model):
    axes = sk.param_logical_axes(model)
    assert axes["blocks"]["wqkv"] == ("layers", "embed", "kv_heads", None, "head_dim")
    assert axes["embed"] == ("vocab", "embed") and axes["head"] == ("embed", "vocab")


def test_logits_in_the_compute_dtype_are_the_fp32_dot_rounded_once():
    """logits_dot_in_fp32=False (MaxText's default): with fp32 compute nothing changes; with bf16 compute the logits
    are the fp32-accumulated dot rounded to bf16 (<= 2^-8 relative each, asserted 2^-8 of the largest |logit|) and
    come back fp32."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 16)), jnp.int32)
    for dtype in ("float32", "bfloat16"):
        cfg = GPTConfig(**{**TINY.__dict__, "dtype": dtype})
        state = nnx.state(GPT(cfg, rngs=nnx.Rngs(0)))
        fp32_dot = nnx.merge(nnx.graphdef(GPT(cfg, rngs=nnx.Rngs(0))), state)(tokens)
        lo = GPT(GPTConfig(**{**cfg.__dict__, "logits_dot_in_fp32": False}), rngs=nnx.Rngs(0))
        nnx.update(lo, state)
        rounded = lo(tokens)
        assert rounded.dtype == fp32_dot.dtype == jnp.float32
        if dtype == "float32":
            np.testing.assert_array_equal(rounded, fp32_dot)
        else:
            assert np.abs(rounded - fp32_dot).max() <= 2**-8 * np.abs(fp32_dot).max()
            np.testing.assert_array_equal(rounded, fp32_dot.astype(jnp.bfloat16).astype(jnp.float32))


def test_a_chunked_loss_equals_the_whole_one_with_its_gradients():
    """loss_chunk=8 over seq 32: the same mean cross-entropy and parameter gradients as the whole [B, S, V] logits
    (the same sums in another order: fp32, 1e-6 relative on the loss, 1e-5 of each gradient's scale)."""
    from models.gpt import lm_loss

    batch = make_batch(4, 32)
    whole = GPT(TINY, rngs=nnx.Rngs(0))
    chunked = GPT(GPTConfig(**{**TINY.__dict__, "loss_chunk": 8}), rngs=nnx.Rngs(0))
    grads = []
    for m in (whole, chunked):
        graphdef, params = nnx.split(m, nnx.Param)
        loss_of = lambda p, g=graphdef: lm_loss(nnx.merge(g, p), batch)
        grads.append(jax.value_and_grad(loss_of)(params))
    (l0, g0), (l1, g1) = grads
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    # no chunk is recomputed: the differentiated chunked loss does the whole one's matmul FLOPs (the forward keeps
    # each chunk's gradients, not its logits; a rematerialised chunk would add its head's forward again)
    flops = []
    for m in (whole, chunked):
        graphdef, params = nnx.split(m, nnx.Param)
        loss_of = lambda p, g=graphdef: lm_loss(nnx.merge(g, p), batch)
        flops.append(hlo.matmul_flops(jax.jit(jax.grad(loss_of)).lower(params).compile()))
    assert flops[0] == flops[1], flops
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(b)).max()
    # and in a sharded train step (fsdp over 8 devices): 3 SGD steps as the whole loss on one device (1e-5)
    sharded = train(sk.make_mesh("data=2,fsdp=4"), "fsdp", cfg=GPTConfig(**{**TINY.__dict__, "loss_chunk": 8}))
    np.testing.assert_allclose(sharded[0], train(one_device_mesh(), "dp")[0], rtol=1e-5)
    with pytest.raises(sk.ShardkitError, match="loss_chunk=-1: positions per chunk"):
        GPTConfig(**{**TINY.__dict__, "loss_chunk": -1})
    with pytest.raises(sk.ShardkitError, match="loss_chunk=7 must divide"):
        lm_loss(GPT(GPTConfig(**{**TINY.__dict__, "loss_chunk": 7}), rngs=nnx.Rngs(0)), batch)


def test_the_target_picks_the_lean_head():
    """logits_dot_in_fp32 and loss_chunk left None (auto): the choice follows the mesh's devices and the per-device
    logits, never the host. Read from the lowered train step (no compile): on a v5e-8 target with bf16 compute the
    head's dot returns bf16 and, with 256 MiB of fp32 logits a device, the loss runs in 2 chunks (1024 positions);
    fp32 compute on the same target, or bf16 on this host's CPU mesh, keeps the fp32 whole-sequence head."""
    import re

    import optax

    from models.gpt_loss import CHUNK_ABOVE_BYTES, auto_head

    def head_dot(target, dtype):
        cfg = GPTConfig(vocab_size=32768, num_layers=1, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32,
                        mlp_dim=128, max_seq_len=2048, dtype=dtype)  # fmt: skip
        mesh = sk.make_mesh("fsdp=8", target=target) if target else sk.make_mesh("fsdp=8")
        step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.sgd(0.1), mesh, "fsdp")
        shape = ((8, 2048), jnp.int32)
        text = step.lower(step.abstract_state(), step.abstract_batch({"inputs": shape, "targets": shape})).as_text()
        return re.findall(r"dot_general.*-> tensor<([0-9x]+x32768x(?:bf16|f32))>", text)[0]

    assert head_dot("v5e-8", "bfloat16") == "8x1024x32768xbf16"
    assert head_dot("v5e-8", "float32") == head_dot(None, "bfloat16") == "8x2048x32768xf32"
    # the rule itself: explicit fields are kept; chunks are the fewest that bring a device's logits under the bound,
    # (else as many as can be), each a whole number of positions on every device of a split sequence
    bf16 = GPTConfig(**{**TINY.__dict__, "dtype": "bfloat16"})
    limit = CHUNK_ABOVE_BYTES // 4
    assert auto_head(bf16, "gpu", 4096, limit) == (False, 0)
    assert auto_head(bf16, "tpu", 4096, 3 * limit) == (False, 1024)  # 3 chunks do not divide 4096: 4
    assert auto_head(bf16, "tpu", 4096, 3 * limit, seq_split=2048) == (False, 2048)  # 2 chunks are the most
    assert auto_head(bf16, "tpu", 4096, 3 * limit, seq_split=4096) == (False, 0)
    assert auto_head(bf16, "cpu", 4096, 3 * limit) == (True, 0)
    fixed = GPTConfig(**{**bf16.__dict__, "logits_dot_in_fp32": True, "loss_chunk": 0})
    assert auto_head(fixed, "tpu", 4096, 3 * limit) == (True, 0)


def test_causal_future_tokens_do_not_change_past_logits(model):
    a = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 16)), jnp.int32)
    b = a.at[0, 10:].set((a[0, 10:] + 1) % 128)
    la, lb = model(a), model(b)
    np.testing.assert_array_equal(la[0, :10], lb[0, :10])
    assert not np.allclose(la[0, 10:], lb[0, 10:])


def test_scan_equals_applying_the_blocks_one_by_one(model):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 128, (2, 16)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    graphdef, stacked = nnx.split(model.blocks)
    x = jnp.take(model.embed[...], tokens, axis=0)
    for i in range(TINY.num_layers):
        x = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked))(x, pos, None)

    ref = rms_norm(x, model.final_norm[...], TINY.norm_eps) @ model.head[...]
    # the same fp32 ops, fused differently: observed max |diff| <= 2.1e-7 on logits up to 0.58 (1.5% of the tolerance)
    np.testing.assert_allclose(model(tokens), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layers_kernel_trains_like_the_scan(remat):
    """`layers=unrolled` (L inlined layers) against the default scan: 3 SGD steps, fsdp on 8 devices, fp32.
    Same math, fused differently: bounded like the scan-vs-loop test above (observed: losses equal, parameters
    within 6e-8 without remat and equal with full remat)."""
    import dataclasses

    from common import train

    cfg = dataclasses.replace(TINY, remat=remat)
    mesh = sk.make_mesh("data=2,fsdp=4")
    fsdp = sk.strategies.strategy("fsdp")
    loss_scan, p_scan, _, _ = train(mesh, fsdp, cfg=cfg)
    loss_unr, p_unr, step_unr, _ = train(mesh, fsdp.replace(layers="unrolled"), cfg=cfg)
    np.testing.assert_allclose(loss_unr, loss_scan, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p_unr, p_scan)
    assert step_unr.strategy.kernels["layers"] == "unrolled"


def reference_attention(q, k, v, mask):
    """Plain softmax attention with K/V heads repeated for GQA (query head n uses kv head n // group)."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(mask[:, None], s, -jnp.inf)
    return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("segments", [False, True])
def test_dense_attention_gqa_and_segments_match_reference(segments):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(2, 12, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 12, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]], 2, axis=0)) if segments else None
    mask = jnp.tril(jnp.ones((12, 12), bool))[None].repeat(2, axis=0)
    if segments:
        mask &= seg[:, :, None] == seg[:, None, :]
    out = sk.attention.dense_attention(q, k, v, causal=True, segment_ids=seg)
    # An output is a softmax-weighted mean of <= 12 values of v (max |v| = 3.1). To first order one evaluation is off
    # by <= (12 + ~15) u max|v| (the 12-term sum, plus each probability's rounding: shift, exp, 12-term normaliser,
    # division), so two differ by <= ~1e-5 even where the mean cancels to ~0: atol 1e-5 (observed: 2.4e-7).
    np.testing.assert_allclose(out, reference_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    """In float64: the identity is exact in real arithmetic, but in fp32 rounding of the angles pos * theta_i
    (~1e-6 rad at pos 13) and the cancellation in this score (0.128 from terms summing to 8.1 in magnitude) leave
    it at ~3e-6 relative, too close to any fp32 tolerance. In float64 it holds to 4e-15; asserted 1e-10."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float64) for _ in range(2))
        rot = lambda x, i: rope(x, jnp.array([[i]]), 10_000.0)
        score = lambda i, j: float((rot(q, i) * rot(k, j)).sum())
        assert rot(q, 5).dtype == jnp.float64
        assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-10)
        assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)  # they differ by 96%


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, r"num_heads=6 must be a multiple of num_kv_heads=4"),
        ({"head_dim": 7}, r"head_dim=7 must be even"),
        ({"remat": "some"}, r"remat='some'"),
    ],
)
def test_bad_model_config(kwargs, message):
    with pytest.raises(sk.ShardkitError, match=message):
        GPTConfig(**kwargs)


def test_constrain_checks_rank():
    mesh = sk.make_mesh("data=8")
    with sk.use_rules(mesh, {"batch": ("data",)}), pytest.raises(sk.ShardkitError, match=r"2 logical names"):
        sk.constrain(jnp.zeros((8, 4, 2)), ("batch", None))
