"""Sharded training equals single-device training, strategy by strategy (the core promise of shardkit).

Tolerances, and why they hold on any CPU: the 8-device and 1-device programs sum the same numbers in a
different order (partial sums per shard, then a collective; the order also depends on the CPU's vector width,
on XLA's kernels and on its optimisation level), so results differ by rounding. The parity tests therefore run
in float64 (the GPT with float64 parameters and compute; jax.enable_x64), where that rounding is bounded to
first order by n·u = 512 tokens x 1.1e-16 ~ 6e-14 of a sum's terms and 3 SGD-momentum steps do not amplify it
(no division by gradient magnitudes): we assert 1e-10 on losses and on parameters relative to their scale,
observed ~1e-15, while a real sharding bug (a missing or doubled reduction, a wrong layout) is >= 1e-3.
One fp32 test keeps the default dtype honest with the fp32 bound: a mean over 512 tokens is exact to n·u_32 =
512 x 6e-8 ~ 3e-5 to first order; we assert 1e-4 (observed ~8e-7 on losses, ~3e-7 on parameters).

AdamW is different: its update lr·m/(sqrt(v)+eps) divides by the gradient's own magnitude, so for a gradient
entry near zero the ulp noise is the whole signal and parameter differences reach 1e-3 of the scale in fp32
(3.1e-3 on one CPU, 1.6e-3 on another: no fixed fp32 tolerance is safe). The AdamW test therefore runs in
float64. There a gradient's reduction-order noise is |dg| <~ 1e-15 (eps_64 = 2.2e-16 times gradients of O(1)),
and the update amplifies it at most by lr/eps = 1e-2/1e-8 = 1e6 per step, so after 3 steps a parameter moves
by at most ~3e-9 absolute, ~1.5e-7 of the parameters' scale (max |p| >= 0.02). We assert 1e-6 (observed:
1.2e-12, gradients agreeing to 2e-17); a real sharding bug (a missing or doubled reduction) is >= 1e-3. (This
needs attention in float64 too: jax.nn.dot_product_attention always takes its softmax in fp32, which left
1e-12 gradient gaps and 4e-6 parameter gaps; shardkit's dense kernel computes a float64 input in float64.)
"""

import jax
import numpy as np
import optax
import pytest
from common import TINY, make_batch, one_device_mesh, train
from matrix import MESH

import shardkit as sk
from models.gpt import GPTConfig

CFG64 = GPTConfig(**{**TINY.__dict__, "dtype": "float64", "param_dtype": "float64"})
RTOL64 = 1e-10  # module docstring


def train64(*args, cfg=CFG64, **kw):
    """`train` in float64 (x64 on for tracing, compiling and running)."""
    with jax.enable_x64(True):
        losses, params, step, state = train(*args, cfg=cfg, **kw)
    assert all(p.dtype == np.float64 for p in jax.tree.leaves(params)), "the test must really run in float64"
    return losses, params, step, state


MESHES = {name: MESH[name] for name in ("dp", "zero1", "fsdp", "tp", "tp_sp", "fsdp_tp", "dp_fsdp_tp")}


@pytest.fixture(scope="module")
def reference():
    return train64(one_device_mesh(), "dp")[:2]


@pytest.fixture(scope="module")
def reference32():
    """The same run in fp32 (another model: a float64 init draws other numbers from the same seed)."""
    return train(one_device_mesh(), "dp")[:2]


def assert_params_close(params, ref, rtol):
    def rel(path, a, b):
        err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: max |diff| / max |ref| = {err:.3g} > {rtol}"

    jax.tree_util.tree_map_with_path(rel, params, ref)


def _strategies_trained_by(test) -> set[str]:
    """The strategy names a parity test is parametrized over (its `name` argument), read from its marks."""
    out = set()
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize":
            names, values = mark.args[0], mark.args[1]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            key = next((k for k in ("name", "strategy") if k in names), None)
            if key is not None:
                i = names.index(key)
                out |= {v[i] if len(names) > 1 else v for v in values}
    return out


def test_every_shipped_strategy_has_a_parity_test():
    """Every registered strategy is trained against one device somewhere in the suite: a new strategy fails here
    until it gets one. The GSPMD tables are tested in this file, the others next to their kernels."""
    import test_context_parallel
    import test_pipeline
    import test_spatial
    import test_tensor3d

    covered = set(MESHES) | {"tp3d", "pp_tp"}  # test_tensor3d / test_pipeline, by name (not parametrized over it)
    covered |= _strategies_trained_by(test_context_parallel.test_cp_strategy_matches_one_device)
    covered |= _strategies_trained_by(test_pipeline.test_pipeline_training_matches_one_device)
    covered |= {"tp_channels"}  # tests/test_resnet_digits.py: a CNN, whose channels it shards
    covered |= _strategies_trained_by(test_spatial.test_training_equals_one_device)  # 3D CNNs, spatial splits
    # tests/test_sdp.py (per-worker reference; coverage 1 = dp), tests/test_hetero.py (= the even step; Whale's split
    # classifier = one device)
    covered |= {"sdp", "hetero_dp", "dp_split_head"}
    import test_any_model

    assert callable(test_any_model.test_a_model_annotated_with_mesh_axes_trains_as_annotated)
    covered |= {"annotated"}  # tests/test_any_model.py: a Flax-example-style transformer annotated with mesh axes
    import test_moe

    covered |= _strategies_trained_by(test_moe.test_gpt_moe_training_equals_one_device)  # ep, ep_gspmd
    assert callable(test_tensor3d.test_gpt_training_under_tp3d_matches_one_device)
    assert callable(test_pipeline.test_pp_tp_matches_one_device)
    missing = set(sk.STRATEGIES) - covered
    assert not missing, f"strategies without a parity test against one device: {sorted(missing)}"


@pytest.mark.parametrize("name", list(MESHES))
def test_strategy_matches_one_device(name, reference):
    ref_losses, ref_params = reference
    losses, params, _, _ = train64(sk.make_mesh(MESHES[name]), name)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL64)
    assert losses[-1] < losses[0], "3 steps of SGD on a fixed batch must lower the loss"
    assert_params_close(params, ref_params, rtol=RTOL64)


@pytest.mark.parametrize("name", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_jax_make_mesh_default_trains_at_parity(name, reference, monkeypatch):
    """A mesh made the way JAX's and Flax's guides make one (Explicit axes) trains like sk.make_mesh's Auto axes:
    taken as the same devices and names with Auto axes, said once (UserWarning)."""
    axes = sk.mesh.parse_spec(MESHES[name])
    mesh = jax.make_mesh(tuple(axes.values()), tuple(axes))
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}, "jax.make_mesh's default is what is tested"
    monkeypatch.setattr(sk.mesh, "_SAID_AUTO", set())
    with pytest.warns(UserWarning, match="Explicit") as said:
        losses, params, _, _ = train64(mesh, name)
    assert len([w for w in said if "Explicit" in str(w.message)]) == 1, "said once, not per call"
    np.testing.assert_allclose(losses, reference[0], rtol=RTOL64)
    assert_params_close(params, reference[1], rtol=RTOL64)


def test_fp32_training_matches_one_device_within_fp32_rounding(reference32):
    ref_losses, ref_params = reference32
    losses, params, _, _ = train(sk.make_mesh(MESHES["dp_fsdp_tp"]), "dp_fsdp_tp")
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert_params_close(params, ref_params, rtol=1e-4)


@pytest.mark.parametrize(
    ("spec", "strategy", "m"), [("data=2,fsdp=4", "fsdp", 2), ("data=8", "dp", 2), ("data=4,tensor=2", "tp_sp", 2)]
)
def test_gradient_accumulation_matches_full_batch(reference, spec, strategy, m):
    ref_losses, ref_params = reference
    losses, params, _, _ = train64(sk.make_mesh(spec), strategy, microbatches=m)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL64)
    assert_params_close(params, ref_params, rtol=RTOL64)


def test_adamw_parity_fsdp_tp_in_float64():
    """AdamW's parity in float64 (see the module docstring for why not fp32)."""
    tx = optax.adamw(1e-2)
    ref_losses, ref_params, _, _ = train64(one_device_mesh(), "dp", tx=tx)
    losses, params, _, _ = train64(sk.make_mesh("fsdp=4,tensor=2"), "fsdp_tp", tx=tx)
    # the loss moves with the parameters' noise times its gradient: <~ 1e-9 relative; asserted 1e-8
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-8)
    assert losses[-1] < losses[0]
    assert_params_close(params, ref_params, rtol=1e-6)


def test_remat_and_tied_embeddings_match_one_device():
    cfg = GPTConfig(**{**CFG64.__dict__, "remat": "full", "tie_embeddings": True})
    ref_losses, ref_params, _, _ = train64(one_device_mesh(), "dp", cfg=cfg)
    losses, params, _, _ = train64(sk.make_mesh("fsdp=4,tensor=2"), "fsdp_tp", cfg=cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL64)
    assert_params_close(params, ref_params, rtol=RTOL64)


def test_bf16_compute_keeps_fp32_params_and_tracks_fp32_loss(reference32):
    cfg = GPTConfig(**{**TINY.__dict__, "dtype": "bfloat16"})
    losses, params, _, _ = train(sk.make_mesh("fsdp=4,tensor=2"), "fsdp_tp", cfg=cfg)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(params))
    # bf16 has 8 mantissa bits (~4e-3 relative): the loss follows the fp32 run to about that.
    np.testing.assert_allclose(losses, reference32[0], rtol=2e-2)
    assert losses[-1] < losses[0]


def test_init_is_identical_across_meshes():
    make = lambda rngs: __import__("models.gpt", fromlist=["GPT"]).GPT(TINY, rngs=rngs)
    one = sk.sharded_init(make, one_device_mesh(), "dp", seed=3)
    eight = sk.sharded_init(make, sk.make_mesh("fsdp=4,tensor=2"), "fsdp_tp", seed=3)
    from flax import nnx

    a, b = nnx.to_pure_dict(nnx.split(one)[1]), nnx.to_pure_dict(nnx.split(eight)[1])
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_batch_not_divisible_is_refused_before_compiling():
    _, _, step, state = train(sk.make_mesh("data=2,fsdp=4"), "fsdp", steps=0)
    with pytest.raises(sk.ShardkitError, match=r"batch 12 is not divisible by 8"):
        step(state, make_batch(batch=12))


def test_step_built_from_the_abstract_model_lowers_then_takes_real_parameters(reference32):
    """Validate and compile before any parameter exists (what experiments/train.py does on resume)."""
    mesh = sk.make_mesh("data=2,fsdp=4")
    make = lambda rngs: __import__("models.gpt", fromlist=["GPT"]).GPT(TINY, rngs=rngs)
    step = sk.make_train_step(sk.abstract_model(make), optax.sgd(0.5, momentum=0.9), mesh, "fsdp")
    batch = make_batch()
    step.lower(step.abstract_state(), batch)
    with pytest.raises(sk.ShardkitError, match=r"built from an abstract model"):
        step.init_state()
    state = step.init_state(sk.sharded_init(make, mesh, "fsdp"))
    losses = [float(step(state, batch)[1]["loss"])]
    np.testing.assert_allclose(losses, reference32[0][:1], rtol=1e-4)  # fp32 rounding (module docstring)
