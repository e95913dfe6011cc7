"""The tokenizers `experiments.data.prepare` runs: bytes, or a Hugging Face folder's tokenizer.json.

    byte      ids 0..255 are the document's UTF-8 bytes; the end-of-document id is 256 (`BYTE_EOD`, the same EOT
              as the built-in corpus of experiments/data/text.py), so the vocabulary is 257 ids (a model pads it
              to 384)
    <dir>     a Hugging Face tokenizer folder (or its tokenizer.json): loaded with the `tokenizers` package (no
              transformers); the end-of-document token is the folder's eos token: `eos_token` of
              tokenizer_config.json, else `eos_token_id` of config.json (or generation_config.json), unless --eod
              names one. Its vocabulary is every id it can produce, added tokens included.

Documents are encoded without the tokenizer's special tokens (no BOS) unless `add_special_tokens`; the caller puts
the end-of-document id after each document.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments.data.readers import PrepareError

BYTE_EOD = 256
BYTE_VOCAB = 257


@dataclasses.dataclass
class Tokenizer:
    """A loaded tokenizer: `encode(docs)` -> one int array per document (no end-of-document id)."""

    spec: str  # "byte" or the folder / tokenizer.json path as given
    vocab_size: int
    eod_id: int
    eod_token: str
    sha256: str  # of tokenizer.json ("" for bytes): part of the input fingerprint
    add_special_tokens: bool = False
    hf: Any = None  # tokenizers.Tokenizer

    @property
    def wants_str(self) -> bool:
        """A Hugging Face tokenizer reads text; the byte tokenizer takes raw bytes as they are."""
        return self.hf is not None

    def encode(self, docs: Sequence[str | bytes]) -> list[np.ndarray]:
        if self.hf is None:
            return [np.frombuffer(d.encode("utf-8") if isinstance(d, str) else d, np.uint8) for d in docs]
        encode = getattr(self.hf, "encode_batch_fast", self.hf.encode_batch)  # _fast (no offsets): tokenizers 0.21+
        out = encode(list(docs), add_special_tokens=self.add_special_tokens)
        return [np.asarray(e.ids, np.uint32) for e in out]

    def describe(self) -> dict[str, Any]:
        """The manifest's `tokenizer` entry."""
        kind = "hf" if self.hf is not None else "byte"
        return dict(kind=kind, path=self.spec, sha256=self.sha256, eod_token=self.eod_token,
                    add_special_tokens=self.add_special_tokens)  # fmt: skip


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PrepareError(f"{path}: not readable JSON ({e})") from None


def _eos(folder: Path, hf: Any) -> tuple[int, str] | None:
    """(id, token) of the folder's eos token, from tokenizer_config.json, config.json or generation_config.json."""
    token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # {"content": "</s>", ...} in older configs
        token = token.get("content")
    if isinstance(token, str) and hf.token_to_id(token) is not None:
        return hf.token_to_id(token), token
    for name in ("config.json", "generation_config.json"):
        ids = _read_json(folder / name).get("eos_token_id")
        ids = ids[0] if isinstance(ids, list) and ids else ids
        if isinstance(ids, int):
            return ids, hf.id_to_token(ids) or ""
    return None


def load_tokenizer(spec: str, eod: str = "", add_special_tokens: bool = False) -> Tokenizer:
    """The tokenizer `spec` names: "byte", or a Hugging Face tokenizer folder / tokenizer.json (see the module
    docstring); `eod` overrides the end-of-document token (a token string of the vocabulary)."""
    if spec == "byte":
        if eod:
            raise PrepareError("--eod applies to a Hugging Face tokenizer; the byte tokenizer's is id 256")
        return Tokenizer("byte", BYTE_VOCAB, BYTE_EOD, "<eod:256>", "")
    path = Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise PrepareError(f"--tokenizer {spec}: no tokenizer.json there; give 'byte' or a Hugging Face tokenizer "
                           "folder (with tokenizer.json)")  # fmt: skip
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise PrepareError("a Hugging Face tokenizer needs the tokenizers package: pip install tokenizers") from None
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises its own Exception type
        raise PrepareError(f"{file}: not a loadable tokenizer.json ({e})") from None
    vocab = max(hf.get_vocab(with_added_tokens=True).values()) + 1
    if eod:
        found = hf.token_to_id(eod)
        if found is None:
            raise PrepareError(f"--eod {eod!r} is not a token of {file}")
        eos: tuple[int, str] | None = (found, eod)
    else:
        eos = _eos(file.parent, hf)
    if eos is None:
        raise PrepareError(f"{file.parent}: no eos token (tokenizer_config.json eos_token, config.json "
                           "eos_token_id); name the end-of-document token with --eod")  # fmt: skip
    if not 0 <= eos[0] < vocab:
        raise PrepareError(f"{file.parent}: eos token id {eos[0]} is outside the tokenizer's {vocab} ids")
    sha = hashlib.sha256(file.read_bytes()).hexdigest()
    return Tokenizer(str(spec), vocab, eos[0], eos[1], sha, add_special_tokens, hf)
