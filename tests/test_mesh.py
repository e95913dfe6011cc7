"""make_mesh: specs, dicts, presets, -1 fill, and the errors a user meets first."""

import math

import jax
import pytest
from jax.sharding import AxisType

import shardkit as sk


def test_spec_string_keeps_order_and_auto_axes():
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_dict_with_fill_axis():
    mesh = sk.make_mesh({"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}


def test_explicit_devices():
    mesh = sk.make_mesh("data=1", jax.devices()[:1])
    assert mesh.devices.size == 1


@pytest.mark.parametrize("name", ["cpu8", "tpu_v5e_8", "tpu_v4_32", "gpu_8xh100", "gpu_2x8xh100"])
def test_presets_load_with_figures_and_sources(name):
    p = sk.load_preset(name)
    assert p.num_devices == math.prod(p.axes.values())
    assert p.hbm_bytes > 0 and p.link("data").bandwidth > 0 and p.link("data").latency > 0
    assert p.sources, "every preset cites where its figures come from"
    if p.platform != "cpu":
        assert p.peak_flops > 1e14


def test_two_node_preset_uses_dcn_link_for_the_cross_node_axis():
    p = sk.load_preset("gpu_2x8xh100")
    assert list(p.axes) == ["data", "fsdp"]  # DCN axes outermost
    assert p.link("data").bandwidth < p.link("fsdp").bandwidth


def test_cpu8_preset_builds_on_8_devices():
    assert sk.make_mesh("cpu8").devices.size == 8
    assert sk.make_mesh("tpu_v5e_8").devices.size == 8  # same count: a plan can be tried on CPU


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("data=3,fsdp=2", r"needs 6 devices but 8 are available"),
        ("data=-1,fsdp=-1", r"only one axis can take the remaining devices"),
        ("data=3,fsdp=-1", r"use 3 devices, which does not divide the 8"),
        ("batch=8", r"unknown mesh axis 'batch'; shardkit's mesh axes are data, fsdp"),
        ("data=0,fsdp=8", r"data=0 must be a positive integer"),
        ({"data": -2, "fsdp": 4}, r"data=-2 must be a positive integer"),
        ("data:8", r"write axis=degree pairs"),
        ("data=2,data=4", r"names axis 'data' twice"),
        ("tpu_v4_32", r"describes 16 devices \(TPU v4\) but 8 are available"),
        ("no_such_preset", r"unknown mesh preset 'no_such_preset'; available: cpu8"),
    ],
)
def test_bad_specs_raise_with_the_fix(spec, message):
    with pytest.raises(sk.ShardkitError, match=message):
        sk.make_mesh(spec)
