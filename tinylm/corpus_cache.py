"""A prepared corpus on disk: <cache_dir>/<corpus>-<tokenizer>/ with train.bin, val.bin,
tokenizer.json and meta.json (data/README.md describes them).

tinylm/data.py's prepare_data writes the ids with `write_ids` into a hidden build directory,
`publish`es it under its name in one rename, and reads it back with `open_cache`, which accepts
only a directory that is complete and current.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinylm.splits import SplitPlan
from tinylm.tokenizer import Tokenizer, load_tokenizer

ENCODE_CHUNK = 1 << 20  # characters of rows encoded together (tokenizers spreads them on cores)


@dataclass
class PreparedData:
    """A prepared corpus: where its ids are, what meta.json says, and its tokenizer."""

    directory: Path
    train_path: Path
    val_path: Path
    meta: dict
    tokenizer: Tokenizer
    from_cache: bool = False  # True when an earlier run's files were reused


def bin_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class IdWriter:
    """Appends one split's ids to its .bin file a chunk of rows at a time, the joiner's ids
    between consecutive rows; counts rows and tokens."""

    def __init__(self, path: Path, tokenizer: Tokenizer, joiner: str):
        self.file = open(path, "wb")
        self.tokenizer, self.dtype = tokenizer, bin_dtype(tokenizer.vocab_size)
        self.joiner_ids = np.array(tokenizer.encode(joiner), dtype=self.dtype)
        self.pending: list[str] = []
        self.pending_chars = self.rows = self.tokens = 0

    def add(self, row: str) -> None:
        self.pending.append(row)
        self.pending_chars += len(row)
        if self.pending_chars >= ENCODE_CHUNK:
            self.flush()

    def flush(self) -> None:
        pieces = []
        for ids in self.tokenizer.encode_batch(self.pending):
            if self.rows > 0:
                pieces.append(self.joiner_ids)
            pieces.append(np.array(ids, dtype=self.dtype))
            self.rows += 1
        if pieces:
            chunk = np.concatenate(pieces)
            chunk.tofile(self.file)
            self.tokens += len(chunk)
        self.pending, self.pending_chars = [], 0


def write_ids(plan: SplitPlan, tokenizer: Tokenizer, joiner: str, directory: Path
              ) -> dict[str, IdWriter]:
    """Tokenize the corpus once into directory/{train,val}.bin; -> the writer of each split."""
    writers = {split: IdWriter(directory / f"{split}.bin", tokenizer, joiner)
               for split in ("train", "val")}
    try:
        for split, row in plan.rows():
            writers[split].add(row)
        for writer in writers.values():
            writer.flush()
    finally:
        for writer in writers.values():
            writer.file.close()
    return writers


def open_cache(directory: Path, expected: str | None) -> tuple[PreparedData | None, str | None]:
    """(the prepared data in `directory`, None) if it is complete and current, else (None, why).

    `expected` None accepts any fingerprint. The .bin sizes must agree with meta.json's counts.
    """
    meta_path = directory / "meta.json"
    if not directory.is_dir():
        return None, None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        return None, f"{meta_path} is missing or unreadable ({err.__class__.__name__})"
    if expected is not None and meta.get("fingerprint") != expected:
        return None, "inputs or settings changed since it was written"
    itemsize = np.dtype(meta.get("dtype", "uint16")).itemsize
    for split in ("train", "val"):
        path = directory / f"{split}.bin"
        size = path.stat().st_size if path.is_file() else None
        if size is None or size != meta.get(f"{split}_tokens", -1) * itemsize:
            held = "is missing" if size is None else f"holds {size // itemsize:,} tokens"
            return None, (f"{path.name} {held} but meta.json says "
                          f"{meta.get(f'{split}_tokens')} tokens")
    try:
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except (OSError, ValueError) as err:
        return None, str(err)
    if tokenizer.vocab_size != meta.get("vocab_size"):
        return None, (f"tokenizer.json has {tokenizer.vocab_size} tokens but meta.json says "
                      f"{meta.get('vocab_size')}")
    return PreparedData(directory, directory / "train.bin", directory / "val.bin", meta,
                        tokenizer, from_cache=True), None


def hidden_sibling(directory: Path, label: str) -> Path:
    """A fresh hidden name beside `directory`, unique to this process (for builds and trash)."""
    return directory.with_name(f".{directory.name}.{label}-{os.getpid()}-{secrets.token_hex(4)}")


def publish(build: Path, directory: Path) -> None:
    """Move a finished build to `directory`, replacing an outdated one; never half-visible."""
    trash = None
    if directory.exists():
        trash = hidden_sibling(directory, "old")
        os.rename(directory, trash)
    try:
        os.rename(build, directory)
    except OSError:
        if not directory.is_dir():  # not "another process published the same build first"
            raise
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

