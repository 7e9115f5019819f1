"""Tokenizers: byte-level BPE (HF `tokenizers`) and character-level, behind one interface.

Both map text to ids and back, give each token's character span in the text (attention pictures
label their axes with it) and save to one JSON file that `load_tokenizer` tells apart; a pretrained
model's tokenizer.json loads as a BPETokenizer too.

    tok = train_tokenizer(TokenizerConfig(name="bpe", vocab_size=512), ["Once upon a time ..."])
    ids, offsets = tok.encode_with_offsets("The cat sat. It purred.")
    tok.token_strings(ids)            # ['The', ' cat', ' sat', '.', ' It', ...]
    tok.save("tokenizer.json"); tok = load_tokenizer("tokenizer.json")
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from tinylm.config import ConfigError, at_least, check, choice, integer
from tinylm.files import read_regular_file, write_text_atomic

EOT = "<|endoftext|>"  # separates documents in the token stream; the model learns "story over"
N_BYTES = 256  # byte-level BPE starts from one symbol per byte value
MAX_PIECE = 256  # characters; BPE learns merges within pieces of at most this length
MAX_FILE_BYTES = 1 << 28  # a pretrained model's tokenizer.json has tens of MB at most


@dataclass
class TokenizerConfig:
    """Which tokenizer to train; the schema of conf/tokenizer/*.yaml (defaults: here only)."""

    name: str = "bpe"  # bpe: byte-level BPE | char: one id per distinct character
    vocab_size: int | None = 4096  # bpe: target size incl. 256 bytes + <|endoftext|>; char: null
    train_bytes: int = 100_000_000  # bpe learns its merges on at most this much training text

    def __post_init__(self):
        check(self, "tokenizer", name=choice("bpe", "char"), train_bytes=at_least(1))
        if self.name == "char" and self.vocab_size is not None:
            raise ConfigError(f"tokenizer.vocab_size={self.vocab_size!r} is not allowed for "
                              "tokenizer=char: its vocabulary is the corpus's characters; "
                              "leave it null")
        if self.name == "bpe":
            # byte-level BPE needs the 256 byte symbols and the special token <|endoftext|>
            integer("tokenizer.vocab_size", self.vocab_size, least=N_BYTES + 1)


class Tokenizer(ABC):
    """What every tinylm tokenizer offers; `eot_id`: the end-of-text id, where generation stops."""

    eot_id: int

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; the model's embedding has this many rows."""

    @abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per id, its (start, end) character span in `text`."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; decode(encode(text)) == text."""

    @abstractmethod
    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """A readable label per id (its text, whitespace kept), for plot axes."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write the tokenizer to one JSON file, whole or not at all."""

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; a special token written out (<|endoftext|>) becomes its id."""
        return self.encode_with_offsets(text)[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() over many texts (BPE does them in parallel)."""
        return [self.encode(text) for text in texts]


def _byte_symbols() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte value (the GPT-2 table): the
    others (controls, space) are shifted to 256 + n, so a space shows as 'Ġ', a newline as 'Ċ'."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(N_BYTES) if b not in printable]
    table.update({chr(N_BYTES + n): b for n, b in enumerate(others)})
    return table


class BPETokenizer(Tokenizer):
    """Byte-level BPE (HF tokenizers): any text encodes, no unknown tokens, exact round-trip. Of
    a pretrained model's file, `eot_id` is its end-of-text token (from config.json), encoding
    adds the BOS its post-processor adds (as transformers does) and decoding leaves it out."""

    def __init__(self, hf_tokenizer: HFTokenizer, eot_id: int | None = None):
        self.hf = hf_tokenizer
        if eot_id is None:
            eot_id = hf_tokenizer.token_to_id(EOT)
            if eot_id is None:
                raise ValueError(f"this BPE tokenizer has no {EOT} token; tinylm needs it")
        elif not 0 <= eot_id < hf_tokenizer.get_vocab_size():
            raise ValueError(f"end-of-text id {eot_id} is outside this tokenizer's vocabulary of "
                             f"{hf_tokenizer.get_vocab_size()}")
        self.eot_id = eot_id
        # byte-level vocabularies (GPT-2's, tinylm's, Llama 3's, Qwen's) spell bytes with the
        # table below; SentencePiece-style ones (Llama 2's) spell a space "▁", a byte "<0x0A>"
        byte_level = isinstance(hf_tokenizer.decoder, decoders.ByteLevel)
        self._bytes_of_symbol = _byte_symbols() if byte_level else None
        # special and added tokens are labelled as written (<|endoftext|>, <s>, <|im_end|>)
        self._added = {i: t.content for i, t in hf_tokenizer.get_added_tokens_decoder().items()}
        # what the post-processor puts before every text (Llama's <s>): decode leaves it out
        sample = hf_tokenizer.encode("a")
        text_start = next((i for i, special in enumerate(sample.special_tokens_mask)
                           if not special), 0)
        self._prefix = sample.ids[:text_start]

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int,
              show_progress: bool | None = None) -> BPETokenizer:
        """Learn merges on `texts` up to vocab_size ids; progress bars by default on a terminal."""
        if show_progress is None:  # in a log file bars are blank lines; pythonw has no stdout
            show_progress = sys.stdout is not None and sys.stdout.isatty()
        # The trainer runs in Rust, minutes on a big corpus, and a Python signal handler runs only
        # once it returns: Ctrl-C or SIGTERM would wait for it. In a child process it is killed
        # at once instead, and this process's handlers run between the waits below.
        with tempfile.TemporaryDirectory(prefix="tinylm-bpe-") as folder:
            out = Path(folder) / "tokenizer.json"
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(vocab_size), str(int(show_progress)), str(out)],
                stdin=subprocess.PIPE, bufsize=1 << 20,
                cwd=Path(__file__).parents[1],  # the child imports this tinylm, not the cwd's
                **OUT_OF_CTRL_C)
            try:
                _send(texts, child.stdin)
                while child.poll() is None:  # short waits, so that handlers run, on Windows too
                    time.sleep(0.02)
            except BaseException:  # Ctrl-C, SIGTERM, an unreadable row: the trainer stops now
                child.kill()
                child.wait()
                raise
            finally:
                with suppress(OSError):  # what is still buffered for a killed child: no reader
                    child.stdin.close()
            if child.returncode != 0:  # what went wrong is on stderr, above, or it was killed
                how = f"was killed by {signal.Signals(-child.returncode).name}" \
                    if child.returncode < 0 else f"ended with exit status {child.returncode}"
                raise RuntimeError(f"training the BPE tokenizer failed: its process {how}")
            return cls(HFTokenizer.from_file(str(out)))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # a BOS the post-processor adds spans (0, 0); tokens holding part of one character (the
        # bytes of an emoji) each get that character's whole span
        enc = self.hf.encode(text)
        return enc.ids, [tuple(span) for span in enc.offsets]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self.hf.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        # A cut through a multi-byte character decodes to U+FFFD (bytes.decode errors="replace").
        ids = [int(i) for i in ids]
        if self._prefix and ids[:len(self._prefix)] == self._prefix:
            ids = ids[len(self._prefix):]  # the BOS encode added: decode(encode(text)) == text
        return self.hf.decode(ids, skip_special_tokens=False)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        labels = []
        for token_id in map(int, ids):
            symbols = self.hf.id_to_token(token_id)
            if symbols is None:
                raise ValueError(f"token id {token_id} is outside this tokenizer's "
                                 f"vocabulary of {self.vocab_size}")
            if token_id in self._added:
                labels.append(self._added[token_id])
                continue
            # part of a multi-byte character shows as escapes ('\xf0\x9f') instead of '�'
            labels.append(self._bytes(symbols).decode("utf-8", errors="backslashreplace"))
        return labels

    def _bytes(self, symbols: str) -> bytes:
        """The bytes a vocabulary entry stands for."""
        if self._bytes_of_symbol is not None:
            return bytes(self._bytes_of_symbol[s] for s in symbols)
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", symbols)  # SentencePiece's byte fallback
        return bytes([int(byte[1], 16)]) if byte else symbols.replace("▁", " ").encode()

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.hf.to_str(pretty=True))


# What BPETokenizer.train runs in its child process (argv: vocab_size, show_progress, out file).
_CHILD = "from tinylm.tokenizer import _train_in_child; _train_in_child()"
# A terminal's Ctrl-C reaches every process of its group, and the child, still importing, would
# print a traceback of its own: it gets a group of its own (the parent alone decides to stop it)
OUT_OF_CTRL_C = {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP} if os.name == "nt" \
    else {"start_new_session": True}
_END = (1 << 64) - 1  # the length that ends the texts sent to the child


def _send(texts: Iterable[str], pipe: BinaryIO) -> None:
    """Write each text to the child as its UTF-8 length (8 bytes) and bytes, then _END; a child
    that ended early stops the writing (its exit status tells why)."""
    with suppress(BrokenPipeError):
        for text in texts:
            data = text.encode()
            pipe.write(len(data).to_bytes(8, "little") + data)
        pipe.write(_END.to_bytes(8, "little"))
        pipe.flush()


def _received(pipe: BinaryIO) -> Iterator[str]:
    """The texts _send wrote, in order."""
    while len(header := pipe.read(8)) == 8 and (size := int.from_bytes(header, "little")) != _END:
        yield pipe.read(size).decode(errors="replace")  # cut short only where the parent died
    # The parent closes the pipe once this process has ended; closed before (the parent was
    # killed, even by kill -9), nobody waits for this trainer: it ends too.
    threading.Thread(target=lambda: (os.read(pipe.fileno(), 1), os._exit(1)), daemon=True).start()


def _train_in_child() -> None:
    """The child's side of BPETokenizer.train: texts from stdin, the tokenizer to argv's file."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent alone decides to stop (above)
    vocab_size, show_progress, out = sys.argv[1:]
    hf = HFTokenizer(models.BPE())
    # No normalizer: text must come back exactly as it went in. Runs of MAX_PIECE characters
    # without whitespace (or of whitespace alone) are cut off first: the trainer's work grows
    # with the square of a piece's length (6 MB of minified data took minutes).
    long_runs = Regex(rf"\S{{{MAX_PIECE}}}|\s{{{MAX_PIECE}}}")
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(long_runs, behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size), special_tokens=[EOT],
        # all 256 bytes from the start, so text never seen in training still encodes
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=show_progress == "1")
    hf.train_from_iterator(_received(sys.stdin.buffer), trainer)
    hf.save(out)


class CharTokenizer(Tokenizer):
    """One id per corpus character (sorted, as nanoGPT's shakespeare_char), then <|endoftext|>."""

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.eot_id = len(self.chars)

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        """Vocabulary = every distinct character in `texts`."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text.replace(EOT, ""))
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids, offsets = [], []
        start = 0
        for i, piece in enumerate(text.split(EOT)):
            if i > 0:  # an <|endoftext|> stood between this piece and the last
                ids.append(self.eot_id)
                offsets.append((start - len(EOT), start))
            try:
                ids.extend(self.stoi[ch] for ch in piece)
            except KeyError as err:
                at = start + piece.index(err.args[0])
                raise ValueError(
                    f"character {err.args[0]!r} (U+{ord(err.args[0]):04X}) at position {at} is not "
                    f"in the char tokenizer's vocabulary of {len(self.chars)} characters (built "
                    "from the training corpus); tokenizer=bpe encodes any text") from None
            offsets.extend((start + j, start + j + 1) for j in range(len(piece)))
            start += len(piece) + len(EOT)
        return ids, offsets

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.token_strings(ids))

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        vocabulary = [*self.chars, EOT]  # id -> its text
        labels = []
        for token_id in map(int, ids):
            # a model may be wider than its tokenizer (model.vocab_size): it can sample such ids
            if not 0 <= token_id < len(vocabulary):
                raise ValueError(f"token id {token_id} is outside this tokenizer's "
                                 f"vocabulary of {self.vocab_size}")
            labels.append(vocabulary[token_id])
        return labels

    def save(self, path: str | Path) -> None:
        data = {"kind": "tinylm-char", "version": 1, "eot": EOT, "chars": self.chars}
        write_text_atomic(path, json.dumps(data, ensure_ascii=False))


def train_tokenizer(cfg: TokenizerConfig, texts: Iterable[str],
                    show_progress: bool | None = None) -> Tokenizer:
    """Train the tokenizer `cfg` names on `texts`."""
    if cfg.name == "char":
        return CharTokenizer.train(texts)
    return BPETokenizer.train(texts, cfg.vocab_size, show_progress=show_progress)


def _check_dense_ids(hf: HFTokenizer, path: Path) -> None:
    """Refuse a BPE file whose ids run past its vocab_size (and the model's embedding)."""
    vocab = hf.get_vocab(with_added_tokens=True)
    token, largest = max(vocab.items(), key=lambda item: item[1], default=("", -1))
    if largest >= hf.get_vocab_size():
        raise ValueError(f"{path} gives token {token!r} id {largest}, past its vocab_size "
                         f"{hf.get_vocab_size()} (ids must run 0..{hf.get_vocab_size() - 1}): the "
                         "file was altered or is not one tinylm wrote; put back the "
                         "tokenizer.json of the run or model")


def load_tokenizer(path: str | Path, eot_id: int | None = None) -> Tokenizer:
    """Load a tokenizer.json of either kind, or a pretrained model's BPE with its `eot_id`."""
    path = Path(path)
    raw = read_regular_file(path, MAX_FILE_BYTES, "tokenizer file")
    try:
        text = raw.decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not a tokenizer: not UTF-8 text (byte {err.start})"
                         ) from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{path} is not a tokenizer: invalid JSON "
                         f"({getattr(err, 'msg', 'nested too deeply')})") from None
    if isinstance(data, dict) and data.get("kind") == "tinylm-char":
        chars = data.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1
                                                  for c in chars):
            raise ValueError(f"{path} is a char tokenizer without its \"chars\" list of "
                             "single characters")
        if eot_id is not None:
            raise ValueError(f"{path} is a char tokenizer, whose end-of-text id is its own: "
                             "eot_id is for a pretrained model's BPE file")
        return CharTokenizer(chars)
    if isinstance(data, dict) and isinstance(data.get("model"), dict) \
            and data["model"].get("type") == "BPE":
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as err:  # the Rust side raises plain Exception: "Missing vocab/merges"
            raise ValueError(f"{path} is not a usable BPE tokenizer: "
                             f"{str(err).splitlines()[0]}") from None
        _check_dense_ids(hf, path)
        try:
            return BPETokenizer(hf, eot_id)
        except ValueError as err:  # its end-of-text token missing
            raise ValueError(f"{path}: {err}") from None
    raise ValueError(f"{path} is not a tinylm tokenizer: expected a char tokenizer "
                     "(\"kind\": \"tinylm-char\") or an HF tokenizers BPE file")
