"""Tokenize documents into token shards that `--config.data.path=<out>` trains on (experiments/data/tokens.py).

    python -m experiments.data.prepare --input 'corpus/*.jsonl' --tokenizer byte --out data/corpus
    python -m experiments.data.prepare --input wiki.parquet --tokenizer ~/hf/Llama-3.2-1B --out data/wiki
    python -m experiments.data.prepare --input 'books/**/*.txt' --tokenizer ~/hf/Qwen2.5-0.5B --out data/books

Inputs (experiments/data/readers.py): .jsonl (the `--field`, default "text"), .parquet (that column; pyarrow), any
other file is one document. Every document is followed by the end-of-document id (experiments/data/tokenizer.py:
the byte tokenizer's 256, a Hugging Face folder's eos token). A document goes to the validation split iff
crc32(its key) % 100 < --val_percent (the rule of experiments/data/text.py, per document: the split does not depend
on the number of workers or on a resume).

Output, in --out: one `train-NNNNN.bin` (and `val-NNNNN.bin` when it holds validation documents) per work unit:
raw little-endian tokens, uint16 when the vocabulary fits in 65,536 ids, else uint32; and `manifest.json`
(tokenizer, vocab_size, eod_id, dtype, the shards and their token and document counts, the unigram entropy of the
train tokens, the input's fingerprint). Work units (about --chunk_mb of input each) tokenize in parallel worker
processes (--workers) under a progress bar.

Resume. Each shard is written to a temporary file and renamed; a unit's record (`.prepare/unit-NNNNN.json`) is
written after its shards, and the manifest after every unit: an interrupted run (Ctrl-C, a killed job) keeps its
finished units, and the same command continues from there (the input fingerprint: files, sizes, mtimes,
tokenizer, options, must match). Bad input (no files, no documents, a jsonl line without the field, an unreadable
parquet file, text a tokenizer cannot read) is one `error:` line, exit 2, and removes what the run wrote.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from experiments.data import readers
from experiments.data.readers import PrepareError, Unit
from experiments.data.tokenizer import Tokenizer, load_tokenizer

FORMAT = "shardkit-tokens-v1"  # change it when the shard layout or the split rule change
MANIFEST = "manifest.json"
WORK = ".prepare"  # unit records and the plan while a run is unfinished
_ENCODE_BATCH = 256  # documents per tokenizer call


@dataclasses.dataclass(frozen=True)
class Options:
    """What decides the shards' bytes (so the fingerprint), besides the input files."""

    tokenizer: str
    field: str = "text"
    val_percent: int = 5
    chunk_bytes: int = 64 << 20
    eod: str = ""
    add_special_tokens: bool = False


def shard_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def atomic_write(path: Path, data: bytes | np.ndarray) -> None:
    """Write to a temporary file in the same folder, then rename: readers see the whole file or none."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fingerprint(opts: Options, tok: Tokenizer, root: Path, rels: list[str]) -> str:
    h = hashlib.sha256(json.dumps([FORMAT, dataclasses.asdict(opts), tok.describe(), tok.vocab_size,
                                   tok.eod_id]).encode())  # fmt: skip
    for rel in rels:
        st = (root / rel).stat()
        h.update(f"\n{rel}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------- one unit (a worker)
_WORKER: dict[str, Any] = {}


def _init(opts: Options, root: Path, out: Path, worker: bool = False) -> None:
    if worker:  # one process per unit is the parallelism; in one process, the Rust tokenizer's own threads are
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(opts.tokenizer, opts.eod, opts.add_special_tokens)
    _WORKER.update(opts=opts, tok=tok, root=root, out=out, dtype=shard_dtype(tok.vocab_size))


def run_unit(unit: Unit) -> dict[str, Any]:
    """Tokenize one unit into its shards and write its record; returns the record."""
    opts, tok, root, out, dtype = (_WORKER[k] for k in ("opts", "tok", "root", "out", "dtype"))
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    docs = {"train": 0, "val": 0}
    eod, empty = np.array([tok.eod_id], dtype), 0
    batch: list[tuple[str, str | bytes]] = []

    def flush() -> None:
        nonlocal empty
        for (key, _), ids in zip(batch, tok.encode([d for _, d in batch]), strict=True):
            if not len(ids):
                empty += 1
                continue
            split = "val" if readers.is_val(key, opts.val_percent) else "train"
            parts[split] += [ids.astype(dtype), eod]
            docs[split] += 1
        batch.clear()

    for key, doc in readers.documents(root, unit, opts.field, tok.wants_str):
        batch.append((key, doc))
        if len(batch) >= _ENCODE_BATCH:
            flush()
    flush()
    shards, counts = [], np.zeros(tok.vocab_size, np.int64)
    for split, arrays in parts.items():
        if not arrays:
            continue
        tokens = np.concatenate(arrays)
        name = f"{split}-{unit.index:05d}.bin"
        atomic_write(out / name, tokens)
        shards.append(dict(name=name, split=split, tokens=len(tokens), documents=docs[split]))
        if split == "train":
            counts = np.bincount(tokens, minlength=tok.vocab_size)
    record = dict(index=unit.index, shards=shards, empty_documents=empty, input_bytes=unit.nbytes)
    with open(out / WORK / f"unit-{unit.index:05d}.counts.npy", "wb") as f:  # rewritten whole on a resume
        np.save(f, counts)
    atomic_write(out / WORK / f"unit-{unit.index:05d}.json", json.dumps(record).encode())
    return record


# ------------------------------------------------------------------------------------------------ the run
def _claim(out: Path, fp: str) -> dict[str, Any] | None:
    """The finished manifest if `out` already holds this exact dataset; else makes `out` ours (or refuses)."""
    if (out / MANIFEST).exists():
        manifest = json.loads((out / MANIFEST).read_text())
        if manifest.get("fingerprint") == fp:
            return manifest
        raise PrepareError(f"--out {out} already holds a prepared dataset of other input or options; choose another "
                           "--out or delete it")  # fmt: skip
    plan = out / WORK / "plan.json"
    if plan.exists():
        if json.loads(plan.read_text()).get("fingerprint") != fp:
            raise PrepareError(f"--out {out} holds an unfinished run of other input or options (the input changed "
                               "since?); delete it or choose another --out")  # fmt: skip
    elif out.exists() and any(out.iterdir()):
        raise PrepareError(f"--out {out} is not empty and is not a prepare output; choose an empty or new folder")
    (out / WORK).mkdir(parents=True, exist_ok=True)
    atomic_write(plan, json.dumps({"fingerprint": fp}).encode())
    for stale in out.glob("*.tmp"):  # a killed run's half-written shard
        stale.unlink()
    return None


def _finished(out: Path, record: Path, itemsize: int) -> bool:
    """A unit is done when its record and every shard it names, of the size it says, are there."""
    if not record.exists():
        return False
    shards = json.loads(record.read_text())["shards"]
    return all((out / s["name"]).is_file() and (out / s["name"]).stat().st_size == s["tokens"] * itemsize
               for s in shards)  # fmt: skip


def _discard(out: Path, created: bool) -> None:
    """Remove what this tool wrote in `out` (after bad input: nothing half-written stays)."""
    for p in [*out.glob("train-*.bin"), *out.glob("val-*.bin"), *out.glob("*.tmp")]:
        p.unlink(missing_ok=True)
    shutil.rmtree(out / WORK, ignore_errors=True)
    if created and out.exists() and not any(out.iterdir()):
        out.rmdir()


def _run_units(pending: list[Unit], opts: Options, root: Path, out: Path, workers: int, bar: Any) -> None:
    def done(record: dict[str, Any]) -> None:
        bar.update(record["input_bytes"])

    if workers <= 1:
        _init(opts, root, out)
        for unit in pending:
            done(run_unit(unit))
        return
    # spawn: no fork of a process that may hold threads (tokenizers, jax); an executor, not a Pool: a worker that
    # dies (killed, out of memory) fails the run (BrokenProcessPool) instead of hanging it
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init, initargs=(opts, root, out, True)) as pool:
        futures = [pool.submit(run_unit, u) for u in pending]
        try:
            for f in as_completed(futures):
                done(f.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / max(int(counts.sum()), 1)
    return float(-(p * np.log(p)).sum())


def prepare(input: str, out: str | os.PathLike[str], opts: Options, workers: int = 0, progress: bool = True
            ) -> dict[str, Any]:  # fmt: skip
    """Tokenize `input` into `out` (see the module docstring); returns the manifest."""
    from tqdm import tqdm

    if not 0 <= opts.val_percent < 100:
        raise PrepareError(f"--val_percent {opts.val_percent}: give 0..99")
    if opts.chunk_bytes < 1:
        raise PrepareError("--chunk_mb must be > 0")
    tok = load_tokenizer(opts.tokenizer, opts.eod, opts.add_special_tokens)
    root, rels = readers.list_inputs(input)
    units = readers.plan_units(root, rels, opts.chunk_bytes)
    fp = fingerprint(opts, tok, root, rels)
    out = Path(out).expanduser()
    created = not out.exists()
    finished = _claim(out, fp)
    if finished is not None:
        print(f"{out} already holds this dataset ({MANIFEST} matches the input): nothing to do", file=sys.stderr)
        return finished
    record = lambda u: out / WORK / f"unit-{u.index:05d}.json"
    pending = [u for u in units if not _finished(out, record(u), shard_dtype(tok.vocab_size).itemsize)]
    workers = min(workers or os.cpu_count() or 1, max(len(pending), 1))
    total = sum(u.nbytes for u in units)
    with tqdm(total=total, initial=total - sum(u.nbytes for u in pending), unit="B", unit_scale=True,
              desc="tokenizing", disable=not progress, file=sys.stderr) as bar:  # fmt: skip
        try:
            _run_units(pending, opts, root, out, workers, bar)
        except PrepareError:
            _discard(out, created)
            raise
        except BaseException:  # interrupted: keep the finished units for a resume
            for stale in out.glob("*.tmp"):
                stale.unlink(missing_ok=True)
            raise
    records = [json.loads(record(u).read_text()) for u in units]
    shards = [s for r in records for s in r["shards"]]
    if not shards:
        _discard(out, created)
        raise PrepareError(f"--input {input}: no documents in {len(rels)} file(s) (all empty or blank): empty input")
    counts = sum(np.load(out / WORK / f"unit-{u.index:05d}.counts.npy") for u in units)
    split_sum = lambda split, key: sum(s[key] for s in shards if s["split"] == split)
    manifest = dict(
        format=FORMAT,
        tokenizer=tok.describe(),
        vocab_size=tok.vocab_size,
        eod_id=tok.eod_id,
        dtype=shard_dtype(tok.vocab_size).name,
        field=opts.field,
        val_percent=opts.val_percent,
        tokens={s: split_sum(s, "tokens") for s in ("train", "val")},
        documents={s: split_sum(s, "documents") for s in ("train", "val")},
        empty_documents=sum(r["empty_documents"] for r in records),
        unigram_entropy_nats=_entropy(counts),
        input=dict(path=str(input), files=len(rels), bytes=total),
        fingerprint=fp,
        shards=shards,
    )
    atomic_write(out / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
    shutil.rmtree(out / WORK, ignore_errors=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.data.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="a .jsonl / .parquet / text file, a folder, or a glob (quoted)")
    ap.add_argument("--tokenizer", required=True, help="'byte' or a Hugging Face tokenizer folder (tokenizer.json)")
    ap.add_argument("--out", required=True, help="output folder (created; an unfinished one is resumed)")
    ap.add_argument("--field", default="text", help="the document's field (jsonl) or column (parquet)")
    ap.add_argument("--eod", default="", help="end-of-document token (default: the tokenizer's eos token)")
    ap.add_argument("--add_special_tokens", action="store_true", help="let the tokenizer add its BOS etc.")
    ap.add_argument("--val_percent", type=int, default=5, help="documents held out for validation (crc32 rule)")
    ap.add_argument("--workers", type=int, default=0, help="worker processes (default: the CPU count)")
    ap.add_argument("--chunk_mb", type=float, default=64.0, help="input MB per work unit (= per shard)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    opts = Options(args.tokenizer, args.field, args.val_percent, int(args.chunk_mb * (1 << 20)), args.eod,
                   args.add_special_tokens)  # fmt: skip
    try:
        m = prepare(args.input, args.out, opts, args.workers, progress=not args.quiet)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: the finished units are kept; rerun the same command to resume into {args.out}",
              file=sys.stderr)  # fmt: skip
        return 130
    n = len(m["shards"])
    print(f"{args.out}: {m['tokens']['train']:,} train / {m['tokens']['val']:,} val tokens, "
          f"{m['documents']['train']:,} / {m['documents']['val']:,} documents, {n} shard(s) of {m['dtype']}; "
          f"vocab {m['vocab_size']:,}, end-of-document id {m['eod_id']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
