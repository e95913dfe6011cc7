"""SDP composed with fsdp and tensor inside each worker, and with microbatches (shardkit/parallel/sdp/compose.py).

Each composed step is checked against test_sdp.py's one-device per-worker reference (fsdp and tensor change where
each worker's sums run, not what they are: the reference is SDP on `data` alone), its compiled per-device argument
bytes against the formula (`state_bytes`), and its HLO for the fsdp / tensor collectives that show the worker's
computation is really split. fp32 with SGD + momentum (linear in the gradients, so it amplifies nothing): the
differences are reordered sums over the batch, the fsdp / tensor shards and the holders, a few ulps of each
array's scale (observed <= 3e-7); asserted 1e-6 as test_sdp.py does.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from common import make_batch
from test_sdp import _reference, _scale_close

import shardkit as sk
from models import gpt_cost
from models.gpt import GPT, GPTConfig
from shardkit.parallel.sdp.compose import state_bytes

# 4 blocks on 4 workers at coverage 1/2: each worker 2 blocks, each block 2 holders (a ring); kv_heads 2 so that
# Megatron splits every head dimension over tensor=2
CFG = GPTConfig(num_layers=4, d_model=32, num_heads=2, num_kv_heads=2, head_dim=16, mlp_dim=64, vocab_size=64,
                max_seq_len=16)  # fmt: skip
LR, MOMENTUM = 0.5, 0.9


def _train(mesh_spec, microbatches, steps=2):
    mesh = sk.make_mesh(mesh_spec)
    strategy = sk.sdp.make_strategy(coverage=0.5)
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(model, optax.sgd(LR, momentum=MOMENTUM), mesh, strategy, microbatches=microbatches)
    state = step.init_state()
    batch = make_batch(16, 16, CFG.vocab_size)
    compiled = step.lower(state, batch).compile()  # the program the steps below run (the same jit, cached)
    full = [jax.tree.map(np.asarray, step.full_params(state)[0])]
    for _ in range(steps):
        state, _ = step(state, batch)
        full.append(jax.tree.map(np.asarray, step.full_params(state)[0]))
    return model, step, state, batch, compiled, full, mesh


@pytest.mark.parametrize(
    "mesh_spec, microbatches, inner",
    [("data=8", 2, {}), ("data=4,fsdp=2", 2, {"all-gather": "fsdp"}), ("data=4,tensor=2", 1, {"all-reduce": "tensor"})],
    ids=["microbatches", "fsdp-microbatches", "tensor"],
)
def test_composed_step_equals_per_worker_reference_and_memory_formula(mesh_spec, microbatches, inner):
    model, step, state, batch, compiled, full, mesh = _train(mesh_spec, microbatches)
    table = step.tables[CFG.num_layers]
    params, trace = full[0], jax.tree.map(np.zeros_like, full[0])
    for t in range(1, len(full)):
        grads = _reference(model, params, batch, table, "block", "forward", microbatches=microbatches)
        trace = jax.tree.map(lambda m, g: MOMENTUM * m + g, trace, grads)
        params = jax.tree.map(lambda p, m: p - LR * m, params, trace)
        _scale_close(full[t], params, 1e-6)

    # memory: per-device state bytes by formula = what XLA allocates for the step's arguments (parameters and the
    # momentum trace, one copy each of the layout; the int32 step; the batch's int32 tokens over data x fsdp)
    devices_per_batch = mesh.shape["data"] * mesh.shape.get("fsdp", 1)
    batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // devices_per_batch
    formula = state_bytes(step)
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes == 2 * formula + 4 + batch_bytes
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    assert held == 2 * formula
    # the formula's meaning: coverage 1/2 of the blocks (SDP on data alone: shared + split / 2), every array over
    # its fsdp / tensor degree (less than that)
    c = step.bytes_per_step()
    alone = 4 * (c["shared_elements"] + c["split_elements"] / 2)
    assert formula < alone if inner else formula == alone
    # the worker's computation is split over the inner axis (not replicated): its collectives are in the program
    colls = sk.hlo.collectives(compiled, mesh)
    kinds = {(c.kind, c.axes) for c in colls}
    for kind, axis in inner.items():
        assert (kind, (axis,)) in kinds, kinds
    # holder averaging array by array on each device's shard: the permutes' bytes are the formula's, and sk.plan's
    # GPT formula (models/gpt_cost/sdp.py) predicts the same bytes and the same parameter memory
    permutes = [c for c in colls if c.kind == "collective-permute" and c.axes == ("data",)]
    sent = sum(c.bytes_sent for c in permutes)
    assert sent == step.bytes_per_step(4)["permute_bytes"] > 0
    comms, memory = gpt_cost.sdp_terms(CFG, dict(mesh.shape), 16, 16, 0.5, nbytes=4)
    planned = [r for r in comms if r.kind == "collective-permute"]
    assert len(planned) == 1 and planned[0].bytes == pytest.approx(sent, rel=1e-9), planned
    assert memory["params"] == formula


def test_composition_refusals():
    model = sk.abstract_model(lambda rngs: GPT(dataclasses.replace(CFG, num_layers=8), rngs=rngs))
    tx = optax.sgd(0.1)
    with pytest.raises(sk.ShardkitError, match="'stage'"):
        sk.make_train_step(model, tx, sk.make_mesh("data=4,stage=2"), sk.sdp.make_strategy())
    with pytest.raises(sk.ShardkitError, match=r"neuron.*tensor=2"):
        sk.make_train_step(model, tx, sk.make_mesh("data=4,tensor=2"), sk.sdp.make_strategy(granularity="neuron"))
    with pytest.raises(sk.ShardkitError, match=r"fsdp or tensor, not both"):  # XLA aborts the process on it
        sk.make_train_step(model, tx, sk.make_mesh("data=2,fsdp=2,tensor=2"), sk.sdp.make_strategy(coverage=1.0))
    with pytest.raises(sk.ShardkitError, match=r"backward.*forward"):
        sk.make_train_step(model, tx, sk.make_mesh("data=4,fsdp=2"), sk.sdp.make_strategy(masking="backward"))


def test_plan_ranks_sdp_candidates_with_their_memory_and_traffic():
    """sk.plan over SDP at coverage 1/2 and 1/4 next to fsdp: every data x fsdp x tensor mesh with data > 1; the
    coverage 1/4 plan stores less than the 1/2 plan and sends less in holder averaging (fewer holders per block)."""
    import shardkit.costmodel as cm

    big = dataclasses.replace(CFG, num_layers=16, d_model=1024, num_heads=16, num_kv_heads=16, head_dim=64,
                              mlp_dim=4096, vocab_size=32000, max_seq_len=1024)  # fmt: skip
    strategies = ("fsdp", "sdp", sk.sdp.make_strategy(coverage=0.25))
    plans = cm.plan(big, 64, "perlmutter", 64, 1024, strategies=strategies, include_rejected=True)
    assert {p.strategy for p in plans} == {"fsdp", "sdp", "sdp@0.25"}
    by = {(p.strategy, p.grid): p for p in plans}
    half, quarter = by["sdp", "data=8,fsdp=8"], by["sdp@0.25", "data=8,fsdp=8"]
    assert quarter.memory["params"] < half.memory["params"] and quarter.comm_bytes < half.comm_bytes
    sdp = [p for p in plans if p.strategy.startswith("sdp")]
    assert sdp and all(p.mesh["data"] > 1 and (p.mesh.get("fsdp", 1) == 1 or p.mesh.get("tensor", 1) == 1) for p in sdp)
    assert {"data=8,tensor=8", "data=16,fsdp=4"} <= {p.grid for p in sdp}
    print(cm.format_plans([p for p in plans if p.fits][:8]))
