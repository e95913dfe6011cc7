"""A v5p-128 target is the 4x4x4 torus it is: its devices in the order MaxText's mesh gives them, and its 64-chip
collectives compiled on the wraparound links (shardkit/targets.py `wraparound`). Compiled by XLA's TPU compiler
(libtpu, from the dev extras) on this CPU-only machine; nothing runs on a TPU.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.costmodel import CommBuilder
from shardkit.costmodel.torus import as_compiled, torus_slice
from shardkit.hlo import collectives
from shardkit.targets import wraparound


@pytest.mark.parametrize(
    "topology, wrap",
    [
        ("v5:4x4x4", (True, True, True)),  # v5p-128: a full cube closes its rings
        ("v5:4x4x8", (True, True, True)),
        ("v4:4x4x4", (True, True, True)),
        ("v5:2x4x4", None),  # v5p-64: an open mesh (libtpu's default)
        ("v5:2x2x1", None),
        ("v5e:2x4", None),  # v5e-8
        ("v5e:8x16", (False, True, False)),  # v5e-128: the pod-wide side wraps
        ("v6e:16x16", (True, True, False)),
    ],
)
def test_wraparound_follows_the_slice_shape(topology, wrap):
    assert wraparound(topology) == wrap


def test_one_axis_mesh_on_v5p_128_is_maxtexts_device_order():
    """MaxText's train_compile builds its mesh with `create_device_mesh` over its 12 axes, all but fsdp of size 1
    (ici_fsdp_parallelism=-1); shardkit's 1-axis mesh lists the same devices in the same order."""
    tgt = sk.target("v5p-128")
    ours = [d.id for d in sk.make_mesh("fsdp=64", target=tgt).devices.flat]
    maxtext_shape = [1, 1, 1, 64] + [1] * 8  # diloco, data, stage, fsdp, fsdp_transpose, context, ..., autoregressive
    theirs = [d.id for d in mesh_utils.create_device_mesh(maxtext_shape, tgt.devices).flat]
    assert ours == theirs
    assert sorted(ours) == list(range(64))


def test_fsdp_over_64_chips_gathers_weights_with_all_gathers():
    """On the torus, a weight sharded over all 64 chips is all-gathered (on the open mesh libtpu assumes without
    `wrap`, the compiler wrote the same gather as an all-reduce of a zero-padded buffer)."""
    mesh = sk.make_mesh("fsdp=64", target="v5p-128")
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
    x = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    text = jax.jit(lambda w, x: x @ w.astype(jnp.bfloat16)).lower(w, x).compile().as_text()
    ops = re.findall(r"= \S+ (all-gather|all-reduce)(?:-start)?\(", text)
    assert ops and set(ops) == {"all-gather"}, ops


@pytest.mark.parametrize(
    "axes, spec, compiled",
    [
        ("fsdp=64", P("fsdp", None), "all-reduce"),  # the whole slice: kept as an all-reduce
        ("data=4,fsdp=16", P(None, "fsdp"), "reduce-scatter"),  # a 4x4 face: fused
        ("data=2,fsdp=32", P(None, "fsdp"), "all-reduce"),  # 4x4x2, all three dimensions, along the last dim
        ("data=2,fsdp=32", P("fsdp", None), "reduce-scatter"),  # the same group, along the first dim
    ],
)
def test_gradient_reduce_scatter_is_what_the_cost_model_predicts(axes, spec, compiled):
    """A weight's gradient scattered over fsdp on the v5p-128 torus, at the 7B's wo shape (4096 x 4096, bf16 dot,
    4096 tokens a chip): the collective XLA emits is the one the cost model's rule (shardkit/costmodel/torus.py)
    names for the row a cost model writes for that gradient."""
    mesh = sk.make_mesh(axes, target="v5p-128")
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=NamedSharding(mesh, spec))
    x = jax.ShapeDtypeStruct((4096 * 64, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P(mesh.axis_names, None)))
    grad = jax.grad(lambda w, x: jnp.sum((x @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2))
    program = jax.jit(grad, out_shardings=w.sharding).lower(w, x).compile()
    reductions = ("all-reduce", "reduce-scatter")  # the gradient's (the forward moves w with gathers or permutes)
    got = {c.kind for c in collectives(program, mesh) if c.axes == ("fsdp",) and c.kind in reductions}
    b = CommBuilder(dict(mesh.shape), ("fsdp", "data"), "tpu")
    b.add("reduce-scatter", "fsdp", 4096 * 4096 * 2, 1, "gradient", gspmd=True, last_dim=spec[1] == "fsdp")
    predicted = {c.kind for c in as_compiled(b.comms(), torus_slice(mesh))}
    assert got == predicted == {compiled}, (got, predicted)
