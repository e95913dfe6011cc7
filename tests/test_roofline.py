"""The predicted step time (shardkit/roofline.py): its terms add up as docs/explain.md says, each mesh axis is priced
on the link it rides (ICI inside a TPU slice, DCN across slices), and every place it appears says it is a prediction.
One tiny GPT compiled by XLA's TPU compiler for two v5e-8 slices; nothing runs on a chip and no time is measured.
"""

import dataclasses
import functools
import math

import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit import hlo, roofline

TINY = GPTConfig(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=128,
                 max_seq_len=32)  # fmt: skip
BATCH, SEQ = 16, 32


@functools.cache
def _report(target: str = "v5e-8x2") -> sk.explain:
    mesh = sk.make_mesh("data=2,fsdp=8", target=target)  # data spans the two slices / hosts, fsdp stays inside one
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.adamw(1e-3), mesh, "fsdp")
    batch = step.abstract_batch({k: ((BATCH, SEQ), jnp.int32) for k in ("inputs", "targets")})
    return sk.explain(step, step.abstract_state(), batch)


def test_terms_add_up_as_documented():
    r = _report().roofline
    chip = sk.target("v5e-8x2").chip
    assert (r.peak_flops, r.hbm_bandwidth) == (chip.peak_flops, chip.hbm_bandwidth)
    assert r.matmul_flops == hlo.matmul_flops(_report().compiled) > 0  # the FLOPs term: matmul FLOPs over the peak
    assert r.kernel_flops == 0 and r.flops_s == pytest.approx(r.matmul_flops / r.peak_flops)
    assert r.hbm_s == pytest.approx(r.hbm_bytes / r.hbm_bandwidth) and r.hbm_bytes > 0
    assert r.compute_s == r.compute_out_of_loops_s + r.compute_in_loops_s >= max(r.flops_s, r.hbm_s)
    assert r.comm_s == pytest.approx(sum(c["seconds"] for c in r.collectives)) and r.comm_s > 0
    assert r.comm_overlappable_s == pytest.approx(sum(c["seconds"] for c in r.collectives if c["overlappable"]))
    assert all(c["in_loop"] for c in r.collectives if c["overlappable"])  # only the layer scan's collectives hide
    assert r.no_overlap_s == pytest.approx(r.compute_s + r.comm_s)
    assert r.full_overlap_s == pytest.approx(max(r.compute_s, r.comm_s))
    assert r.full_overlap_s <= r.step_s <= r.no_overlap_s + 1e-15
    model_flops = TINY.flops_per_token(SEQ) * BATCH * SEQ / 16  # per device: 16 devices
    assert r.model_flops == pytest.approx(model_flops)
    assert r.mfu == pytest.approx(model_flops / (r.step_s * r.peak_flops))


def test_each_axis_rides_its_link_and_dcn_prices_the_cross_slice_collectives():
    r = _report().roofline
    dcn, ici = sk.target("v5e-8x2").chip.links["dcn"], sk.target("v5e-8x2").chip.links["ici"]
    links = {a.axis: a for a in r.links}
    assert (links["data"].link, links["data"].bandwidth) == ("DCN", dcn.bandwidth)
    assert links["fsdp"].link == "ICI" and links["fsdp"].bandwidth == 2 * 2 * ici.bandwidth  # 2x4: two torus dims
    across = [c for c in r.collectives if "data" in c["axes"]]
    assert across and all(c["link"] == "DCN" and c["seconds"] >= c["bytes_sent"] / dcn.bandwidth for c in across)
    inside = [c for c in r.collectives if c["axes"] == ["fsdp"]]
    assert inside and all(c["link"] == "ICI" for c in inside)
    assert "data=2: DCN" in r.text() and "fsdp=8: ICI" in r.text()


def test_gpu_axes_ride_nvlink_inside_a_host_and_infiniband_across():
    from shardkit import targets_gpu

    assert not targets_gpu.cuda_missing(), "the dev extras bring XLA's CUDA compiler (pyproject.toml)"
    r = _report("h100-8x2").roofline
    chip = sk.target("h100-8x2").chip
    links = {a.axis: (a.link, a.bandwidth) for a in r.links}
    ib, nvlink = chip.links["dcn"].bandwidth, chip.links["ici"].bandwidth
    assert links == {"data": ("InfiniBand", ib), "fsdp": ("NVLink", nvlink)}
    assert r.hbm_bytes_cost_analysis is None and r.hbm_bytes > 0  # the CUDA compiler's cost_analysis gives nothing
    assert all(c["link"] == "InfiniBand" for c in r.collectives if "data" in c["axes"])


def test_the_report_labels_it_a_prediction():
    report = _report()
    assert "PREDICTED, not measured" in report.text() and "XLA's schedule" in report.text()
    d = report.to_dict()["roofline"]
    assert d["label"] == roofline.PREDICTION and d["step_s"] == report.roofline.step_s and "mfu" in d
    cpu = sk.make_train_step(sk.abstract_model(lambda r: GPT(TINY, rngs=r)), optax.adamw(1e-3),
                             sk.make_mesh("data=2,fsdp=4"), "fsdp")  # fmt: skip
    batch = cpu.abstract_batch({k: ((BATCH, SEQ), jnp.int32) for k in ("inputs", "targets")})
    assert sk.explain(cpu, cpu.abstract_state(), batch).roofline is None  # CPU: no chip figures, no prediction
    cpu8 = sk.load_preset("cpu8")  # its peak is measured at start-up: 0 in the file
    with pytest.raises(sk.ShardkitError, match=r"no roofline for 'cpu8'.*peak_bf16_flops > 0"):
        roofline.roofline(report.compiled, sk.make_mesh("data=2,fsdp=4"), cpu8)
    # a measured peak and no HBM bandwidth (strategy=auto on a preset that gives none): no second roof, said so
    bare = dataclasses.replace(cpu8, peak_flops=1e12, hbm_bandwidth=0.0)
    r = roofline.roofline(report.compiled, sk.make_mesh("data=2,fsdp=4"), bare)
    assert r.hbm_s == 0 and r.no_overlap_s == pytest.approx(r.flops_s + r.comm_s) and "no HBM bandwidth" in r.text()


_LOOP = """HloModule m, num_partitions=1

%body (bp: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %bp = (s32[], f32[8,8]{1,0}) parameter(0)
  %bi = s32[] get-tuple-element(%bp), index=0
  %bx = f32[8,8]{1,0} get-tuple-element(%bp), index=1
  %one = s32[] constant(1)
  %bj = s32[] add(%bi, %one)
  %by = f32[8,8]{1,0} dot(%bx, %bx), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %bt = (s32[], f32[8,8]{1,0}) tuple(%bj, %by)
}

%cond (cp: (s32[], f32[8,8])) -> pred[] {
  %cp = (s32[], f32[8,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8]{1,0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[8,8]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[8,8]{1,0}) while(%t), condition=%cond, body=%body
  %r = f32[8,8]{1,0} get-tuple-element(%w), index=1
  %v = f32[8,8]{1,0:S(1)} copy(%r)
  ROOT %o = f32[8,8]{1,0} negate(%v)
}
"""


def test_hbm_bytes_count_loop_trips_and_leave_out_other_memory_spaces():
    c = roofline.program_costs(_LOOP)
    assert c["flops"] == [0, 3 * 2 * 8 * 8 * 8]  # the dot, three trips
    # in the loop, three trips of: add (4 + 4 + 4 bytes), dot (256 x 3), the condition's compare (1 + 4 + 4)
    assert c["hbm"][1] == 3 * (12 + 3 * 256 + 9)
    assert c["hbm"][0] == 256 + 256  # copy reads 256 from HBM into S(1); negate writes 256: S(1) bytes left out
    assert math.isclose(sum(c["hbm"]), 3 * 789 + 512)
