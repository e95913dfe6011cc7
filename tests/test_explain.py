"""sk.explain and experiments/explain.py: the table is the HLO's, the memory is memory_analysis()'s, nothing is
allocated, and a mesh larger than the machine is explained on a smaller one with SCALED figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from common import TINY

import shardkit as sk
from experiments import explain as ex
from experiments.configs import gpt_tiny
from models.gpt import GPT, GPTConfig
from shardkit import hlo
from shardkit.explain import _batch_axes, explain

REPO = Path(__file__).resolve().parents[1]
SMALL = {"model.num_layers": 2, "model.d_model": 64, "model.num_heads": 4, "model.num_kv_heads": 4,
         "model.head_dim": 16, "model.mlp_dim": 128, "batch_size": 16, "seq_len": 32}  # fmt: skip


def _abstract_step(spec: str, strategy: str):
    mesh = sk.make_mesh(spec)
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=step.batch_sharding)
    return step, step.abstract_state(), {"inputs": tokens, "targets": tokens}


CASES = [("fsdp=8", "fsdp", ("all-gather", ("fsdp",))), ("data=4,tensor=2", "tp", ("all-reduce", ("tensor",)))]


@pytest.mark.parametrize(("spec", "strategy", "main"), CASES)
def test_table_and_memory_match_the_compiled_hlo(spec, strategy, main, tmp_path):
    step, state, batch = _abstract_step(spec, strategy)
    report = explain(step, state, batch)
    compiled = step.lower(state, batch).compile()  # independently (the persistent cache makes it cheap)
    expect = hlo.summarize(hlo.collectives(compiled, step.mesh))
    got = {(r["kind"], tuple(r["axes"])): r for r in report.rows() if r["count"]}
    assert set(got) == set(expect)
    for key, e in expect.items():
        assert got[key]["count"] == e["count"] and got[key]["bytes_sent"] == pytest.approx(e["bytes_sent"])
    ma = compiled.memory_analysis()
    assert report.memory["temporaries"] == ma.temp_size_in_bytes
    assert report.memory["outputs"] == ma.output_size_in_bytes
    split = math.prod(step.mesh.shape[a] for a in _batch_axes(step, batch))
    batch_bytes = 2 * 16 * 32 * 4 // split  # inputs + targets, int32, split over the batch axes
    assert report.memory["parameters"] + report.memory["optimizer_state"] + batch_bytes + 4 == ma.argument_size_in_bytes
    # the cost model covers fsdp and tp: its prediction for the main collective matches the HLO's bytes within 1%
    assert got[main]["predicted_bytes"] == pytest.approx(got[main]["bytes_sent"], rel=0.01)
    assert report.memory_rows()[0]["predicted"] == pytest.approx(report.memory["parameters"], rel=0.01)
    d = json.loads(report.to_json())
    assert d["strategy"] == strategy and d["memory"]["temporaries"] == ma.temp_size_in_bytes
    assert "all-" in report.text() and "memory per device" in report.text()
    png = report.plot(str(tmp_path / "r.png"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _config(**over):
    c = gpt_tiny.get_config()
    for k, v in {**SMALL, **over}.items():
        node, *path = k.split(".")
        target = c[node] if path else c
        target[path[0] if path else node] = v
    return c


@pytest.fixture
def no_allocation(monkeypatch):
    """Parameter initialisation, state creation and data loading all fail loudly if reached."""

    def boom(*a, **k):
        raise AssertionError("explain must not allocate parameters or read data")

    for target in ("shardkit.sharded_init", "shardkit.init.sharded_init", "experiments.data.text.load_dataset",
                   "shardkit.step.TrainStep.init_state", "experiments.data.text.global_batch"):  # fmt: skip
        monkeypatch.setattr(target, boom)


def test_cli_explains_on_abstract_inputs(no_allocation):
    report, header = ex.explain_config(_config(strategy="fsdp_tp", mesh="data=2,fsdp=2,tensor=2"))
    assert report.scaled is None and "SCALED" not in report.text() and "fsdp_tp" in header
    axes = {tuple(r["axes"]) for r in report.rows() if r["count"]}
    assert ("tensor",) in axes and ("fsdp",) in axes
    assert report.prediction_source.startswith("shardkit.costmodel (fsdp_tp")  # fsdp_tp is modelled too


def test_cli_scales_a_mesh_larger_than_the_machine(no_allocation):
    report, header = ex.explain_config(_config(strategy="fsdp", mesh="data=4,fsdp=8"))
    assert report.mesh == {"data": 2, "fsdp": 4}
    assert "fewer than the plan's 32" in header and "same proportions" in header
    assert report.scaled["target_mesh"] == {"data": 4, "fsdp": 8}
    assert "SCALED" in report.text()
    # parameters and optimizer state go exactly 1/4 -> 1/8 (fsdp shards `embed`; only Adam's step counts stay)
    assert report.scaled["memory"]["parameters"] * 2 == report.memory["parameters"]
    assert report.scaled["memory"]["optimizer_state"] * 2 == pytest.approx(report.memory["optimizer_state"], abs=16)
    ag = report.scaled["collectives"]["all-gather|fsdp"]
    assert ag["scale_method"] == "cost model ratio" and ag["scaled_bytes"] == pytest.approx(
        ag["predicted_target_bytes"], rel=0.01
    )


def test_fit_mesh():
    assert ex.fit_mesh({"data": 4, "fsdp": 8}, 8) == ({"data": 2, "fsdp": 4}, "same proportions: every axis / 2")
    assert ex.fit_mesh({"data": 2, "tensor": 4}, 8)[0] == {"data": 2, "tensor": 4}
    mesh, how = ex.fit_mesh({"data": 2, "fsdp": 2, "tensor": 64}, 8)
    assert mesh == {"data": 2, "fsdp": 2, "tensor": 2} and "NOT kept" in how


def test_cli_command(tmp_path):
    flags = [f"--config.{k}={v}" for k, v in SMALL.items()]
    cmd = [sys.executable, "-m", "experiments.explain", "--config.mesh=data=4,fsdp=8", f"--json={tmp_path}/r.json"]
    out = subprocess.run(cmd + flags, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SCALED" in out.stdout and "compiled on data=2,fsdp=4" in out.stdout
    assert json.loads((tmp_path / "r.json").read_text())["scaled"]["target_mesh"] == {"data": 4, "fsdp": 8}


# ------------------------------------------------------------------------------------------- any model, any strategy
def test_a_registered_strategy_gets_a_prediction_from_its_rules_tables():
    """No formula knows `fsdp_mlp` (the GPT's parameters rest on `mlp` instead of `embed`): the prediction comes from
    the rules tables and the parameter specs, and matches the compiled parameter traffic (observed: exact)."""
    fsdp = sk.strategy("fsdp")
    mine = fsdp.replace(name="fsdp_mlp", param_rules={**fsdp.param_rules, "embed": None, "mlp": "fsdp"})
    step, state, batch = _abstract_step("data=2,fsdp=4", mine)
    report = explain(step, state, batch)
    assert report.prediction_source.startswith("rules tables of fsdp_mlp")
    rows = {(r["kind"], tuple(r["axes"])): r for r in report.rows()}
    for key in [("all-gather", ("fsdp",)), ("all-reduce", ("fsdp",)), ("all-reduce", ("data",))]:
        assert rows[key]["predicted_bytes"] == pytest.approx(rows[key]["bytes_sent"], rel=0.01), key
    mem = {r["name"]: r for r in report.memory_rows()}
    assert mem["parameters"]["predicted"] == report.memory["parameters"]  # exact: from the shardings
    assert mem["temporaries"]["predicted"] is None  # activations: not modelled, and said so
    assert any("not modelled" in n for n in report.notes)


def test_explain_works_on_any_model_and_batch():
    from test_any_model import IMAGE_AXES, ConvNet, GuideLM, image_batch, image_loss, lm_loss, token_batch

    mesh = sk.make_mesh("data=8")
    step = sk.make_train_step(sk.abstract_model(GuideLM), optax.adamw(1e-3), mesh, "dp", loss_fn=lm_loss)
    report = explain(step, step.abstract_state(), token_batch())
    ar = next(r for r in report.rows() if r["kind"] == "all-reduce" and r["axes"] == ["data"])
    assert ar["predicted_bytes"] == pytest.approx(ar["bytes_sent"], rel=0.01)  # dp: the gradients, all of them
    step = sk.make_train_step(sk.abstract_model(ConvNet), optax.adamw(1e-3), sk.make_mesh("data=2,fsdp=4"), "fsdp",
                              loss_fn=image_loss, batch_axes=IMAGE_AXES)  # fmt: skip
    text = explain(step, step.abstract_state(), image_batch()).text()
    assert "batch image [16, 8, 8, 1], label [16]" in text and "all-gather" in text


@pytest.mark.parametrize(("spec", "strategy"), [("data=2,seq=4", "cp_zigzag"), ("data=4,stage=2", "pp_dp")])
def test_rules_prediction_covers_sequence_and_pipeline_splits(spec, strategy):
    """Gradients of a sequence-split batch are all-reduced over seq too; a pipeline keeps each stage's layers
    where they rest (no gather over stage): the rules-based rows equal the compiled ones (observed: exact)."""
    cfg = GPTConfig(**{**TINY.__dict__, "num_layers": 4})
    mesh = sk.make_mesh(spec)
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=step.batch_sharding)
    report = explain(step, step.abstract_state(), {"inputs": tokens, "targets": tokens})
    predicted = [r for r in report.rows() if r["predicted_bytes"] is not None]
    assert predicted and all(r["count"] for r in predicted), "a predicted collective is not in the HLO"
    for r in predicted:
        assert r["predicted_bytes"] == pytest.approx(r["bytes_sent"], rel=0.01), r
