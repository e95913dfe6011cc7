"""One way in: the step a strategy names is looked up in a registry, and cost predictions follow the tables.

No compile here: these check the dispatch and the predictions' inputs, which the parity and explain tests then
exercise end to end.
"""

import optax
import pytest
from common import TINY

import shardkit as sk
from models.cosmoflow import CosmoFlowConfig
from models.gpt import GPT


def test_make_train_step_runs_the_step_the_strategy_names():
    @sk.register_step("toy_registry_check")
    class Toy(sk.TrainStep):
        def step_fn(self, state, batch):  # never traced here
            raise AssertionError

    try:
        mesh = sk.make_mesh("data=8")
        model = sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs))
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, sk.strategy("dp").replace(step="toy_registry_check"))
        assert type(step) is Toy and step.strategy.step == "toy_registry_check"
        assert type(sk.make_train_step(model, optax.sgd(0.1), mesh, "dp")).__name__ == "GSPMDStep"
        with pytest.raises(sk.ShardkitError, match="not registered"):
            sk.make_train_step(model, optax.sgd(0.1), mesh, sk.strategy("dp").replace(step="nope"))
    finally:
        sk.dispatch.STEPS.pop("toy_registry_check")


def test_configure_applies_the_sections_named_after_the_step_and_kernels():
    pp = sk.configure("pp", {"pipeline": {"schedule": "1f1b", "microbatches": 8, "virtual_stages": 0}}, devices=8)
    assert pp.kernels["layers"] == "pipeline:1f1b:8"
    sdp = sk.configure("sdp", {"sdp": {"coverage": 0.25}}, devices=8)
    assert sdp.step == "sdp" and sdp.options.coverage == 0.25
    assert sk.configure("fsdp", {"sdp": {"coverage": 0.25}}, devices=8) == sk.strategy("fsdp")  # not its step


@pytest.mark.parametrize(
    ("name", "cfg", "mesh", "shapes"),
    [
        ("fsdp_tp", TINY, {"data": 2, "fsdp": 2, "tensor": 2}, {"inputs": (16, 32)}),
        ("tp3d", TINY, {"data": 2, "row": 2, "col": 2}, {"inputs": (16, 32)}),
        ("zero1", TINY, {"data": 8}, {"inputs": (16, 32)}),
        ("spatial_dp_halo", CosmoFlowConfig(size=32, widths=(4, 8, 8, 8, 8), dense=(16,), spatial_blocks=3),
         {"data": 2, "space": 4}, {"volume": (8,)}),
    ],
)  # fmt: skip
def test_a_copy_under_a_new_name_gets_the_originals_prediction(name, cfg, mesh, shapes):
    copy = sk.strategy(name).replace(name=f"my_{name}_copy")
    original = cfg.cost_model(sk.strategy(name), mesh, shapes, 4, "cpu")
    assert original is not None
    got = cfg.cost_model(copy, mesh, shapes, 4, "cpu")
    assert got[0] == original[0] and got[1] == original[1]  # comms rows and memory terms equal
    assert copy.traits() == sk.strategy(name).traits()


def test_a_strategy_the_formulas_do_not_describe_gets_none_whatever_its_name():
    # the GPT's tp formula under the name of a CNN strategy that splits channels: not Megatron, so no formula
    assert TINY.cost_model(sk.strategy("tp_channels").replace(name="tp"), {"data": 4, "tensor": 2},
                           {"inputs": (16, 32)}, 4, "cpu") is None  # fmt: skip
    assert sk.strategy("fsdp").traits().reduce_scatters and not sk.strategy("dp").traits().reduce_scatters
