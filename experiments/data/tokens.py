"""Training on prepared token shards (`python -m experiments.data.prepare`), with document boundaries.

`--config.data.path=<folder with manifest.json>` selects this loader (experiments/tasks.py). The shards are
memory-mapped and read as one token sequence (`TokenStream`, no copy); the train and validation splits are the
manifest's (with no validation document, the last 5% of the train tokens, as experiments/data/text.py holds out).
Batches are the same pure function of (seed, split, step) as text.py's: `text.batch_offsets` draws the window
starts, so a resume needs only the step, and each process reads only the rows its devices hold.

Documents (`data.documents`, on by default). Each document is followed by the end-of-document id (EOD). Within a
window, a new segment starts at every EOD *input* token: the EOD closes the previous document as its last target,
and opens the next one as its first input (as GPT-2's <|endoftext|> does), so no target is predicted across a
boundary and no loss needs masking. For window tokens x_0..x_T (inputs x_0..x_{T-1}, targets x_1..x_T):

    segment_ids[j] = #{i <= j : x_i = EOD}        positions[j] = j - max({i <= j : x_i = EOD} U {0})

Attention is masked to one segment (`segment_ids`) and RoPE positions restart at 0 in each (`positions`; RoPE
depends only on position differences, so a document cut by the window start loses nothing but its past). A packed
row then computes exactly what its documents compute one by one (tests/test_documents.py). Under context
parallelism the batch is laid out for the ring (`perm`, sk.attention.layout_perm) after the segments are found in
natural order: inputs, targets, positions and segment ids move together. Finding them needs the window from its
start, so a process reads the whole prefix of its rows up to its last column (one row: seq_len tokens).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from experiments.data import text
from experiments.data.assemble import global_arrays
from experiments.data.text import Arrays, Batch, Sharding, TokenDataset

MANIFEST = "manifest.json"
FORMAT = "shardkit-tokens-v1"  # experiments/data/prepare.py writes it
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids")


class TokenStream:
    """Shards (1-D token arrays, usually memmaps) read as one sequence: ``len``, ``dtype``, integer-array and
    slice indexing (numpy results). Global index i lies in the shard whose cumulative start is the last <= i."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype("<u2")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, stride = key.indices(len(self))
            return self[np.arange(start, stop, stride)]
        idx = np.asarray(key, np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):  # no negative index wraps around
            raise IndexError(f"token index out of range [0, {len(self)})")
        if len(self.arrays) == 1:
            return np.asarray(self.arrays[0][idx])
        shard = np.searchsorted(self.starts, idx, side="right") - 1
        out = np.empty(idx.shape, self.dtype)
        for s in np.unique(shard):  # fancy indexing per shard reads only these tokens
            mask = shard == s
            out[mask] = self.arrays[s][idx[mask] - self.starts[s]]
        return out

    def split_at(self, cut: int) -> tuple[TokenStream, TokenStream]:
        """(tokens [0, cut), tokens [cut, len)) as streams over views of the same memmaps."""
        head, tail = [], []
        for a, start in zip(self.arrays, self.starts[:-1], strict=True):
            k = min(max(cut - int(start), 0), len(a))
            head.append(a[:k])
            tail.append(a[k:])
        return TokenStream(head), TokenStream(tail)


@dataclasses.dataclass(eq=False)
class PreparedDataset(TokenDataset):
    """A TokenDataset of prepared shards: its end-of-document id and its manifest."""

    eod_id: int = -1
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict)

    def unigram_entropy_nats(self) -> float:
        """The train tokens' unigram entropy, counted by prepare (no pass over the shards here)."""
        return float(self.manifest["unigram_entropy_nats"])

    def __repr__(self) -> str:
        return f"PreparedDataset({self.name!r}, train={len(self.train):,}, val={len(self.val):,}, " \
               f"vocab={self.vocab_size}, eod={self.eod_id})"  # fmt: skip


def is_prepared(path: str | Path) -> bool:
    """A folder `experiments.data.prepare` wrote (or is writing): it has a manifest.json or a .prepare/."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / MANIFEST).exists() or (p / ".prepare").is_dir())


def load_prepared(path: str | Path) -> PreparedDataset:
    """The prepared dataset in `path`; ValueError naming the problem and the fix when it is not whole."""
    p = Path(path).expanduser()
    if not (p / MANIFEST).exists():
        raise ValueError(f"{p} has no {MANIFEST}: its prepare run did not finish; rerun the same "
                         "`python -m experiments.data.prepare` command to resume it")  # fmt: skip
    try:
        m = json.loads((p / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{p / MANIFEST}: not readable JSON ({e})") from None
    if m.get("format") != FORMAT:
        raise ValueError(f"{p / MANIFEST}: format {m.get('format')!r}, this loader reads {FORMAT!r}; prepare again")
    dtype = np.dtype(m["dtype"]).newbyteorder("<")
    if not 0 <= m["eod_id"] < m["vocab_size"] or m["vocab_size"] > np.iinfo(dtype).max + 1:
        raise ValueError(f"{p / MANIFEST}: eod_id {m['eod_id']}, vocab_size {m['vocab_size']}, dtype {dtype} "
                         "do not fit together; prepare again")  # fmt: skip
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    for s in m["shards"]:
        f = p / s["name"]
        want = s["tokens"] * dtype.itemsize
        if not f.is_file() or f.stat().st_size != want:
            have = f.stat().st_size if f.is_file() else "no"
            raise ValueError(f"{f}: {have} bytes, the manifest says {s['tokens']:,} {dtype} tokens ({want:,} "
                             "bytes): a shard is missing or cut short (a partial copy?); copy or prepare it "
                             "again")  # fmt: skip
        splits[s["split"]].append(np.memmap(f, dtype=dtype, mode="r"))
    train, val = TokenStream(splits["train"]), TokenStream(splits["val"])
    if not len(val):  # too few documents for the crc32 rule: hold out the tail, as text.py does
        train, val = train.split_at(len(train) - len(train) * text.VAL_PERCENT // 100)
    name = f"{p.name} ({m['tokenizer']['kind']} tokenizer, end-of-document id {m['eod_id']})"
    return PreparedDataset(train, val, int(m["vocab_size"]), name, eod_id=int(m["eod_id"]), manifest=m)


def documents(window: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) int32 [b, n] of input windows [b, n] (the module docstring's formulas)."""
    is_eod = window == eod
    idx = np.arange(window.shape[1])
    start = np.maximum.accumulate(np.where(is_eod, idx, 0), axis=1)
    return np.cumsum(is_eod, axis=1, dtype=np.int32), (idx - start).astype(np.int32)


def read_windows(
    tokens: Any, offsets: np.ndarray, col0: int, col1: int, perm: np.ndarray | None = None, eod: int | None = None
) -> Batch:
    """Columns [col0, col1) of the windows at `offsets` (text.read_windows), with `segment_ids` and `positions`
    from the end-of-document id `eod` (None: none, as text.py reads). Column j is window position perm[j]."""
    if eod is None:
        return text.read_windows(tokens, offsets, col0, col1, perm)
    cols = np.arange(col0, col1) if perm is None else np.asarray(perm[col0:col1])
    n = int(cols.max()) + 2  # the prefix through the last input's target
    w = np.asarray(tokens[offsets[:, None] + np.arange(n)[None, :]], dtype=np.int32)
    seg, pos = documents(w[:, :-1], eod)
    return {"inputs": w[:, cols], "targets": w[:, cols + 1], "positions": pos[:, cols], "segment_ids": seg[:, cols]}


def batch_at(
    tokens: Any, offsets: np.ndarray, seq_len: int, sharding: Sharding, perm: np.ndarray | None = None,
    eod: int | None = None,
) -> Arrays:  # fmt: skip
    """Global [B, T] arrays of the windows at `offsets`, each process reading only the rows (and, without
    documents, the columns) of its own devices' blocks; the same arrays whatever the process count."""
    keys = BATCH_KEYS if eod is not None else BATCH_KEYS[: 2 if perm is None else 3]
    read = lambda spans: read_windows(tokens, offsets[slice(*spans[0])], *spans[1], perm, eod)
    return global_arrays((len(offsets), seq_len), sharding, read, keys)


def global_batch(
    ds: TokenDataset, step: int, global_batch_size: int, seq_len: int, sharding: Sharding, split: str = "train",
    seed: int = 0, perm: np.ndarray | None = None, eod: int | None = None,
) -> Arrays:  # fmt: skip
    """Batch `step` of `split`, a pure function of (seed, split, step): text.global_batch's, plus documents."""
    if eod is None:
        return text.global_batch(ds, step, global_batch_size, seq_len, sharding, split, seed, perm)
    tokens = ds.split(split)
    offsets = text.batch_offsets(len(tokens), step, global_batch_size, seq_len, seed, split)
    return batch_at(tokens, offsets, seq_len, sharding, perm, eod)


def val_batches(
    ds: TokenDataset, n_batches: int, batch_size: int, seq_len: int, sharding: Sharding,
    perm: np.ndarray | None = None, eod: int | None = None,
) -> list[Arrays]:  # fmt: skip
    """The fixed validation windows of text.val_batches (evenly spaced, no seed), with documents."""
    if eod is None:
        return text.val_batches(ds, n_batches, batch_size, seq_len, sharding, perm)
    n = len(ds.val)
    text.batch_offsets(n, 0, 0, seq_len, split="val")  # validates the length
    offsets = np.linspace(0, n - seq_len - 1, n_batches * batch_size).round().astype(np.int64)
    return [batch_at(ds.val, o, seq_len, sharding, perm, eod) for o in offsets.reshape(n_batches, batch_size)]
