"""Documents in prepared data: segment ids and positions from the end-of-document tokens; the loader's batches are a
pure function of (seed, step) and exact under every sequence layout; a packed row computes what its documents
compute alone, on one device and under context and pipeline parallelism.

Tolerance of the packed-vs-alone losses: 1e-5 relative + 1e-5 absolute on per-token cross-entropies of ~10 nats
(up to 18: the larger init makes logits of magnitude ~20), fp32. A packed row and the same document alone sum the
same attention terms (the other documents' scores get exactly zero weight) and RoPE sees the same position
differences, but in other orders and blockings (a ring's online softmax over chunks, other matmul shapes):
rounding only, a few u (6e-8) of a logit's magnitude per reduction. Measured: 0 on one device and under pp,
8.6e-6 under cp_zigzag and cp_usp (5e-7 of the largest loss). A token that sees across a boundary moves far more:
the control (the same packed rows without segment ids) differs from the documents alone by 9.5 nats.
Layouts: the loader test checks the batch of every layout exactly; the model runs under cp_zigzag (ring), cp_usp
(Ulysses x zigzag ring) and pp; tests/test_context_parallel.py checks each kernel's segment ids against dense
attention (ring contiguous / zigzag / striped, Ulysses, USP).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import TINY

import shardkit as sk
from experiments.data import prepare, text
from experiments.data import tokens as shards
from models.gpt import GPT

T = 32
EOD = 256
# larger init than TINY's 0.02, so that a token's loss depends clearly on what it attends to (the control below)
CFG = dataclasses.replace(TINY, vocab_size=384, max_seq_len=T, init_std=0.3)
TOL = 1e-5  # relative and absolute: see the module docstring
MESHES = {"dp": "data=1", "cp_zigzag": "data=2,seq=4", "cp_usp": "data=2,seq_u=2,seq_r=2", "pp": "stage=2"}


def _reference_documents(window: np.ndarray) -> tuple[list[int], list[int]]:
    """The docstring's rule, one token at a time: a segment starts at each end-of-document input."""
    seg, pos, s, start = [], [], 0, 0
    for j, t in enumerate(window):
        if t == EOD:
            s, start = s + 1, j
        seg.append(s)
        pos.append(j - start)
    return seg, pos


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-tokenized documents of 0..16 bytes in several shards (some shorter than a window, some empty)."""
    root = tmp_path_factory.mktemp("documents")
    rng = np.random.default_rng(0)
    docs = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(0, 17))) for _ in range(300)]
    (root / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    opts = prepare.Options("byte", chunk_bytes=256)
    prepare.prepare(str(root / "d.jsonl"), root / "out", opts, workers=1, progress=False)
    return root / "out"


def _stream(out: Path, split: str) -> np.ndarray:
    m = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.fromfile(out / s["name"], "<u2") for s in m["shards"] if s["split"] == split])


def test_segment_ids_and_positions_of_a_window() -> None:
    w = np.array([[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, 1, 2, 3, 4, 5, 6, 7]])
    seg, pos = shards.documents(w, EOD)
    np.testing.assert_array_equal(seg, [[0, 0, 1, 1, 2, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(pos, [[0, 1, 0, 1, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("layout", ["none", "contiguous", "zigzag", "striped"])
def test_batches_are_a_function_of_seed_and_step_and_exact_in_every_layout(prepared: Path, layout: str) -> None:
    ds = shards.load_prepared(prepared)
    stream, b = _stream(prepared, "train"), 8
    assert len(ds.manifest["shards"]) > 4 and len(ds.train) == len(stream)
    mesh = sk.make_mesh("data=2,seq=4")
    spec = jax.sharding.PartitionSpec("data", None if layout == "none" else "seq")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    perm = None if layout in ("none", "contiguous") else sk.attention.layout_perm(layout, T, 4)
    for step in (0, 7):
        got = shards.global_batch(ds, step, b, T, sharding, seed=3, perm=perm, eod=EOD)
        again = shards.global_batch(ds, step, b, T, sharding, seed=3, perm=perm, eod=EOD)
        offsets = text.batch_offsets(len(stream), step, b, T, 3)
        windows = np.stack([stream[o : o + T + 1] for o in offsets]).astype(np.int32)
        docs = [_reference_documents(w[:-1]) for w in windows]
        want = {"inputs": windows[:, :-1], "targets": windows[:, 1:], "positions": np.array([d[1] for d in docs]),
                "segment_ids": np.array([d[0] for d in docs])}  # fmt: skip
        if perm is not None:
            want = sk.attention.layout_batch(want, layout, 4)
        assert set(got) == set(shards.BATCH_KEYS)
        for k in shards.BATCH_KEYS:
            np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
            np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(got[k]))
            assert got[k].sharding == sharding
    assert not np.array_equal(np.asarray(got["inputs"]), np.asarray(shards.global_batch(
        ds, 8, b, T, sharding, seed=3, perm=perm, eod=EOD)["inputs"]))  # fmt: skip
    # the shards read as one stream, windows across shard boundaries included
    np.testing.assert_array_equal(ds.train[np.arange(len(stream))], stream)
    i = np.arange(len(stream) - T)[:, None] + np.arange(T + 1)
    np.testing.assert_array_equal(ds.train[i], stream[i])


def _per_token(model: GPT, batch: dict) -> tuple[jax.Array, dict]:
    """(mean cross-entropy, {"ce": per-token cross-entropies [B, T]}) in the batch's column order."""
    extra = {k: batch[k] for k in ("positions", "segment_ids") if k in batch}
    logits = model(batch["inputs"], **extra)
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    return ce.mean(), {"ce": ce}


def _step(name: str) -> sk.TrainStep:
    spec = MESHES[name]
    n = int(np.prod([int(kv.split("=")[1]) for kv in spec.split(",")]))
    mesh = sk.make_mesh(spec, jax.devices()[:n])
    model = sk.sharded_init(lambda rngs: GPT(CFG, rngs=rngs), mesh, name, seed=0)
    return sk.make_train_step(model, optax.sgd(0.1), mesh, name, loss_fn=_per_token)


@pytest.fixture(scope="module")
def alone(prepared: Path) -> tuple[np.ndarray, list[tuple[int, int, int, int]], np.ndarray]:
    """(window offsets, segments (row, start, end, k), per-token losses of each segment run alone as row k).

    A document alone is its own row from position 0, padded at the end (causal: padding changes nothing before it)
    and run on one device without segment ids."""
    stream = _stream(prepared, "train")
    offsets = np.array([0, 5, 17, 40, 63, 100, 131, 170])  # starts at, before and inside documents
    segments, rows = [], []
    for r, o in enumerate(offsets):
        seg = np.array(_reference_documents(stream[o : o + T])[0])
        for s in np.unique(seg):
            start, end = np.flatnonzero(seg == s)[[0, -1]] + [0, 1]
            row = np.zeros(T + 1, np.int32)
            row[: end - start + 1] = stream[o + start : o + end + 1]
            segments.append((r, int(start), int(end), len(rows)))
            rows.append(row)
    assert len(segments) > 2.5 * len(offsets)  # several documents per row
    rows = np.stack(rows)
    step = _step("dp")
    _, aux = step.evaluate(step.init_state(), {"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    return offsets, segments, np.asarray(aux["ce"])


@pytest.mark.parametrize("name", list(MESHES))
def test_a_packed_row_computes_each_document_as_if_alone(prepared: Path, alone: tuple, name: str) -> None:
    offsets, segments, alone_ce = alone
    ds = shards.load_prepared(prepared)
    step = _step(name)
    layout, n = sk.kernels.batch_layout(step.strategy, step.mesh)
    perm = None if layout == "contiguous" else sk.attention.layout_perm(layout, T, n)
    batch = shards.batch_at(ds.train, offsets, T, step.batch_sharding, perm, EOD)
    state = step.init_state()
    ce = np.asarray(step.evaluate(state, batch)[1]["ce"])
    if perm is not None:
        ce = ce[:, np.argsort(perm)]  # back to window order
    for r, start, end, k in segments:
        np.testing.assert_allclose(ce[r, start:end], alone_ce[k, : end - start], atol=TOL, rtol=TOL)
    if name == "dp":  # the control: without segment ids, tokens after a boundary see the previous documents
        crossed = {k: v for k, v in batch.items() if k in ("inputs", "targets")}
        ce = np.asarray(step.evaluate(state, crossed)[1]["ce"])
        worst = max(np.abs(ce[r, s:e] - alone_ce[k, : e - s]).max() for r, s, e, k in segments)
        assert worst > 1e3 * TOL


def test_the_training_task_reads_prepared_documents(prepared: Path, tmp_path: Path) -> None:
    """experiments.train's task on data.path=<prepared>, under cp_zigzag and under pp_dp: the batch spec the step is
    compiled for names segment ids and positions, and the train and validation batches match it (the step's own
    check); data.documents=False gives plain windows."""
    from common import override

    from experiments import train as tr
    from experiments.configs import base

    for strategy, mesh in (("cp_zigzag", "data=2,seq=4"), ("pp_dp", "stage=2,data=4")):
        config = override(base.get_config(), {
            "data.path": str(prepared), "strategy": strategy, "mesh": mesh, "run_dir": str(tmp_path),
            "model.num_layers": 2, "batch_size": 8, "seq_len": T, "eval_batches": 1, "cpu_devices": 8,
        })  # fmt: skip
        run = tr.build(config)
        assert set(run.task.batch_spec(run.step)) == set(shards.BATCH_KEYS)
        batch = run.task.train_batch(run.step, 0)
        run.step.check_batch(batch)
        run.step.check_batch(run.task.val_batches(run.step)[0], evaluation=True)
        assert int(np.asarray(batch["segment_ids"]).max()) > 0
        config.data.documents = False
        plain = tr.build(config).task
        assert "segment_ids" not in plain.batch_spec(run.step) and plain.eod is None
