"""Training data: a byte-level token corpus, resumable batches, per-process global batches.

Corpus. With no ``path``: the running Python's standard library (``sysconfig.get_paths()["stdlib"]``), every
``*.py`` sorted by relative path, skipping directories named ``site-packages``, ``dist-packages``, ``__pycache__``,
``test``, ``tests`` and ``idle_test``: third-party code is machine-specific, and Debian/Ubuntu (so Colab) ship the
test suites separately while the official Docker images delete exactly these directories, so without them one
Python version gives the same corpus on more machines (``include_tests=True`` adds them: ~2.5x more text). Each
Python version has its own stdlib, so its own corpus and cache key. Tokens are bytes 0..255 plus ``EOT = 256`` after
every document: ``VOCAB_SIZE = 257``; models use ``PADDED_VOCAB = 384`` (a multiple of 128, which shards and tiles
evenly; the extra logits are never targets).

Split. A text file is validation iff ``zlib.crc32(relative_posix_path) % 100 < 5`` (``VAL_PERCENT``), whatever the
listing order. If that leaves a split empty (a few files), and for a single file or ``.bin``, the last 5% of tokens
are validation. A directory holding ``train.bin`` (and ``val.bin``) is nanoGPT's layout: raw little-endian tokens,
no header, dtype ``bin_dtype``. Text corpora are tokenised once into ``<cache_dir>/<key>.{train,val}.bin`` (uint16,
written atomically) and memory-mapped.

Batches. Batch ``i`` is a pure function of ``(seed, split, i)``: window starts come from
``np.random.default_rng([seed, split_id, i])``, so resuming at step 40 needs only the number 40. ``global_batch``
reads, in each process, only the blocks that its addressable devices hold.

Why not grain. grain 0.2.18 installs, and ``MapDataset.range(n).random_map(...)`` could express the sampler, but
its per-process sharding (``ShardByJaxProcess``) gives process ``k`` the ``k``-th contiguous slice of the data,
while the rows (and columns) a process must supply are fixed by the batch's ``NamedSharding`` (several mesh axes on
dim 0, sequence sharding on dim 1, device orders that interleave processes). We would still compute the device
index map and assemble the arrays ourselves; grain would add iterator state to checkpoint, worker processes and
dependencies (array_record, cloudpickle). A stateless numpy memmap sampler is simpler and resumes exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from experiments.data.assemble import global_arrays

EOT = 256
VOCAB_SIZE = 257
PADDED_VOCAB = 384
VAL_PERCENT = 5
DEFAULT_CACHE_DIR = Path("~/.cache/shardkit/data")
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_EXCLUDED = frozenset({"site-packages", "dist-packages", "__pycache__"}) | _TEST_DIRS
_SPLIT_ID = {"train": 0, "val": 1}
_FORMAT = "bytes-eot-after-v1"  # change it when tokenisation or split change

Batch = dict[str, np.ndarray]
Arrays = dict[str, jax.Array]
Sharding = jax.sharding.Sharding
PathLike = str | os.PathLike[str]


def is_val_file(relpath: str) -> bool:
    """The split rule: validation iff crc32(relative POSIX path) % 100 < VAL_PERCENT."""
    return zlib.crc32(relpath.encode("utf-8")) % 100 < VAL_PERCENT


def list_files(root: Path, suffix: str = "", exclude: frozenset[str] = frozenset()) -> list[str]:
    """Sorted relative POSIX paths of non-hidden files under ``root`` ending in ``suffix``, pruning ``exclude`` dirs."""
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in exclude and d[0] != "."]
        rel = Path(top).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(suffix) and f[0] != "."]
    return sorted(out)


def stdlib_files(include_tests: bool = False) -> tuple[Path, list[str]]:
    """The stdlib directory and the sorted relative paths of the corpus's ``.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = _EXCLUDED - _TEST_DIRS if include_tests else _EXCLUDED
    return root, list_files(root, ".py", excluded)


def tokenize_bytes(blobs: Sequence[bytes]) -> np.ndarray:
    """Concatenate byte documents into uint16 tokens, ``EOT`` after each (vectorised)."""
    lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
    out = np.full(int(lengths.sum()) + len(blobs), EOT, dtype=np.uint16)
    is_text = np.ones(len(out), dtype=bool)
    is_text[np.cumsum(lengths + 1) - 1] = False
    out[is_text] = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    return out


def _atomic_write(path: Path, arr: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            arr.tofile(f)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_bin(path: PathLike, dtype: Any = np.uint16) -> np.ndarray:
    """A raw little-endian token file as a read-only memmap (empty array if empty)."""
    dt = np.dtype(dtype).newbyteorder("<")
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise ValueError(f"{path}: {size} bytes is not whole {dt} tokens (bin_dtype?)")
    return np.memmap(path, dtype=dt, mode="r") if size else np.zeros(0, dt)


def _split_tail(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last VAL_PERCENT % of a token stream as validation."""
    cut = len(tokens) - len(tokens) * VAL_PERCENT // 100
    return tokens[:cut], tokens[cut:]


@dataclasses.dataclass(eq=False)
class TokenDataset:
    """Train/validation token arrays (usually read-only memmaps) and the vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str = ""

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of 128 (``PADDED_VOCAB`` for bytes)."""
        return -(-self.vocab_size // 128) * 128

    def split(self, split: str) -> np.ndarray:
        """The token array of ``split`` ("train" or "val")."""
        if split not in _SPLIT_ID:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return self.train if split == "train" else self.val

    def unigram_entropy_nats(self) -> float:
        """Entropy of the train split's token frequencies in nats/token (one pass over the data).

        The loss of the best context-free predictor: compare cross-entropy losses (natural log) with this number.
        """
        counts, chunk = np.zeros(self.vocab_size, dtype=np.int64), 1 << 24
        for i in range(0, len(self.train), chunk):  # bincount copies to int64: chunk it
            counts += np.bincount(self.train[i : i + chunk], minlength=self.vocab_size)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def unigram_entropy_bits(self) -> float:
        """The same unigram entropy in bits/token (nats / ln 2)."""
        return self.unigram_entropy_nats() / float(np.log(2))

    def __repr__(self) -> str:
        n_train, n_val = len(self.train), len(self.val)
        return f"TokenDataset({self.name!r}, {n_train=:,}, {n_val=:,}, vocab={self.vocab_size})"


def _load_text(root: Path, rels: list[str], name: str, cache_dir: Path) -> TokenDataset:
    """Tokenise text files (cached under a key of their paths, sizes and mtimes)."""
    if not rels:
        raise FileNotFoundError(f"no text files for {name} under {root}")
    h = hashlib.sha256(f"{_FORMAT}|{VAL_PERCENT}|{root.resolve()}".encode())
    for rel in rels:
        st = (root / rel).stat()
        h.update(f"\n{rel}|{st.st_size}|{st.st_mtime_ns}".encode())
    paths = {s: cache_dir / f"{name}-{h.hexdigest()[:16]}.{s}.bin" for s in _SPLIT_ID}
    if not all(p.exists() for p in paths.values()):
        cache_dir.mkdir(parents=True, exist_ok=True)
        val = [r for r in rels if is_val_file(r)]
        train = [r for r in rels if not is_val_file(r)]

        def read(rs: list[str]) -> np.ndarray:
            return tokenize_bytes([(root / r).read_bytes() for r in rs])

        # Too few files for the hash rule: hold out the tail of the stream instead.
        parts = (read(train), read(val)) if train and val else _split_tail(read(rels))
        for p, arr in zip(paths.values(), parts, strict=True):
            _atomic_write(p, arr)
    return TokenDataset(open_bin(paths["train"]), open_bin(paths["val"]), VOCAB_SIZE, name)


def load_dataset(
    path: PathLike | None = None,
    *,
    cache_dir: PathLike | None = None,
    bin_dtype: Any = np.uint16,
    vocab_size: int | None = None,
    include_tests: bool = False,
    max_files: int | None = None,
) -> TokenDataset:
    """Load a token corpus (see the module docstring for the rules).

    Args:
      path: None (stdlib corpus); a directory or glob of text files; a directory with nanoGPT's ``train.bin`` and
        ``val.bin``; one ``.bin`` token file; one text file.
      cache_dir: cache of tokenised text (default ``~/.cache/shardkit/data``).
      bin_dtype: dtype of ``.bin`` files (uint16 as in nanoGPT, or uint32).
      vocab_size: vocabulary of ``.bin`` data; default ``max(token) + 1`` (one pass).
      include_tests: stdlib only: also take ``test``/``tests``/``idle_test`` directories.
      max_files: only the first ``max_files`` sorted text files (quick runs, tests).
    """
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    if path is None:
        root, rels = stdlib_files(include_tests)
        tag = "stdlib-py{}.{}".format(*sys.version_info[:2]) + "-tests" * include_tests
        return _load_text(root, rels[:max_files], tag, cache)
    p = Path(path).expanduser()
    parts = p.parts
    wild = [i for i, s in enumerate(parts) if any(c in s for c in "*?[")]
    if wild:  # a glob: paths (so the split) are relative to its wildcard-free prefix
        root = Path(*parts[: wild[0]]) if wild[0] else Path()
        found = root.glob(str(Path(*parts[wild[0] :])))
        rels = sorted(q.relative_to(root).as_posix() for q in found if q.is_file())
        return _load_text(root, rels[:max_files], "text", cache)
    if p.is_dir() and (p / "train.bin").exists():
        train = open_bin(p / "train.bin", bin_dtype)
        train, val = (train, open_bin(p / "val.bin", bin_dtype)) if (p / "val.bin").exists() else _split_tail(train)
    elif p.is_dir():
        return _load_text(p, list_files(p)[:max_files], "text", cache)
    elif p.suffix == ".bin":
        train, val = _split_tail(open_bin(p, bin_dtype))
    elif p.is_file():
        return _load_text(p.parent, [p.name], "text", cache)
    else:
        raise FileNotFoundError(p)
    _check_width(p, train, np.dtype(bin_dtype))
    if vocab_size is None:
        vocab_size = max(int(a.max()) if len(a) else 0 for a in (train, val)) + 1
    return TokenDataset(train, val, vocab_size, p.name)


#: Token ids at or above this in a uint32 file mean it was written as uint16 (pairs of ids read as one); no
#: tokenizer in use has a vocabulary this large (LLaMA 3: 128,256).
MAX_PLAUSIBLE_VOCAB = 1 << 20


def _check_width(path: Path, tokens: np.ndarray, dtype: np.dtype) -> None:
    """A token file read with the wrong integer width trains on garbage: catch both directions up front."""
    head = np.asarray(tokens[: 1 << 16])
    if dtype.itemsize >= 4 and len(head) and int(head.max()) >= MAX_PLAUSIBLE_VOCAB:
        raise ValueError(
            f"{path}: token id {int(head.max()):,} read as {dtype}: no vocabulary is that large, so this is likely a "
            "uint16 file (nanoGPT's format) read two tokens at a time; set data.bin_dtype=uint16"
        )
    if dtype.itemsize == 2 and len(head) >= 256 and not head[1::2].any() and head[0::2].any():
        raise ValueError(
            f"{path}: every second uint16 token is 0, the high halves of uint32 tokens; this is likely a uint32 "
            "file read as uint16: set data.bin_dtype=uint32"
        )


def batch_offsets(
    n_tokens: int, step: int, batch_size: int, seq_len: int, seed: int = 0, split: str = "train"
) -> np.ndarray:
    """Window starts of global batch ``step``, uniform over ``[0, n_tokens - seq_len - 1]``."""
    if n_tokens < seq_len + 1:
        raise ValueError(f"{split} split has {n_tokens} tokens < seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng([seed, _SPLIT_ID[split], step])
    return rng.integers(0, n_tokens - seq_len, size=batch_size, dtype=np.int64)


def read_windows(
    tokens: np.ndarray, offsets: np.ndarray, col0: int, col1: int, perm: np.ndarray | None = None
) -> Batch:
    """Columns ``[col0, col1)`` of int32 inputs and targets of the windows at ``offsets``.

    With ``perm`` (a context-parallel layout, ``sk.attention.layout_perm``) column j holds the token at window
    position ``perm[j]``, and ``positions`` (those window positions, for RoPE) is returned too.
    """
    if perm is None:
        idx = offsets[:, None] + np.arange(col0, col1 + 1)[None, :]
        w = np.asarray(tokens[idx], dtype=np.int32)  # fancy index: reads only these tokens
        return {"inputs": w[:, :-1].copy(), "targets": w[:, 1:].copy()}
    cols = np.asarray(perm[col0:col1])
    idx = offsets[:, None] + cols[None, :]
    return {
        "inputs": np.asarray(tokens[idx], dtype=np.int32),
        "targets": np.asarray(tokens[idx + 1], dtype=np.int32),
        "positions": np.broadcast_to(cols.astype(np.int32), idx.shape).copy(),
    }


def _to_global(
    tokens: np.ndarray, offsets: np.ndarray, seq_len: int, sharding: Sharding, perm: np.ndarray | None = None
) -> Arrays:
    """Global [B, T] arrays, reading only the blocks held by this process's devices (replicated blocks once:
    experiments/data/assemble.py)."""
    keys = ("inputs", "targets", "positions")[: 2 if perm is None else 3]
    read = lambda spans: read_windows(tokens, offsets[slice(*spans[0])], *spans[1], perm)
    return global_arrays((len(offsets), seq_len), sharding, read, keys)


def global_batch(
    ds: TokenDataset,
    step: int,
    global_batch_size: int,
    seq_len: int,
    sharding: Sharding,
    split: str = "train",
    seed: int = 0,
    perm: np.ndarray | None = None,
) -> Arrays:
    """Global batch ``step`` as sharded int32 ``[B, T]`` jax ``inputs``/``targets`` (+ ``positions`` with ``perm``).

    Every process draws all ``B`` offsets (cheap) but reads tokens only for its own devices' rows and columns, so
    the result equals the single-process batch whatever the process count. ``perm`` lays the sequence out for
    context parallelism (see ``read_windows``).
    """
    tokens = ds.split(split)
    offsets = batch_offsets(len(tokens), step, global_batch_size, seq_len, seed, split)
    return _to_global(tokens, offsets, seq_len, sharding, perm)


@dataclasses.dataclass
class BatchIterator:
    """Deterministic, resumable batches: ``batch(i)`` depends only on ``(seed, split, i)``.

    Iterating yields batch ``step`` and advances ``step``: sharded jax arrays (``global_batch``) when ``sharding`` is
    set, else numpy. The whole state is ``{step, seed}``.
    """

    ds: TokenDataset
    batch_size: int
    seq_len: int
    split: str = "train"
    seed: int = 0
    sharding: Sharding | None = None
    step: int = 0

    def offsets(self, step: int) -> np.ndarray:
        """Window starts of batch ``step``."""
        n = len(self.ds.split(self.split))
        return batch_offsets(n, step, self.batch_size, self.seq_len, self.seed, self.split)

    def batch(self, step: int) -> Batch:
        """The whole batch ``step`` as numpy int32 ``inputs``/``targets`` [B, T]."""
        return read_windows(self.ds.split(self.split), self.offsets(step), 0, self.seq_len)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        args = (self.batch_size, self.seq_len, self.sharding, self.split, self.seed)
        b = self.batch(self.step) if self.sharding is None else global_batch(self.ds, self.step, *args)
        self.step += 1
        return b

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume: the next step and the seed."""
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from a ``state_dict()``."""
        self.step, self.seed = int(state["step"]), int(state["seed"])


def val_batches(
    ds: TokenDataset,
    n_batches: int,
    batch_size: int,
    seq_len: int,
    sharding: Sharding | None = None,
    perm: np.ndarray | None = None,
) -> list[Any]:
    """A fixed eval set: ``n_batches * batch_size`` windows evenly spaced over the val split.

    No seed: every call (each eval, any process count) gives the same windows; numpy dicts, or sharded jax arrays
    when ``sharding`` is given.
    """
    n = len(ds.val)
    batch_offsets(n, 0, 0, seq_len, split="val")  # validates the length
    offsets = np.linspace(0, n - seq_len - 1, n_batches * batch_size).round().astype(np.int64)
    offsets = offsets.reshape(n_batches, batch_size)
    if sharding is None:
        return [read_windows(ds.val, o, 0, seq_len, perm) for o in offsets]
    return [_to_global(ds.val, o, seq_len, sharding, perm) for o in offsets]
