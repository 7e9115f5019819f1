"""Corpus -> token ids on disk -> random training windows.

    prepared = prepare_data(DataConfig(), TokenizerConfig(), log=print)   # or: tinylm-prepare
    sampler = BatchSampler(prepared.train_path, block_size=128, batch_size=16, seed=1337)
    x, y = sampler.next_batch("cpu")                    # (B, T) int64; y is x shifted by one

prepare_data streams the corpus (tinylm/corpus.py) into <cache_dir>/<corpus>-<tokenizer>/
{train.bin, val.bin, tokenizer.json, meta.json}, published whole or not at all; meta.json's
fingerprint of the inputs and settings lets a later run reuse it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import tokenizers
import torch

from tinylm.config import ConfigError, at_least, bad, check, choice, within
from tinylm.corpus import (
    SplitPlan,
    check_embedded,
    data_root,
    plan_hub_split,
    plan_local_split,
    plural,
    resolve_files,
    scan_file,
    training_texts,
)
from tinylm.files import (
    NotWritten,
    nearest_folder,
    not_written,
    published_atomically,
    read_regular_file,
    sweep_leftovers,
)
from tinylm.tokenizer import EOT, Tokenizer, TokenizerConfig, load_tokenizer, train_tokenizer

# bump when what prepare_data writes changes: old caches then rebuild (2: sample_by=document cuts
# a file into documents at its <|endoftext|> lines, and the TinyStories sample is read that way)
FORMAT_VERSION = 2
# What joins two rows of a local file back into the text they were cut from; whole documents
# are joined by <|endoftext|> instead, so the model sees where one ends.
ROW_JOINER = {"line": "\n", "paragraph": "\n\n", "document": EOT}
ENCODE_CHUNK = 1 << 20  # characters of rows encoded together (tokenizers spreads them on cores)
LISTED_FILES = 3  # the corpus line names this many local files, then counts the rest
# below this many training tokens per BPE id, prepare warns that the vocabulary is too large
# (the default run has 54 per id and reaches val perplexity 33; 80 KB with 4,096 ids: ~440)
TOKENS_PER_ENTRY = 20
MIN_SUGGESTED_VOCAB = 512  # a smaller BPE is barely more than its 256 bytes: char is the advice


@dataclass
class DataConfig:
    """Which corpus to read and how to cut it; schema of conf/data/*.yaml (defaults: here only)."""

    name: str = "tinystories"  # the cache goes to <cache_dir>/<name>-<tokenizer.name>/
    source: str = "local"  # local: `files` below | hub: datasets.load_dataset(hub_id)
    files: list[str] = field(default_factory=lambda: [
        "tinystories/train-head.txt", "tinystories/validation-head.txt"])
    data_root: str | None = None  # where relative `files` live; None: $TINYLM_DATA_ROOT, else
    #                               the embedded corpora (data/corpora/)
    # how local files are cut into rows: line | paragraph | document (a file, or each text between
    # lines holding only <|endoftext|>: the stories of the TinyStories sample)
    sample_by: str = "document"
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
        check(self, "data", source=choice("local", "hub"),
              sample_by=choice("line", "paragraph", "document"),
              split=choice("auto", "tail", "documents"),
              val_fraction=within(0, 1, low_open=True, high_open=True),
              max_documents=at_least(2, null="for all"),
              on_decode_error=choice("strict", "replace"))
        if self.source == "hub" and not self.hub_id:
            raise ConfigError(f"data.source=hub needs data.hub_id (corpus {self.name!r} has none)")
        if self.source == "local" and not self.files:
            raise ConfigError("data.files is empty: name the local text files (paths or globs), "
                              "e.g. data=text 'data.files=[notes/*.txt]'")
        if not isinstance(self.files, list) or not all(isinstance(f, str) for f in self.files):
            raise bad("data.files", self.files, "must be a list of paths or globs")
        if not self.name or "/" in self.name:
            raise bad("data.name", self.name, "it names the cache directory, so it must be "
                      "non-empty and without '/'")

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
        return "document" if self.source == "hub" else self.sample_by

    @property
    def joiner(self) -> str:
        """Text between two consecutive rows of a split."""
        return ROW_JOINER[self.row_unit]


# ------------------------------------------------------------------------ the cache on disk

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
    """Appends one split's rows to its .bin file as ids, the joiner's ids between two rows."""

    def __init__(self, file: BinaryIO, tokenizer: Tokenizer, joiner: str):
        self.file, self.tokenizer, self.dtype = file, tokenizer, bin_dtype(tokenizer.vocab_size)
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
            self.file.write(chunk)  # not tofile: its error on a full disk has no errno
            self.tokens += len(chunk)
        self.pending, self.pending_chars = [], 0


def write_ids(plan: SplitPlan, tokenizer: Tokenizer, joiner: str, directory: Path
              ) -> dict[str, IdWriter]:
    """Tokenize the corpus once into directory/{train,val}.bin; -> the writer of each split."""
    with ExitStack() as files:
        writers = {split: IdWriter(files.enter_context(open(directory / f"{split}.bin", "wb")),
                                   tokenizer, joiner) for split in ("train", "val")}
        for split, row in plan.rows():
            writers[split].add(row)
        for writer in writers.values():
            writer.flush()
    return writers


def open_cache(directory: Path, expected: str) -> tuple[PreparedData | None, str | None]:
    """(prepared data, None) if `directory` is complete with fingerprint `expected`, else why."""
    if not directory.is_dir():
        return None, None
    meta_path = directory / "meta.json"
    try:  # the inputs listed make it MBs at most
        meta = json.loads(read_regular_file(meta_path, 1 << 26, "the cache's meta.json"))
    except (OSError, ValueError) as err:
        return None, f"{meta_path} is missing or unreadable ({err.__class__.__name__})"
    if meta.get("fingerprint") != expected:
        return None, "inputs or settings changed since it was written"
    # the same fingerprint means the same format: every field below is there
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        path, tokens = directory / f"{split}.bin", meta[f"{split}_tokens"]
        size = path.stat().st_size if path.is_file() else None
        if size != tokens * itemsize:
            held = "is missing" if size is None else f"holds {size // itemsize:,} tokens"
            return None, f"{path.name} {held} but meta.json says {tokens} tokens"
    try:
        tokenizer = load_tokenizer(directory / "tokenizer.json")
    except (OSError, ValueError) as err:
        return None, str(err)
    if tokenizer.vocab_size != meta["vocab_size"]:
        return None, (f"tokenizer.json has {tokenizer.vocab_size} tokens but meta.json says "
                      f"{meta['vocab_size']}")
    return PreparedData(directory, directory / "train.bin", directory / "val.bin", meta,
                        tokenizer, from_cache=True), None


def cache_path(data_cfg: DataConfig, tok_cfg: TokenizerConfig) -> Path:
    """<cache_dir>/<corpus>-<tokenizer>: the folder prepare_data writes."""
    return Path(data_cfg.cache_dir).expanduser() / f"{data_cfg.name}-{tok_cfg.name}"


# ------------------------------------------------------------------------------- preparing

def listing(root: Path, files: list[Path], inputs: list[dict]) -> str:
    """The first LISTED_FILES files with their sizes, then how many more and the bytes of all."""
    shown = [f"{f.relative_to(root) if f.is_relative_to(root) else f} ({i['bytes']:,} bytes)"
             for f, i in zip(files[:LISTED_FILES], inputs, strict=False)]
    if len(files) > LISTED_FILES:
        total = sum(i["bytes"] for i in inputs)
        shown.append(f"and {len(files) - LISTED_FILES:,} more ({total:,} bytes in all)")
    return ", ".join(shown)


def warn_if_small(meta: dict, log: Callable[[str], None]) -> None:
    """Warn when a BPE vocabulary is too large for the training text to teach its embeddings."""
    tokens, vocab = meta["train_tokens"], meta["vocab_size"]
    if meta["tokenizer"] != "bpe" or tokens >= TOKENS_PER_ENTRY * vocab:
        return
    # the largest power of two with enough tokens per id (a smaller one cuts the text into more)
    fits = tokens // TOKENS_PER_ENTRY
    suggested = 1 << (fits.bit_length() - 1) if fits else 0
    advice = "tokenizer=char"
    if suggested >= MIN_SUGGESTED_VOCAB:
        advice = f"tokenizer.vocab_size={suggested} or tokenizer=char"
    log(f"Warning: the training split holds {tokens:,} tokens, {tokens / vocab:.1f} per id of "
        f"the {vocab:,}-token BPE vocabulary (fewer than {TOKENS_PER_ENTRY} per id: most are "
        f"seen too rarely to learn, expect a high val perplexity); use {advice}, or more text")


def fingerprint(data_cfg: DataConfig, tok_cfg: TokenizerConfig, inputs: list[dict]) -> str:
    """SHA-256 of the inputs' contents and all settings, but not of where files live: moving the
    corpus changes no token."""
    settings = dataclasses.asdict(data_cfg)
    for where in ("data_root", "cache_dir"):
        settings.pop(where)
    key = {"format": FORMAT_VERSION, "data": settings, "tokenizer": dataclasses.asdict(tok_cfg),
           "tokenizers": tokenizers.__version__ if tok_cfg.name == "bpe" else None,
           "inputs": [(i["bytes"], i["sha256"]) for i in inputs]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def prepare_data(data_cfg: DataConfig, tok_cfg: TokenizerConfig, *, force: bool = False,
                 log: Callable[[str], None]) -> PreparedData:
    """Tokenize the corpus into <cache_dir>/<name>-<tokenizer>/, or reuse it if it is current."""
    start = time.perf_counter()
    directory = cache_path(data_cfg, tok_cfg)
    folder = nearest_folder(directory, "data.cache_dir", data_cfg.cache_dir,
                            "cannot hold the prepared data")
    writable = os.access(folder, os.W_OK | os.X_OK)  # False on a read-only disk, even for root
    if writable and (removed := sweep_leftovers(directory.parent)):
        log(f"Removed what an interrupted prepare left in {directory.parent}/: "
            f"{', '.join(removed)}")
    if data_cfg.source == "local":
        root, why = data_root(data_cfg.data_root)
        files = resolve_files(root, data_cfg.files, data_cfg.name, why)
        inputs = [scan_file(f, data_cfg.on_decode_error == "strict", log) for f in files]
        check_embedded(root, inputs)
        log(f"Corpus {data_cfg.name}: local files under {root}: {listing(root, files, inputs)}")
    else:
        inputs = []
        limit = f", first {data_cfg.max_documents:,} documents" if data_cfg.max_documents else ""
        val = f"; validation: split {data_cfg.hub_val_split}" if data_cfg.hub_val_split else ""
        log(f"Corpus {data_cfg.name}: Hugging Face hub dataset {data_cfg.hub_id} "
            f"(split {data_cfg.hub_split}{limit}{val}), streamed")
    key = fingerprint(data_cfg, tok_cfg, inputs)

    if not force:
        cached, why_not = open_cache(directory, key)
        if cached is not None:
            meta = cached.meta
            log(f"Reusing {directory}/ (same inputs and settings, fingerprint {key[:12]}): "
                f"train {meta['train_tokens']:,} tokens, val {meta['val_tokens']:,} tokens, "
                f"vocab_size {meta['vocab_size']:,} ({time.perf_counter() - start:.1f} s)")
            warn_if_small(meta, log)
            return cached
        if why_not:
            log(f"Rebuilding {directory}/: {why_not}")

    if not writable:
        raise ValueError(f"data.cache_dir={data_cfg.cache_dir}: {folder} cannot be written (a "
                         "read-only disk or no permission); name a folder you can write with "
                         "data.cache_dir=/path/to/folder")
    plan = plan_local_split(data_cfg, files) if data_cfg.source == "local" \
        else plan_hub_split(data_cfg)
    try:
        # swapped whole for an outdated cache once complete and flushed
        with published_atomically(directory, replace=True) as build:
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
                "inputs": inputs,
                "hub_id": data_cfg.hub_id if data_cfg.source == "hub" else None,
                "tokenizer": tok_cfg.name, "vocab_size": tokenizer.vocab_size,
                "eot_id": tokenizer.eot_id, "dtype": bin_dtype(tokenizer.vocab_size).name,
                "split": data_cfg.split_kind, "split_detail": how,
                "train_tokens": writers["train"].tokens, "val_tokens": writers["val"].tokens,
                "train_rows": writers["train"].rows, "val_rows": writers["val"].rows,
                "fingerprint": key,
                "settings": {"data": dataclasses.asdict(data_cfg),
                             "tokenizer": dataclasses.asdict(tok_cfg)},
            }
            (build / "meta.json").write_text(
                json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except NotWritten as err:  # name the cache, not a file in the hidden build folder
        raise not_written(directory, err.__cause__) from err

    m, dtype, unit = meta, meta["dtype"], data_cfg.row_unit
    log(f"Wrote {directory}/ in {time.perf_counter() - start:.1f} s:\n"
        f"  train.bin       {m['train_tokens']:>12,} tokens ({dtype}, "
        f"{plural(m['train_rows'], unit)})\n"
        f"  val.bin         {m['val_tokens']:>12,} tokens ({dtype}, "
        f"{plural(m['val_rows'], unit)})\n"
        f"  tokenizer.json  {m['tokenizer']}, vocab_size {m['vocab_size']:,} "
        f"({EOT} = id {m['eot_id']})\n"
        f"  meta.json       fingerprint {key[:12]}")
    warn_if_small(meta, log)
    return PreparedData(directory, directory / "train.bin", directory / "val.bin", meta, tokenizer)


# ------------------------------------------------------------------------------ batch sampling

def check_enough_tokens(prepared: PreparedData, block_size: int) -> None:
    """Raise ValueError unless train and val both hold at least one window of block_size + 1."""
    n_train, n_val = (prepared.meta[f"{split}_tokens"] for split in ("train", "val"))
    fits = min(n_train, n_val) - 1  # the largest block_size both splits hold a window of
    smaller = f"model.block_size={fits}" if fits >= 1 else "a smaller model.block_size"
    # more validation text takes it from training, so the advice for val names both sides
    advice = {"train": f"use a longer corpus or {smaller}",
              "val": f"use {smaller}, a longer corpus, or a larger data.val_fraction (now the "
                     f"training split holds {n_train:,} tokens)"}
    for split, n in (("train", n_train), ("val", n_val)):
        if n < block_size + 1:
            raise ValueError(f"{prepared.directory / f'{split}.bin'} holds {n:,} tokens, fewer "
                             f"than one training window of model.block_size + 1 = "
                             f"{block_size + 1}; {advice[split]}")


class BatchSampler:
    """Random windows of block_size + 1 tokens from a prepared .bin file, reproducible and
    resumable (state_dict). Under DDP every rank draws the same world_size * batch_size starts
    and keeps its own slice: together the global batch a single process would draw."""

    def __init__(self, path: str | Path, block_size: int, batch_size: int, seed: int,
                 rank: int = 0, world_size: int = 1):
        self.path = Path(path)
        dtype = json.loads((self.path.parent / "meta.json").read_text(encoding="utf-8"))["dtype"]
        self.data = np.memmap(self.path, dtype=dtype, mode="r")  # only the windows drawn are read
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
        if torch.device(device).type == "cuda":  # pinned memory lets the copy overlap with compute
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def state_dict(self) -> dict:
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
