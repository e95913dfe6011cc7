"""The documents of `experiments.data.prepare`'s inputs, cut into work units that tokenize independently.

    .jsonl     one JSON object per line, the document in its `field` (default "text"); blank lines skipped (.json
               too: JSON lines, as Hugging Face datasets export them; a JSON array fails on its first line)
    .parquet   one document per row of the `field` column (needs pyarrow: `pip install pyarrow`)
    other      each file is one document (its raw bytes for the byte tokenizer, UTF-8 text for a Hugging Face one);
               compressed files (.gz, .zst, ...) are refused

A unit is a byte range of one jsonl file (the lines that *start* in it), a run of row groups of one parquet file, or
a run of whole text files, each about `chunk_bytes` of input: units are planned from the files' sizes alone, so a
resumed run cuts the same units. Each document has a key that does not depend on the cut (path and byte offset,
path and row, path): `is_val` sends it to the validation split by the crc32 rule of experiments/data/text.py.
Bad input raises `PrepareError` naming the file (and line or row) and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path


class PrepareError(ValueError):
    """Bad input or arguments for `experiments.data.prepare`: printed as one `error:` line."""


@dataclasses.dataclass(frozen=True)
class Unit:
    """One shard's worth of input: `kind` "jsonl" (bytes [start, end) of `paths[0]`), "parquet" (row groups
    [start, end) of `paths[0]`) or "text" (whole files)."""

    index: int
    kind: str
    paths: tuple[str, ...]  # relative POSIX paths under the input root
    start: int = 0
    end: int = 0
    nbytes: int = 0  # input bytes (progress)


_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")


def kind_of(rel: str) -> str:
    """The reader of a file: jsonl (.jsonl, .json: JSON lines, as Hugging Face datasets export them), parquet, text."""
    if rel.endswith(_COMPRESSED):
        raise PrepareError(f"{rel}: compressed input is not read; decompress it first (e.g. gunzip, zstd -d)")
    return "jsonl" if rel.endswith((".jsonl", ".json")) else "parquet" if rel.endswith(".parquet") else "text"


def list_inputs(spec: str) -> tuple[Path, list[str]]:
    """(root, sorted relative paths) of a file, a directory (every non-hidden file under it) or a glob."""
    p = Path(spec).expanduser()
    parts = p.parts
    wild = [i for i, s in enumerate(parts) if any(c in s for c in "*?[")]
    if wild:
        root = Path(*parts[: wild[0]]) if wild[0] else Path()
        rels = [q.relative_to(root).as_posix() for q in root.glob(str(Path(*parts[wild[0] :]))) if q.is_file()]
    elif p.is_dir():
        root = p
        rels = [(Path(top) / f).relative_to(p).as_posix() for top, dirs, files in os.walk(p)
                for f in files if not f.startswith(".")]  # fmt: skip
        rels = [r for r in rels if not any(s.startswith(".") for s in Path(r).parts)]
    elif p.is_file():
        root, rels = p.parent, [p.name]
    else:
        raise PrepareError(f"--input {spec}: no such file or directory")
    if not rels:
        raise PrepareError(f"--input {spec}: matches no files (empty input)")
    return root, sorted(rels)


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError("reading .parquet needs pyarrow: pip install pyarrow") from None
    return pq


def _parquet_file(path: Path):
    pq = _parquet()
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # ArrowInvalid, OSError: the file is not parquet or is truncated
        raise PrepareError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def plan_units(root: Path, rels: list[str], chunk_bytes: int) -> list[Unit]:
    """The work units of the inputs, in input order (see the module docstring)."""
    units: list[Unit] = []
    texts: list[str] = []
    text_bytes = 0

    def add(kind: str, paths: tuple[str, ...], start: int = 0, end: int = 0, nbytes: int = 0) -> None:
        units.append(Unit(len(units), kind, paths, start, end, nbytes))

    def flush_texts() -> None:
        nonlocal texts, text_bytes
        if texts:
            add("text", tuple(texts), nbytes=text_bytes)
        texts, text_bytes = [], 0

    for rel in rels:
        size = (root / rel).stat().st_size
        kind = kind_of(rel)
        if kind == "text":
            if texts and text_bytes + size > chunk_bytes:
                flush_texts()
            texts.append(rel)
            text_bytes += size
            continue
        flush_texts()
        if kind == "jsonl":
            for start in range(0, max(size, 1), chunk_bytes):
                add("jsonl", (rel,), start, min(start + chunk_bytes, size), min(chunk_bytes, size - start))
        else:
            meta = _parquet_file(root / rel).metadata
            group, acc, first = 0, 0, 0
            for group in range(meta.num_row_groups):
                acc += meta.row_group(group).total_byte_size
                if acc >= chunk_bytes:
                    add("parquet", (rel,), first, group + 1, acc)
                    first, acc = group + 1, 0
            if first < meta.num_row_groups:
                add("parquet", (rel,), first, meta.num_row_groups, acc)
    flush_texts()
    return units


def is_val(key: str, val_percent: int) -> bool:
    """The split rule: a document is validation iff crc32(its key) % 100 < val_percent."""
    return zlib.crc32(key.encode("utf-8")) % 100 < val_percent


def _line_number(path: Path, pos: int) -> int:
    """1-based number of the line starting at byte `pos` (read only when reporting an error)."""
    n, done = 1, 0
    with open(path, "rb") as f:
        while done < pos:
            buf = f.read(min(1 << 20, pos - done))
            n, done = n + buf.count(b"\n"), done + len(buf)
    return n


def _jsonl(root: Path, unit: Unit, field: str) -> Iterator[tuple[str, str]]:
    path = root / unit.paths[0]
    with open(path, "rb") as f:
        if unit.start:  # the first line that starts at or after `start` (the previous unit owns the one before)
            f.seek(unit.start - 1)
            f.readline()
        while (pos := f.tell()) < unit.end or (pos == 0 == unit.end):
            line = f.readline()
            if not line:
                return
            if not line.strip():
                continue
            where = lambda: f"{path}:{_line_number(path, pos)}"
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise PrepareError(f"{where()}: not a JSON line ({e})") from None
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise PrepareError(f"{where()}: no field {field!r} (has: {keys}); name the text field with --field")
            value = obj[field]
            if not isinstance(value, str):
                raise PrepareError(f"{where()}: field {field!r} is {type(value).__name__}, not a string")
            yield f"{unit.paths[0]}@{pos}", value


def _parquet_rows(root: Path, unit: Unit, field: str) -> Iterator[tuple[str, str]]:
    path = root / unit.paths[0]
    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise PrepareError(f"{path}: no column {field!r} (has: {', '.join(names)}); name the text column with --field")
    row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
    for group in range(unit.start, unit.end):
        try:
            values = pf.read_row_group(group, columns=[field]).column(0).to_pylist()
        except Exception as e:
            raise PrepareError(f"{path}: row group {group} is unreadable ({type(e).__name__}: {e})") from None
        for value in values:
            if not isinstance(value, str):
                what = "null" if value is None else type(value).__name__
                raise PrepareError(f"{path}: row {row}: column {field!r} is {what}, not a string")
            yield f"{unit.paths[0]}#{row}", value
            row += 1


def _text_files(root: Path, unit: Unit, want_str: bool) -> Iterator[tuple[str, str | bytes]]:
    for rel in unit.paths:
        data = (root / rel).read_bytes()
        if want_str:
            try:
                yield rel, data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PrepareError(f"{root / rel}: not UTF-8 text at byte {e.start}; a Hugging Face tokenizer reads "
                                   "text (the byte tokenizer takes any bytes)") from None  # fmt: skip
        else:
            yield rel, data


def documents(root: Path, unit: Unit, field: str, want_str: bool) -> Iterator[tuple[str, str | bytes]]:
    """(key, document) of each document of `unit`, in order; text files as bytes unless `want_str`."""
    if unit.kind == "jsonl":
        return _jsonl(root, unit, field)
    if unit.kind == "parquet":
        return _parquet_rows(root, unit, field)
    return _text_files(root, unit, want_str)
