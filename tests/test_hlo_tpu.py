"""shardkit/hlo.py on programs compiled by XLA's TPU compiler (libtpu; compile-only devices of a v5e target, no TPU).

The TPU compiler writes what XLA:CPU never does: a reduce-scatter as a `kCustom` fusion around an all-reduce; async
collective fusions that repeat one collective in a start, in the fusions it overlaps with, and in a done; replica
groups in the mesh form; while loops without `known_trip_count`; every dot as a convolution; a large dot's gather
as a windowed-einsum ring of collective-permutes; across slices, megascale send/recv. Each test compiles a tiny
program (GPT train steps: 2 layers, d_model 128, seq 128, batch 16) and checks what hlo.py reads against what the
program must move, from the parameter and activation shapes.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit import hlo

L, B, S, D = 2, 16, 128, 128  # layers, batch, sequence, d_model
CFG = dict(
    num_layers=L, d_model=D, num_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=512, vocab_size=384, max_seq_len=S
)
BF16, F32 = 2, 4


def _compile(lowered: jax.stages.Lowered, mesh: Mesh) -> jax.stages.Compiled:
    with sk.targets.cache_off_for(mesh):  # JAX's persistent cache cannot read back entries for compile-only devices
        return lowered.compile()


Run = collections.namedtuple("Run", "state text colls flops")  # abstract state, HLO text, hlo's readings


@functools.cache
def _gpt(strategy: str, spec: str, attention_block: str = "xla", **config: int) -> Run:
    """A GPT train step under `strategy`, compiled for v5e-8, with XLA's attention (these tests read XLA's own
    collectives and dots; the splash kernels a TPU gets by default: tests/test_attention_tpu.py)."""
    mesh = sk.make_mesh(spec, target="v5e-8")
    cfg = GPTConfig(**{**CFG, **config})
    strategy = sk.strategy(strategy)
    strategy = strategy.replace(kernels={**strategy.kernels, "attention_block": attention_block})
    step = sk.make_train_step(sk.abstract_model(lambda r: GPT(cfg, rngs=r)), optax.adamw(1e-3), mesh, strategy)
    batch = step.abstract_batch({k: ((B, S), jnp.int32) for k in ("inputs", "targets")})
    compiled = _compile(step.lower(state := step.abstract_state(), batch), mesh)
    colls = hlo.collectives(compiled, mesh)
    assert all("?" not in c.axes for c in colls), hlo.format_table(colls)  # every group is a set of mesh axes
    return Run(state, compiled.as_text(), colls, hlo.matmul_flops(compiled))


def _rows(colls: list[hlo.Collective], kind: str, axes: tuple[str, ...], in_loop: bool | None = None) -> list:
    return [c for c in colls if (c.kind, c.axes) == (kind, axes) and in_loop in (None, c.in_loop)]


def _ring(c: hlo.Collective) -> bool:
    """bytes_sent is the ring volume of `count` occurrences."""
    p = c.group_size
    volume = {"all-gather": (p - 1) / p * c.result_bytes, "all-reduce": 2 * (p - 1) / p * c.operand_bytes}
    return math.isclose(c.bytes_sent, c.count * volume.get(c.kind, (p - 1) / p * c.operand_bytes))


def _layer_weights(state: sk.TrainState) -> dict[str, int]:
    """Per-layer element counts of the stacked block matrices (leading axis: the layer)."""
    return {k: math.prod(v.shape[1:]) for k, v in state.params["blocks"].items() if v.ndim > 2}


def test_shape_bytes_reads_the_logical_shape_of_tpu_layouts():
    # T(8,128) tiles pad the buffer in memory, S(1) names a memory space: neither changes the logical bytes
    assert hlo.shape_bytes("bf16[1,512,128]{1,0,2:T(2,128)(2,1)S(1)}") == 512 * 128 * BF16
    assert hlo.shape_bytes("(f32[3,5]{1,0:T(8,128)S(1)}, s32[2]{0:S(4)}, u32[]{:S(2)})") == 15 * F32 + 8 + 4


def _matmul_grad(target: str, spec: str, w_axes=("fsdp",), x_axes=("data", "fsdp")) -> tuple[str, list, int]:
    """The gradient of tanh(x @ w).sum() w.r.t. w [512, 256] (rows over `w_axes`), x [64, 512] (rows over `x_axes`):
    (HLO text, hlo.collectives, hlo.matmul_flops)."""
    mesh = sk.make_mesh(spec, target=target)
    w, x = (jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P(a, None)))
            for s, a in (((512, 256), w_axes), ((64, 512), x_axes)))  # fmt: skip
    loss = lambda w, x: jnp.tanh(jnp.dot(x, w, precision="highest")).sum()
    c = _compile(jax.jit(jax.grad(loss), out_shardings=NamedSharding(mesh, P(w_axes, None))).lower(w, x), mesh)
    return c.as_text(), hlo.collectives(c, mesh), hlo.matmul_flops(c)


def test_fsdp_matmul_gradient_gathers_and_reduce_scatters_the_weight():
    """w [512, 256] sharded 4 ways over fsdp: gathered whole for x @ w, its gradient reduce-scattered back to the
    shards (TPU's `fusion(...), kind=kCustom, calls=%all-reduce-scatter` around an all-reduce), then summed over
    data."""
    text, colls, flops = _matmul_grad("v5e-8", "data=2,fsdp=4")
    assert re.search(r"kind=kCustom, calls=%all-reduce-scatter", text)
    got = {(c.kind, c.axes, c.count, c.result_bytes, c.operand_bytes) for c in colls}
    w = 512 * 256 * F32
    assert got == {("all-gather", ("fsdp",), 1, w, w // 4), ("reduce-scatter", ("fsdp",), 1, w // 4, w),
                   ("all-reduce", ("data",), 1, w // 4, w // 4)}  # fmt: skip
    assert all(_ring(c) for c in colls)
    assert flops == 2 * (2 * (64 // 8) * 512 * 256)  # x @ w and x.T @ dy on this device's 8 rows (convolutions)


def test_across_slices_the_data_all_reduce_is_a_megascale_transfer():
    """On two v5e-8 slices the data axis crosses DCN: XLA:TPU sends the gradient shard through the megascale runtime
    (send/recv with _xla_megascale_transfer_type="ALL_REDUCE"), one all-reduce over data."""
    text, colls, _ = _matmul_grad("v5e-8x2", "data=2,fsdp=8")
    assert '_xla_megascale_transfer_type="ALL_REDUCE"' in text
    (ar,) = _rows(colls, "all-reduce", ("data",))
    assert (ar.group_size, ar.count, ar.operand_bytes) == (2, 1, 512 * 256 * F32 // 8) and _ring(ar)
    (rs,) = _rows(colls, "reduce-scatter", ("fsdp",))
    assert (rs.group_size, rs.operand_bytes, rs.result_bytes) == (8, 512 * 256 * F32, 512 * 256 * F32 // 8)
    # one axis over both slices: the gather of w's 16 row blocks is a DCN gather of 2, then one of 8 in each slice
    text, colls, _ = _matmul_grad("v5e-8x2", "fsdp=16", ("fsdp",), ("fsdp",))
    assert '_xla_megascale_transfer_type="ALL_GATHER"' in text
    (dcn,) = [c for c in _rows(colls, "all-gather", ("fsdp",)) if c.group_size == 2]
    assert (dcn.count, dcn.operand_bytes, dcn.result_bytes) == (1, 512 * 256 * F32 // 16, 512 * 256 * F32 // 8)


def test_fsdp_gathers_each_layer_weight_twice_and_reduce_scatters_its_gradient():
    state, text, colls, _ = _gpt("fsdp", "data=2,fsdp=4")
    # the forms read: async collective fusions (start, overlapped copies, done, one chain_id), scatter fusions
    assert "AsyncCollectiveStart" in text and "AsyncCollectiveDone" in text and "calls=%all-reduce-scatter" in text
    chains = re.findall(r'all-gather\(.*?chain_id="(\d+)"', text)
    assert max(map(chains.count, set(chains))) >= 3, "a chain's collective is written at least 3 times"
    weights = _layer_weights(state)
    gathers = {c.result_bytes: c for c in _rows(colls, "all-gather", ("fsdp",), in_loop=True)}
    for name, n in weights.items():  # forward, and again for the backward: the bf16 weight, counted once a chain
        c = gathers.get(n * BF16)
        assert c is not None, (name, hlo.format_table(colls))
        assert (c.count, c.operand_bytes, c.group_size) == (2 * L, n * BF16 // 4, 4) and _ring(c)
    scatters = _rows(colls, "reduce-scatter", ("fsdp",), in_loop=True)
    sums = {sum(s) for k in range(1, len(weights) + 1) for s in itertools.combinations(weights.values(), k)}
    assert scatters
    for c in scatters:  # the f32 gradients of whole layer weights, once a layer
        assert c.count == L and c.operand_bytes == 4 * c.result_bytes and c.operand_bytes // F32 in sums and _ring(c)
    (data,) = _rows(colls, "all-reduce", ("data",), in_loop=True)  # each layer's gradient shards, summed over data
    assert (data.count, data.operand_bytes) == (L, sum(weights.values()) * F32 // 4)
    head = _rows(colls, "reduce-scatter", ("fsdp",), in_loop=False)
    assert [(c.count, c.operand_bytes) for c in head] == [(1, D * CFG["vocab_size"] * F32)]  # the untied head


def test_tp_all_reduces_the_activations_over_tensor():
    colls = _gpt("tp", "data=2,tensor=4").colls
    act = (B // 2) * S * D * F32  # this data shard's [batch, seq, d_model] partial sums
    (c,) = [c for c in _rows(colls, "all-reduce", ("tensor",), in_loop=True) if c.operand_bytes == act]
    assert (c.count, c.group_size) == (4 * L, 4) and _ring(c)  # attention and MLP outputs, forward and backward
    assert {c.kind for c in colls} == {"all-reduce"}


def test_fsdp_tp_gathers_and_scatters_over_fsdp_and_all_reduces_over_tensor():
    state, _, colls, _ = _gpt("fsdp_tp", "fsdp=4,tensor=2")
    gathers = _rows(colls, "all-gather", ("fsdp",), in_loop=True)
    assert gathers and all(c.count == 2 * L and c.operand_bytes * 4 == c.result_bytes and _ring(c) for c in gathers)
    # each layer weight is split over tensor too: fsdp gathers a tensor shard of it, in bf16
    assert {c.result_bytes for c in gathers} <= {n * BF16 // 2 for n in _layer_weights(state).values()}
    assert [c.count for c in _rows(colls, "reduce-scatter", ("fsdp",), in_loop=True)] == [L]
    (c,) = [c for c in _rows(colls, "all-reduce", ("tensor",), in_loop=True) if c.operand_bytes == B // 4 * S * D * F32]
    assert c.count == 4 * L and c.group_size == 2


@pytest.mark.parametrize("strategy", ["cp_zigzag"])  # cp_ring's ring is the same loop (masks differ, not transfers)
def test_context_parallel_rings_kv_blocks_over_seq(strategy):
    colls = _gpt(strategy, "seq=4,data=2").colls
    perms = [c for c in colls if c.kind == "collective-permute"]
    assert perms and all(c.axes == ("seq",) and c.group_size == 4 and c.in_loop for c in perms)
    block = (B // 2) * CFG["num_kv_heads"] * (S // 4) * CFG["head_dim"]  # one device's K (or V) block
    counts = {c.result_bytes: c.count for c in perms}
    assert set(counts) == {block * BF16, block * F32}  # K, V forward and again backward; dK, dV in f32
    assert counts[block * BF16] == 2 * 2 * L * (4 - 1) and counts[block * F32] % L == 0


def test_tp3d_all_reduces_over_row_and_col():
    colls = _gpt("tp3d", "data=2,row=2,col=2,depth=1").colls
    assert {c.axes for c in colls} == {("row",), ("col",), ("data",)} and all(c.group_size == 2 for c in colls)
    inner = [c for c in colls if c.in_loop and c.kind == "all-reduce" and c.axes in (("row",), ("col",))]
    assert all(c.count % L == 0 for c in inner), hlo.format_table(colls)  # once a layer each
    # a block's 4 linear layers (qkv, out, gate-up, down) each all-reduce forward (over col or row), and backward
    assert sum(c.count for c in inner) >= 4 * 2 * L


def test_ep_all_to_all_dispatches_tokens_over_expert():
    colls = _gpt("ep", "data=2,expert=4", num_experts=4).colls
    (c,) = [c for c in colls if c.kind == "all-to-all"]
    capacity = math.ceil(2 * S * 1.25 / 4)  # top_k 2, capacity factor 1.25, 4 experts: tokens per expert a sequence
    assert (c.axes, c.group_size, c.in_loop) == (("expert",), 4, True)
    assert c.operand_bytes == c.result_bytes == 4 * (B // 8) * capacity * D * BF16  # [experts, batch, capacity, d]
    assert c.count == 4 * L  # dispatch and combine, forward and backward


def test_pipeline_permutes_microbatch_activations_over_stage():
    colls = _gpt("pp_dp", "stage=2,data=4").colls
    (c,) = [c for c in colls if c.kind == "collective-permute"]
    m, p = 2, 2  # GPipe, as many microbatches as stages: m + p - 1 ticks, one hop a tick forward and backward
    assert (c.axes, c.in_loop, c.count) == (("stage",), True, 2 * (m + p - 1))
    assert (
        c.result_bytes == c.operand_bytes == (B // 4 // m) * S * D * F32 and c.bytes_sent == c.count * c.operand_bytes
    )


#: (b, s, e, f) of x [b, s, e] @ w [e, f]; the specs of x, w and the product. Gather: x's s is sharded, the product's
#: f. Scatter: the contraction e is sharded, the product's s.
WINDOWED = {
    "all-gather": ((1, 64, 256, 8192), ((None, "tensor", None), (None, "tensor"), (None, None, "tensor"))),
    "reduce-scatter": ((1, 64, 8192, 64), ((None, None, "tensor"), ("tensor", None), (None, "tensor", None))),
}


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_windowed_einsum_ring_counts_as_the_collective_it_implements(kind):
    """A dot whose unsharded dimension is large (here 8192) gets XLA:TPU's collective matmul: SPMD writes the
    all-gather of x (reduce-scatter of the product) as a loop, `windowed_dot_general_body_ag` (`_rs`), of
    bidirectional collective-permutes: 2 trips x 4 + 1 = 9 block transfers on 8 devices. hlo.py reads the ring as
    one gather (scatter) over tensor with its ring volume."""
    mesh = sk.make_mesh("tensor=8", target="v5e-8")
    (b, s, e, f), (xs, ws, out) = WINDOWED[kind]
    x = jax.ShapeDtypeStruct((b, s, e), jnp.bfloat16, sharding=NamedSharding(mesh, P(*xs)))
    w = jax.ShapeDtypeStruct((e, f), jnp.bfloat16, sharding=NamedSharding(mesh, P(*ws)))
    c = _compile(jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P(*out))).lower(x, w), mesh)
    text, suffix = c.as_text(), {"all-gather": "ag", "reduce-scatter": "rs"}[kind]
    assert f"windowed_dot_general_body_{suffix}" in text and not re.search(r"\b(all-gather|reduce-scatter)\(", text)
    mod = hlo._parse_module(text)
    mult = hlo._multipliers(mod)
    starts = sum(
        mult[n][0] for n, instrs in mod.comps.items() for i in instrs if i.opcode == "collective-permute-start"
    )
    assert starts == 9
    (coll,) = hlo.collectives(c, mesh)
    whole = b * s * (e if kind == "all-gather" else f) * BF16  # x gathered; the product scattered
    assert (coll.kind, coll.axes, coll.group_size, coll.count, coll.in_loop) == (kind, ("tensor",), 8, 1, False)
    assert (coll.result_bytes, coll.operand_bytes) == (
        (whole, whole // 8) if kind == "all-gather" else (whole // 8, whole)
    )
    assert coll.bytes_sent == 7 / 8 * whole
    assert hlo.matmul_flops(c) == 2 * b * s * e * f // 8


def test_replica_groups_map_through_the_executables_devices():
    """Partition i runs on the i-th device the program was compiled for (compile-only TPU devices have no runtime
    executable to ask): a mesh that orders the same devices differently still gets the right axis."""
    mesh = sk.make_mesh("data=2,fsdp=4", target="v5e-8")
    x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("data", "fsdp")))
    c = _compile(jax.jit(lambda a: a.sum(1), out_shardings=NamedSharding(mesh, P("data"))).lower(x), mesh)
    assert re.search(r"replica_groups=mesh\[", c.as_text())
    assert [c.axes for c in hlo.collectives(c, mesh)] == [("fsdp",)]
    other = Mesh(mesh.devices.T.copy(), ("f", "d"))  # the same devices, transposed, renamed
    assert [c.axes for c in hlo.collectives(c, other)] == [("f",)]
    assert [c.axes for c in hlo.collectives(c.as_text(), other)] == [("?",)]  # bare text: partition i = flat[i]


def test_matmul_flops_reads_tpu_convolutions_and_loop_trips():
    """TPU writes a batched dot as a convolution whose batch dimensions are windows over a dilated input
    (`window={size=2x4 stride=1x3 lhs_dilate=2x4}`), inside a while loop with no known_trip_count: a scan of 3
    batched attention-score products is counted exactly."""
    mesh = sk.make_mesh("data=8", target="v5e-8")
    q = jax.ShapeDtypeStruct((3, 16, 4, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    scores = lambda q, k: jax.lax.scan(lambda c, x: (c, jnp.tanh(jnp.einsum("bhqd,bhkd->bhqk", *x))), 0, (q, k))[1]
    c = _compile(jax.jit(scores).lower(q, q), mesh)
    assert "lhs_dilate=" in c.as_text() and "known_trip_count" not in c.as_text()
    assert hlo.matmul_flops(c) == 3 * 2 * (16 // 8) * 4 * 64 * 64 * 32


def test_matmul_flops_of_a_tpu_train_step_equal_xla_cpus():
    """The fsdp GPT step's dots on TPU are convolutions (a dot's free dimensions as windows over padding:
    `window={size=1x4x3 pad=0_0x3_3x2_2 rhs_reversal=0x1x1}`); XLA:CPU compiles the same step with dots. The
    attention stays XLA's here: under splash (a TPU's default block kernel) its dots are inside Mosaic kernels,
    which the HLO does not show (`hlo.matmul_flops` counts the dots XLA compiles)."""
    mesh = sk.make_mesh("data=2,fsdp=4")  # conftest's 8 CPU devices
    step = sk.make_train_step(
        sk.abstract_model(lambda r: GPT(GPTConfig(**CFG), rngs=r)), optax.adamw(1e-3), mesh, "fsdp"
    )
    batch = step.abstract_batch({k: ((B, S), jnp.int32) for k in ("inputs", "targets")})
    cpu = step.lower(step.abstract_state(), batch).compile()
    tpu = _gpt("fsdp", "data=2,fsdp=4")
    assert " dot(" in cpu.as_text() and " dot(" not in tpu.text
    assert tpu.flops == hlo.matmul_flops(cpu) > 0
