"""The planner trades memory for time: per-remat-policy memory and recompute cost of the GPT, `sk.plan(remat=)`.

The per-policy activation formulas (models/gpt_remat_cost.py) are checked against XLA: the compiled temporaries
of the tiny GPT's train step under `none` minus those under `full` (what full remat frees; the terms that do not
depend on the policy, gradients, gathered weights, the optimizer's update, cancel) vs the predicted activations'
difference, within 10% (measured +8.3% on 8 CPU devices, jax 0.10.2: the formula's one-block working set is a
little larger than XLA's under full remat). Whole-step figures for gpt_small per policy: docs/planner.md.
"""

import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from common import TINY

import shardkit as sk
from models import gpt_cost as gc
from models import gpt_remat_cost as grc
from models.gpt import GPT, GPTConfig
from shardkit import costmodel as cm

BIG = GPTConfig(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                vocab_size=32768)  # fmt: skip  # 7.2B parameters


def test_plans_that_fit_only_with_remat_are_ranked_with_their_recompute_cost():
    args = dict(devices=16, hardware="perlmutter", global_batch=16, seq_len=2048, include_rejected=True)
    plans = cm.plan(BIG, **args)
    fits = [p for p in plans if p.fits]
    assert all(cm.rank_key(a) <= cm.rank_key(b) for a, b in itertools.pairwise(fits))
    remat_only, peak = [p for p in fits if p.remat != "none"], sk.load_preset("perlmutter").peak_flops
    assert remat_only and all(p.recompute_flops > 0 and p.recompute_time_s > 0 for p in remat_only)
    for p in remat_only:  # without remat the same plan is over the memory cap: it fits only with remat
        none = gc.memory(gc.formula(p.strategy), BIG, p.mesh, 16, 2048, 2, remat="none")
        assert none["total"] > 0.9 * sk.load_preset("perlmutter").hbm_bytes >= p.memory["total"]
        assert p.step_time_s == pytest.approx(p.comm_time_s + p.recompute_flops / (peak * 0.5))  # efficiency 0.5
    plain = cm.plan(BIG, **args, remat=("none",))  # the same (strategy, mesh) without remat: rejected
    rejected = {(p.strategy, tuple(p.mesh.items())) for p in plain if not p.fits}
    assert {(p.strategy, tuple(p.mesh.items())) for p in remat_only} <= rejected
    old = cm.plan(BIG, **args, remat=None)  # the previous behaviour: no policy varied, nothing recomputed
    assert {p.remat for p in old} == {"none"} and all(p.recompute_flops == 0 for p in old)
    text = cm.format_plans(remat_only[:3], efficiency=0.5)
    assert remat_only[0].remat in text and "recomp ms" in text and "ranked by:" in text
    with pytest.raises(sk.ShardkitError, match="efficiency"):
        cm.plan(BIG, **args, efficiency=0.0)


def test_policies_order_memory_against_recompute_and_full_recomputes_one_forward():
    mesh, tokens = {"data": 2, "fsdp": 4}, 64 * 2048
    acts = {p: gc.memory("fsdp", BIG, mesh, 64, 2048, 2, remat=p)["activations"] for p in grc.POLICIES}
    flops = {p: grc.recompute_flops(BIG, p, tokens, 2048, 8) for p in grc.POLICIES}
    order = ["none", "dots", "dots_no_batch", "full"]  # memory falls, recompute grows
    assert all(acts[a] > acts[b] and flops[a] < flops[b] for a, b in itertools.pairwise(order))
    assert flops["none"] == 0
    # one forward of the blocks = a third of the 6N + 12 L n hd s training FLOPs, less the untied head's 6 e V and
    # the RMSNorm scales' 6 (2L + 1) e (N counts them; the convention counts norms as elementwise work)
    e, L = BIG.d_model, BIG.num_layers
    forward = (BIG.flops_per_token(2048) - 6 * e * BIG.vocab_size - 6 * (2 * L + 1) * e) / 3
    assert flops["full"] == pytest.approx(forward * tokens / 8)
    tags = gc.memory("fsdp", BIG, mesh, 64, 2048, 2, remat="names:qkv_proj,mlp_hidden")["activations"]
    assert acts["full"] < tags < acts["none"]
    with pytest.raises(sk.ShardkitError, match="tags no"):
        gc.memory("fsdp", BIG, mesh, 64, 2048, 2, remat="names:nope")


def test_what_full_remat_frees_matches_the_compiled_step():
    mesh_axes = {"data": 2, "fsdp": 4}
    mesh = sk.make_mesh(mesh_axes)
    abstract = sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs), 0)
    temp, pred = {}, {}
    for policy in ("none", "full"):
        strategy = sk.strategy("fsdp").replace(kernels={"remat": policy})
        strategy.bind(mesh)
        step = sk.make_train_step(abstract, optax.adamw(1e-3), mesh, strategy)
        tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=step.batch_sharding)
        compiled = step.lower(step.abstract_state(), {"inputs": tokens, "targets": tokens}).compile()
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
        pred[policy] = TINY.cost_model(strategy, mesh_axes, {"inputs": (16, 32)}, 4, "cpu")[1]["activations"]
    assert pred["none"] - pred["full"] == pytest.approx(temp["none"] - temp["full"], rel=0.10)
