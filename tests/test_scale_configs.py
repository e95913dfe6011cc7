"""The large configs fit what they are named for, and the planner says when a plan may not (issue 52, items 3-4).

Each large GPT config names its target (`TARGET`, also in its docstring) and carries the plan `sk.plan` picks for
it there (mesh, strategy, remat). The checks:

- every one (cost model only, no compile): the config's own plan is predicted to fit its target's usable memory
  (the planner's `memory_fraction` of HBM) with the cost model's known error to spare (not "tight");
- one by the compiler's verdict: gpt_350m compiled by XLA's TPU compiler for its v5e-8 (the cheapest of them to
  compile: the file takes about 20 s on this 2-core host), `fits` read from the compiled program's peak against
  the chip's HBM less the target's margin. The 7B on a v5p-128 and the 70B on a v5p-256 take 40-55 s each to
  compile here, too long for the suite: their compiled figures are in docs/targets.md §6 (`experiments.train ...
  --config.compile_only`: both fit);
- the planner's "tight" plans (cost model only).
"""

import dataclasses
import importlib
import math

import pytest

import shardkit as sk
from experiments import runtime, tasks
from experiments.data import text
from models.gpt_cost.model import TPU_MEMORY_ERROR
from models.gpt_remat import REMAT_ALIASES

#: the large configs and what they are named for
LARGE = ("gpt_350m", "gpt_1b", "gpt_7b", "gpt_70b", "gpt_moe_8x350m")


def _config(name: str):
    mod = importlib.import_module(f"experiments.configs.{name}")
    return mod, mod.get_config()


@pytest.mark.parametrize("name", LARGE)
def test_config_names_its_target_and_its_plan_fits(name):
    """The docstring names `TARGET`; the config's plan on it is predicted to fit with the known error to spare."""
    mod, c = _config(name)
    tgt = sk.target(mod.TARGET)
    assert mod.TARGET in mod.__doc__, f"{name}'s docstring should name its target {mod.TARGET}"
    mesh = runtime.target_axes(c, tgt.num_devices)
    assert math.prod(mesh.values()) == tgt.num_devices
    cfg = tasks.model_config(c, text.VOCAB_SIZE)
    micro = c.batch_size // c.microbatches  # the planner models one microbatch's activations
    policy = REMAT_ALIASES[cfg.remat]
    strategy = sk.strategy(c.strategy).replace(kernels={"remat": policy})
    _, mem, _ = sk.costmodel.for_config(cfg).predict(strategy, mesh, {"inputs": (micro, c.seq_len)}, 2, "tpu")
    # gradient accumulation: the fp32 sum of the microbatches' gradients, a parameter shard's worth, beside them
    accum = mem["params"] / 2 * 4 if c.microbatches > 1 else 0.0
    usable = 0.9 * tgt.hbm_bytes  # sk.plan's default memory_fraction
    error = sk.costmodel.for_config(cfg).memory_error("tpu")  # the GPT's, or the MoE GPT's larger one
    total = (mem["total"] + accum) * (1 + error)
    assert total <= usable, (
        f"{name} on {mod.TARGET}: {total / 2**30:.1f} GiB with the known error > {usable / 2**30:.1f}"
    )


def test_gpt_350m_fits_its_target_by_the_compiler():
    """The compiler's verdict on a named config at its named target: compiled, its peak within the chip's HBM."""
    from experiments.compile_only import explain_config

    mod, c = _config("gpt_350m")
    c.update(target=mod.TARGET, compile_only=True)
    report, _ = explain_config(c)
    assert report.platform == "tpu" and report.fits, report.fits_text()


def test_plans_within_the_known_error_of_the_limit_are_marked_tight_and_ranked_after():
    """`sk.plan` never offers a plan near the HBM limit without its margin: the 7B on a v5p-128 (batch 256 x 4096).
    fsdp data=16,fsdp=4 under dots_no_batch is predicted at 83.9 GiB of 85.5 usable (compiled: 83.7, docs/targets.md
    §6), less than the GPT's known 10% error away, so that mesh is offered with full remat (46.4 GiB) instead; fsdp
    data=32,fsdp=2 is tight even with full remat (80.5 GiB): marked, printed so, ranked after every plan with
    margin."""
    _, c = _config("gpt_7b")
    cfg = dataclasses.replace(tasks.model_config(c, text.VOCAB_SIZE), remat="none")
    plans = sk.plan(cfg, 64, sk.target("v5p-128").preset(), 256, 4096)
    assert all(p.fits for p in plans) and plans[0].memory_error == TPU_MEMORY_ERROR
    tight = [p for p in plans if p.tight]
    assert tight and all(p.memory["total"] * (1 + p.memory_error) > p.usable_bytes for p in tight)
    first_tight = plans.index(tight[0])
    assert all(not p.tight for p in plans[:first_tight]) and all(p.tight for p in plans[first_tight:])
    by_grid = {(p.strategy, p.grid): p for p in plans}
    assert by_grid["fsdp", "data=32,fsdp=2"].tight
    assert by_grid["fsdp", "data=16,fsdp=4"].remat == "full" and not by_grid["fsdp", "data=16,fsdp=4"].tight
    table = sk.costmodel.format_plans(plans)
    assert "tight: may not fit" in table and "spare GiB" in table
