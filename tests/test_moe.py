"""Mixture of experts (shardkit/parallel/moe/, the GPT's MoE blocks): routing against a per-token loop, capacity
and dropping by hand, expert parallelism (2 all-to-alls per layer each way) against one device.

The dropless `ragged` kernel (tokens sorted by expert, `sk.moe.grouped_dot`) against a dense reference (every
expert on every token, masked by the routing) in float64, an expert-parallel buffer that overflows and one that
cannot, and the GPT trained with it against today's dropless einsum; `grouped_dot` against `jax.lax.ragged_dot`
and a per-group reference in float64, and its compiled FLOPs (the routed rows' plus at most E (tile - 1) rows).

Tolerances: the layer against the per-token reference is the same fp32 arithmetic in another order (einsums over
one-hot dispatch vs per-token matmuls): observed <= 3e-7 relative, asserted 1e-5 on outputs and gradients. GPT-MoE
on 8 devices vs one: losses 1e-5 as the dp parity tests (reduction order). The ragged layer in float64: 1e-12 on
outputs, 1e-11 on gradients (observed ~1e-13: float64 rounding of the same sums in another order).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import make_batch

import shardkit as sk
from models.gpt import GPT, GPTConfig

CFG = GPTConfig(num_layers=2, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=32, vocab_size=64,
                max_seq_len=16, num_experts=4, top_k=2, capacity_factor=1.0)  # fmt: skip


def _experts(w, xe):
    gu = jnp.einsum("encm,emtf->enctf", xe, w[0])
    return jnp.einsum("encf,efm->encm", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w[1])


def _picks(logits, top_k, cap):
    """Per group and token: (first, second, [(rank, expert) kept]): queues filled in token order, second choices
    after all first choices, a dropped token still taking its place in the queue. From concrete logits."""
    p = np.asarray(jax.nn.softmax(logits, axis=-1))
    g_n, s_n, e_n = p.shape
    out = []
    for g in range(g_n):
        first = [int(np.argmax(p[g, s])) for s in range(s_n)]
        second = [int(np.argmax(np.where(np.arange(e_n) == first[s], -1, p[g, s]))) for s in range(s_n)]
        count, kept = np.zeros(e_n, int), [[] for _ in range(s_n)]
        for rank, picks in enumerate([first, second][:top_k]):
            for s in range(s_n):
                if count[picks[s]] < cap:
                    kept[s].append((rank, picks[s]))
                count[picks[s]] += 1
        out.append((first, second, kept))
    return out


def _reference(x, logits, w, top_k, picks):
    """The MoE layer token by token, each token through its kept experts' SwiGLU, weighted by its gates."""
    probs = jax.nn.softmax(logits, axis=-1)
    out = []
    for g, (first, second, kept) in enumerate(picks):
        rows = []
        for s in range(x.shape[1]):
            gates = [probs[g, s, first[s]], probs[g, s, second[s]]][:top_k]
            norm = gates[0] + gates[1] if top_k == 2 else 1.0
            y = jnp.zeros_like(x[g, s])
            for rank, e in kept[s]:
                h = jnp.einsum("m,mtf->tf", x[g, s], w[0][e])
                y = y + gates[rank] / norm * ((jax.nn.silu(h[0]) * h[1]) @ w[1][e])
            rows.append(y)
        out.append(jnp.stack(rows))
    return jnp.stack(out)


@pytest.mark.parametrize("top_k,cap", [(1, 2), (2, 3), (2, 8)], ids=["switch-drops", "gshard-drops", "dropless"])
def test_layer_equals_the_per_token_loop(top_k, cap):
    rng = np.random.default_rng(0)
    g, s, e, m, f = 2, 8, 4, 8, 6
    x = jnp.asarray(rng.normal(size=(g, s, m)), jnp.float32)
    w_router = jnp.asarray(rng.normal(size=(m, e)), jnp.float32)
    w = (jnp.asarray(rng.normal(size=(e, m, 2, f)) * 0.3, jnp.float32),
         jnp.asarray(rng.normal(size=(e, f, m)) * 0.3, jnp.float32))  # fmt: skip

    def ours(x, w_router, w):
        r = sk.moe.route(jnp.einsum("gsm,me->gse", x, w_router), top_k, cap)
        return sk.moe.apply(x, r, _experts, w), r

    picks = _picks(jnp.einsum("gsm,me->gse", x, w_router), top_k, cap)

    def ref(x, w_router, w):
        return _reference(x, jnp.einsum("gsm,me->gse", x, w_router), w, top_k, picks)

    y, r = ours(x, w_router, w)
    np.testing.assert_allclose(y, ref(x, w_router, w), rtol=1e-5, atol=1e-6)
    if cap < s:
        assert float(r["dropped"]) > 0  # the case exercises dropping
    else:
        assert float(r["dropped"]) == 0
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)[0] if fn is ours else fn(*a)))
    g_ours = jax.grad(loss(ours), argnums=(0, 1, 2))(x, w_router, w)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w_router, w)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_capacity_and_queueing_by_hand():
    # 4 tokens, 2 experts, every token prefers expert 0 (second choice: expert 1); capacity 2
    logits = jnp.asarray([[[2.0, 0.0]] * 4])
    r1 = sk.moe.route(logits, 1, 2)
    np.testing.assert_array_equal(np.asarray(r1["dispatch"][0, :, 0]), [[1, 0], [0, 1], [0, 0], [0, 0]])
    assert float(r1["dropped"]) == 0.5  # tokens 2 and 3 over expert 0's capacity
    r2 = sk.moe.route(logits, 2, 2)
    # second choices queue behind all 4 first choices of expert 1 (none): tokens 0, 1 take its 2 slots
    np.testing.assert_array_equal(np.asarray(r2["dispatch"][0, :, 1]), [[1, 0], [0, 1], [0, 0], [0, 0]])
    gate0 = float(jax.nn.softmax(jnp.asarray([2.0, 0.0]))[0])
    np.testing.assert_allclose(float(r2["combine"][0, 0, 0, 0]), gate0 / 1.0, rtol=1e-6)  # gates renormalised
    assert sk.moe.capacity(16, 4, 2, 1.25) == 10 and sk.moe.capacity(16, 4, 2, 1.0, dropless=True) == 16
    # balanced routing (token i -> expert i): load-balancing loss E^2 mean(f p) = 16 x mean(1/4 x 1/4) = 1
    np.testing.assert_allclose(float(sk.moe.route(5.0 * jnp.eye(4)[None], 1, 4)["aux_loss"]), 1.0, rtol=1e-6)
    # every token sure of expert 0: f = p = (1, 0, 0, 0) -> E (= 4) times the balanced value
    peaked = jnp.asarray([[[9.0, 0, 0, 0]] * 4])
    np.testing.assert_allclose(float(sk.moe.route(peaked, 1, 4)["aux_loss"]), 4.0, rtol=1e-3)


def _moe_run(strategy: str, mesh: jax.sharding.Mesh, compile_it: bool) -> tuple:
    """3 SGD steps of the MoE GPT from seed 0: (losses, params, the compiled step or None, mesh, last metrics,
    step, state)."""
    batch = make_batch(16, 16, CFG.vocab_size)
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(model, optax.sgd(0.3), mesh, strategy)
    state, losses = step.init_state(), []
    compiled = step.lower(state, batch).compile() if compile_it else None
    for _ in range(3):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses, jax.tree.map(np.asarray, state.params), compiled, mesh, m, step, state


@pytest.fixture(scope="module")
def moe_one_device() -> tuple:
    """The one-device dp reference, the same program for every strategy below: trained once per module."""
    return _moe_run("dp", sk.make_mesh("data=1", jax.devices()[:1]), compile_it=False)


@pytest.mark.parametrize("name,spec", [("ep", "data=2,expert=4"), ("ep_gspmd", "data=2,expert=4"),
                                       ("ep_tp", "expert=4,tensor=2"), ("ep_fsdp", "fsdp=2,expert=4")])  # fmt: skip
def test_gpt_moe_training_equals_one_device(moe_one_device, name, spec):
    """Each strategy's 3 steps against the one-device run (shared by the cases: `moe_one_device`)."""
    results = {"one": moe_one_device, name: _moe_run(name, sk.make_mesh(spec), compile_it=True)}
    step, state = results[name][5], results[name][6]
    # sk.explain: the collectives predicted by formula (models/gpt_cost/moe.py) vs compiled
    report = sk.explain(step, state, make_batch(16, 16, CFG.vocab_size))
    n, b = report.predicted_comms["all-to-all", "expert"]
    got = [c for c in report.collectives if c.kind == "all-to-all"]
    assert sum(c.count for c in got) == n and sum(c.bytes_sent for c in got) == pytest.approx(b, rel=0.02)
    # every kind's bytes (XLA groups some gradient reductions over other axes, so per kind, not per axis):
    # the gradients' all-reduces, ep_tp's g / f, ep_fsdp's gathers; the scalars' and the router's small
    # exchanges are not modelled (measured: 0.987-1.0 of the compiled bytes per kind)
    for kind in {k for k, _ in report.predicted_comms}:
        pred = sum(b for (k, _), (_, b) in report.predicted_comms.items() if k == kind)
        compiled = sum(c.bytes_sent for c in report.collectives if c.kind == kind)
        assert pred == pytest.approx(compiled, rel=0.03), (kind, pred, compiled)
    np.testing.assert_allclose(results[name][0], results["one"][0], rtol=1e-5)
    for got, want in zip(jax.tree.leaves(results[name][1]), jax.tree.leaves(results["one"][1]), strict=True):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert {"ce", "moe_aux", "moe_z", "moe_dropped"} <= set(results[name][4])
    # both formulations (ep's shard_map, ep_gspmd's reshape idiom) compile to the same collectives
    colls = sk.hlo.collectives(results[name][2], results[name][3])
    a2a = [c for c in colls if c.kind == "all-to-all"]
    # 2 forward + 2 backward per MoE layer; buffer E x G_local x C x M fp32 (G_local = 16 / the batch axes' size)
    assert sum(c.count for c in a2a) == 4 * CFG.num_layers
    cap = sk.moe.capacity(16, CFG.num_experts, CFG.top_k, CFG.capacity_factor)
    local = 16 // (8 // (2 if name == "ep_tp" else 1))
    assert {c.result_bytes for c in a2a} == {CFG.num_experts * local * cap * CFG.d_model * 4}
    # no activation all-gather (GSPMD's pitfall with a plain constraint on the experts: docs/jax_pitfalls.md §14)
    # (over `expert`: fsdp's parameter all-gathers are over fsdp)
    gathers = [c for c in colls if c.kind == "all-gather" and "expert" in c.axes and c.result_bytes >= 2 * 16 * 32]
    assert not gathers, gathers


def test_plan_covers_expert_parallelism():
    cfg = GPTConfig(num_layers=24, d_model=1024, num_heads=16, num_kv_heads=16, head_dim=64, mlp_dim=2816,
                    vocab_size=50304, num_experts=8)  # fmt: skip
    plans = {p.mesh["expert"]: p for p in sk.plan(cfg, devices=8, hardware="gpu_8xh100", global_batch=32,
                                                  seq_len=1024, strategies=("ep",))}  # fmt: skip
    assert set(plans) == {2, 4, 8}
    # more expert parallelism: less memory per device (the experts split further), more all-to-all traffic, less
    # gradient traffic (each device's experts' slice, all-reduced over data, shrinks; none at data=1)
    assert plans[8].memory["params"] < plans[4].memory["params"] < plans[2].memory["params"]
    rows = lambda p, kind, axis: sum(c.bytes for c in p.comms if c.kind == kind and c.axis == axis)
    assert rows(plans[8], "all-to-all", "expert") > rows(plans[4], "all-to-all", "expert") > 0
    grads = [rows(plans[x], "all-reduce", "data") for x in (2, 4, 8)]
    assert grads[0] > grads[1] > grads[2] == 0


# --- the dropless `ragged` kernel (#28): tokens sorted by expert, grouped matmuls ---


def _grouped(w, xs, sizes, **how):
    gate, up = (sk.moe.grouped_dot(xs, w[0][:, :, i], sizes, **how) for i in (0, 1))
    return sk.moe.grouped_dot(jax.nn.silu(gate) * up, w[1], sizes, **how)


def _dense_reference(x, logits, w, top_k):
    """Every expert on every token, masked by the routing and weighted by the gates (no sorting, no capacity)."""
    r = sk.moe.route(logits, top_k, None)
    weight = jnp.sum(jax.nn.one_hot(r["experts"], w[0].shape[0], dtype=x.dtype) * r["gates"][..., None], axis=-2)
    gu = jnp.einsum("gsm,emtf->gsetf", x, w[0])
    return jnp.einsum("gsef,efm,gse->gsm", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], w[1], weight)


def _layer_inputs(dtype, g=2, s=6, e=4, m=5, f=3):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(g, s, m)), dtype)
    w_router = jnp.asarray(rng.normal(size=(m, e)), dtype)
    bias = jnp.asarray([0.0] * (e - 1) + [-30.0], dtype)  # expert e-1 never in any token's top 2: an empty group
    w = (jnp.asarray(rng.normal(size=(e, m, 2, f)), dtype), jnp.asarray(rng.normal(size=(e, f, m)), dtype))
    return x, w_router, bias, w


@pytest.mark.parametrize("top_k", [1, 2])
def test_ragged_layer_equals_the_dense_reference_in_float64(top_k):
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    with jax.enable_x64(True):
        x, w_router, bias, w = _layer_inputs(jnp.float64)
        logits = lambda x, w_router: jnp.einsum("gsm,me->gse", x, w_router) + bias

        def ours(x, w_router, w):
            with sk.use_rules(mesh, {}, kernels={"moe": "ragged"}):
                assert sk.moe.is_grouped()
                r = sk.moe.route(logits(x, w_router), top_k, None)
                y, dropped = sk.moe.apply(x, r, None, w, grouped_fn=_grouped, with_dropped=True)
            assert "dispatch" not in r and float(dropped) == 0 and float(r["dropped"]) == 0
            return y

        ref = lambda x, w_router, w: _dense_reference(x, logits(x, w_router), w, top_k)
        counts = np.bincount(np.asarray(sk.moe.route(logits(x, w_router), top_k, None)["experts"]).ravel(), None, 4)
        assert counts[-1] == 0 and counts.sum() == 2 * 6 * top_k  # an expert with no token; every pair routed
        np.testing.assert_allclose(ours(x, w_router, w), ref(x, w_router, w), rtol=1e-12, atol=1e-12)
        loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)))
        g_ours = jax.grad(loss(ours), argnums=(0, 1, 2))(x, w_router, w)
        g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(x, w_router, w)
        for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref), strict=True):
            assert a.dtype == jnp.float64
            np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11 * float(np.abs(b).max()))
        assert not np.any(np.asarray(g_ours[2][0][-1])) and not np.any(np.asarray(g_ours[2][1][-1]))  # empty: 0


def test_ragged_expert_parallel_buffer_bound():
    """ep's fixed buffer (ragged:<f>): every token on expert 0 overflows a factor-1 buffer (ceil(N / 4) rows of N
    pairs reach device 0: 3/4 dropped, counted) and fits with f = 4 = the axis size (equal to the reference)."""
    mesh = sk.make_mesh("data=2,expert=4")
    rules = {"batch": ("data", "expert"), "experts": ("expert",)}
    x, w_router, _, w = _layer_inputs(jnp.float32, g=8, s=4, e=8)
    logits = jnp.einsum("gsm,me->gse", x, w_router).at[..., 0].add(50.0)  # every first choice: expert 0
    ref = _dense_reference(x, logits, w, 1)

    def layer(x, logits, w):
        return sk.moe.apply(x, sk.moe.route(logits, 1, None), None, w, grouped_fn=_grouped, with_dropped=True)

    for name, want in (("ragged:1", 0.75), ("ragged:4", 0.0)):
        with sk.use_rules(mesh, rules, kernels={"moe": name}):
            # a fresh function per kernel: jit's cache does not key on the kernel table (docs/jax_pitfalls.md §7)
            y, dropped = jax.jit(lambda *a, _name=name: layer(*a))(x, logits, w)
        assert float(dropped) == want
        if want == 0:
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    assert any("padded all_to_all fallback" in path for path in sk.moe.RAGGED_PATHS.values())


def test_ragged_refuses_bad_input():
    logits = jnp.zeros((1, 4, 4))
    with pytest.raises(sk.ShardkitError, match="top_k=3"):
        sk.moe.route(logits, 3, None)
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    w = (jnp.zeros((4, 2, 2, 3)), jnp.zeros((4, 3, 2)))
    with sk.use_rules(mesh, {}, kernels={"moe": "ragged"}), pytest.raises(sk.ShardkitError, match="grouped_fn"):
        sk.moe.apply(jnp.zeros((1, 4, 2)), sk.moe.route(logits, 1, None), _experts, w)
    with sk.use_rules(mesh, {}, kernels={"moe": "einsum"}), pytest.raises(sk.ShardkitError, match="cap=None"):
        sk.moe.apply(jnp.zeros((1, 4, 2)), sk.moe.route(logits, 1, None), _experts, w)
    with sk.use_rules(mesh, {}, kernels={"moe": "ragged:x"}), pytest.raises(sk.ShardkitError, match="padding"):
        sk.moe.apply(jnp.zeros((1, 4, 2)), sk.moe.route(logits, 1, None), _experts, w, grouped_fn=_grouped)
    from experiments import runtime  # the CLI's --config.kernels: refused when named, before anything is built

    with pytest.raises(sk.ShardkitError, match=r"moe kernel 'ragged:x': ragged or ragged:<padding factor > 0>"):
        runtime.with_kernels(sk.strategy("ep"), "moe=ragged:x")
    assert runtime.with_kernels(sk.strategy("ep"), "moe=ragged:4").kernels["moe"] == "ragged:4"


def _per_group(x, w, sizes):
    """The grouped matmul by hand: each group's rows times its expert's weights, rows past sum(sizes) zero."""
    out, start = [], 0
    for e, size in enumerate(sizes):
        out.append(x[start : start + size] @ w[e])
        start += size
    return jnp.concatenate([*out, jnp.zeros((x.shape[0] - start, w.shape[2]), x.dtype)])


@pytest.mark.parametrize("how", [{"tile": 4}, {"method": "tiled"}, {"method": "ragged_dot"}])
def test_grouped_dot_equals_ragged_dot_in_float64(how):
    """Sizes [9, 0, 5, 1, 4] of 23 rows: an empty group, groups over and under a tile of 4, 4 padding rows past the
    sum (output 0); forward and gradients (x and w) against jax.lax.ragged_dot and a per-group reference."""
    sizes = [9, 0, 5, 1, 4]
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        x, w = jnp.asarray(rng.normal(size=(23, 5))), jnp.asarray(rng.normal(size=(5, 5, 3)))
        group_sizes = jnp.asarray(sizes, jnp.int32)
        ours = jax.jit(lambda x, w: sk.moe.grouped_dot(x, w, group_sizes, **how))
        ragged = lambda x, w: jax.lax.ragged_dot(x, w, group_sizes)
        y = ours(x, w)
        assert y.dtype == jnp.float64 and y.shape == (23, 3) and not np.any(np.asarray(y[19:]))
        for ref in (ragged, lambda x, w: _per_group(x, w, sizes)):
            np.testing.assert_allclose(y, ref(x, w), rtol=1e-13, atol=1e-13)
            dy = jnp.asarray(rng.normal(size=(23, 3)))
            loss = lambda fn, dy=dy: lambda x, w: jnp.sum(jnp.sin(fn(x, w)) * dy)
            for a, b in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        assert not np.any(np.asarray(jax.grad(loss(ours), 1)(x, w)[1]))  # the empty group's weights: no gradient
    with pytest.raises(sk.ShardkitError, match="method"):
        sk.moe.grouped_dot(x, w, group_sizes, method="dense")


@pytest.mark.parametrize("n, e", [(1024, 2), (512, 8)])
def test_grouped_expert_flops_are_the_routed_rows(n, e):
    """Compiled FLOPs of the grouped SwiGLU (3 grouped_dots, this backend's default path; M 64, mlp 128) against the
    routed rows' 3 x 2 N M F: at most 10% over the routed rows plus grouped_dot's padding bound E (tile - 1) rows.
    (1024, 2) is bench_moe's ep device (2 local experts, 1024 buffer rows): within 10% of the routed rows alone
    (1.085 measured on CPU: 1.029 of padding, the rest XLA counting the gathers' elements, T K F for the weights).
    Before grouped_dot, CPU compiled E x the routed FLOPs (ragged_dot's masked dense dot over all groups)."""
    m, f = 64, 128
    w = (jnp.zeros((e, m, 2, f)), jnp.zeros((e, f, m)))
    sizes = jnp.zeros((e,), jnp.int32)  # FLOPs are static: the sizes' values do not matter
    cost = jax.jit(_grouped).lower(w, jnp.zeros((n, m)), sizes).compile().cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]  # a list of one dict in some jax versions
    routed = 3 * 2 * n * m * f
    padded = 3 * 2 * (n + e * (sk.moe.TILE - 1)) * m * f
    assert routed <= flops <= 1.1 * padded, (flops / routed, padded / routed)
    if n >= 150 * e:  # the padding bound is under 10% of the routed rows
        assert flops <= 1.1 * routed, flops / routed


def test_gpt_moe_ragged_trains_like_dropless():
    """3 SGD steps: moe=ragged on one device and under ep (data=2,expert=4; default buffer, nothing overflows at
    these shapes) against today's dropless einsum (capacity = seq) on one device."""
    cfg = dataclasses.replace(CFG, dropless=True)
    batch = make_batch(16, 16, CFG.vocab_size)
    one = sk.make_mesh("data=1", jax.devices()[:1])
    runs = {}
    for key, strategy, mesh in (("dropless", "dp", one),
                                ("ragged", sk.strategy("dp").replace(kernels={"moe": "ragged"}), one),
                                ("ragged_ep", sk.strategy("ep").replace(kernels={"moe": "ragged"}),
                                 sk.make_mesh("data=2,expert=4"))):  # fmt: skip
        model = sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), mesh, strategy, seed=0)
        step = sk.make_train_step(model, optax.sgd(0.3), mesh, strategy)
        state, losses = step.init_state(), []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
            assert float(m["moe_dropped"]) == 0
        runs[key] = losses, jax.tree.map(np.asarray, state.params)
    for key in ("ragged", "ragged_ep"):
        np.testing.assert_allclose(runs[key][0], runs["dropless"][0], rtol=1e-5)
        for got, want in zip(jax.tree.leaves(runs[key][1]), jax.tree.leaves(runs["dropless"][1]), strict=True):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
