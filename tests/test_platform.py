"""Every platform decision is made for the devices a program is compiled for (`sk.rules.platform_family`), never
for this host's backend: the same train step compiled for this session's 8 CPU devices and for a v5e-8 TPU target
(compile-only devices, libtpu's compiler, no TPU) gets each platform's own choice.

- ring attention's default chunk (shardkit/parallel/context/chunking.py): 128 on CPU, 512 on TPU, read from what the
  kernel resolves and from the compiled program's [.., chunk, chunk] score tiles;
- the MoE grouped matmul (`moe=ragged`, shardkit/parallel/moe/ragged.py): "tiled" on CPU, `ragged_dot` on TPU,
  whose TPU lowering shows as `ragged-dot` custom calls;
- attention=cudnn is refused on a TPU target naming the mesh's platform, 'tpu', not the host's 'cpu';
- inside a `shard_map` body, on an abstract mesh (a pipeline stage's), and for a step's up-front kernel check
  (`compiling_for`) the answer is the mesh's platform, and the remat offload check asks the mesh's devices: the
  TPU program offloads the tagged activations, the CPU mesh is refused.

Tiny models (2 layers, d_model 64), one compile per platform and check: about 14 s on 2 cores (cold compile cache).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from models.gpt import GPT, GPTConfig
from shardkit.parallel.context import ring
from shardkit.parallel.moe import ragged as moe_ragged
from shardkit.rules import compile_devices, compiling_for, platform_family, use_rules

ROOT = Path(__file__).resolve().parent.parent
TARGET = "v5e-8"
# seq 1024 over seq=2: blocks of c = 512 tokens, so the preferred chunk (128 on CPU, 512 on TPU) divides them
RING = GPTConfig(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128, vocab_size=128,
                 max_seq_len=1024)  # fmt: skip
MOE = GPTConfig(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=64, vocab_size=128,
                max_seq_len=32, num_experts=4, top_k=2)  # fmt: skip


def mesh_for(spec: str, platform: str) -> jax.sharding.Mesh:
    return sk.make_mesh(spec) if platform == "cpu" else sk.make_mesh(spec, target=TARGET)


def lowered(cfg: GPTConfig, strategy: object, mesh: jax.sharding.Mesh, batch: int, seq: int) -> jax.stages.Lowered:
    """The train step of the abstract GPT on `mesh`, lowered for ShapeDtypeStructs (nothing runs on a target)."""
    step = sk.make_train_step(sk.abstract_model(lambda rngs: GPT(cfg, rngs=rngs)), optax.sgd(0.1), mesh, strategy)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=step.batch_sharding)
    return step.lower(step.abstract_state(), {"inputs": tokens, "targets": tokens})


def test_ring_chunk_is_chosen_for_the_mesh_devices(monkeypatch):
    """The XLA scan's chunk (a TPU's default block kernel here would be splash: the scan is asked for)."""
    scan = sk.strategy("cp_ring").replace(kernels={**sk.strategy("cp_ring").kernels, "attention_block": "xla"})
    chunks: list[int] = []
    resolve = ring.resolve_chunk
    monkeypatch.setattr(ring, "resolve_chunk", lambda *a: chunks.append(resolve(*a)) or chunks[-1])
    got = {}
    for platform in ("cpu", "tpu"):
        chunks.clear()
        text = lowered(RING, scan, mesh_for("data=4,seq=2", platform), 4, 1024).compile().as_text()
        tiles = {int(n) for n in re.findall(r"\[[0-9,]*?,(128|256|512),\1\]", text)}  # [.., chunk, chunk] scores
        got[platform] = set(chunks), tiles
    assert got == {"cpu": ({128}, {128}), "tpu": ({512}, {512})}, got


def test_moe_grouped_matmul_is_chosen_for_the_mesh_devices(monkeypatch):
    tiled: list[tuple[int, ...]] = []
    tiles_dot = moe_ragged._tiles_dot
    monkeypatch.setattr(moe_ragged, "_tiles_dot", lambda xt, *a: tiled.append(xt.shape) or tiles_dot(xt, *a))
    strategy = sk.strategy("ep").replace(kernels={"moe": "ragged"})
    got = {}
    for platform in ("cpu", "tpu"):
        tiled.clear()
        low = lowered(MOE, strategy, mesh_for("data=2,expert=4", platform), 8, 32)
        text = low.compile().as_text()
        got[platform] = bool(tiled), "ragged_dot" in low.as_text(), "ragged-dot" in text
    # CPU: the tiled grouped matmul, no ragged_dot anywhere; TPU: ragged_dot, compiled to TPU ragged-dot kernels
    assert got == {"cpu": (True, False, False), "tpu": (False, True, True)}, got


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_cudnn_is_refused_naming_the_mesh_platform(platform):
    cfg = GPTConfig(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128, vocab_size=128,
                    max_seq_len=32, dtype="bfloat16")  # fmt: skip
    strategy = sk.strategy("fsdp").replace(kernels={"attention": "cudnn"})
    with pytest.raises(sk.ShardkitError, match=rf"NVIDIA GPUs only.*the mesh's '{platform}' devices.*attention=dense"):
        lowered(cfg, strategy, mesh_for("fsdp=8", platform), 8, 32)


def test_shard_map_bodies_abstract_meshes_and_up_front_checks_get_the_mesh_platform(monkeypatch):
    cpu, tpu = sk.make_mesh("seq=8"), sk.make_mesh("seq=8", target=TARGET)
    assert jax.default_backend() == "cpu" and platform_family() == "cpu"  # no mesh anywhere: the host's
    assert [platform_family(m) for m in (cpu, cpu.abstract_mesh, tpu, tpu.abstract_mesh)] == ["cpu"] * 2 + ["tpu"] * 2
    assert platform_family(tpu.abstract_mesh) == "tpu"
    with use_rules(tpu, {}), use_rules(tpu.abstract_mesh, {}):  # a pipeline stage's context inside the step's
        assert platform_family() == "tpu" and compile_devices() == list(tpu.devices.flat)
        assert sk.layers.remat_policy("offload:attn_out") is not None  # TPU devices have pinned_host
    with use_rules(tpu.abstract_mesh, {}):  # a hetero / sdp worker's context: no concrete mesh known
        assert platform_family() == "tpu" and compile_devices() == []
        assert sk.layers.remat_policy("offload:attn_out") is not None

    seen = []
    body = lambda x: seen.append(platform_family()) or x
    sds = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(tpu, P("seq")))
    jax.jit(jax.shard_map(body, mesh=tpu, in_specs=P("seq"), out_specs=P("seq"))).lower(sds)
    assert seen == ["tpu"]

    # the ring kernel on an abstract TPU mesh (as inside a shard_map) takes TPU's chunk
    chunks = []
    resolve = ring.resolve_chunk
    monkeypatch.setattr(ring, "resolve_chunk", lambda *a: chunks.append(resolve(*a)) or chunks[-1])
    qkv = jax.ShapeDtypeStruct((1, 8 * 512, 2, 32), jnp.float32, sharding=NamedSharding(tpu, P(None, "seq")))
    jax.jit(lambda q, k, v: ring.ring_attention(q, k, v, mesh=tpu.abstract_mesh, axis="seq")).lower(qkv, qkv, qkv)
    assert chunks == [512]

    # a strategy's kernel table checked up front: for the step's mesh under compiling_for, the host's without one
    with pytest.raises(sk.ShardkitError, match=r"'cpu' backend cannot offload activations"):
        sk.kernels.check({"remat": "offload:attn_out"})
    with compiling_for(tpu):
        sk.kernels.check({"remat": "offload:attn_out"})
        assert platform_family() == "tpu"


def test_remat_offload_is_checked_against_the_target_devices_and_offloads_there():
    """`remat=offload:...` is refused for CPU devices (XLA:CPU compiles the moves away: tests/test_offload.py) and
    accepted for the TPU target's, whose compiled program keeps the tagged activations in host memory (S(5)).
    The step checks its kernel table for its own mesh (TrainStep: `compiling_for(mesh)`), before it traces."""
    cfg = GPTConfig(num_layers=2, d_model=64, num_heads=2, num_kv_heads=2, head_dim=32, mlp_dim=128, vocab_size=128,
                    max_seq_len=32)  # fmt: skip
    strategy = sk.strategy("fsdp").replace(kernels={"remat": "offload:attn_out,mlp_in"})
    cpu, tpu = mesh_for("fsdp=8", "cpu"), mesh_for("fsdp=8", "tpu")
    with pytest.raises(sk.ShardkitError, match=r"'cpu' backend cannot offload activations"):
        lowered(cfg, strategy, cpu, 8, 32)
    with sk.targets.cache_off_for(tpu):
        text = lowered(cfg, strategy, tpu, 8, 32).compile().as_text()
    assert "S(5)" in text


def _default_backend_calls(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of every `*.default_backend` reference in a source file."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            if isinstance(child, ast.Attribute) and child.attr == "default_backend":
                found.append((child.lineno, where))
            if isinstance(child, ast.Name | ast.alias) and "default_backend" in getattr(child, "id", "") + getattr(
                child, "name", ""
            ):
                found.append((child.lineno, where))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_platform_decision_reads_the_host_backend():
    calls = {
        (str(p.relative_to(ROOT)), line, fn)
        for p in sorted((ROOT / "shardkit").rglob("*.py"))
        for line, fn in _default_backend_calls(p)
    }
    assert calls == set(), sorted(calls)  # every decision reads devices: rules.platform_family's meshes


def test_the_platform_family_is_read_in_one_place():
    """`rules.platform_family` is the one reader of a mesh's device platform: "cuda" / "rocm" (plugins' names) are
    "gpu", and no other module (but the targets, which ask a plugin for devices by its name) reads `.platform` off
    a mesh's devices or spells the GPU platforms itself."""
    from shardkit.rules import family

    assert [family(p) for p in ("cpu", "gpu", "cuda", "rocm", "tpu")] == ["cpu", "gpu", "gpu", "gpu", "tpu"]
    spelled = re.compile(r"devices\.flat\[0\]\.platform|[\"']cuda[\"']|[\"']rocm[\"']")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "shardkit").rglob("*.py"))
        if p.name not in ("rules.py", "targets.py", "targets_gpu.py")  # the targets name the PJRT plugins they ask
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if spelled.search(line)
    ]
    assert found == [], found
