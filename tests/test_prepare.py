"""python -m experiments.data.prepare: documents in, token shards + manifest out; resume; one `error:` line for bad
input with nothing half-written. Tokenizers are built here with the `tokenizers` package (no download, no asset)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from common import override

import shardkit as sk
from experiments import tasks
from experiments.configs import base
from experiments.data import prepare, readers
from experiments.data.tokenizer import BYTE_EOD

DOCS = [f"doc {i}: " + "lorem ipsum dolor " * (1 + i % 7) + "é∑" * (i % 3) for i in range(60)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _run(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of the CLI's main (one worker, in this process, unless --workers says otherwise)."""
    rc = prepare.main([*args, "--quiet", *(() if "--workers" in args else ("--workers", "1"))])
    return rc, capsys.readouterr().err


def _shard_docs(out: Path) -> dict[str, list[np.ndarray]]:
    """Each split's documents, in shard order, split at the end-of-document id (every document ends with it)."""
    m = json.loads((out / "manifest.json").read_text())
    found: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for s in m["shards"]:
        t = np.fromfile(out / s["name"], dtype=np.dtype(m["dtype"]))
        assert len(t) == s["tokens"] and t[-1] == m["eod_id"]
        cuts = np.flatnonzero(t == m["eod_id"])
        found[s["split"]] += [t[a + 1 : b] for a, b in zip(np.r_[-1, cuts[:-1]], cuts, strict=True)]
    return found


def _hf_tokenizer(folder: Path, vocab: int = 0) -> Path:
    """A byte-level BPE trained on DOCS (vocab > 0: a word-level vocabulary of that many ids), with an eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab:
        words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
        tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
        tok.train_from_iterator(DOCS, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return folder


def test_jsonl_and_text_become_byte_shards_with_eod_and_the_crc32_split(tmp_path: Path, capsys) -> None:
    _jsonl(tmp_path / "in" / "a.jsonl", DOCS)
    (tmp_path / "in" / "b.txt").write_bytes(b"a whole file\x00\xff is one document")
    rc, err = _run(capsys, "--input", str(tmp_path / "in" / "*"), "--tokenizer", "byte", "--out",
                   str(tmp_path / "out"), "--val_percent", "20", "--chunk_mb", "0.001")  # fmt: skip
    assert rc == 0, err
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (m["vocab_size"], m["eod_id"], m["dtype"]) == (257, BYTE_EOD, "uint16")
    assert len(m["shards"]) > 3 and not (tmp_path / "out" / ".prepare").exists()  # several units; work dir gone
    lines = (tmp_path / "in" / "a.jsonl").read_bytes().splitlines(keepends=True)
    keys = [f"a.jsonl@{sum(map(len, lines[:i]))}" for i in range(len(DOCS))] + ["b.txt"]
    want = {"train": [], "val": []}
    for key, doc in zip(keys, [d.encode() for d in DOCS] + [(tmp_path / "in" / "b.txt").read_bytes()], strict=True):
        want["val" if readers.is_val(key, 20) else "train"].append(doc)
    got = _shard_docs(tmp_path / "out")
    assert want["val"] and want["train"]  # the rule sent documents both ways
    for split in ("train", "val"):  # every document once, in input order, its exact bytes
        assert [d.astype(np.uint8).tobytes() for d in got[split]] == want[split]
        assert m["documents"][split] == len(want[split])
        assert m["tokens"][split] == sum(len(d) + 1 for d in want[split])


def test_parallel_workers_write_the_same_shards(tmp_path: Path, capsys) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS)
    outs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        assert _run(capsys, "--input", str(tmp_path / "a.jsonl"), "--tokenizer", "byte", "--out", str(out),
                    "--chunk_mb", "0.002", "--workers", workers)[0] == 0  # fmt: skip
        outs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert len(outs[0]) > 2 and outs[0] == outs[1]


def test_hf_tokenizer_ids_eos_and_shard_dtype(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer

    folder = _hf_tokenizer(tmp_path / "tok")
    _jsonl(tmp_path / "a.jsonl", DOCS[:20])
    assert _run(capsys, "--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(folder), "--out",
                str(tmp_path / "out"), "--val_percent", "0")[0] == 0  # fmt: skip
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert (m["eod_id"], m["vocab_size"], m["dtype"]) == (tok.token_to_id("</s>"), tok.get_vocab_size(), "uint16")
    assert [d.tolist() for d in _shard_docs(tmp_path / "out")["train"]] == [tok.encode(d).ids for d in DOCS[:20]]
    # a vocabulary past 65,536 ids: uint32 shards, the large ids intact
    big = _hf_tokenizer(tmp_path / "big", vocab=70_000)
    (tmp_path / "w.txt").write_text("w5 w65535 w65536 w69999")
    assert _run(capsys, "--input", str(tmp_path / "w.txt"), "--tokenizer", str(big), "--out",
                str(tmp_path / "out32"), "--val_percent", "0")[0] == 0  # fmt: skip
    m = json.loads((tmp_path / "out32" / "manifest.json").read_text())
    assert (m["dtype"], m["vocab_size"]) == ("uint32", 70_000)
    assert np.fromfile(tmp_path / "out32" / "train-00000.bin", "<u4").tolist() == [5, 65535, 65536, 69999, 1]
    assert prepare.shard_dtype(1 << 16) == np.uint16 and prepare.shard_dtype((1 << 16) + 1) == np.uint32


def test_parquet_rows_are_documents(tmp_path: Path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "d.parquet", row_group_size=7)
    rc, err = _run(capsys, "--input", str(tmp_path / "d.parquet"), "--tokenizer", "byte", "--out",
                   str(tmp_path / "out"), "--field", "body", "--val_percent", "0", "--chunk_mb", "0.0005")  # fmt: skip
    assert rc == 0, err
    got = _shard_docs(tmp_path / "out")["train"]
    assert [d.astype(np.uint8).tobytes().decode() for d in got] == DOCS
    assert len(json.loads((tmp_path / "out" / "manifest.json").read_text())["shards"]) > 2  # row groups split


def test_an_interrupted_run_resumes_to_the_same_shards(tmp_path: Path, capsys, monkeypatch) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS)
    args = ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", "byte", "--chunk_mb", "0.001", "--workers", "1"]
    assert _run(capsys, *args, "--out", str(tmp_path / "fresh"))[0] == 0
    real, ran = prepare.run_unit, []

    def dies_at_unit_3(unit: readers.Unit) -> dict:
        if unit.index == 3:
            raise KeyboardInterrupt
        ran.append(unit.index)
        return real(unit)

    monkeypatch.setattr(prepare, "run_unit", dies_at_unit_3)
    rc, err = _run(capsys, *args, "--out", str(tmp_path / "out"))
    assert rc == 130 and "rerun the same command to resume" in err
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "manifest.json" not in left and not any(n.endswith(".tmp") for n in left)
    assert {"train-00000.bin", "train-00002.bin"} <= set(left) and ran == [0, 1, 2]
    ran.clear()
    (tmp_path / "out" / "train-00001.bin").unlink()  # a finished unit's shard lost: that unit is redone
    monkeypatch.setattr(prepare, "run_unit", lambda u: ran.append(u.index) or real(u))
    assert _run(capsys, *args, "--out", str(tmp_path / "out"))[0] == 0
    assert ran[:2] == [1, 3] and 0 not in ran and 2 not in ran  # units 0 and 2 were not redone
    files = lambda d: {p.name: p.read_bytes() for p in d.iterdir()}
    assert files(tmp_path / "out") == files(tmp_path / "fresh")
    rc, err = _run(capsys, *args, "--out", str(tmp_path / "out"))  # finished: nothing to do
    assert rc == 0 and "nothing to do" in err


def _fails(capsys, tmp_path: Path, *args: str) -> str:
    rc, err = _run(capsys, *args, "--out", str(tmp_path / "out"))
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # nothing half-written
    return err


def test_bad_input_is_one_error_line_and_nothing_written(tmp_path: Path, capsys, monkeypatch) -> None:
    byte = ("--tokenizer", "byte")
    assert "matches no files" in _fails(capsys, tmp_path, "--input", str(tmp_path / "*.jsonl"), *byte)
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    assert "no documents" in _fails(capsys, tmp_path, "--input", str(tmp_path / "blank.jsonl"), *byte)
    # the line missing the field is in the last of several units: the units before it were written, then removed
    path = _jsonl(tmp_path / "a.jsonl", DOCS)
    path.write_text(path.read_text() + json.dumps({"body": "x"}) + "\n")
    err = _fails(capsys, tmp_path, "--input", str(path), *byte, "--chunk_mb", "0.001", "--workers", "2")
    assert f"{path}:{len(DOCS) + 1}: no field 'text' (has: body); name the text field with --field" in err
    (tmp_path / "z" / "c.jsonl.gz").parent.mkdir()
    (tmp_path / "z" / "c.jsonl.gz").write_bytes(b"\x1f\x8b")
    assert "compressed input is not read" in _fails(capsys, tmp_path, "--input", str(tmp_path / "z"), *byte)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert "bad.parquet: not a readable parquet file" in _fails(capsys, tmp_path, "--input",
                                                                 str(tmp_path / "bad.parquet"), *byte)  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    assert "pip install pyarrow" in _fails(capsys, tmp_path, "--input", str(tmp_path / "bad.parquet"), *byte)
    assert "no tokenizer.json" in _fails(capsys, tmp_path, "--input", str(path), "--tokenizer", str(tmp_path))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    rc, err = _run(capsys, "--input", str(path), *byte, "--out", str(tmp_path / "out"))
    assert rc == 2 and "is not empty and is not a prepare output" in err
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep me"


def test_training_refuses_a_tokenizer_larger_than_the_model(tmp_path: Path, capsys) -> None:
    _jsonl(tmp_path / "a.jsonl", DOCS)
    folder = _hf_tokenizer(tmp_path / "tok")
    assert _run(capsys, "--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(folder), "--out",
                str(tmp_path / "out"))[0] == 0  # fmt: skip
    vocab = json.loads((tmp_path / "out" / "manifest.json").read_text())["vocab_size"]
    config = override(base.get_config(), {"data.path": str(tmp_path / "out"), "seq_len": 16, "model.vocab_size": 256})
    with pytest.raises(sk.ShardkitError, match=rf"model.vocab_size=256 < the data's vocabulary {vocab}: .*tokenizer"):
        tasks.build_task(config)
    config.model.vocab_size = 0  # the data's, padded to 128
    task = tasks.build_task(config)
    assert task.model_cfg.vocab_size == -(-vocab // 128) * 128
    assert task.eod == json.loads((tmp_path / "out" / "manifest.json").read_text())["eod_id"]
    (tmp_path / "out" / "train-00000.bin").write_bytes(b"\0\0")  # a shard cut short
    with pytest.raises(sk.ShardkitError, match=r"train-00000\.bin: 2 bytes, the manifest says"):
        tasks.build_task(config)
