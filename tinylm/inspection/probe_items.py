"""Probe files (the format: docs/inspecting.md): JSONL, each line checked as it is read by the
probe type that recognises it (probe_types.py), then tokenized for probe.py. A line that cannot be
used raises ProbeFileError naming its file and line; behind that, items are trusted.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tinylm.files import read_regular_file, shipped_dir
from tinylm.inspection.capture import PRONOUNS, find_words, token_word_index, word_at

SHIPPED_PROBES = ("pronouns.jsonl", "agreement.jsonl")  # data/probes/ (a wheel: tinylm/probes/)
WORD_CHAR = re.compile(r"\w")
MAX_PROBE_FILE_BYTES = 100 * 2**20  # a thousand times the shipped sets: no probe is larger


class ProbeFileError(ValueError):
    """A probe line that cannot be used; the message starts with `<file>, line <n>:`."""


@dataclass
class ProbeItem:
    """One validated probe line."""

    kind: str  # the name of the probe type that read it: "attention" (two characters), "agreement"
    source: str  # "<file>, line <n>", for messages
    text: str
    pronoun_char: int
    antecedent_chars: list[int]
    distractor_chars: list[int] | None  # attention items
    wrong_pronoun: str | None  # agreement items; optional on attention items
    counterfactual: str | None = None  # agreement items: the partner's text (once loaded)
    id: str | None = None  # names the item as another line's counterfactual

    @property
    def pronoun(self) -> str:
        """The pronoun as written in the text."""
        return next(self.text[s:end] for s, end in find_words(self.text) if s == self.pronoun_char)

    def error(self, message: str) -> ProbeFileError:
        return ProbeFileError(f"{self.source}: {message}")


def parse_pronoun_item(obj: dict, where: str, kind: str) -> ProbeItem:
    """A pronoun item of `kind` from a decoded line (ProbeFileError if unusable): two characters
    where it has distractor_chars, else one and a wrong pronoun to compare with."""
    text = obj.get("text")
    if not isinstance(text, str) or not text:
        raise ProbeFileError(f"{where}: \"text\" must be a non-empty string")
    p = obj.get("pronoun_char")
    if not isinstance(p, int) or isinstance(p, bool):
        raise ProbeFileError(f"{where}: pronoun_char must be a character offset, got {p!r}")
    spans = find_words(text)

    def word_starting(key: str, char: int) -> int:
        if not 0 <= char < len(text):
            raise ProbeFileError(f"{where}: {key}={char} is outside the text "
                                 f"({len(text)} characters)")
        index = word_at(spans, char)
        if index is None:
            raise ProbeFileError(f"{where}: {key}={char} is not at the start of a word "
                                 f"(the text there reads {text[max(0, char - 5):char + 10]!r})")
        return index

    pronoun_word = word_starting("pronoun_char", p)
    pronoun = text[slice(*spans[pronoun_word])]
    if pronoun not in PRONOUNS:
        raise ProbeFileError(f"{where}: pronoun_char={p} points at {pronoun!r}, which is not a "
                             f"pronoun; known: {', '.join(sorted(PRONOUNS))}")

    roles = ["antecedent", "distractor"] if "distractor_chars" in obj else ["antecedent"]
    mentions: dict[str, list[int]] = {}
    seen: dict[int, str] = {}
    for role in roles:
        key = f"{role}_chars"
        mentions[role] = value = obj.get(key)
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in value)):
            raise ProbeFileError(f"{where}: {key} must be a non-empty list of character offsets, "
                                 f"got {value!r}")
        for i, char in enumerate(value):
            word_starting(f"{key}[{i}]", char)
            if char >= p:
                raise ProbeFileError(
                    f"{where}: {key}[{i}]={char} is not before the pronoun at {p}: the pronoun "
                    f"must be preceded by every mention of the {role} (attention cannot look "
                    "ahead)")
            if char in seen:
                raise ProbeFileError(f"{where}: character {char} is listed twice (as {seen[char]}"
                                     f" and as {role})")
            seen[char] = role

    wrong = obj.get("wrong_pronoun")
    if wrong is None and "distractor" not in mentions:  # an agreement item
        raise ProbeFileError(f"{where}: missing wrong_pronoun; an item without "
                             "distractor_chars is an agreement item and needs the pronoun "
                             "to compare with (e.g. \"wrong_pronoun\": \"he\")")
    if wrong is not None:
        if not isinstance(wrong, str) or wrong.lower() not in PRONOUNS:
            raise ProbeFileError(f"{where}: wrong_pronoun={wrong!r} is not a known pronoun; "
                                 f"known: {', '.join(sorted(w for w in PRONOUNS if w.islower()))}")
        if wrong.lower() == pronoun.lower():
            raise ProbeFileError(f"{where}: wrong_pronoun={wrong!r} is the pronoun in the text")

    for key in ("id", "counterfactual"):
        if obj.get(key) is not None and (not isinstance(obj[key], str) or not obj[key]):
            raise ProbeFileError(f"{where}: {key} must be a non-empty string, got {obj[key]!r}")
    if obj.get("counterfactual") is not None and "distractor" in mentions:
        raise ProbeFileError(f"{where}: a counterfactual is for agreement items (one character): "
                             "patching swaps one name, and this item has distractor_chars")
    return ProbeItem(kind, where, text, p, mentions["antecedent"], mentions.get("distractor"),
                     wrong, obj.get("counterfactual"), obj.get("id"))


def _pronoun_word(item: ProbeItem) -> int:
    return word_at(find_words(item.text), item.pronoun_char)


def counterfactual_item(item: ProbeItem) -> ProbeItem:
    """An item's partner (read_probe_lines checked it) as an agreement item: its own pronoun, the
    mentions at the item's word indices, the item's pronoun to compare with."""
    text, k = item.counterfactual, _pronoun_word(item)
    spans, item_spans = find_words(text), find_words(item.text)
    pronoun = text[slice(*spans[k])]
    # a partner of the same pronoun (a name swap within a gender) keeps the item's wrong pronoun
    wrong = item.pronoun.lower() if pronoun.lower() != item.pronoun.lower() else item.wrong_pronoun
    antecedents = [spans[word_at(item_spans, c)][0] for c in item.antecedent_chars]
    return ProbeItem("agreement", f"{item.source} (counterfactual)", text, spans[k][0], antecedents,
                     None, wrong)


def _resolve_counterfactual(item: ProbeItem, by_id: dict[str, ProbeItem]) -> ProbeItem:
    """The item with its counterfactual as text (an id stands for that line's text), checked to
    have a pronoun where the item has its own."""
    if item.counterfactual is None:
        return item
    named, k = by_id.get(item.counterfactual), _pronoun_word(item)
    text = named.text if named is not None else item.counterfactual
    if text == item.text:
        raise item.error(f"counterfactual {item.counterfactual!r} is the item itself; a partner "
                         "differs from it in the name and the pronoun")
    spans = find_words(text)
    if k >= len(spans) or text[slice(*spans[k])] not in PRONOUNS:
        what = (f"is the id of {named.source}, whose text has no pronoun" if named is not None
                else "is neither the id of an item in this file nor a text with a pronoun")
        raise item.error(f"counterfactual {item.counterfactual!r} {what} as word {k + 1}, where "
                         f"the item has {item.pronoun!r}")
    return dataclasses.replace(item, counterfactual=text)


def read_probe_lines(path: str | Path, parse: Callable[[object, str], ProbeItem]
                     ) -> list[ProbeItem]:
    """Every line of a JSONL probe file as an item, each decoded line checked and read by `parse`
    (probe_types.parse_item); the first bad line raises ProbeFileError."""
    items, by_id = [], {}
    lines = read_regular_file(path, MAX_PROBE_FILE_BYTES, "probe file").split(b"\n")
    for n, raw in enumerate(lines, start=1):
        where = f"{path}, line {n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ProbeFileError(f"{where}: not valid UTF-8 (byte {err.start + 1} of the "
                                 f"line: {err.reason})") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ProbeFileError(f"{where}: invalid JSON ({err.msg} at column {err.colno})"
                                 ) from None
        except RecursionError:  # [[[[...]]]] deeper than Python's stack
            raise ProbeFileError(f"{where}: JSON nested too deeply to be a probe item") from None
        item = parse(obj, where)
        if item.id in by_id:  # None is never a key
            raise ProbeFileError(f"{where}: id {item.id!r} is already the id of "
                                 f"{by_id[item.id].source}; ids must be unique in a file")
        if item.id is not None:
            by_id[item.id] = item
        items.append(item)
    if not items:
        raise ProbeFileError(f"{path}: no probe items (the file is empty)")
    return [_resolve_counterfactual(item, by_id) for item in items]


def shipped_probe(name: str) -> Path:
    """A shipped probe set: data/probes/<name> (an installed wheel: tinylm/probes/<name>)."""
    return shipped_dir("data/probes", "probes") / name


@dataclass
class EncodedAttentionItem:
    """An item as tokens up to the pronoun's last token, and word indices."""

    ids: list[int]
    token_words: list[int]
    n_words: int
    pronoun_word: int
    antecedent_words: list[int]
    distractor_words: list[int]


def _encode(tokenizer, item: ProbeItem, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    try:
        ids, offsets = tokenizer.encode_with_offsets(text)
    except ValueError as err:  # e.g. a character the char tokenizer never saw
        raise item.error(f"cannot tokenize the text: {err}") from None
    return list(ids), [tuple(o) for o in offsets]


def _check_length(item: ProbeItem, n_tokens: int, block_size: int) -> None:
    if n_tokens > block_size:
        raise item.error(f"the text up to the pronoun is {n_tokens} tokens, longer than the "
                         f"model's block_size={block_size}")


def encode_attention_item(tokenizer, item: ProbeItem, block_size: int) -> EncodedAttentionItem:
    """Tokenize the item's text and map tokens to words; later tokens are not needed (causal)."""
    ids, offsets = _encode(tokenizer, item, item.text)
    spans = find_words(item.text)
    token_words = token_word_index(offsets, spans, len(item.text))
    pronoun_word = word_at(spans, item.pronoun_char)
    end = max(t for t, w in enumerate(token_words) if w == pronoun_word) + 1
    _check_length(item, end, block_size)
    return EncodedAttentionItem(
        ids[:end], token_words[:end], len(spans), pronoun_word,
        [word_at(spans, c) for c in item.antecedent_chars],
        [word_at(spans, c) for c in item.distractor_chars or ()])


def match_case(word: str, like: str) -> str:
    """`word` capitalised like `like` ("he", "She" -> "He")."""
    return word.capitalize() if like[:1].isupper() else word.lower()


def new_word_tokens(tokenizer) -> torch.Tensor:
    """(V,) bool: tokens whose text starts with something other than a word character, i.e. that
    end the word before them (a space, punctuation, <|endoftext|>)."""
    strings = tokenizer.token_strings(range(tokenizer.vocab_size))
    return torch.tensor([not WORD_CHAR.match(s) for s in strings], dtype=torch.bool)


@dataclass
class EncodedAgreementItem:
    """Context + written pronoun and context + wrong pronoun as tokens, and the context length."""

    written: list[int]
    wrong: list[int]
    n_context: int  # tokens before the word; the last of them predicts it


def encode_agreement_item(tokenizer, item: ProbeItem, block_size: int,
                          wrong_pronoun: str | None = None) -> EncodedAgreementItem:
    """Tokenize the text before the pronoun followed by each pronoun (the wrong one:
    `wrong_pronoun`, else the item's), as running text would be."""
    context = item.text[:item.pronoun_char]
    before = len(context.rstrip())  # the word is read together with the whitespace before it
    written = item.pronoun
    wrong = match_case(wrong_pronoun or item.wrong_pronoun, item.pronoun)
    encoded = []
    for word in (written, wrong):
        ids, offsets = _encode(tokenizer, item, context + word)
        # The word's tokens: from the first one past the context's last non-space character.
        # Byte-level BPE may read " She" as " S" "he" but " He" as " " "H" "e"; both then
        # continue the same context tokens, and the space is part of each word's probability.
        n_context = next(i for i, (_, end) in enumerate(offsets) if end > before)
        if offsets[n_context][0] < before:
            raise item.error(f"the tokenizer joins {word!r} with the text before it, so its "
                             "probability cannot be read on its own")
        _check_length(item, len(ids), block_size)
        encoded.append((ids, n_context))
    (ids_written, n), (ids_wrong, n_wrong) = encoded
    if ids_written[:n] != ids_wrong[:n_wrong]:
        raise item.error(f"the text before the pronoun tokenizes differently before {written!r} "
                         f"and before {wrong!r}")
    return EncodedAgreementItem(ids_written, ids_wrong, n)
