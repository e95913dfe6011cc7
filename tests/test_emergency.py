"""shardkit/emergency.py: each process's own shards, saved and restored exactly, refused when they cannot be used.

Pure data movement: restored arrays must equal the saved ones bit for bit, with the target's shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.emergency import LocalCheckpointer


def _state(mesh):
    """A parameter split over fsdp and tensor, one over fsdp (replicated over data and tensor), a bf16 scalar-ish,
    a PRNG key and an int step."""
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    rng = np.random.default_rng(0)
    return {
        "w": put(jnp.asarray(rng.normal(size=(8, 12)), jnp.float32), "fsdp", "tensor"),
        "b": put(jnp.asarray(rng.normal(size=(8,)), jnp.bfloat16), "fsdp"),
        "key": put(
            jax.random.key(3),
        ),
        "step": put(jnp.int32(7)),
    }


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_saved_shards_restore_bit_for_bit_and_damage_or_another_mesh_is_refused(tmp_path):
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    state = _state(mesh)
    local = LocalCheckpointer(tmp_path, keep=2)
    for step in (2, 4, 6):
        local.save(state, {"seed": 0}, step=step)
    assert local.steps() == [4, 6]  # keep=2
    target = _abstract(state)
    assert local.newest_common(target) == 6 and local.newest_common(target, newer_than=6) is None
    restored, meta = local.restore(target, 6)
    assert meta == {"seed": 0}
    for name in ("w", "b", "step"):
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(state[name]))
        assert restored[name].sharding == state[name].sharding
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    # replicas are written once: w's 8 devices hold 4 distinct shards
    manifest = (tmp_path / "p0" / "6" / "manifest.json").read_text()
    assert manifest.count('"index"') == 4 + 2 + 1 + 1
    # a flipped byte: step 6 is unusable, 4 is the newest common step
    data = tmp_path / "p0" / "6" / "shards.bin"
    raw = bytearray(data.read_bytes())
    raw[5] ^= 1
    data.write_bytes(bytes(raw))
    assert "CRC-32" in local.why_unusable(target, 6) and local.newest_common(target) == 4
    # another mesh: not these shards (the global checkpoint reshards instead)
    other = _abstract(_state(sk.make_mesh("data=1,fsdp=4,tensor=2")))
    assert "mesh" in local.why_unusable(other, 4) and local.newest_common(other) is None
    with pytest.raises(sk.ShardkitError, match="keep=0"):
        LocalCheckpointer(tmp_path, keep=0)
