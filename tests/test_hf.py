"""Hugging Face checkpoints in and out (models/hf): logits against transformers' own, shard-only reads, round trip.

The references in tests/assets/hf/<family>/ were written once by transformers itself
(experiments/reference/make_hf_assets.py, versions in each reference.json): no torch here.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk
from models import hf
from models.gpt import lm_loss
from models.hf import config as hf_config
from models.hf import layout
from tests.conftest import ROOT

ASSETS = ROOT / "tests" / "assets" / "hf"
FAMILIES = ("llama", "mistral", "qwen2", "gemma")
MESHES = {"dp": "data=8", "fsdp": "data=2,fsdp=4", "tp": "data=4,tensor=2", "pp_dp": "stage=2,data=4",
          "cp_zigzag": "data=4,seq=2"}  # fmt: skip


def _logits_loss(model, batch):
    return lm_loss(model, batch), {"logits": model(batch["inputs"], positions=batch["positions"])}


@pytest.mark.parametrize(
    "family,strategy",
    [("llama", "dp"), ("llama", "cp_zigzag")] + [(f, s) for f in FAMILIES for s in ("fsdp", "tp", "pp_dp")],
)
def test_logits_match_transformers(family: str, strategy: str) -> None:
    """The model the strategy's train step runs (its compute rules; pp_dp: the GPipe kernel over 2 stages;
    cp_zigzag: ring attention over the sequence laid out zigzag, with its positions) gives transformers' fp32 logits
    to 1e-4 (logits ~ N(0, 1.1); seen: <= 5e-6, XLA's and torch's reduction orders and RoPE angles in fp32)."""
    ref = np.load(ASSETS / family / "logits.npz")
    mesh = sk.make_mesh(MESHES[strategy])
    model, _ = hf.from_pretrained(ASSETS / family, mesh, strategy)
    step = sk.make_train_step(model, optax.sgd(0.0), mesh, strategy, loss_fn=_logits_loss)
    layout, ring = sk.kernels.batch_layout(step.strategy, mesh)  # what the data loader lays out (cp_*)
    perm = sk.attention.layout_perm(layout, ref["tokens"].shape[1], ring)
    tokens = np.tile(ref["tokens"], (4, 1))[:, perm]  # 8 rows: every batch axis divides it
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "positions": np.broadcast_to(perm, tokens.shape)}
    _, aux = step.evaluate(step.init_state(model).params, {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()})
    got = np.asarray(aux["logits"])
    np.testing.assert_allclose(got, np.tile(ref["logits"], (4, 1, 1))[:, perm], atol=1e-4, rtol=0)


def _tensors(folder) -> dict[str, np.ndarray]:
    reader = hf.Reader(folder)
    return {k: reader.read(k, ()) for k in reader.shapes}


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_exact(family: str, tmp_path) -> None:
    """HF -> GPT sharded under fsdp_tp -> HF: every tensor the same bytes, in several files with an index; the
    config maps back to the same GPTConfig."""
    mesh = sk.make_mesh("fsdp=4,tensor=2")
    model, cfg = hf.from_pretrained(ASSETS / family, mesh, "fsdp_tp")
    kind = json.loads((ASSETS / family / "config.json").read_text())["model_type"]
    files = hf.save_pretrained(model, cfg, tmp_path, model_type=kind, max_shard_bytes=50_000)
    assert (tmp_path / "model.safetensors.index.json") in files and len(files) >= 4
    before, after = _tensors(ASSETS / family), _tensors(tmp_path)
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].tobytes() == value.tobytes(), name
    assert hf.read_config(tmp_path) == cfg


def test_both_rope_spellings_and_errors() -> None:
    """transformers 4.x's top-level rope_theta / rope_scaling ("type" or "rope_type") read as 5.x's
    rope_parameters; every field the GPT cannot reproduce is refused by name and value."""
    new = json.loads((ASSETS / "llama" / "config.json").read_text())
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    params = dict(new["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    assert hf.to_gpt(old) == hf.to_gpt(new)
    assert hf.to_gpt(new).rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    bad = [
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("quantization_config", {"quant_method": "gptq"}, "quantization_config={'quant_method': 'gptq'}"),
        ("attention_bias", True, "attention_bias=True"),
        ("model_type", "phi3", "model_type='phi3'"),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_parameters.rope_type='yarn'"),
        ("layer_types", ["full_attention", "sliding_attention"], "layer_types=['full_attention', 'sliding_"),
    ]
    for field, value, said in bad:
        with pytest.raises(sk.ShardkitError, match=re.escape(f"Hugging Face config field {said}")):
            hf.to_gpt({**new, field: value})
    gemma = json.loads((ASSETS / "gemma" / "config.json").read_text())  # 4.x: tanh's GELU named hidden_activation
    assert hf.to_gpt({**gemma, "hidden_act": "gelu", "hidden_activation": "gelu_pytorch_tanh"}) == hf.to_gpt(gemma)
    with pytest.raises(sk.ShardkitError, match=re.escape("hidden_act='gelu': gemma as the GPT reproduces it has")):
        hf.to_gpt({**gemma, "hidden_act": "gelu"})  # exact GELU in transformers 5, tanh's in 4.x: refused


def test_each_shard_reads_only_its_bytes(monkeypatch) -> None:
    """Every distinct shard a device holds is read once, and exactly its bytes (file dtype x its elements), under
    fsdp_tp (everything split) and dp (everything replicated: each tensor read once for the 8 devices)."""
    calls = []
    block = layout.block

    def counted(path, cfg, read, box):
        start = sum(reader.bytes_read.values())
        out = block(path, cfg, read, box)
        calls.append((path, box, sum(reader.bytes_read.values()) - start, out.size * 4))  # fp32 files
        return out

    monkeypatch.setattr(layout, "block", counted)
    file_bytes = sum(math.prod(s) * 4 for s in hf.Reader(ASSETS / "qwen2").shapes.values())
    for strategy, spec in (("fsdp_tp", "fsdp=4,tensor=2"), ("dp", "data=8")):
        calls.clear()
        reader = hf.Reader(ASSETS / "qwen2")
        mesh = sk.make_mesh(spec)
        model = hf.load_params(ASSETS / "qwen2", hf.read_config(ASSETS / "qwen2"), mesh, strategy, reader=reader)
        assert calls and all(read == held for _, _, read, held in calls), [c for c in calls if c[2] != c[3]]
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for path, x in jax.tree_util.tree_leaves_with_path(params):  # one read per distinct shard of each
            distinct = {str(s.index) for s in x.addressable_shards}
            name = "/".join(str(k.key) for k in path)
            assert sum(1 for c in calls if c[0] == name) == len(distinct), name
        if strategy == "dp":  # one read per tensor for all 8 devices: the file, once
            assert sum(reader.bytes_read.values()) == file_bytes
        else:  # 8 distinct shards of the split parameters; the tied head is the embedding (no lm_head tensor)
            assert sum(1 for p, *_ in calls if p == "blocks/wqkv") == 8


def test_missing_and_extra_tensors(tmp_path) -> None:
    """A folder whose tensors disagree with its config.json is refused before anything is placed."""
    shutil.copytree(ASSETS / "qwen2", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
    with pytest.raises(sk.ShardkitError, match=r"lm_head\.weight \(264, 32\) is missing"):
        hf.from_pretrained(tmp_path / "m", sk.make_mesh("data=8"), "dp")
    with pytest.raises(sk.ShardkitError, match="model_type='qwen2' with qkv_bias=False"):
        hf_config.to_hf(hf.to_gpt(cfg, qkv_bias=False), "qwen2")


def test_cli_fine_tunes_from_the_folder(tmp_path) -> None:
    """`init_from=hf:<dir>` (experiments/configs/llama_tiny_finetune.py, shortened): the first step's loss is the
    folder's model's loss on that batch (its weights, not a random init), and the loss falls; the run exports
    (`python -m experiments.export`) to a folder holding exactly its trained parameters."""
    from common import override

    from experiments import train as tr
    from experiments.configs import llama_tiny_finetune

    short = {"steps": 8, "batch_size": 8, "seq_len": 32, "eval_every": 0, "optimizer.warmup_steps": 1,
             "optimizer.lr": 1e-2, "data.max_files": 60, "progress": False, "jax_cache_dir": "",
             "run_dir": str(tmp_path / "runs"), "data.cache_dir": str(tmp_path / "data")}  # fmt: skip
    config = override(llama_tiny_finetune.get_config(), short)
    run = tr.build(config)
    assert hf_config.architecture(run.model_cfg) == hf_config.architecture(hf.read_config(ASSETS / "llama"))
    model, _ = hf.from_pretrained(ASSETS / "llama", run.mesh, run.step.strategy)
    first = float(jax.jit(lm_loss)(model, run.task.train_batch(run.step, 0)))
    summary = tr.train(config)
    losses = summary["losses"]
    assert abs(losses[0] - first) < 1e-5 * first, (losses[0], first)
    assert losses[-1] < losses[0] - 1.0, losses
    # python -m experiments.export: the run's last checkpoint as a folder that loads back to the same parameters
    from experiments import export, sample

    assert export.main(["--run", summary["run_dir"], "--to", str(tmp_path / "out"), "--max_shard_mb", "0.05"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"  # init_from's family
    trained = nnx.to_pure_dict(nnx.state(sample.load(summary["run_dir"])[0], nnx.Param))
    back, _ = hf.from_pretrained(tmp_path / "out", sk.make_mesh("data=1", jax.devices()[:1]), "dp")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(back, nnx.Param)), trained)


_TWO_PROCESSES = """
import json, os, sys
import jax
env = os.environ
jax.distributed.initialize(env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"]),
                           initialization_timeout=60)
import numpy as np
from flax import nnx
import shardkit as sk
from models import hf
path = sys.argv[1]
reader = hf.Reader(path)
mesh = sk.make_mesh("fsdp=8")  # both processes' 4 devices
model = hf.load_params(path, hf.read_config(path), mesh, "fsdp", reader=reader)
held = 0
for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param))):  # this process's distinct shards
    held += sum({str(s.index): s.data.size * 4 for s in x.addressable_shards}.values())
ref = np.load(f"{path}/logits.npz")
out = jax.jit(lambda m, t: m(t), out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(
    model, np.tile(ref["tokens"], (4, 1)))
diff = float(np.abs(np.asarray(out.addressable_data(0))[:2] - ref["logits"]).max())
print("RESULT", json.dumps({"read": sum(reader.bytes_read.values()), "held": held, "diff": diff}))
"""


@pytest.mark.slow
def test_two_processes_each_read_their_own_bytes() -> None:
    """2 processes x 4 CPU devices (jax.distributed on 127.0.0.1), fsdp over all 8: each process reads exactly the
    bytes of the distinct shards its devices hold (about half the file), and the model gives transformers' logits."""
    import subprocess
    import sys

    from experiments.launch_local import child_env, free_port

    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(ASSETS / "qwen2")], cwd=ROOT,
                              env=child_env(pid, 2, 4, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].split("RESULT", 1)[1]) for o in outs]
    file_bytes = sum(math.prod(s) * 4 for s in hf.Reader(ASSETS / "qwen2").shapes.values())
    for r in results:
        assert r["read"] == r["held"] < 0.6 * file_bytes and r["diff"] < 1e-4, r
    assert sum(r["read"] for r in results) >= file_bytes  # between them, every byte (the replicated biases twice)


def test_bf16_checkpoint_round_trips_through_fp32_parameters(tmp_path) -> None:
    """A bf16 checkpoint (as the Hub's are) loads into fp32 parameters exactly (bf16 -> fp32 is exact) and exports
    back to the same bf16 bytes; the config says bfloat16."""
    import ml_dtypes
    from safetensors.numpy import save_file

    src = tmp_path / "bf16"
    src.mkdir()
    shutil.copy(ASSETS / "llama" / "config.json", src / "config.json")
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(ASSETS / "llama").items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    model, cfg = hf.from_pretrained(src, sk.make_mesh("data=2,fsdp=4"), "fsdp")
    assert model.embed[...].dtype == jnp.float32
    hf.save_pretrained(model, cfg, tmp_path / "out", dtype="bfloat16")
    before, after = _tensors(src), _tensors(tmp_path / "out")
    assert after.keys() == before.keys()
    assert all(after[k].dtype == ml_dtypes.bfloat16 and after[k].tobytes() == v.tobytes() for k, v in before.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
