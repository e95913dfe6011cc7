"""The `remat` kernel slot (docs/memory.md): every policy trains the GPT and the ResNet as `none` does, `full` and
`dots` lower the compiled temporary memory, and bad policies, impossible offload and a conflicting model alias are
refused before XLA.

Parity tolerance. A policy only decides which of a layer's values the backward pass reads from memory and which it
computes again; the recomputation is the same operations on the same inputs, so the gradients are the same numbers
unless XLA fuses (and so rounds) the recomputed copy differently from the original. Measured after 3 SGD steps
(momentum 0.9, fp32, one device), relative to each array's largest value: the GPT's losses and parameters equal
under `full` and `names`, within 1.0e-7 (losses) and 1.7e-7 (parameters) under `dots` / `dots_no_batch` (the
recomputed softmax and SwiGLU are fused apart from the matmuls they fed); the ResNet's losses within 1.2e-7, its
arrays within 8.3e-7, all of it in BatchNorm biases (~0.005 after 3 steps, from gradients that nearly cancel: the
same ~1e-9 absolute rounding is a larger fraction of a small array; tests/test_resnet_digits.py sees the same).
We assert 1e-6 for the GPT and 1e-5 for the ResNet (test_resnet_digits.py's bound), on the losses and on every
parameter and BatchNorm statistic relative to its array's scale: 6x and 12x above the worst case, and far below
what a wrong gradient gives (one dropped term moves the loss by > 1e-3).

Memory. The shapes are TINY's GPT (2 layers, batch 16 x seq 32) and a ResNet stage of 4 blocks (3 stacked) on
16 x 16 images, batch 16: activations are most of the compiled temporary memory (the GPT's weights are ~0.35 MB,
its saved activations a few MB), so a policy that keeps fewer of them shows in `temp_size_in_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import TINY, make_batch, one_device_mesh, train

import shardkit as sk
from experiments import runtime
from experiments.configs import base
from models.cosmoflow import CosmoFlow, CosmoFlowConfig, regression_loss
from models.gpt import GPT
from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss
from models.unet3d import UNet3D, UNet3DConfig, segmentation_loss

POLICIES = ["none", "full", "dots", "dots_no_batch", "names"]
NAMES = {"gpt": "names:qkv_proj,mlp_hidden", "resnet": "names:conv1"}  # values each model tags
RESNET = ResNetConfig(widths=(8,), blocks=(4,), dropout=0.0)  # stage 1: `first` + 3 stacked identity blocks
RTOL = {"gpt": 1e-6, "resnet": 1e-5}  # measured worst: 1.7e-7, 8.3e-7 (module docstring)


def _temp(step: sk.TrainStep, state: sk.TrainState, batch: dict) -> int:
    return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes


def _strategy(model: str, policy: str) -> sk.Strategy:
    return sk.strategy("dp").replace(kernels={"remat": NAMES[model] if policy == "names" else policy})


def _resnet_batch() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {"image": jnp.asarray(rng.normal(size=(16, 16, 16, 1)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 10, 16), jnp.int32)}  # fmt: skip


@functools.cache
def run(model: str, policy: str) -> tuple[np.ndarray, dict, Callable[[], int]]:
    """(losses of 3 steps, final params and model state as numpy, a function measuring the compiled temp bytes)
    of `model` under `policy` (the memory is compiled again, so only where a test asks for it)."""
    mesh, strategy = one_device_mesh(), _strategy(model, policy)
    if model == "gpt":
        losses, params, step, state = train(mesh, strategy, steps=3)
        return losses, params, lambda: _temp(step, state, make_batch())
    net = sk.sharded_init(lambda rngs: ResNet(RESNET, rngs=rngs), mesh, strategy, seed=0)
    step = sk.make_train_step(net, optax.sgd(0.1, momentum=0.9), mesh, strategy, loss_fn=classification_loss,
                              batch_axes=BATCH_AXES)  # fmt: skip
    state, batch, losses = step.init_state(), _resnet_batch(), []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    arrays = jax.tree.map(np.asarray, {"params": state.params, "model_state": state.model_state})
    return np.array(losses), arrays, lambda: _temp(step, state, batch)


@pytest.mark.parametrize("model", ["gpt", "resnet"])
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_every_policy_trains_as_none_does(model, policy):
    losses, arrays, _ = run(model, policy)
    want_losses, want, _ = run(model, "none")
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL[model])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(arrays), jax.tree.leaves(want), strict=True):
        if np.issubdtype(a.dtype, np.floating):
            scale = max(float(np.abs(b).max()), 1e-30)
            assert float(np.abs(a - b).max()) <= RTOL[model] * scale, (model, policy, jax.tree_util.keystr(path))


@pytest.mark.parametrize("model", ["gpt", "resnet"])
def test_full_and_dots_lower_the_compiled_temporary_memory(model):
    temp = {policy: run(model, policy)[2]() for policy in ("none", "full", "dots")}
    print(model, {k: f"{v / 1e6:.3f} MB" for k, v in temp.items()})
    assert temp["full"] < temp["none"], temp
    assert temp["dots"] < temp["none"], temp


def test_a_bad_policy_is_refused_listing_the_policies():
    with pytest.raises(sk.ShardkitError, match=r"available: dots, dots_no_batch, full, names, none, offload"):
        sk.kernels.check({"remat": "some"})
    listed = r"choose one of none, full, dots, dots_no_batch, names:<a,b>, offload:<a,b>"
    with pytest.raises(sk.ShardkitError, match=listed):
        sk.layers.remat_policy("some")
    with pytest.raises(sk.ShardkitError, match=r"'full' takes no options"):
        sk.kernels.check({"remat": "full:x"})
    with pytest.raises(sk.ShardkitError, match=r"give the tagged names after a colon"):
        sk.kernels.check({"remat": "names"})
    with pytest.raises(sk.ShardkitError, match=r"available: dots, dots_no_batch"):  # through the API, up front
        sk.make_train_step(sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs)), optax.sgd(0.1), one_device_mesh(),
                           sk.strategy("dp").replace(kernels={"remat": "dotz"}))  # fmt: skip


def test_offload_is_refused_on_the_cpu_backend_naming_it_and_the_alternative():
    message = r"'cpu' backend cannot offload activations to host memory.*'names:attn_out,mlp_in'"
    with pytest.raises(sk.ShardkitError, match=message):
        sk.kernels.check({"remat": "offload:attn_out,mlp_in"})
    with pytest.raises(sk.ShardkitError, match=message):  # the config path, before anything is built
        runtime.with_kernels(sk.strategy("fsdp"), "remat=offload:attn_out,mlp_in")


def test_the_config_path_parses_name_lists_and_checks_up_front():
    strategy = runtime.with_kernels(sk.strategy("fsdp"), "remat=names:qkv_proj,mlp_in,attention=dense")
    assert strategy.kernels["remat"] == "names:qkv_proj,mlp_in" and strategy.kernels["attention"] == "dense"
    with pytest.raises(sk.ShardkitError, match=r"kernel 'dotz' is not registered for slot 'remat'"):
        runtime.with_kernels(sk.strategy("fsdp"), "remat=dotz")
    config = base.get_config()
    config.kernels, config.model.remat = "remat=full", "full"  # the same policy twice: fine
    assert runtime.strategy_of(config, 8).kernels["remat"] == "full"
    config.model.remat = "dots"  # the alias's dots is the slot's dots_no_batch: a conflict with full
    message = r"kernels=\{'remat': 'full'\} and the model's own remat policy 'dots_no_batch' disagree"
    with pytest.raises(sk.ShardkitError, match=message):
        runtime.strategy_of(config, 8)


def test_the_gpt_alias_is_the_slot_and_a_conflict_is_an_error():
    """GPTConfig.remat="dots" lowers to the program of the slot's dots_no_batch; alias and slot differing: refused."""
    batch, mesh = make_batch(), one_device_mesh()

    def lowered(remat: str, kernels: dict) -> str:
        model = sk.abstract_model(lambda rngs: GPT(dataclasses.replace(TINY, remat=remat), rngs=rngs))
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, sk.strategy("dp").replace(kernels=kernels))
        return step.lower(step.abstract_state(), batch).as_text()

    assert lowered("dots", {}) == lowered("none", {"remat": "dots_no_batch"})
    with pytest.raises(sk.ShardkitError, match=r"and the model's own remat policy 'full' disagree"):
        lowered("full", {"remat": "dots"})


def test_the_gpt_cost_model_reads_full_remat_from_the_slot_as_from_the_alias():
    mesh, shapes = {"data": 2, "fsdp": 4}, {"inputs": (16, 32), "targets": (16, 32)}
    predict = lambda cfg, s: sk.costmodel.for_config(cfg).predict(s, mesh, shapes, 4, "cpu")[1]
    slot = predict(TINY, sk.strategy("fsdp").replace(kernels={"remat": "full"}))
    alias = predict(dataclasses.replace(TINY, remat="full"), "fsdp")
    assert slot == alias and slot != predict(TINY, "fsdp")


def test_matmul_flops_counts_each_loop_trip_and_convolutions():
    """XLA's cost_analysis counts a scan's body once; hlo.matmul_flops counts it per trip: L x 2mnk, exactly."""

    def stack(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.lax.scan(lambda h, wi: (h @ wi, None), x, w)[0]

    w, x = jnp.ones((5, 16, 16)), jnp.ones((8, 16))
    compiled = jax.jit(stack).lower(w, x).compile()
    assert sk.hlo.matmul_flops(compiled) == 5 * 2 * 8 * 16 * 16
    conv = lambda v, k: jax.lax.conv_general_dilated(v, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    v, k = jnp.ones((2, 6, 6, 3)), jnp.ones((3, 3, 3, 4))
    assert sk.hlo.matmul_flops(jax.jit(conv).lower(v, k).compile()) == 2 * (2 * 6 * 6 * 4) * (3 * 3 * 3)


def test_explain_tabulates_each_policys_memory_and_recomputed_flops():
    mesh, batch = one_device_mesh(), make_batch()
    step = sk.make_train_step(sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs)), optax.sgd(0.1), mesh, "dp")
    report = sk.explain(step, step.abstract_state(), batch, remat_policies=("full", "dots"))
    rows = {r.policy: r for r in report.remat}
    assert list(rows) == ["none", "full", "dots"] and rows["none"].recomputed_flops == 0
    assert rows["full"].temp_bytes < rows["dots"].temp_bytes < rows["none"].temp_bytes, rows
    # dots keeps every matmul output: nothing to recompute; full recomputes the layers' forward matmuls (those whose
    # outputs the backward pass reads), which the loop-aware count sees in both of the scan's layers
    assert rows["dots"].recomputed_flops == 0 and rows["full"].recomputed_flops > 0, rows
    # XLA's cost_analysis counts the scan's body once: its difference is one layer's recomputation (matmuls plus a
    # little elementwise work, measured 34.5 MFLOP), the loop-aware count both layers' matmuls (67.1 MFLOP)
    assert rows["full"].recomputed_flops > 1.5 * (rows["full"].flops - rows["none"].flops), rows
    assert rows["none"].temp_bytes == report.memory["temporaries"]  # the step's own program, reused
    assert rows["full"].matmul_flops == rows["none"].matmul_flops + rows["full"].recomputed_flops
    assert "recomputed" in report.text() and report.to_dict()["remat"][1]["policy"] == "full"


COSMO = CosmoFlowConfig(size=8, widths=(4, 4), dense=(8,), batch_norm=True)  # two conv blocks, no stack
UNET = UNet3DConfig(widths=(4, 4), num_classes=3)  # a down pair, the bottom pair, an up pair


@pytest.mark.parametrize("model", ["cosmoflow", "unet3d"])
def test_3d_cnn_blocks_run_under_the_policy_and_train_as_none_does(model):
    """The 3D CNNs' blocks differ in shape (no stack): each (CosmoFlow's conv block, the U-Net's conv pair) runs
    under `sk.layers.checkpoint_module` (nnx.remat, BatchNorm statistics updated inside). Parity with `none` after
    3 SGD steps, same bound as the ResNet's."""
    rng = np.random.default_rng(0)
    volume = jnp.asarray(rng.normal(size=(8, 8, 8, 8, 1)), jnp.float32)
    if model == "cosmoflow":
        net_fn, loss_fn = lambda rngs: CosmoFlow(COSMO, rngs=rngs), regression_loss
        batch = {"volume": volume, "target": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
    else:
        net_fn, loss_fn = lambda rngs: UNet3D(UNET, rngs=rngs), segmentation_loss
        batch = {"volume": volume, "label": jnp.asarray(rng.integers(0, 3, size=(8, 8, 8, 8)), jnp.int32)}
    out = {}
    for policy in ("none", "full"):
        mesh, strategy = one_device_mesh(), _strategy("resnet", policy)
        net = sk.sharded_init(net_fn, mesh, strategy, seed=0)
        step = sk.make_train_step(net, optax.sgd(0.1, momentum=0.9), mesh, strategy, loss_fn=loss_fn)
        state, losses = step.init_state(), []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        lowered = step.lower(state, batch).as_text()
        out[policy] = losses, jax.tree.leaves((state.params, state.model_state)), lowered
    np.testing.assert_allclose(out["full"][0], out["none"][0], rtol=RTOL["resnet"])
    for a, b in zip(out["full"][1], out["none"][1], strict=True):
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= RTOL["resnet"] * float(np.abs(b).max())
    # the policy reaches the blocks: jax emits the recomputation (XLA:CPU may fuse it away again: docs/memory.md)
    assert "optimization_barrier" in out["full"][2] and "optimization_barrier" not in out["none"][2]
