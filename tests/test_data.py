"""Tests for experiments/data/text.py: corpus, split rule, cache, batches, sharded global batches."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.data import text

REPO = Path(__file__).resolve().parents[1]


def _names(n_val: int, n_train: int) -> list[str]:
    """File names giving exactly n_val validation and n_train train files under the crc32 rule."""
    val, train, i = [], [], 0
    while len(val) < n_val or len(train) < n_train:
        name = f"sub{i % 3}/doc{i}.txt"
        bucket = val if text.is_val_file(name) else train
        if len(bucket) < (n_val if bucket is val else n_train):
            bucket.append(name)
        i += 1
    return val + train


def _write_corpus(root: Path, names: list[str], reverse: bool = False) -> dict[str, bytes]:
    texts = {n: f"# {n}\n".encode() + bytes(range(32, 127)) * (1 + i % 4) for i, n in enumerate(names)}
    for n in reversed(names) if reverse else names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        (root / n).write_bytes(texts[n])
    return texts


def _docs(tokens: np.ndarray) -> list[bytes]:
    """Split a token stream at EOT into byte documents (the stream must end with EOT)."""
    assert tokens[-1] == text.EOT
    cuts = np.flatnonzero(tokens == text.EOT)
    return [tokens[a + 1 : b].astype(np.uint8).tobytes() for a, b in zip(np.r_[-1, cuts[:-1]], cuts, strict=True)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> text.TokenDataset:
    root = tmp_path_factory.mktemp("corpus")
    _write_corpus(root, _names(3, 12))
    return text.load_dataset(root, cache_dir=root.parent / (root.name + "-cache"))


def test_split_rule_is_the_documented_one() -> None:
    names = [f"pkg{i}/mod{i}.py" for i in range(2000)]
    assert [text.is_val_file(n) for n in names] == [zlib.crc32(n.encode()) % 100 < 5 for n in names]
    assert 60 < sum(map(text.is_val_file, names)) < 140


def test_offsets_cover_exactly_the_valid_range() -> None:
    assert set(text.batch_offsets(9, 0, 64, 8).tolist()) == {0}  # 9 tokens: one window of 8 + target
    assert set(text.batch_offsets(10, 0, 64, 8).tolist()) == {0, 1}
    with pytest.raises(ValueError, match="seq_len"):
        text.batch_offsets(8, 0, 4, 8)


def test_text_dir_tokens_eot_and_split(tmp_path: Path) -> None:
    names = _names(3, 12)
    texts = _write_corpus(tmp_path / "a", names)
    ds = text.load_dataset(tmp_path / "a", cache_dir=tmp_path / "cache")
    assert ds.vocab_size == text.VOCAB_SIZE == 257 and ds.padded_vocab_size == text.PADDED_VOCAB == 384
    assert isinstance(ds.train, np.memmap) and ds.train.dtype == np.uint16
    for split, want_val in (("train", False), ("val", True)):
        toks = ds.split(split)
        assert toks.max() <= text.EOT
        expected = sorted(n for n in names if text.is_val_file(n) == want_val)
        assert _docs(toks) == [texts[n] for n in expected]  # EOT after every document, sorted order
    # Creating the files in another order (another directory, another cache) gives the same split.
    _write_corpus(tmp_path / "b", names, reverse=True)
    ds2 = text.load_dataset(tmp_path / "b", cache_dir=tmp_path / "cache2")
    assert np.array_equal(ds.train, ds2.train) and np.array_equal(ds.val, ds2.val)


def test_few_files_fall_back_to_tail_split(tmp_path: Path) -> None:
    names = _names(0, 2)
    texts = _write_corpus(tmp_path, names)
    ds = text.load_dataset(tmp_path, cache_dir=tmp_path / ".cache")
    stream = np.concatenate([ds.train, ds.val])
    assert _docs(stream) == [texts[n] for n in sorted(names)]
    assert len(ds.val) == len(stream) * text.VAL_PERCENT // 100 > 0


def test_glob_and_single_text_file(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(b"hello " * 50)
    (tmp_path / "y.md").write_bytes(b"skip me")
    ds = text.load_dataset(str(tmp_path / "*.txt"), cache_dir=tmp_path / "c")
    stream = np.concatenate([ds.train, ds.val])
    assert _docs(stream) == [b"hello " * 50]
    ds1 = text.load_dataset(tmp_path / "x.txt", cache_dir=tmp_path / "c1")
    assert np.array_equal(np.concatenate([ds1.train, ds1.val]), stream)


def test_cache_is_reused_and_invalidated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_corpus(tmp_path / "c", _names(2, 4))
    ds = text.load_dataset(tmp_path / "c", cache_dir=tmp_path / "cache")
    files = sorted(os.listdir(tmp_path / "cache"))  # no temporary files left behind
    assert len(files) == 2 and files[0].endswith(".train.bin") and files[1].endswith(".val.bin")
    assert Path(ds.train.filename) == tmp_path / "cache" / files[0]

    def boom(blobs: object) -> np.ndarray:
        raise AssertionError("re-tokenised a cached corpus")

    monkeypatch.setattr(text, "tokenize_bytes", boom)
    again = text.load_dataset(tmp_path / "c", cache_dir=tmp_path / "cache")
    assert np.array_equal(again.train, ds.train)
    monkeypatch.undo()
    first = min((tmp_path / "c").rglob("*.txt"))
    first.write_bytes(first.read_bytes() + b"changed")
    changed = text.load_dataset(tmp_path / "c", cache_dir=tmp_path / "cache")
    assert len(changed.train) + len(changed.val) == len(ds.train) + len(ds.val) + 7


def test_stdlib_corpus(tmp_path: Path) -> None:
    root, rels = text.stdlib_files()
    assert rels == sorted(rels) == text.stdlib_files()[1]
    assert not any(set(r.split("/")[:-1]) & {"site-packages", "test", "tests"} for r in rels)
    assert all(r.endswith(".py") for r in rels) and "os.py" in rels
    ds = text.load_dataset(cache_dir=tmp_path)
    n_val = sum(map(text.is_val_file, rels))
    assert 0 < n_val < len(rels)
    assert int((ds.val == text.EOT).sum()) == n_val
    assert int((ds.train == text.EOT).sum()) == len(rels) - n_val
    assert len(ds.train) > 1_000_000 and len(ds.val) > 10_000 and ds.train.max() <= text.EOT
    val_docs = set(_docs(ds.val))
    assert (root / "os.py").read_bytes() in (val_docs if text.is_val_file("os.py") else set(_docs(ds.train)))
    assert not val_docs & set(_docs(ds.train))  # disjoint by file
    assert 3.0 < ds.unigram_entropy_bits() < 6.0


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_bin_round_trip(tmp_path: Path, dtype: type) -> None:
    # uint32: ids past uint16's range, below text.MAX_PLAUSIBLE_VOCAB (larger ones mean a uint16 file misread)
    high = np.iinfo(dtype).max if dtype == np.uint16 else text.MAX_PLAUSIBLE_VOCAB
    toks = np.random.default_rng(0).integers(0, high, 2000).astype(dtype)
    toks.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "all.bin")
    ds = text.load_dataset(tmp_path / "all.bin", bin_dtype=dtype)
    assert len(ds.val) == 100 and np.array_equal(np.concatenate([ds.train, ds.val]), toks)
    assert ds.vocab_size == int(toks.max()) + 1
    assert ds.padded_vocab_size % 128 == 0 and ds.padded_vocab_size >= ds.vocab_size
    (tmp_path / "ng").mkdir()
    toks[:1500].tofile(tmp_path / "ng" / "train.bin")
    toks[1500:].tofile(tmp_path / "ng" / "val.bin")
    ng = text.load_dataset(tmp_path / "ng", bin_dtype=dtype, vocab_size=70000)
    assert np.array_equal(ng.train, toks[:1500]) and np.array_equal(ng.val, toks[1500:])
    assert ng.vocab_size == 70000
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(ValueError, match="bin_dtype"):
        text.load_dataset(tmp_path / "odd.bin", bin_dtype=np.uint32)


def test_unigram_entropy(tmp_path: Path) -> None:
    np.frombuffer(b"ab" * 5000, np.uint8).astype(np.uint16).tofile(tmp_path / "ab.bin")
    ds = text.load_dataset(tmp_path / "ab.bin")
    assert ds.unigram_entropy_bits() == pytest.approx(1.0, abs=1e-12)
    assert ds.unigram_entropy_nats() == pytest.approx(math.log(2), abs=1e-12)
    four = text.TokenDataset(np.tile(np.arange(4, dtype=np.uint16), 100), np.zeros(0, np.uint16), 257)
    assert four.unigram_entropy_bits() == pytest.approx(2.0)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "ab.txt").write_bytes(b"ab" * 20000)  # text: one EOT per document shifts it a hair
    txt = text.load_dataset(tmp_path / "t", cache_dir=tmp_path / "c")
    assert txt.unigram_entropy_bits() == pytest.approx(1.0, abs=2e-3)


def test_batches_deterministic_shifted_and_resumable(corpus: text.TokenDataset) -> None:
    it = text.BatchIterator(corpus, batch_size=4, seq_len=16, seed=3)
    b5 = it.batch(5)
    assert b5["inputs"].dtype == np.int32 and b5["inputs"].shape == (4, 16)
    assert np.array_equal(b5["inputs"], text.BatchIterator(corpus, 4, 16, seed=3).batch(5)["inputs"])
    assert not np.array_equal(b5["inputs"], it.batch(6)["inputs"])
    assert not np.array_equal(b5["inputs"], text.BatchIterator(corpus, 4, 16, seed=4).batch(5)["inputs"])
    assert np.array_equal(b5["targets"][:, :-1], b5["inputs"][:, 1:])
    for o, row, tgt in zip(it.offsets(5), b5["inputs"], b5["targets"], strict=True):
        assert np.array_equal(row, corpus.train[o : o + 16]) and tgt[-1] == corpus.train[o + 16]
    run = [next(it) for _ in range(6)]
    resumed = text.BatchIterator(corpus, 4, 16)
    resumed.load_state_dict({"step": 3, "seed": 3})
    assert all(np.array_equal(next(resumed)["inputs"], b["inputs"]) for b in run[3:])
    assert it.state_dict() == {"step": 6, "seed": 3} and resumed.state_dict() == it.state_dict()
    val = text.BatchIterator(corpus, 4, 16, split="val", seed=3).batch(5)
    assert val["inputs"].max() <= text.EOT and not np.array_equal(val["inputs"], b5["inputs"])


@pytest.mark.parametrize(
    "spec",
    [
        P(("data", "fsdp")),
        P(("fsdp", "data"), None),
        P("data", "fsdp"),
        P(None, "fsdp"),
        P(),
    ],
    ids=str,
)
def test_global_batch_equals_numpy_batch(corpus: text.TokenDataset, spec: P) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, spec)
    gb = text.global_batch(corpus, 9, 16, 8, sharding, seed=1)
    full = text.BatchIterator(corpus, 16, 8, seed=1).batch(9)
    for k in ("inputs", "targets"):
        assert gb[k].shape == (16, 8) and gb[k].dtype == np.int32 and gb[k].sharding == sharding
        assert np.array_equal(np.asarray(gb[k]), full[k])
        for shard in gb[k].addressable_shards:
            assert np.array_equal(np.asarray(shard.data), full[k][shard.index])
    it = text.BatchIterator(corpus, 16, 8, seed=1, sharding=sharding, step=9)
    assert np.array_equal(np.asarray(next(it)["targets"]), full["targets"])


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_global_batch_in_context_parallel_layout(corpus: text.TokenDataset, layout: str) -> None:
    """Sequence sharded over 4 ranks in a ring layout: same tokens as laying out the natural batch, plus positions."""
    from shardkit.attention import layout_batch, layout_perm

    mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data", "seq"))
    gb = text.global_batch(corpus, 3, 4, 16, sharding, seed=2, perm=layout_perm(layout, 16, 4))
    expected = layout_batch(text.BatchIterator(corpus, 4, 16, seed=2).batch(3), layout, 4)
    assert set(gb) == {"inputs", "targets", "positions"}
    for k, v in expected.items():
        assert np.array_equal(np.asarray(gb[k]), v), k
    val = text.val_batches(corpus, 1, 4, 16, sharding, perm=layout_perm(layout, 16, 4))[0]
    assert np.array_equal(np.asarray(val["positions"][0]), layout_perm(layout, 16, 4))


def test_val_batches_fixed(corpus: text.TokenDataset) -> None:
    a = text.val_batches(corpus, 3, 4, 8)
    b = text.val_batches(corpus, 3, 4, 8)
    assert len(a) == 3 and all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])
    assert a[0]["inputs"][0].tolist() == corpus.val[:8].tolist()
    assert a[-1]["targets"][-1].tolist() == corpus.val[-8:].tolist()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = text.val_batches(corpus, 3, 8, 8, NamedSharding(mesh, P("data")))
    assert all(
        np.array_equal(np.asarray(s["inputs"]), n["inputs"])
        for s, n in zip(sh, text.val_batches(corpus, 3, 8, 8), strict=True)
    )


_WORKER = textwrap.dedent(
    """
    import sys, numpy as np, jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from experiments.data import text
    read = []
    orig = text.read_windows
    text.read_windows = lambda t, o, c0, c1, perm=None: read.append(len(o) * (c1 - c0)) or orig(t, o, c0, c1, perm)
    ds = text.load_dataset(path)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    for spec in (P(("data", "fsdp")), P("data", "fsdp"), P("fsdp", "data")):
        full = text.BatchIterator(ds, 16, 8).batch(7)
        read.clear()
        gb = text.global_batch(ds, 7, 16, 8, NamedSharding(mesh, spec))
        for k in gb:
            for s in gb[k].addressable_shards:
                assert np.array_equal(np.asarray(s.data), full[k][s.index]), (spec, k)
        assert sum(read) == 16 * 8 // 2, (spec, read)  # this process read only its half
    print("WORKER_OK", pid)
    """
)


@pytest.mark.timeout(90)
def test_global_batch_two_processes(tmp_path: Path) -> None:
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "tok.bin")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(pid), port, str(tmp_path / "tok.bin")],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outs = [p.communicate(timeout=80)[0] for p in procs]
    for pid, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"WORKER_OK {pid}" in out, out[-3000:]
