"""Tests for shardkit/hlo.py: collectives, axes and bytes read from compiled HLO (8 CPU devices, from conftest)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit import hlo
from shardkit.errors import ShardkitError

F32 = 4  # bytes


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert jax.device_count() >= 8, "tests/conftest.py must give 8 CPU devices (--xla_force_host_platform_device_count)"
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))  # Mesh(...) gives Auto axes


def _smap(mesh: Mesh, f, in_specs, out_specs, *args):
    sm = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(sm).lower(*args).compile()


def _only(colls: list[hlo.Collective]) -> hlo.Collective:
    assert len(colls) == 1, colls
    return colls[0]


def test_psum_over_one_axis(mesh):
    c = _smap(mesh, lambda x: lax.psum(x, "b"), P("a", "b"), P("a", None), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size, coll.count, coll.in_loop) == ("all-reduce", ("b",), 4, 1, False)
    assert coll.operand_bytes == coll.result_bytes == 4 * 4 * F32  # the [8,16] block per device is [4,4]
    assert coll.bytes_sent == 2 * 3 / 4 * coll.operand_bytes
    assert hlo.collectives(c.as_text(), mesh) == [coll]  # text route agrees


def test_psum_over_both_axes(mesh):
    c = _smap(mesh, lambda x: lax.psum(x, ("a", "b")), P("a", "b"), P(), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("all-reduce", ("a", "b"), 8)
    assert coll.bytes_sent == 2 * 7 / 8 * 64


def test_all_gather_tiled(mesh):
    c = _smap(mesh, lambda x: lax.all_gather(x, "a", tiled=True), P("a", "b"), P(None, "b"), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("all-gather", ("a",), 2)
    assert (coll.operand_bytes, coll.result_bytes) == (4 * 4 * F32, 8 * 4 * F32)
    assert coll.bytes_sent == 1 / 2 * coll.result_bytes


def test_psum_scatter(mesh):
    f = lambda x: lax.psum_scatter(x, "b", scatter_dimension=0, tiled=True)
    c = _smap(mesh, f, P("a", None), P(("a", "b"), None), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("reduce-scatter", ("b",), 4)
    assert (coll.operand_bytes, coll.result_bytes) == (4 * 16 * F32, 1 * 16 * F32)
    assert coll.bytes_sent == 3 / 4 * coll.operand_bytes


def test_all_to_all(mesh):
    f = lambda x: lax.all_to_all(x, "b", 0, 1, tiled=True)
    c = _smap(mesh, f, P("a", "b"), P("a", "b"), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("all-to-all", ("b",), 4)
    assert coll.operand_bytes == coll.result_bytes == 4 * 4 * F32  # CPU splits it into 4 [1,4] operands
    assert coll.bytes_sent == 3 / 4 * coll.operand_bytes


def test_ppermute(mesh):
    f = lambda x: lax.ppermute(x, "a", [(0, 1), (1, 0)])
    c = _smap(mesh, f, P("a", "b"), P("a", "b"), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("collective-permute", ("a",), 2)
    assert coll.bytes_sent == coll.operand_bytes == 4 * 4 * F32
    f = lambda x: lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)])
    coll = _only(hlo.collectives(_smap(mesh, f, P("a", "b"), P("a", "b"), jnp.ones((8, 16))), mesh))
    assert (coll.axes, coll.group_size) == (("b",), 4)


def test_psum_in_scan_counts_trip_count(mesh):
    def f(x):
        return lax.scan(lambda c, _: (lax.psum(c, "b") * 0.5, None), x, None, length=5)[0]

    c = _smap(mesh, f, P("a", "b"), P("a", "b"), jnp.ones((8, 16)))
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.count, coll.in_loop) == ("all-reduce", ("b",), 5, True)
    assert coll.bytes_sent == 5 * 2 * 3 / 4 * 64
    # Without XLA's known_trip_count the bound is read from the loop condition's constant.
    text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", c.as_text())
    assert _only(hlo.collectives(text, mesh)).count == 5


def test_nested_loops_multiply(mesh):
    def f(x):
        inner = lambda c, _: (lax.psum(c, "b") * 0.5, None)
        outer = lambda c, _: (lax.psum(lax.scan(inner, c, None, length=3)[0], "a"), None)
        return lax.scan(outer, x, None, length=4)[0]

    colls = hlo.collectives(_smap(mesh, f, P("a", "b"), P("a", "b"), jnp.ones((8, 16))), mesh)
    counts = {c.axes: (c.count, c.in_loop) for c in colls}
    assert counts == {("b",): (12, True), ("a",): (4, True)}
    assert hlo.summarize(colls)["all-reduce", ("b",)] == {"count": 12, "bytes_sent": 12 * 2 * 3 / 4 * 64}


def test_gspmd_matmul_contracting_dim(mesh):
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "b")))
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("b", None)))
    c = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()
    coll = _only(hlo.collectives(c, mesh))
    assert (coll.kind, coll.axes, coll.group_size) == ("all-reduce", ("b",), 4)
    assert coll.operand_bytes == 8 * 8 * F32  # partial sums of the full [8,8] output


def test_permuted_device_order_maps_to_mesh_axes(mesh):
    devs = mesh.devices.flat[[3, 0, 6, 1, 7, 2, 5, 4]].reshape(2, 4)
    mesh = Mesh(devs, ("a", "b"))
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "a")))
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("a", None)))
    c = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P())).lower(x, w).compile()
    assert _only(hlo.collectives(c, mesh)).axes == ("a",)
    assert _only(hlo.collectives(c.as_text(), mesh)).axes == ("a",)  # partition i = mesh.devices.flat[i]
    c = _smap(mesh, lambda x: lax.psum(x, "b"), P("a", "b"), P("a", None), jnp.ones((8, 16)))
    assert _only(hlo.collectives(c, mesh)).axes == ("b",)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("{{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("{}", [[0, 1, 2, 3, 4, 5, 6, 7]]),
        ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("[4,2]<=[2,4]T(1,0), channel_id=3", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("[2,4]<=[2,2,2]T(2,1,0)", [[0, 4, 2, 6], [1, 5, 3, 7]]),
        ("mesh['a'=2,'b'=4] {'b'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh[a=2,b=4] {a}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("mesh['x'=2,'y'=2], device_ids=(0,2,1,3) {'x'}", [[0, 1], [2, 3]]),
        ("mesh['x'=8] {'x':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("mesh['x'=4] {}", [[0], [1], [2], [3]]),
        ("mesh['u'=1,'v'=2,'w'=2] {'u','w'}", [[0, 1], [2, 3]]),
    ],
)
def test_parse_replica_groups(value, expected):
    assert hlo.parse_replica_groups(value, 8) == expected


def test_parse_replica_groups_unknown_format():
    with pytest.raises(ShardkitError, match="unknown replica_groups format"):
        hlo.parse_replica_groups("<<0,1>>", 8)


ASYNC_HLO = """HloModule m, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (t: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %t = (s32[], bf16[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[8,4]{1,0} get-tuple-element(%t), index=1
  %ars = bf16[8,4]{1,0} all-reduce-start(%v), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %ard = bf16[8,4]{1,0} all-reduce-done(%ars)
  ROOT %r = (s32[], /*index=1*/bf16[8,4]{1,0}) tuple(%i, %ard)
}

%cond (t.1: (s32[], bf16[8,4])) -> pred[] {
  %t.1 = (s32[], bf16[8,4]{1,0}) parameter(0)
  %n = s32[] constant(3)
  %j = s32[] get-tuple-element(%t.1), index=0
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (p: f32[4,4]) -> f32[8,4] {
  %p = f32[4,4]{1,0} parameter(0)
  %ags = (f32[4,4]{1,0}, f32[8,4]{1,0}) all-gather-start(%p), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), \
dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/all_gather{x}" source_line=3}
  %agd = f32[8,4]{1,0} all-gather-done(%ags)
  %cps = (f32[8,4]{1,0}, f32[8,4]{1,0}, u32[], u32[]) collective-permute-start(%agd), channel_id=3, \
source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}
  %cpd = f32[8,4]{1,0} collective-permute-done(%cps)
  %c = bf16[8,4]{1,0} convert(%cpd)
  %z = s32[] constant(0)
  %tup = (s32[], bf16[8,4]{1,0}) tuple(%z, %c)
  %w = (s32[], bf16[8,4]{1,0}) while(%tup), condition=%cond, body=%body
  %g = bf16[8,4]{1,0} get-tuple-element(%w), index=1
  ROOT %out = f32[8,4]{1,0} convert(%g)
}
"""


def test_async_pairs_count_once_with_true_sizes(mesh):
    colls = {c.kind: c for c in hlo.collectives(ASYNC_HLO, mesh)}
    assert set(colls) == {"all-gather", "collective-permute", "all-reduce"}
    ag, cp, ar = colls["all-gather"], colls["collective-permute"], colls["all-reduce"]
    assert (ag.axes, ag.count, ag.operand_bytes, ag.result_bytes) == (("a",), 1, 64, 128)
    assert (cp.axes, cp.count, cp.operand_bytes, cp.result_bytes, cp.bytes_sent) == (("b",), 1, 128, 128, 128)
    assert (ar.axes, ar.count, ar.in_loop, ar.operand_bytes) == (("b",), 3, True, 8 * 4 * 2)
    assert ar.bytes_sent == 3 * 2 * 3 / 4 * 64
    # Without the -done halves the gathered size still comes from the start's (operand, result) tuple.
    no_done = ASYNC_HLO.replace("all-gather-done(%ags)", "copy(%ags)")
    assert {c.kind: c for c in hlo.collectives(no_done, mesh)}["all-gather"].result_bytes == 128


def test_unmatched_groups_and_table(mesh):
    text = ASYNC_HLO.replace("replica_groups=[2,4]<=[8]", "replica_groups={{0,1},{2,3},{4,5},{6,7}}")
    ar = next(c for c in hlo.collectives(text, mesh) if c.kind == "all-reduce")
    assert (ar.axes, ar.group_size) == (("?",), 2)  # pairs within a row of 4 are no product of mesh axes
    table = hlo.format_table(hlo.collectives(ASYNC_HLO, mesh))
    assert table.splitlines()[0].split() == ["kind", "axes", "p", "count", "result", "operand", "sent/step", "loop"]
    assert "all-gather" in table and table.splitlines()[-1].split()[:2] == ["total", "5"]


def test_rejects_non_hlo(mesh):
    with pytest.raises(ShardkitError, match="Compiled"):
        hlo.collectives("module @jit_f { func.func public @main() }", mesh)
    with pytest.raises(ShardkitError, match="Compiled"):
        hlo.collectives(jax.jit(lambda x: x).lower(1.0), mesh)  # a Lowered has StableHLO, not partitioned HLO
