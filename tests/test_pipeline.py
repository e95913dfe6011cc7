"""Pipeline parallelism (shardkit/parallel/pipeline/stack.py): schedule tables, training parity, bad input, gradient
reduction structure, memory.

Parity runs in float64 (jax.enable_x64 and float64 model dtypes; shardkit's dense kernel then computes in float64
throughout), SGD with momentum at lr 0.5, 3 steps. The pipelined and one-device programs sum in a different order
(per microbatch, per data shard); in float64 that is <~ n u = 512 x 1.1e-16 ~ 6e-14 of a gradient's scale to first
order (n = 512 tokens per sum). Measured: losses <= 1.2e-15 relative, parameters <= 1.6e-15 of a leaf's scale
(YNNPACK's kernels or XLA's own CPU emitters at AVX2); asserted 1e-10, while a real defect (a lost microbatch, a
stage applied twice) is >= 1e-3. In fp32 the worst leaf of this 8-layer model (blocks/wo) was 1.1e-6 off, under
10x from a 1e-5 tolerance: hence float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from common import TINY, make_batch, one_device_mesh, train
from test_parity import assert_params_close

import shardkit as sk
from models.gpt import GPTConfig
from shardkit import hlo
from shardkit import pipeline as pp
from shardkit.rules import ShardingContext

CFG = GPTConfig(**{**TINY.__dict__, "num_layers": 8})  # 8 layers: 4 stages x 2 virtual, or 2 stages x 2 x 2
CFG64 = GPTConfig(**{**CFG.__dict__, "dtype": "float64", "param_dtype": "float64"})  # for parity (see the docstring)
RTOL64 = 1e-10


# ------------------------------------------------------------------------------------ schedules as data
_PMV = [(2, 2, 1), (4, 4, 1), (4, 8, 1), (4, 16, 1), (8, 3, 1), (3, 7, 1)]


@pytest.mark.parametrize(
    ("kind", "p", "m", "v"),
    [("gpipe", *pmv) for pmv in _PMV] + [("1f1b", p, m, v) for p, m, v in _PMV if m >= p],  # 1f1b needs m >= p
)
def test_bubble_of_the_table_equals_the_formula(kind, p, m, v):
    sched = pp.schedule(p, m, v, kind)
    assert sched.bubble() == pytest.approx(pp.bubble_formula(p, m, v), abs=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (4, 4, 2), (4, 8, 2), (2, 4, 4), (4, 4, 3)])
def test_circular_bubble_is_reduced_by_v(p, m, v):
    sched = pp.schedule(p, m, v, "circular")
    assert sched.bubble() == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert sched.bubble() < pp.schedule(p, m, 1, "gpipe").bubble()


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8)])
def test_peak_in_flight_is_m_for_gpipe_and_at_most_p_for_1f1b(p, m):
    gpipe, one = pp.schedule(p, m, 1, "gpipe").peak_in_flight(), pp.schedule(p, m, 1, "1f1b").peak_in_flight()
    assert (gpipe == m).all()
    assert (one <= p).all() and one[0] == p  # the first stage holds p, stage s holds p - s
    np.testing.assert_array_equal(one, p - np.arange(p))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "circular"])
def test_every_table_runs_each_forward_and_backward_once_in_dependency_order(kind):
    p, m, v = 4, 8, 2 if kind == "circular" else 1
    sched = pp.schedule(p, m, v, kind)
    when = {}
    for t, s in zip(*np.nonzero(sched.op), strict=True):
        key = (int(sched.op[t, s]), int(sched.mb[t, s]), int(sched.chunk[t, s]) * p + int(s))
        assert key not in when, f"{key} scheduled twice"
        when[key] = t
    assert len(when) == 2 * m * v * p
    for (op, i, c), t in when.items():  # c: global chunk index = repeat * p + stage
        if op == pp.FWD and c > 0:
            assert when[(pp.FWD, i, c - 1)] < t
        if op == pp.BWD:
            assert when[(pp.FWD, i, c)] < t
            if c < v * p - 1:
                assert when[(pp.BWD, i, c + 1)] < t


def test_parse_layers_names():
    assert pp.parse("pipeline", 4) == ("gpipe", 4, 1)
    assert pp.parse("pipeline:1f1b:8@3,5", 2) == ("1f1b", 8, 1) and pp.stage_cut("pipeline:1f1b:8@3,5", 2, 8) == (3, 5)
    assert pp.stage_cut("pipeline:1f1b:8", 2, 8) is None
    assert pp.configure_name("pipeline", {"schedule": "1f1b", "microbatches": 4, "stage_layers": "3,5"}) == (
        "pipeline:1f1b:4@3,5"
    )
    assert pp.configure_name("pipeline", {"schedule": "gpipe", "stage_layers": ""}) == "pipeline:gpipe"
    for bad, message in (("3,-1", "whole numbers >= 1"), ("hetero", "resolved from the hardware preset")):
        with pytest.raises(sk.ShardkitError, match=message):
            pp.configure_name("pipeline", {"stage_layers": bad})
    assert pp.parse("pipeline:1f1b:8", 4) == ("1f1b", 8, 1)
    assert pp.parse("pipeline:circular:8", 4) == ("circular", 8, 2)
    assert pp.parse("pipeline:circular:8:3", 4) == ("circular", 8, 3)
    with pytest.raises(sk.ShardkitError, match="zigzag"):
        pp.parse("pipeline:zigzag", 4)


# ------------------------------------------------------------------------------------------- bad input
def _stack_call(layers: str, num_layers: int = 8, batch: int = 16) -> None:
    mesh = sk.make_mesh("stage=4", jax.devices()[:4])
    ctx = ShardingContext(mesh, {}, kernels={"layers": layers})
    stacked = {"w": jnp.zeros((num_layers, 2))}
    pp.pipeline_stack(lambda w, x: x, stacked, jnp.zeros((batch, 2)), context=ctx)


@pytest.mark.parametrize(
    ("layers", "num_layers", "batch", "message"),
    [
        ("pipeline:gpipe:4", 6, 16, r"6 layers are not divisible by 4 stages x 1 virtual stages = 4"),
        ("pipeline:circular:4:4", 8, 16, r"8 layers are not divisible by 4 stages x 4 virtual stages = 16"),
        ("pipeline:1f1b:2", 8, 16, r"1f1b needs microbatches >= stages: got 2 microbatches for 4 stages"),
        ("pipeline:gpipe:3", 8, 16, r"batch 16 is not divisible by 3 pipeline microbatches"),
        ("pipeline:1f1b:4@3,5", 8, 16, r"2 stage layer counts \[3, 5\] for 4 pipeline stages"),
        ("pipeline:gpipe:4@1,2,3,3", 8, 16, r"counts \[1, 2, 3, 3\] sum to 9, but the model stacks 8 layers"),
        ("pipeline:gpipe:4@0,2,3,3", 8, 16, r"stage layers='0,2,3,3': give the layers of each stage"),
        ("pipeline:1f1b:4@3,x", 8, 16, r"whole numbers >= 1"),
        ("pipeline:circular:4:2@1,2,3,2", 8, 16, r"uneven stages run with the gpipe and 1f1b schedules only"),
    ],
)
def test_bad_input_is_refused_with_the_numbers(layers, num_layers, batch, message):
    with pytest.raises(sk.ShardkitError, match=message):
        _stack_call(layers, num_layers, batch)


# --------------------------------------------------------------------------------------- training parity
@pytest.fixture(scope="module")
def reference():
    with jax.enable_x64(True):
        return train(one_device_mesh(), "dp", cfg=CFG64)[:2]


def _mesh(spec: str):
    n = int(np.prod([int(part.split("=")[1]) for part in spec.split(",")]))
    return sk.make_mesh(spec, jax.devices()[:n])


LAYERS = {"gpipe": "pipeline:gpipe:4", "1f1b": "pipeline:1f1b:4", "circular": "pipeline:circular:4:2"}


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize(
    ("name", "spec"), [("pp", "stage=4"), ("pp_dp", "stage=2,data=4"), ("pp_fsdp", "stage=2,fsdp=4")]
)
def test_pipeline_training_matches_one_device(reference, name, spec, kind):
    ref_losses, ref_params = reference
    strategy = sk.strategy(name).replace(layers=LAYERS[kind])
    with jax.enable_x64(True):
        losses, params, _, _ = train(_mesh(spec), strategy, cfg=CFG64)
    assert all(p.dtype == np.float64 for p in jax.tree.leaves(params))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL64)
    assert_params_close(params, ref_params, rtol=RTOL64)


def test_pp_tp_matches_one_device(reference):
    with jax.enable_x64(True):
        losses, params, _, _ = train(_mesh("stage=4,tensor=2"), sk.strategy("pp_tp"), cfg=CFG64)
    np.testing.assert_allclose(losses, reference[0], rtol=RTOL64)
    assert_params_close(params, reference[1], rtol=RTOL64)


# ------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize(
    ("name", "spec", "kind"),
    [
        ("pp_fsdp", "stage=2,fsdp=4", "gpipe"),
        ("pp_fsdp", "stage=2,fsdp=4", "circular"),
        ("pp_fsdp", "stage=2,fsdp=4", "1f1b"),
        ("pp_dp", "stage=2,data=4", "gpipe"),
    ],
)
def test_gradients_are_reduced_over_the_batch_axes_once_per_step_not_per_microbatch(name, spec, kind):
    """The data/fsdp gradient reduction is one psum after the tick loop: its bytes do not grow with m."""
    mesh, sent = _mesh(spec), {}
    for m in (2, 4):
        strategy = sk.strategy(name).replace(layers=f"pipeline:{kind}:{m}" + (":2" if kind == "circular" else ""))
        _, _, step, state = train(mesh, strategy, cfg=CFG, steps=0)
        colls = hlo.collectives(step.lower(state, make_batch()).compile(), mesh)
        red = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter") and set(c.axes) & {"data", "fsdp"}]
        assert red and not [c for c in red if c.in_loop], red
        sent[m] = sum(c.bytes_sent for c in red)
    assert sent[4] == pytest.approx(sent[2], rel=0.02), sent


def test_microbatch_rows_must_divide_over_the_batch_axes():
    mesh = _mesh("stage=2,fsdp=4")
    ctx = ShardingContext(mesh, {"batch": ("fsdp",)}, kernels={"layers": "pipeline:gpipe:4"})
    with pytest.raises(sk.ShardkitError, match=r"microbatch of 2 rows \(batch 8 / 4\).*size 4"):
        pp.pipeline_stack(lambda w, x: x, {"w": jnp.zeros((8, 2))}, jnp.zeros((8, 2)), context=ctx)


# ---------------------------------------------------------------------------------------------- memory
def test_1f1b_temp_memory_is_below_gpipe_at_m_equal_4p():
    """m = 4p = 16 microbatches on 4 stages: GPipe keeps m microbatches of residuals, 1F1B at most p."""
    mesh, temp = _mesh("stage=4"), {}
    for kind in ("gpipe", "1f1b"):
        strategy = sk.strategy("pp").replace(layers=f"pipeline:{kind}:16")
        _, _, step, state = train(mesh, strategy, cfg=CFG, steps=0)
        temp[kind] = step.lower(state, make_batch()).compile().memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] < temp["gpipe"], temp  # measured 1.9 MB vs 15.3 MB


# ------------------------------------------------------------------------------------------- uneven stages
@pytest.mark.parametrize(
    ("name", "p"),
    [("pipeline:1f1b:4@1,7", 2), ("pipeline:gpipe:4@7,1", 2), ("pipeline:1f1b:4@1,1,1,5", 4)],
)
def test_uneven_stack_equals_the_scan_exactly_where_padding_would_show(name, p):
    """Stage s holds cut[s] layers in max(cut) slots; the padding slots copy a real layer of their stage. If a padding
    slot were applied (forward) or sent back a gradient (its copy's gradient added to the layer), the output or
    the gradient would be off by O(1). Float64 on a toy residual tanh block; measured <= 5e-14 (summation order). A
    padding slot computed and masked (a select) would pass that, so the compiled forward must hold the branch."""
    with jax.enable_x64(True):
        k1, k2 = jax.random.split(jax.random.key(0))
        stacked = {"a": 0.5 * jax.random.normal(k1, (8, 4, 4), jnp.float64)}
        x = jax.random.normal(k2, (8, 4), jnp.float64)
        block = lambda w, h: jnp.tanh(h @ w["a"]) + h
        mesh = _mesh(f"stage={p}")
        ctx = ShardingContext(mesh, {}, kernels={"layers": name})
        run = lambda st, h: jnp.sum(jnp.sin(pp.pipeline_stack(block, st, h, context=ctx)))
        ref = lambda st, h: jnp.sum(jnp.sin(sk.layers.scan_stack(block, st, h)))
        with jax.set_mesh(mesh):
            got = jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(stacked, x)
            forward = jax.jit(run).lower(stacked, x).compile().as_text()  # no 1F1B switch in the forward
        want = jax.value_and_grad(ref, argnums=(0, 1))(stacked, x)
    assert " conditional(" in forward  # padding skipped by a branch, not computed and masked (a select)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL64, atol=RTOL64 * float(np.abs(w).max()))


def test_uneven_1f1b_training_matches_one_device(reference):
    """3 SGD steps of the 8-layer GPT cut 3 + 5 over 2 stages x 4 data shards: the same float64 bound as the even
    cut (see the docstring). GPipe and 4 uneven stages: the exact kernel test above (a GPT each costs ~15 s)."""
    strategy = sk.strategy("pp_dp").replace(layers="pipeline:1f1b:4@3,5")
    with jax.enable_x64(True):
        losses, params, _, _ = train(_mesh("stage=2,data=4"), strategy, cfg=CFG64)
    np.testing.assert_allclose(losses, reference[0], rtol=RTOL64)
    assert_params_close(params, reference[1], rtol=RTOL64)


def test_the_config_field_reaches_the_kernel_name(tmp_path):
    """--config.pipeline.stage_layers=3,5 (built, not trained: the hand-run CLI and the parity test above train)."""
    from test_experiments import make_config

    from experiments import train as tr

    cfg = {"strategy": "pp_dp", "mesh": "stage=2,data=4", "model.num_layers": 8, "pipeline.schedule": "1f1b"}
    run = tr.build(make_config(tmp_path, "given", **cfg, **{"pipeline.stage_layers": "3,5"}))
    assert run.step.strategy.kernels["layers"] == "pipeline:1f1b:4@3,5"
    assert run.step.strategy.description.endswith("; stage layers 3,5 (given; pipeline.stage_layers)")
    with pytest.raises(sk.ShardkitError, match=r"3 stage layer counts \[2, 3, 3\] for 2 pipeline stages"):
        tr.build(make_config(tmp_path, "bad", **cfg, **{"pipeline.stage_layers": "2,3,3"}))
