"""Corpus -> token ids on disk -> random training windows.

From the command line (Hydra, same conf/ tree as training):

    tinylm-prepare                                      # TinyStories sample, byte-level BPE 4096
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]'

In code (training calls the same function, which returns at once when the cache is current):

    prepared = prepare_data(DataConfig(), TokenizerConfig())
    sampler = BatchSampler(prepared.train_path, block_size=128, batch_size=16, seed=1337)
    x, y = sampler.next_batch("cpu")                    # (B, T) int64; y is x shifted by one

Preparing reads the corpus with HF `datasets` (local text files, or the hub when online), holds
out a validation part, trains the tokenizer on the training part and writes
<cache_dir>/<corpus>-<tokenizer>/{train.bin, val.bin, tokenizer.json, meta.json}. meta.json
keeps a fingerprint of the input files' contents and of every setting, so a second run with the
same inputs reuses the directory and anything changed rebuilds it. A build happens in a temporary
directory that is renamed into place when complete: no half-written cache is ever visible.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import itertools
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tinylm.config import integer, number, one_of, project_root
from tinylm.tokenizer import EOT, Tokenizer, TokenizerConfig, load_tokenizer, train_tokenizer

DATA_ROOT_ENV = "TINYLM_DATA_ROOT"  # overrides where the offline corpora are looked for
FORMAT_VERSION = 1  # bump when what prepare_data writes changes: old caches then rebuild
SOURCES = ("local", "hub")
SAMPLE_BY = ("line", "paragraph", "document")
SPLITS = ("auto", "tail", "documents")
ON_DECODE_ERROR = ("strict", "replace")
# What joins two rows of a local file back into the text they were cut from; whole documents
# are joined by <|endoftext|> instead, so the model sees where one ends.
ROW_JOINER = {"line": "\n", "paragraph": "\n\n", "document": EOT}
HOW_TO_POINT = (f"point at the folder holding the corpora with data.data_root=/path/to/data or "
                f"{DATA_ROOT_ENV}=/path/to/data, use your own files with data=text "
                "'data.files=[path/to/*.txt]', or read the hub with data.source=hub "
                "(needs internet)")


@dataclass
class DataConfig:
    """Which corpus to read and how to cut it; schema of conf/data/*.yaml (defaults: here only)."""

    name: str = "tinystories"  # the cache goes to <cache_dir>/<name>-<tokenizer.name>/
    source: str = "local"  # local: `files` below | hub: datasets.load_dataset(hub_id)
    files: list[str] = field(default_factory=lambda: [
        "tinystories/train-head.txt", "tinystories/validation-head.txt"])
    data_root: str | None = None  # where relative `files` live; None: $TINYLM_DATA_ROOT or
    #                               ../shared/data from the project root (or the current dir)
    sample_by: str = "paragraph"  # how local files are cut into rows: line | paragraph | document
    split: str = "auto"  # tail | documents | auto (documents for hub, tail for local files)
    val_fraction: float = 0.1  # share of the text (tail) or of the documents held out
    split_seed: int = 1337  # which documents go to validation under split=documents
    hub_id: str | None = "roneneldan/TinyStories"  # for source=hub
    hub_split: str = "train"
    max_documents: int | None = None  # hub: stream only the first N documents (no full download)
    cache_dir: str = "data"  # relative to the current directory
    on_decode_error: str = "strict"  # strict: stop at invalid UTF-8 | replace: use U+FFFD

    def __post_init__(self):
        for key, allowed in (("source", SOURCES), ("sample_by", SAMPLE_BY), ("split", SPLITS),
                             ("on_decode_error", ON_DECODE_ERROR)):
            one_of(f"data.{key}", getattr(self, key), allowed)
        number("data.val_fraction", self.val_fraction, 0, 1, low_open=True, high_open=True)
        integer("data.split_seed", self.split_seed)
        if self.source == "hub" and not self.hub_id:
            raise ValueError(f"data.source=hub needs data.hub_id (corpus {self.name!r} has none)")
        if self.source == "local" and not self.files:
            raise ValueError("data.files is empty: name the local text files (paths or globs), "
                             "e.g. data=text 'data.files=[notes/*.txt]'")
        if not isinstance(self.files, list) or not all(isinstance(f, str) for f in self.files):
            raise ValueError(f"data.files={self.files!r} is not allowed: must be a list of "
                             "paths or globs")
        integer("data.max_documents", self.max_documents, least=2, null="for all")
        if not self.name or "/" in self.name:
            raise ValueError(f"data.name={self.name!r} is not allowed: it names the cache "
                             "directory, so it must be non-empty and without '/'")

    @property
    def split_kind(self) -> str:
        """`split` with auto resolved: hub rows are whole documents, local files a text stream."""
        if self.split != "auto":
            return self.split
        return "documents" if self.source == "hub" else "tail"

    @property
    def row_unit(self) -> str:
        """What one row of the corpus is: line, paragraph or document."""
        return "document" if self.source == "hub" else self.sample_by

    @property
    def joiner(self) -> str:
        """Text between two consecutive rows of a split."""
        return EOT if self.source == "hub" else ROW_JOINER[self.sample_by]


@dataclass
class PreparedData:
    """A prepared corpus: where its ids are, what meta.json says, and its tokenizer."""

    directory: Path
    train_path: Path
    val_path: Path
    meta: dict
    tokenizer: Tokenizer
    from_cache: bool = False  # True when an earlier run's files were reused


# ---------------------------------------------------------------------------- finding the inputs

def data_root_candidates(cfg: DataConfig) -> list[tuple[Path, str]]:
    """Folders where relative `data.files` are looked for, in order, each with why it is tried."""
    if cfg.data_root is not None:
        candidates = [(Path(cfg.data_root), "data.data_root")]
    elif os.environ.get(DATA_ROOT_ENV):
        candidates = [(Path(os.environ[DATA_ROOT_ENV]), f"${DATA_ROOT_ENV}")]
    else:
        candidates = [(Path.cwd().parent / "shared" / "data",
                       "../shared/data from the current directory")]
        if project_root() is not None:
            candidates.insert(0, (project_root().parent / "shared" / "data",
                                  "../shared/data from the project root"))
    unique: dict[Path, str] = {}
    for path, why in candidates:
        unique.setdefault(path.expanduser().resolve(), why)
    return list(unique.items())


def _match(root: Path, pattern: str) -> list[Path]:
    """Files `pattern` names under `root` (absolute patterns ignore root); sorted for globs."""
    path = Path(pattern).expanduser()
    if not path.is_absolute():
        path = root / path
    if any(ch in pattern for ch in "*?["):
        anchor = Path(path.anchor)
        return sorted(p for p in anchor.glob(str(path.relative_to(anchor))) if p.is_file())
    return [path] if path.is_file() else []


def resolve_files(cfg: DataConfig) -> tuple[Path, list[Path]]:
    """(data root, corpus files) for a local corpus; FileNotFoundError names every path tried."""
    tried = []
    for root, why in data_root_candidates(cfg):
        files, missing = [], []
        for pattern in cfg.files:
            if (root / Path(pattern).expanduser()).is_dir():
                example = f"{pattern.rstrip('/')}/*.txt"
                raise ValueError(f"data.files: {pattern} is a directory ({root / pattern}); name "
                                 f"the files in it, e.g. 'data.files=[{example}]'")
            matches = _match(root, pattern)
            if not matches:
                missing.append(pattern)
            files += [m for m in matches if m not in files]  # a file named twice is read once
        if not missing:
            return root, files
        tried.append(f"{root} ({why}): no {', '.join(missing)}")
    raise FileNotFoundError(f"corpus {cfg.name!r}: its files were not found: in "
                            + "; in ".join(tried) + f". To fix: {HOW_TO_POINT}.")


def scan_file(path: Path, strict_utf8: bool = True, log: Callable[[str], None] = print) -> dict:
    """Size and SHA-256 of a corpus file; refuses empty files and (if strict) invalid UTF-8."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed = newlines = 0  # bytes and line breaks before the current chunk
    has_text = bad_utf8 = False
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            digest.update(chunk)
            has_text = has_text or bool(chunk.strip())
            if not bad_utf8:
                pending = decoder.getstate()[0]  # a character cut by the chunk border
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as err:
                    bad_utf8 = True
                    where = pending + chunk
                    offset = consumed - len(pending) + err.start
                    line = newlines + where[:err.start].count(b"\n") + 1
                    problem = (f"{path} is not valid UTF-8: byte offset {offset} (line {line}) "
                               f"holds {where[err.start:err.end]!r} ({err.reason})")
                    if strict_utf8:
                        raise ValueError(problem + "; fix the file or set "
                                         "data.on_decode_error=replace to read bad bytes as "
                                         "U+FFFD") from None
                    log(f"Note: {problem}; replacing bad bytes with U+FFFD "
                        "(data.on_decode_error=replace)")
            if not chunk:
                break
            consumed += len(chunk)
            newlines += chunk.count(b"\n")
    if consumed == 0:
        raise ValueError(f"corpus file {path} is empty (0 bytes)")
    if not has_text:
        raise ValueError(f"corpus file {path} holds only whitespace ({consumed} bytes)")
    return {"path": str(path), "bytes": consumed, "sha256": digest.hexdigest()}


# ------------------------------------------------------------------------ rows and their split

def load_rows(cfg: DataConfig, files: list[Path], cache_dir: Path, log: Callable[[str], None]):
    """The corpus as a `datasets.Dataset` with one "text" column, one row per line/paragraph/doc."""
    import datasets

    if cfg.source == "local":
        # A fresh cache_dir per build: datasets' own cache then cannot hand back rows of an earlier
        # version of the same file; whether to rebuild at all is decided by our fingerprint.
        return datasets.load_dataset(
            "text", data_files=[str(f) for f in files], split="train", sample_by=cfg.sample_by,
            encoding_errors="replace" if cfg.on_decode_error == "replace" else "strict",
            cache_dir=str(cache_dir))
    try:
        if cfg.max_documents:
            stream = datasets.load_dataset(cfg.hub_id, split=cfg.hub_split, streaming=True)
            texts = [row["text"] for row in stream.take(cfg.max_documents)]
            rows = datasets.Dataset.from_dict({"text": texts})
        else:
            rows = datasets.load_dataset(cfg.hub_id, split=cfg.hub_split)
    except Exception as err:  # offline, unknown id, ...: say what to do instead
        raise RuntimeError(f"could not load {cfg.hub_id!r} (split {cfg.hub_split!r}) from the "
                           f"Hugging Face hub: {err}\nOffline, use data.source=local") from err
    if "text" not in rows.column_names:
        raise ValueError(f"hub dataset {cfg.hub_id!r} has no 'text' column "
                         f"(columns: {', '.join(rows.column_names)})")
    log(f"Read {len(rows):,} documents from the hub")
    return rows.select_columns(["text"])


def split_rows(rows, cfg: DataConfig):
    """(train, val, how): a deterministic hold-out of cfg.val_fraction of the corpus.

    tail: the last val_fraction of the characters, cut at a row boundary; a single row (one
    document, e.g. Tiny Shakespeare) is cut inside at int(n * (1 - val_fraction)) characters,
    exactly as nanoGPT does. documents: a seeded random val_fraction of the documents.
    """
    import datasets
    import pyarrow.compute as pc

    n = len(rows)
    if cfg.split_kind == "documents":
        if n < 2:
            raise ValueError(f"data.split=documents needs at least 2 documents, the corpus has {n};"
                             " use data.split=tail")
        n_val = min(max(1, round(n * cfg.val_fraction)), n - 1)
        order = np.random.default_rng(cfg.split_seed).permutation(n)
        val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
        how = f"{n_val:,} of {n:,} documents held out at random (data.split_seed={cfg.split_seed})"
        return rows.select(train_idx), rows.select(val_idx), how
    if n == 1:
        text = rows[0]["text"]
        cut = int(len(text) * (1 - cfg.val_fraction))
        if not 0 < cut < len(text):
            raise ValueError(f"the corpus is too short to hold out a validation part: "
                             f"{len(text)} characters")
        how = f"last {len(text) - cut:,} of {len(text):,} characters held out"
        return (datasets.Dataset.from_dict({"text": [text[:cut]]}),
                datasets.Dataset.from_dict({"text": [text[cut:]]}), how)
    lengths = pc.utf8_length(rows.with_format("arrow")["text"]).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # where each row begins in the text
    # validation starts with the first row that begins past the cut
    first_val = int(np.searchsorted(starts, lengths.sum() * (1 - cfg.val_fraction)))
    first_val = min(max(first_val, 1), n - 1)
    how = f"last {n - first_val:,} of {_count(n, cfg.row_unit)} held out"
    return rows.select(range(first_val)), rows.select(range(first_val, n)), how


def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}{'' if n == 1 else 's'}"


# ----------------------------------------------------------------------------- writing the ids

def bin_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_ids(rows, tokenizer: Tokenizer, joiner: str, path: Path, desc: str, work_dir: Path
              ) -> int:
    """Tokenize `rows` with a batched datasets.map and write the id stream to `path`; -> count."""
    joiner_ids = tokenizer.encode(joiner)
    last = len(rows) - 1
    dtype = bin_dtype(tokenizer.vocab_size)

    def encode(batch, indices):
        ids = tokenizer.encode_batch(batch["text"])
        pairs = zip(ids, indices, strict=True)
        return {"ids": [row + joiner_ids if i < last else row for row, i in pairs]}

    encoded = rows.map(encode, batched=True, batch_size=1000, with_indices=True,
                       remove_columns=rows.column_names, desc=desc,
                       # our own fingerprint: hashing the tokenizer object would only warn
                       new_fingerprint=hashlib.sha256(f"{desc}{path}".encode()).hexdigest()[:16],
                       cache_file_name=str(work_dir / f"{path.stem}-ids.arrow"))
    with open(path, "wb") as f:
        for batch in encoded.with_format("arrow").iter(batch_size=10_000):
            flat = batch.column("ids").combine_chunks().flatten()
            f.write(flat.to_numpy(zero_copy_only=False).astype(dtype).tobytes())
    return path.stat().st_size // dtype.itemsize


def _texts(*splits) -> Iterator[str]:
    for rows in splits:
        for batch in rows.iter(batch_size=1000):
            yield from batch["text"]


# --------------------------------------------------------------------------------- the cache

def fingerprint(data_cfg: DataConfig, tok_cfg: TokenizerConfig, inputs: list[dict]) -> str:
    """SHA-256 of everything the prepared files depend on: input contents and all settings.

    Where files live (data_root, cache_dir, absolute paths) is left out: moving the corpus does
    not change the tokens.
    """
    import tokenizers

    settings = dataclasses.asdict(data_cfg)
    for where in ("data_root", "cache_dir"):
        settings.pop(where)
    key = {"format": FORMAT_VERSION, "data": settings, "tokenizer": dataclasses.asdict(tok_cfg),
           "tokenizers": tokenizers.__version__ if tok_cfg.name == "bpe" else None,
           "inputs": [(i["bytes"], i["sha256"]) for i in inputs]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _open_cache(directory: Path, expected: str | None) -> tuple[PreparedData | None, str | None]:
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


def _sibling(directory: Path, label: str) -> Path:
    """A fresh hidden name beside `directory`, unique to this process (for builds and trash)."""
    return directory.with_name(f".{directory.name}.{label}-{os.getpid()}-{secrets.token_hex(4)}")


def _publish(build: Path, directory: Path) -> None:
    """Move a finished build to `directory`, replacing an outdated one; never half-visible."""
    trash = None
    if directory.exists():
        trash = _sibling(directory, "old")
        os.rename(directory, trash)
    try:
        os.rename(build, directory)
    except OSError:
        if not directory.is_dir():  # not "another process published the same build first"
            raise
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def prepare_data(data_cfg: DataConfig, tok_cfg: TokenizerConfig, *, force: bool = False,
                 log: Callable[[str], None] = print) -> PreparedData:
    """Tokenize the corpus into <cache_dir>/<name>-<tokenizer>/, or reuse it if it is current."""
    start = time.perf_counter()
    cache_root = Path(data_cfg.cache_dir).expanduser()
    directory = cache_root / f"{data_cfg.name}-{tok_cfg.name}"
    files: list[Path] = []
    if data_cfg.source == "local":
        root, files = resolve_files(data_cfg)
        inputs = [scan_file(f, data_cfg.on_decode_error == "strict", log) for f in files]
        listing = ", ".join(f"{f.relative_to(root) if f.is_relative_to(root) else f} "
                            f"({i['bytes']:,} bytes)" for f, i in zip(files, inputs, strict=True))
        log(f"Corpus {data_cfg.name}: local files under {root}: {listing}")
    else:
        inputs = []
        limit = f", first {data_cfg.max_documents:,} documents" if data_cfg.max_documents else ""
        log(f"Corpus {data_cfg.name}: Hugging Face hub dataset {data_cfg.hub_id} "
            f"(split {data_cfg.hub_split}{limit})")
    key = fingerprint(data_cfg, tok_cfg, inputs)

    if not force:
        cached, why_not = _open_cache(directory, key)
        if cached is not None:
            m = cached.meta
            log(f"Reusing {directory}/ (same inputs and settings, fingerprint {key[:12]}): "
                f"train {m['train_tokens']:,} tokens, val {m['val_tokens']:,} tokens, "
                f"vocab_size {m['vocab_size']:,} ({time.perf_counter() - start:.1f} s)")
            return cached
        if why_not:
            log(f"Rebuilding {directory}/: {why_not}")

    cache_root.mkdir(parents=True, exist_ok=True)
    build = _sibling(directory, "tmp")
    build.mkdir()
    try:
        work = build / "work"  # datasets' arrow files; deleted before the build is published
        rows = load_rows(data_cfg, files, work, log)
        if len(rows) == 0:
            raise ValueError(f"corpus {data_cfg.name!r} has no text")
        train_rows, val_rows, how = split_rows(rows, data_cfg)
        log(f"Split ({data_cfg.split_kind}): {how}")
        if tok_cfg.name == "char":
            # Every character must get an id, the joiner's and validation's too (nanoGPT's
            # shakespeare_char also takes its vocabulary from the whole text).
            texts = itertools.chain(_texts(train_rows, val_rows), [data_cfg.joiner])
            tokenizer = train_tokenizer(tok_cfg, texts)
        else:
            log(f"Training byte-level BPE (vocab_size {tok_cfg.vocab_size}) on the training split")
            tokenizer = train_tokenizer(tok_cfg, _texts(train_rows), length=len(train_rows))
        counts = {}
        for split, part in (("train", train_rows), ("val", val_rows)):
            counts[split] = write_ids(part, tokenizer, data_cfg.joiner,
                                      build / f"{split}.bin", f"Tokenizing {split}", work)
            if counts[split] == 0:
                raise ValueError(f"the {split} split of corpus {data_cfg.name!r} has no tokens")
        tokenizer.save(build / "tokenizer.json")
        meta = {
            "format": FORMAT_VERSION, "corpus": data_cfg.name, "source": data_cfg.source,
            "inputs": inputs, "hub_id": data_cfg.hub_id if data_cfg.source == "hub" else None,
            "tokenizer": tok_cfg.name, "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "dtype": bin_dtype(tokenizer.vocab_size).name,
            "split": data_cfg.split_kind, "split_detail": how,
            "train_tokens": counts["train"], "val_tokens": counts["val"],
            "train_rows": len(train_rows), "val_rows": len(val_rows),
            "fingerprint": key,
            "settings": {"data": dataclasses.asdict(data_cfg),
                         "tokenizer": dataclasses.asdict(tok_cfg)},
        }
        (build / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                         encoding="utf-8")
        del rows, train_rows, val_rows  # release datasets' memory maps before deleting the files
        shutil.rmtree(work, ignore_errors=True)
        _publish(build, directory)
    finally:
        shutil.rmtree(build, ignore_errors=True)

    prepared, problem = _open_cache(directory, None)
    if prepared is None:
        raise RuntimeError(f"{directory} was just written but does not read back: {problem}")
    prepared.from_cache = False
    m = prepared.meta
    dtype, unit = m["dtype"], data_cfg.row_unit
    log(f"Wrote {directory}/ in {time.perf_counter() - start:.1f} s:\n"
        f"  train.bin       {m['train_tokens']:>12,} tokens ({dtype}, "
        f"{_count(m['train_rows'], unit)})\n"
        f"  val.bin         {m['val_tokens']:>12,} tokens ({dtype}, "
        f"{_count(m['val_rows'], unit)})\n"
        f"  tokenizer.json  {m['tokenizer']}, vocab_size {m['vocab_size']:,} "
        f"({EOT} = id {m['eot_id']})\n"
        f"  meta.json       fingerprint {key[:12]}")
    return prepared


# ------------------------------------------------------------------------------ batch sampling

def _require_window(n_tokens: int, block_size: int, what: str,
                    advice: str = "use a longer corpus or a smaller model.block_size") -> None:
    if n_tokens < block_size + 1:
        raise ValueError(f"{what} holds {n_tokens:,} tokens, fewer than one training window of "
                         f"model.block_size + 1 = {block_size + 1}; {advice}")


def check_enough_tokens(prepared: PreparedData, block_size: int) -> None:
    """Raise ValueError unless train and val both hold at least one window of block_size + 1.

    The advice fits the split that is short: more validation text takes it from training.
    """
    n_train, n_val = (prepared.meta[f"{split}_tokens"] for split in ("train", "val"))
    fits = min(n_train, n_val) - 1  # the largest block_size both splits hold a window of
    smaller = f"model.block_size={fits}" if fits >= 1 else "a smaller model.block_size"
    _require_window(n_train, block_size, f"{prepared.directory / 'train.bin'}",
                    f"use a longer corpus or {smaller}")
    _require_window(n_val, block_size, f"{prepared.directory / 'val.bin'}",
                    f"use {smaller}, a longer corpus, or a larger data.val_fraction (now the "
                    f"training split holds {n_train:,} tokens)")


class BatchSampler:
    """Random windows of block_size + 1 tokens from a .bin file, reproducible and resumable.

    The random stream belongs to this sampler (a seeded torch.Generator), so a saved
    state_dict() resumes it bit-exactly. Under DDP every rank draws the same world_size *
    batch_size starts and keeps its own slice: ranks see different windows, together the same
    global batch a single process would. For a fixed evaluation set, create a new sampler with a
    fixed seed for each evaluation.
    """

    def __init__(self, path: str | Path, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1, dtype: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"token file {self.path} does not exist; run tinylm-prepare")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not allowed with world_size={world_size}")
        if dtype is None:  # prepare_data records it beside the ids
            meta_path = self.path.parent / "meta.json"
            if not meta_path.is_file():
                raise FileNotFoundError(f"{meta_path} (which says the dtype of {self.path.name}) "
                                        "does not exist; pass dtype= or run tinylm-prepare")
            dtype = json.loads(meta_path.read_text(encoding="utf-8"))["dtype"]
        # A read-only memory map: only the windows drawn are read from disk.
        self.data = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        _require_window(len(self.data), block_size, str(self.path))
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next_batch(self, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64 on `device`; y[b, t] is the token after x[b, t]."""
        B, T = self.batch_size, self.block_size
        n_starts = len(self.data) - T  # a window starting at i needs tokens i .. i+T
        starts = torch.randint(n_starts, (self.world_size * B,), generator=self.generator)
        starts = starts[self.rank * B:(self.rank + 1) * B].numpy()
        self.batches_drawn += 1
        windows = self.data[starts[:, None] + np.arange(T + 1)]  # (B, T+1)
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each
        device = torch.device(device)
        if device.type == "cuda":  # pinned memory lets the copy overlap with compute
            return x.pin_memory().to(device, non_blocking=True), \
                y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def state_dict(self) -> dict:
        """Everything needed to continue the same stream of batches (tensors and primitives)."""
        return {"seed": self.seed, "block_size": self.block_size, "batch_size": self.batch_size,
                "rank": self.rank, "world_size": self.world_size,
                "batches_drawn": self.batches_drawn, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict(); the sampler must have the same shape and rank layout."""
        for key in ("block_size", "batch_size", "rank", "world_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the batch sampler: saved {key}={state[key]}, "
                                 f"this run has {key}={getattr(self, key)}")
        self.seed, self.batches_drawn = state["seed"], state["batches_drawn"]
        self.generator.set_state(state["generator"])
