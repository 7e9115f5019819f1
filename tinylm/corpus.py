"""Reading a corpus (local UTF-8 files or a Hugging Face hub dataset, streamed either way) as rows
of text, and dividing the rows into training and validation; tinylm.data writes the planned rows.

    root, why = data_root(None)                         # the embedded corpora (data/corpora/)
    files = resolve_files(root, ["tinystories/*.txt"], "tinystories", why)
    for paragraph in read_rows(files[0], "paragraph"): ...
    plan = plan_local_split(DataConfig(), files)        # one counting pass over the files
    for split, row in plan.rows(): ...                  # ("train" | "val", text) in corpus order
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urlsplit

import numpy as np

from tinylm.files import shipped_dir

if TYPE_CHECKING:  # a type only: tinylm.data, which defines it, imports this module
    from tinylm.data import DataConfig

DATA_ROOT_ENV = "TINYLM_DATA_ROOT"  # overrides where relative data.files are read from
CHECKSUMS = "SHA256SUMS"
RESTORE = "restore it with `git checkout data/` (or reinstall tinylm)"
OFFLINE_CHOICES = ("offline, train on the embedded TinyStories sample (data=tinystories), on Tiny "
                   "Shakespeare (data=tinyshakespeare) or on your own text (data=text "
                   "'data.files=[notes/*.txt]')")
READ_CHUNK = 8 << 20  # characters read from a local file at a time
# A line holding only <|endoftext|> ends a document (sample_by=document), as it ends each story in
# the raw TinyStories files (tinylm.tokenizer.EOT, a layer above this one, whose id joins them)
DOCUMENT_END_LINE = re.compile(r"^[ \t]*<\|endoftext\|>[ \t]*$", re.MULTILINE)
# what switches datasets off the hub, in the order datasets lets them decide
OFFLINE_SWITCHES = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


class HubError(RuntimeError):
    """The hub cannot be read (offline, unreachable, unknown dataset); the message says why."""


# ------------------------------------------------------------------------------- local files

def embedded_dir() -> Path:
    """The corpora shipped with tinylm: data/corpora/ of a checkout, tinylm/corpora/ of a wheel."""
    return shipped_dir("data/corpora", "corpora")


def data_root(configured: str | None) -> tuple[Path, str]:
    """(folder relative data.files are read from, why): data.data_root, else $TINYLM_DATA_ROOT,
    else the embedded corpora."""
    if configured is not None:
        root, why = Path(configured), "data.data_root"
    elif os.environ.get(DATA_ROOT_ENV):
        root, why = Path(os.environ[DATA_ROOT_ENV]), f"${DATA_ROOT_ENV}"
    else:
        root, why = embedded_dir(), "the embedded corpora"
    return root.expanduser().resolve(), why


def resolve_files(root: Path, patterns: list[str], corpus: str, why: str) -> list[Path]:
    """The files `patterns` name under `root`, each once; FileNotFoundError if one matches none."""
    files, missing = [], []
    for pattern in patterns:
        path = root / Path(pattern).expanduser()  # an absolute pattern ignores root
        if path.is_dir():
            raise ValueError(f"data.files: {pattern} is a directory ({root / pattern}); name "
                             f"the files in it, e.g. 'data.files=[{pattern.rstrip('/')}/*.txt]'")
        if any(ch in pattern for ch in "*?["):
            anchor = Path(path.anchor)
            matches = sorted(p for p in anchor.glob(str(path.relative_to(anchor))) if p.is_file())
        else:
            matches = [path] if path.is_file() else []
        if not matches:
            missing.append(pattern)
        files += [m for m in matches if m not in files]  # a file named twice is read once
    if root == embedded_dir().resolve() and missing:
        raise FileNotFoundError(f"embedded corpus file {root / missing[0]} is missing; {RESTORE}")
    if missing:
        raise FileNotFoundError(
            f"corpus {corpus!r}: no {', '.join(missing)} under {root} ({why}); point at the "
            f"folder holding them with data.data_root=/path or {DATA_ROOT_ENV}=/path, or use "
            "your own files with data=text 'data.files=[path/to/*.txt]'")
    return files


def check_embedded(root: Path, inputs: list[dict]) -> None:
    """Refuse an embedded corpus file whose SHA-256 (scan_file's) differs from SHA256SUMS."""
    if root != embedded_dir().resolve():
        return
    sums = {}
    for line in (root / CHECKSUMS).read_text(encoding="utf-8").splitlines():
        digest, name = line.split(maxsplit=1)
        sums[(root / name.lstrip("*")).resolve()] = digest
    for item in inputs:
        expected = sums.get(Path(item["path"]).resolve())
        if expected is not None and item["sha256"] != expected:
            raise ValueError(f"embedded corpus file {item['path']} is altered: its SHA-256 is "
                             f"{item['sha256']}, {CHECKSUMS} says {expected}; {RESTORE}")


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Name an unreadable corpus file in one line, as bad input (not a write the disk refused)."""
    try:
        yield
    except OSError as err:
        raise ValueError(f"corpus file {path} could not be read: {err.strerror or err}") from None


def scan_file(path: Path, strict_utf8: bool, log: Callable[[str], None]) -> dict:
    """Size and SHA-256 of a corpus file, refusing an empty one and (if strict) bad UTF-8."""
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed = newlines = 0  # bytes and line breaks before the current chunk
    has_text = bad_utf8 = False
    with reading(path), open(path, "rb") as f:
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


def read_rows(path: Path, sample_by: str, errors: str = "strict") -> Iterator[str]:
    """The rows of a UTF-8 text file, read a chunk at a time: its lines, its paragraphs
    (non-empty pieces between blank lines) or its documents (see _documents); newlines are
    universal, as in datasets' "text" loader."""
    with reading(path), open(path, encoding="utf-8", errors=errors) as f:
        if sample_by == "document":
            yield from _documents(f)
            return
        carry = ""  # a paragraph that may continue in the next chunk
        while chunk := f.read(READ_CHUNK):
            chunk += f.readline()  # end on a line break, so no line is cut in two
            if sample_by == "line":
                yield from chunk.removesuffix("\n").split("\n")
                continue
            pieces = (carry + chunk).split("\n\n")
            carry = pieces.pop()
            yield from (p for p in pieces if p)
        if carry:
            yield carry


def _documents(f: TextIO) -> Iterator[str]:
    """The texts between lines holding only <|endoftext|> (without the line breaks around them;
    an empty one is skipped), or the whole file when it has none."""
    carry, marked = [], False  # the pieces of the document that may go on in the next chunk
    while chunk := f.read(READ_CHUNK):
        chunk += f.readline()  # chunks start and end at line breaks: a mark is never cut
        *ended, rest = DOCUMENT_END_LINE.split(chunk)  # only the new chunk is searched
        if ended:
            ended[0] = "".join([*carry, ended[0]])
            carry, marked = [rest], True
            yield from (text for doc in ended if (text := doc.strip("\n")))
        else:
            carry.append(chunk)
    if not marked:
        yield "".join(carry)  # the whole file, as it is
    elif text := "".join(carry).strip("\n"):
        yield text


# ----------------------------------------------------------------------------------- the hub

def check_hub_reachable() -> None:
    """Raise HubError at once where the hub is switched off or unreachable, not after half a
    minute of retries (behind a proxy only the switches are checked)."""
    from datasets import config  # here: its import takes a second, and only a hub corpus needs it

    if config.HF_HUB_OFFLINE:  # datasets' reading of the switches (huggingface_hub's constants)
        switch = next(name for name in OFFLINE_SWITCHES if os.environ.get(name))
        raise HubError(f"the Hugging Face hub is switched off ({switch}="
                       f"{os.environ[switch]}); {OFFLINE_CHOICES}")
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=5).close()
    except OSError as err:
        raise HubError(f"the Hugging Face hub ({endpoint.hostname}:{port}) is unreachable "
                       f"({err.strerror or err}); {OFFLINE_CHOICES}") from None


def hub_rows(hub_id: str, split: str, limit: int | None = None) -> Iterator[str]:
    """The "text" of each row of a hub dataset's split, streamed (first `limit` rows if given)."""
    import datasets  # here, not at the top: it takes seconds, and only a hub corpus needs it

    try:
        stream = datasets.load_dataset(hub_id, split=split, streaming=True)
        if limit:
            stream = stream.take(limit)
        for row in stream:
            if "text" not in row:
                raise ValueError(f"hub dataset {hub_id!r} has no 'text' column (columns: "
                                 f"{', '.join(row)})")
            yield row["text"]
    except ValueError:
        raise
    except Exception as err:  # offline, unknown id, connection lost mid-stream: one line
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise HubError(f"could not read {hub_id!r} (split {split!r}) from the Hugging Face hub: "
                       f"{first_line}; {OFFLINE_CHOICES}") from err


# ------------------------------------------------------------------------------ the split plan

@dataclass
class SplitPlan:
    """A corpus's split into training and validation rows; rows() streams it afresh each call."""

    rows: Callable[[], Iterator[tuple[str, str]]]
    describe: Callable[[dict[str, int]], str]  # rows per split -> e.g. "last 511 of ... held out"


def plural(n: int, unit: str) -> str:
    """"1,122 documents", "1 paragraph"."""
    return f"{n:,} {unit}{'' if n == 1 else 's'}"


def plan_local_split(cfg: DataConfig, files: list[Path]) -> SplitPlan:
    """A deterministic hold-out of val_fraction of local files, after one counting pass. tail:
    the last characters, cut at a row boundary (a single row, Tiny Shakespeare, inside it as
    nanoGPT does); documents: a seeded random share of the documents."""
    def corpus_rows() -> Iterator[str]:
        for path in files:
            yield from read_rows(path, cfg.sample_by, cfg.on_decode_error)  # strict | replace

    n = chars = 0
    for row in corpus_rows():
        n, chars = n + 1, chars + len(row)
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

        return SplitPlan(official, lambda n: f"the hub's {cfg.hub_split!r} split trains "
                         f"({n['train']:,} documents), its {cfg.hub_val_split!r} split validates "
                         f"({n['val']:,})")

    def seeded() -> Iterator[tuple[str, str]]:
        draws = np.random.default_rng(cfg.split_seed)
        for row in hub_rows(cfg.hub_id, cfg.hub_split, cfg.max_documents):
            yield ("val" if draws.random() < cfg.val_fraction else "train"), row

    return SplitPlan(seeded, lambda n: f"{n['val']:,} of {n['train'] + n['val']:,} documents "
                     f"held out at random (data.split_seed={cfg.split_seed})")


def training_texts(plan: SplitPlan, max_bytes: int) -> Iterator[str]:
    """The training rows from the start of the corpus, cut at `max_bytes` of UTF-8 in all."""
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
