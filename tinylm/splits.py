"""How a corpus divides into training and validation rows, planned before anything is written.

tinylm/data.py's prepare_data plans the split here, then streams the rows twice: once to train the
tokenizer (a BPE on the first training rows, `training_texts`; a char tokenizer on every row),
once to write the ids of both splits.

    plan = plan_local_split(DataConfig(), files)     # one counting pass over the local files
    for split, row in plan.rows(): ...               # ("train" | "val", text) in corpus order
    plan.describe({"train": 5019, "val": 511})       # "last 511 of 5,530 paragraphs held out"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tinylm.sources import check_hub_reachable, hub_rows, read_rows

if TYPE_CHECKING:  # a type only: tinylm.data, which defines it, imports this module
    from tinylm.data import DataConfig


@dataclass
class SplitPlan:
    """How a corpus divides into training and validation rows, decided before any is written.

    `rows()` streams the corpus afresh on every call as ("train" | "val", text) pairs in corpus
    order; preparing reads it twice (tokenizer training stops early), so nothing is held whole.
    """

    rows: Callable[[], Iterator[tuple[str, str]]]
    describe: Callable[[dict[str, int]], str]  # rows per split -> e.g. "last 511 of ... held out"


def plural(n: int, unit: str) -> str:
    """"5,530 paragraphs", "1 document"."""
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
                                          f"{plural(n, cfg.row_unit)} held out")


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

