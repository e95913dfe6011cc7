"""What each strategy compiles to, read from the partitioned HLO (kinds, mesh axes, counts, bytes).

CPU caveat, asserted explicitly below: XLA's CPU pipeline has no reduce-scatter creation pass, so where GSPMD
means "reduce-scatter" (FSDP gradients, Megatron-SP's g) the CPU executable holds an all-reduce followed by
a dynamic-slice; the GPU and TPU pipelines rewrite that pair into a reduce-scatter. The non-CPU branches
state what those backends must show.
"""

import jax
import optax
import pytest
from common import TINY, make_batch

import shardkit as sk
from models.gpt import GPT
from shardkit import hlo

CPU = jax.default_backend() == "cpu"
BATCH, SEQ = 16, 32
LAYERS = TINY.num_layers
PARAM_BYTES = 4 * TINY.num_params()


def compiled(spec: str, strategy: str):
    mesh = sk.make_mesh(spec)
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, strategy)
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy)
    c = step.lower(step.init_state(), make_batch(BATCH, SEQ)).compile()
    return c.as_text(), hlo.collectives(c, mesh)


def select(colls, kind, axes, in_loop=None):
    return [c for c in colls if c.kind == kind and c.axes == axes and (in_loop is None or c.in_loop == in_loop)]


def moved(colls, attr):
    """Sum over occurrences of one buffer size (`operand_bytes` or `result_bytes`)."""
    return sum(getattr(c, attr) * c.count for c in colls)


def test_dp_reduces_each_gradient_once_and_never_gathers_parameters():
    _, colls = compiled("data=8", "dp")
    assert {c.kind for c in colls} == {"all-reduce"}
    reduced = moved(select(colls, "all-reduce", ("data",)), "operand_bytes")
    # every gradient once (+ the scalar loss / token count): not once per layer per microbatch, not twice
    assert PARAM_BYTES <= reduced <= PARAM_BYTES + 64, (reduced, PARAM_BYTES)


def test_fsdp_gathers_parameters_and_reduces_gradients_once():
    _, colls = compiled("fsdp=8", "fsdp")
    gathered = select(colls, "all-gather", ("fsdp",))
    assert gathered and all(c.result_bytes == 8 * c.operand_bytes for c in gathered)
    # forward gathers every parameter once; backward gathers the block weights again (they are not saved)
    assert moved(gathered, "result_bytes") >= PARAM_BYTES
    rs = moved(select(colls, "reduce-scatter", ("fsdp",)), "operand_bytes")
    ar = moved(select(colls, "all-reduce", ("fsdp",)), "operand_bytes")
    if CPU:
        assert rs == 0 and PARAM_BYTES <= ar <= PARAM_BYTES + 64  # all-reduce + dynamic-slice (see docstring)
    else:
        assert PARAM_BYTES <= rs <= PARAM_BYTES + 64 and ar <= 64


def test_tp_has_megatrons_two_forward_and_two_backward_all_reduces_per_layer():
    _, colls = compiled("data=4,tensor=2", "tp")
    act_bytes = (BATCH // 4) * SEQ * TINY.d_model * 4
    in_layers = select(colls, "all-reduce", ("tensor",), in_loop=True)
    big = [c for c in in_layers if c.operand_bytes == act_bytes]
    assert sum(c.count for c in big) == 4 * LAYERS  # f and g, forward and backward
    assert not select(colls, "all-gather", ("tensor",)) and not select(colls, "all-to-all", ("tensor",))
    # the data axis reduces the gradients of this device's half of the parameters, once
    assert moved(select(colls, "all-reduce", ("data",)), "operand_bytes") < PARAM_BYTES


def test_tp_sp_replaces_all_reduces_by_all_gather_reduce_scatter_pairs():
    text, colls = compiled("data=4,tensor=2", "tp_sp")
    act_bytes = (BATCH // 4) * SEQ * TINY.d_model * 4
    gathers = [c for c in select(colls, "all-gather", ("tensor",), in_loop=True) if c.result_bytes == act_bytes]
    assert sum(c.count for c in gathers) == 4 * LAYERS
    assert all(c.operand_bytes == act_bytes // 2 for c in gathers)  # sequence-sharded input, gathered
    assert not select(colls, "all-to-all", ("tensor",))
    kind = "all-reduce" if CPU else "reduce-scatter"
    scatters = [c for c in select(colls, kind, ("tensor",), in_loop=True) if c.operand_bytes == act_bytes]
    assert sum(c.count for c in scatters) == 4 * LAYERS
    if CPU:
        assert "dynamic-slice" in text  # the second half of the CPU's reduce-scatter


@pytest.mark.parametrize(
    ("spec", "strategy"), [("fsdp=4,tensor=2", "fsdp_tp"), ("data=2,fsdp=2,tensor=2", "dp_fsdp_tp")]
)
def test_combined_strategies_use_every_axis_for_its_own_job(spec, strategy):
    _, colls = compiled(spec, strategy)
    assert select(colls, "all-gather", ("fsdp",)), "parameters are gathered over fsdp"
    assert select(colls, "all-reduce", ("tensor",), in_loop=True), "Megatron all-reduces over tensor"
    assert not select(colls, "all-gather", ("tensor",)), "tensor-sharded weights are never gathered"
    if "data=2" in spec:
        data = [c for c in colls if "data" in c.axes]
        assert data and all(c.kind == "all-reduce" for c in data), "data is plain replication (HSDP)"
    gathered = moved(select(colls, "all-gather", ("fsdp",)), "result_bytes")
    assert gathered >= PARAM_BYTES / 2  # every parameter's 1/tensor slice is gathered (fwd, and bwd for blocks)


@pytest.mark.parametrize(("spec", "strategy"), [("data=8", "dp"), ("fsdp=8", "fsdp"), ("data=4,tensor=2", "tp")])
def test_gradient_accumulation_reduces_gradients_once_per_step_not_per_microbatch(spec, strategy):
    mesh = sk.make_mesh(spec)
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, strategy)
    sent = {}
    for m in (1, 4):
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy, microbatches=m)
        c = step.lower(step.init_state(), make_batch(32, SEQ)).compile()
        colls = [x for x in hlo.collectives(c, mesh) if x.kind in ("all-reduce", "reduce-scatter")]
        sent[m] = sum(x.bytes_sent for x in colls if set(x.axes) & {"data", "fsdp"})
    assert sent[4] == pytest.approx(sent[1], rel=0.02), sent
