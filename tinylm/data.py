"""Corpus -> token ids on disk -> random training windows.

From the command line (Hydra, same conf/ tree as training):

    tinylm-prepare                                      # embedded TinyStories sample, BPE 4096
    tinylm-prepare data=tinyshakespeare tokenizer=char
    tinylm-prepare data=text 'data.files=[notes/*.txt]'
    tinylm-prepare data=tinystories_hub                 # the full TinyStories, streamed (online)

In code (training calls the same function, which returns at once when the cache is current):

    prepared = prepare_data(DataConfig(), TokenizerConfig())
    sampler = BatchSampler(prepared.train_path, block_size=128, batch_size=16, seed=1337)
    x, y = sampler.next_batch("cpu")                    # (B, T) int64; y is x shifted by one

Preparing streams the corpus (tinylm/sources.py: local files or the hub) as rows, routes each row
to the training or validation split, trains the tokenizer on at most tokenizer.train_bytes of the
training rows and appends the ids a chunk of rows at a time to
<cache_dir>/<corpus>-<tokenizer>/{train.bin, val.bin}, beside tokenizer.json and meta.json. So
memory stays flat whatever the corpus size. meta.json keeps a fingerprint of the input files'
contents and of every setting, so a second run with the same inputs reuses the directory and
anything changed rebuilds it. A build happens in a temporary directory that is renamed into place
when complete: no half-written cache is ever visible.
"""

from __future__ import annotations

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

from tinylm.config import integer, number, one_of
from tinylm.sources import (
    check_embedded,
    check_hub_reachable,
    data_root,
    hub_rows,
    read_rows,
    resolve_files,
    scan_file,
)
from tinylm.tokenizer import EOT, Tokenizer, TokenizerConfig, load_tokenizer, train_tokenizer

FORMAT_VERSION = 1  # bump when what prepare_data writes changes: old caches then rebuild
SOURCES = ("local", "hub")
SAMPLE_BY = ("line", "paragraph", "document")
SPLITS = ("auto", "tail", "documents")
ON_DECODE_ERROR = ("strict", "replace")
# What joins two rows of a local file back into the text they were cut from; whole documents
# are joined by <|endoftext|> instead, so the model sees where one ends.
ROW_JOINER = {"line": "\n", "paragraph": "\n\n", "document": EOT}
ENCODE_CHUNK = 1 << 20  # characters of rows encoded together (tokenizers spreads them on cores)


@dataclass
class DataConfig:
    """Which corpus to read and how to cut it; schema of conf/data/*.yaml (defaults: here only)."""

    name: str = "tinystories"  # the cache goes to <cache_dir>/<name>-<tokenizer.name>/
    source: str = "local"  # local: `files` below | hub: datasets.load_dataset(hub_id)
    files: list[str] = field(default_factory=lambda: [
        "tinystories/train-head.txt", "tinystories/validation-head.txt"])
    data_root: str | None = None  # where relative `files` live; None: $TINYLM_DATA_ROOT, else
    #                               the embedded corpora (data/corpora/)
    sample_by: str = "paragraph"  # how local files are cut into rows: line | paragraph | document
    split: str = "auto"  # tail | documents | auto (documents for hub, tail for local files)
    val_fraction: float = 0.1  # share of the text (tail) or of the documents held out
    split_seed: int = 1337  # which documents go to validation under split=documents
    hub_id: str | None = "roneneldan/TinyStories"  # for source=hub
    hub_split: str = "train"
    hub_val_split: str | None = "validation"  # hub: the split to validate on; None: hold out
    #                                           a seeded val_fraction of hub_split's documents
    max_documents: int | None = None  # hub: only the first N documents of hub_split (and
    #                                   N * val_fraction of hub_val_split)
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
        if self.source == "hub" and self.hub_val_split:
            return "hub"
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


# ------------------------------------------------------------------------ rows and their split

@dataclass
class SplitPlan:
    """How a corpus divides into training and validation rows, decided before any is written.

    `rows()` streams the corpus afresh on every call as ("train" | "val", text) pairs in corpus
    order; preparing reads it twice (tokenizer training stops early), so nothing is held whole.
    """

    rows: Callable[[], Iterator[tuple[str, str]]]
    describe: Callable[[dict[str, int]], str]  # rows per split -> e.g. "last 511 of ... held out"


def _count(n: int, unit: str) -> str:
    return f"{n:,} {unit}{'' if n == 1 else 's'}"


def plan_local_split(cfg: DataConfig, files: list[Path]) -> SplitPlan:
    """A deterministic hold-out of cfg.val_fraction of local files (one counting pass first).

    tail: the last val_fraction of the characters, cut at a row boundary; a single row (one
    document, e.g. Tiny Shakespeare) is cut inside at int(n * (1 - val_fraction)) characters,
    exactly as nanoGPT does. documents: a seeded random val_fraction of the documents.
    """
    errors = "replace" if cfg.on_decode_error == "replace" else "strict"

    def corpus_rows() -> Iterator[str]:
        for path in files:
            yield from read_rows(path, cfg.sample_by, errors)

    n = chars = 0
    for row in corpus_rows():
        n, chars = n + 1, chars + len(row)
    if n == 0:
        raise ValueError(f"corpus {cfg.name!r} has no text")
    if cfg.split_kind == "documents":
        if n < 2:
            raise ValueError(f"data.split=documents needs at least 2 documents, the corpus has {n};"
                             " use data.split=tail")
        n_val = min(max(1, round(n * cfg.val_fraction)), n - 1)
        held_out = np.zeros(n, dtype=bool)
        held_out[np.random.default_rng(cfg.split_seed).permutation(n)[:n_val]] = True
        return SplitPlan(
            lambda: (("val" if out else "train", row)
                     for out, row in zip(held_out, corpus_rows(), strict=True)),
            lambda _: f"{n_val:,} of {n:,} documents held out at random "
                      f"(data.split_seed={cfg.split_seed})")
    if n == 1:
        cut = int(chars * (1 - cfg.val_fraction))
        if not 0 < cut < chars:
            raise ValueError(f"the corpus is too short to hold out a validation part: "
                             f"{chars} characters")

        def cut_document() -> Iterator[tuple[str, str]]:
            (text,) = corpus_rows()
            yield from (("train", text[:cut]), ("val", text[cut:]))

        return SplitPlan(cut_document, lambda _: f"last {chars - cut:,} of {chars:,} characters "
                                                 "held out")
    cut = chars * (1 - cfg.val_fraction)

    def tail() -> Iterator[tuple[str, str]]:
        # validation starts with the first row that begins past the cut; the first row always
        # trains and the last always validates
        start, held_out = 0, False
        for i, row in enumerate(corpus_rows()):
            held_out = held_out or (i > 0 and (start >= cut or i == n - 1))
            yield ("val" if held_out else "train"), row
            start += len(row)

    return SplitPlan(tail, lambda counts: f"last {counts['val']:,} of "
                                          f"{_count(n, cfg.row_unit)} held out")


def plan_hub_split(cfg: DataConfig) -> SplitPlan:
    """Hub documents: hub_split trains and hub_val_split validates; without a validation split,
    each document of hub_split is held out with probability val_fraction (seeded, streamed)."""
    check_hub_reachable()
    if cfg.hub_val_split:
        val_limit = max(1, round(cfg.max_documents * cfg.val_fraction)) \
            if cfg.max_documents else None

        def official() -> Iterator[tuple[str, str]]:
            yield from (("train", row) for row in hub_rows(cfg.hub_id, cfg.hub_split,
                                                            cfg.max_documents))
            yield from (("val", row) for row in hub_rows(cfg.hub_id, cfg.hub_val_split,
                                                          val_limit))

        return SplitPlan(official, lambda counts: f"the hub's {cfg.hub_split!r} split trains "
                                                  f"({counts['train']:,} documents), its "
                                                  f"{cfg.hub_val_split!r} split validates "
                                                  f"({counts['val']:,})")

    def seeded() -> Iterator[tuple[str, str]]:
        draws = np.random.default_rng(cfg.split_seed)
        for row in hub_rows(cfg.hub_id, cfg.hub_split, cfg.max_documents):
            yield ("val" if draws.random() < cfg.val_fraction else "train"), row

    return SplitPlan(seeded, lambda counts: f"{counts['val']:,} of "
                                            f"{counts['train'] + counts['val']:,} documents held "
                                            f"out at random (data.split_seed={cfg.split_seed})")


def training_texts(plan: SplitPlan, max_bytes: int) -> Iterator[str]:
    """The training rows from the start of the corpus, at most `max_bytes` of UTF-8 in all
    (the row that crosses the limit is cut there)."""
    left = max_bytes
    for split, row in plan.rows():
        if split != "train":
            continue
        size = len(row.encode())
        if size >= left:
            yield row.encode()[:left].decode("utf-8", errors="ignore")
            return
        left -= size
        yield row


# ----------------------------------------------------------------------------- writing the ids

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
    if data_cfg.source == "local":
        root, why = data_root(data_cfg.data_root)
        files = resolve_files(root, data_cfg.files, data_cfg.name, why)
        inputs = [scan_file(f, data_cfg.on_decode_error == "strict", log) for f in files]
        check_embedded(root, inputs)
        listing = ", ".join(f"{f.relative_to(root) if f.is_relative_to(root) else f} "
                            f"({i['bytes']:,} bytes)" for f, i in zip(files, inputs, strict=True))
        log(f"Corpus {data_cfg.name}: local files under {root}: {listing}")
    else:
        inputs = []
        limit = f", first {data_cfg.max_documents:,} documents" if data_cfg.max_documents else ""
        val = f"; validation: split {data_cfg.hub_val_split}" if data_cfg.hub_val_split else ""
        log(f"Corpus {data_cfg.name}: Hugging Face hub dataset {data_cfg.hub_id} "
            f"(split {data_cfg.hub_split}{limit}{val}), streamed")
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

    plan = plan_local_split(data_cfg, files) if data_cfg.source == "local" \
        else plan_hub_split(data_cfg)
    cache_root.mkdir(parents=True, exist_ok=True)
    build = _sibling(directory, "tmp")
    build.mkdir()
    try:
        if tok_cfg.name == "char":
            # Every character must get an id, the joiner's and validation's too (nanoGPT's
            # shakespeare_char also takes its vocabulary from the whole text).
            texts = itertools.chain((row for _, row in plan.rows()), [data_cfg.joiner])
            tokenizer = train_tokenizer(tok_cfg, texts)
        else:
            log(f"Training byte-level BPE (vocab_size {tok_cfg.vocab_size}) on the training "
                f"split's first {tok_cfg.train_bytes / 1e6:,.0f} MB at most")
            tokenizer = train_tokenizer(tok_cfg, training_texts(plan, tok_cfg.train_bytes))
        writers = write_ids(plan, tokenizer, data_cfg.joiner, build)
        for split, writer in writers.items():
            if writer.tokens == 0:
                raise ValueError(f"the {split} split of corpus {data_cfg.name!r} has no tokens")
        how = plan.describe({split: writer.rows for split, writer in writers.items()})
        log(f"Split ({data_cfg.split_kind}): {how}")
        tokenizer.save(build / "tokenizer.json")
        meta = {
            "format": FORMAT_VERSION, "corpus": data_cfg.name, "source": data_cfg.source,
            "inputs": inputs, "hub_id": data_cfg.hub_id if data_cfg.source == "hub" else None,
            "tokenizer": tok_cfg.name, "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "dtype": bin_dtype(tokenizer.vocab_size).name,
            "split": data_cfg.split_kind, "split_detail": how,
            "train_tokens": writers["train"].tokens, "val_tokens": writers["val"].tokens,
            "train_rows": writers["train"].rows, "val_rows": writers["val"].rows,
            "fingerprint": key,
            "settings": {"data": dataclasses.asdict(data_cfg),
                         "tokenizer": dataclasses.asdict(tok_cfg)},
        }
        (build / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n",
                                         encoding="utf-8")
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
