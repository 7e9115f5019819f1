"""Where each head looks: capture every layer's attention over a text, map tokens to words, and
read each pronoun from the token before it ("deciding": its logits choose the pronoun, so a name's
gender has to arrive there) and from the pronoun itself ("resolving").

    capture = capture_attention(model, tokenizer, "Lily and Tom went to the park. She")
    capture.weights.shape      # (n_layer, n_head, T, T), each row sums to 1
    read_pronouns(capture)     # every head's most-attended earlier words, per pronoun

Attention *to* a word sums the weights of its sub-word tokens; attention *from* a word averages
its tokens' rows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tinylm.hooks import caching
from tinylm.inspection.head_numbers import (
    ArithmeticCapture,
    arithmetic_from,
    arithmetic_layers,
    arithmetic_names,
)


def _cased(words: str) -> frozenset[str]:
    return frozenset(word for w in words.split() for word in (w, w.capitalize()))


PRONOUNS = _cased("he she it they him her his its them their")
# The pronouns a reading links to names: personal ones, which stand for people. "it" and "its"
# stand for a thing or an animal ("Lily had a dog. It was happy."): a name at the top of their
# reading would be read as their referent, wrongly, so they get no reading.
PERSON_PRONOUNS = _cased("he him his she her they them their")
PRONOUN_GENDER = {**dict.fromkeys(_cased("she her"), "female"),
                  **dict.fromkeys(_cased("he him his"), "male")}  # they/them/their: either
# Frequent character names of TinyStories-style text and of the shipped probe sets, by the gender
# stories give them; a name of neither list (Sam, Spot, a capitalised word) has no gender here,
# so no reading of it is flagged.
FEMALE_NAMES = frozenset((
    "Lily Sue Mia Anna Ann Lucy Sara Sarah Amy Jane Kate Mary Emma Molly Jill Zoe Lisa Sally Ivy "
    "Ella Emily Lila").split())
MALE_NAMES = frozenset((
    "Tom Tommy Tim Timmy Ben Benny Jack Jake John Bob Bobby Joe Billy Leo Mike Max Mark Dave Jim "
    "Jimmy Jeff Peter").split())
NAME_GENDER = {**dict.fromkeys(FEMALE_NAMES, "female"), **dict.fromkeys(MALE_NAMES, "male")}
# A word counts as a name when it is listed here, or when it is capitalised but does not start a
# sentence (see `is_name`).
NAMES = FEMALE_NAMES | MALE_NAMES | frozenset("Sam Spot Rex Kitty".split())
_ACCENTS = "\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"  # combining marks
# letters/digits with their combining accents ("Ame\u0301lie"), keeping "Tom's" and "don't" whole
WORD_RE = re.compile(rf"\w[\w{_ACCENTS}]*(?:['’]\w[\w{_ACCENTS}]*)*")
SENTENCE_START = re.compile(r"[.!?:\n\"“”]")  # a gap containing these starts a new sentence


@dataclass
class AttentionCapture:
    """Every layer's attention over one text, with the token and word bookkeeping."""

    text: str
    ids: list[int]  # the tokens the model read: at most block_size of the text's tokens
    tokens: list[str]  # readable token strings, for labels
    offsets: list[tuple[int, int]]  # character span of each token in `text`
    weights: np.ndarray  # (n_layer, n_head, T, T) float32
    word_spans: list[tuple[int, int]]  # character span of each word in `text`
    token_words: list[int]  # word index of each token, -1 for punctuation and spaces
    start: int = 0  # position of ids[0] among all the text's tokens
    n_text_tokens: int = 0  # how many tokens the whole text has (> len(ids) when it was cut)
    kv_heads: list[int] | None = None  # each layer's key/value heads; None: one per query head
    # q, k and v of the layers that fit, for the tab's arithmetic panel; None: not recorded
    arithmetic: ArithmeticCapture | None = None

    def window_note(self) -> str:
        """Which tokens of the text the capture covers, in words."""
        t = len(self.ids)
        if self.n_text_tokens <= t:
            return f"{t} tokens"
        return (f"the text has {self.n_text_tokens} tokens, more than fit in the context: these "
                f"are its tokens {self.start}..{self.start + t - 1}")

    @property
    def words(self) -> list[str]:
        return [self.text[s:e] for s, e in self.word_spans]

    @property
    def shared_kv_heads(self) -> list[int] | None:
        """Each layer's key/value heads where some layer's are shared by several query heads
        (grouped-query attention); None where every head has its own."""
        n_head = self.weights.shape[1]
        kv = self.kv_heads
        return kv if kv is not None and any(n != n_head for n in kv) else None


def kv_heads(model) -> list[int]:
    """Each layer's key/value heads: attn.n_kv_head where a group of query heads shares each
    (grouped-query attention), one per query head otherwise."""
    return [getattr(block.attn, "n_kv_head", block.attn.n_head) for block in model.blocks]


def kv_head(head: int, n_head: int, n_kv: int) -> int:
    """The key/value head that query head `head` reads: each of the n_kv is shared by
    n_head / n_kv consecutive query heads (n_kv = n_head: its own)."""
    return head // (n_head // n_kv)


def kv_groups(n_head: int, kv: Sequence[int]) -> str:
    """Which query heads share each key/value head, in words: "grouped-query attention, in every
    layer: heads 0-1 share key/value head 0, heads 2-3 share key/value head 1"; "" where every
    head has its own."""
    def groups(n_kv: int) -> str:
        if n_kv == n_head:
            return "each head has its own key/value head"
        size = n_head // n_kv
        return ", ".join(f"heads {g * size}-{(g + 1) * size - 1} share key/value head {g}"
                         for g in range(n_kv))

    if all(n == n_head for n in kv):
        return ""
    if len(set(kv)) == 1:
        return f"grouped-query attention, in every layer: {groups(kv[0])}"
    return "grouped-query attention: " + "; ".join(f"layer {i}: {groups(n)}"
                                                   for i, n in enumerate(kv))


def find_words(text: str) -> list[tuple[int, int]]:
    """Character spans (start, end) of the words in `text`; punctuation is not a word."""
    return [m.span() for m in WORD_RE.finditer(text)]


def word_at(word_spans: Sequence[tuple[int, int]], char: int) -> int | None:
    """Index of the word starting exactly at character `char`, else None."""
    return next((i for i, (start, _) in enumerate(word_spans) if start == char), None)


def token_word_index(offsets: Sequence[tuple[int, int]],
                     word_spans: Sequence[tuple[int, int]], text_len: int) -> list[int]:
    """For each token, the index of the word its characters belong to (-1: none); matched by the
    first word character it covers, since byte-level tokens often carry a space (" Lily")."""
    char_word = np.full(text_len + 1, -1, dtype=np.int64)
    for i, (start, end) in enumerate(word_spans):
        char_word[start:end] = i
    result = []
    for start, end in offsets:
        covered = char_word[start:end]
        hits = covered[covered >= 0]
        result.append(int(hits[0]) if hits.size else -1)
    return result


def key_words(weights: np.ndarray | torch.Tensor, token_words: Sequence[int],
              n_words: int) -> np.ndarray:
    """Token attention (..., Q, T) -> attention to words (..., Q, n_words): column j sums the
    weights on word j's tokens; tokens outside every word (-1) are left out."""
    weights = np.asarray(weights, dtype=np.float64)
    to_word = np.zeros((len(token_words), n_words))  # (T, W): one-hot token -> word
    for token, word in enumerate(token_words):
        if word >= 0:
            to_word[token, word] = 1.0
    return weights @ to_word  # (..., Q, W)


def word_level(weights: np.ndarray | torch.Tensor, token_words: Sequence[int],
               n_words: int) -> np.ndarray:
    """Token attention (..., T, T) -> word attention (..., n_words, n_words): column j sums the
    weights on word j's tokens, row i averages the rows of word i's tokens."""
    to_word = key_words(np.eye(len(token_words)), token_words, n_words)  # (T, W): one-hot
    mean_rows = (to_word / np.maximum(to_word.sum(axis=0), 1.0)).T  # (W, T): average a word's rows
    return mean_rows @ key_words(weights, token_words, n_words)  # (..., W, W)


def deciding_token(token_words: Sequence[int], word: int) -> int | None:
    """The token just before `word`'s first one, whose logits predict it (None: there is none)."""
    first = list(token_words).index(word)
    return first - 1 if first > 0 else None


def other_gender(pronoun: str, word: str) -> bool:
    """Whether `word` is a name of the other gender than `pronoun` ("She" and "Tom"): a reading
    that points there points at the wrong character. False where either has no gender here."""
    gender, named = PRONOUN_GENDER.get(pronoun), NAME_GENDER.get(word)
    return gender is not None and named is not None and gender != named


def is_name(text: str, word_spans: Sequence[tuple[int, int]], i: int) -> bool:
    """Heuristic: word i is a name if listed in NAMES, or capitalised but not sentence-initial
    (first in the text, or after . ! ? : a newline or a quote mark). Pronouns and "I" never are."""
    start, end = word_spans[i]
    word = text[start:end]
    if word in NAMES:
        return True
    if not word[:1].isupper() or word in PRONOUNS or word == "I":
        return False
    gap = text[word_spans[i - 1][1]:start] if i > 0 else None
    return gap is not None and not SENTENCE_START.search(gap)


@torch.inference_mode()
def capture_attention(model, tokenizer, text: str, keep: str = "first") -> AttentionCapture:
    """One forward pass over `text` with every layer's attention weights kept (read at the hook
    points blocks.{i}.attn.hook_pattern); a longer text than block_size is cut to its first or
    last block_size tokens (`keep`; after generation "first" is the attention the model wrote
    them with). The same pass keeps the q, k and v behind those weights, as many layers as
    head_numbers.MAX_STORED numbers hold, for the tab's arithmetic panel."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    if not ids:
        raise ValueError("cannot inspect an empty text")
    n = len(ids)
    start = max(0, n - model.config.block_size) if keep == "last" else 0
    window = slice(start, start + model.config.block_size)
    ids, offsets = list(ids[window]), [tuple(o) for o in offsets[window]]
    device = next(model.parameters()).device
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    kept, not_stored = arithmetic_layers(model, len(ids))
    with caching(model, [*arithmetic_names(kept), "hook_pattern"]) as cache:
        model(idx)
    weights = torch.stack([cache[f"blocks.{i}.attn.hook_pattern"][0]  # (L, nh, T, T)
                           for i in range(len(model.blocks))]).float().cpu().numpy()
    word_spans = find_words(text)
    return AttentionCapture(text, ids, list(tokenizer.token_strings(ids)), offsets, weights,
                            word_spans, token_word_index(offsets, word_spans, len(text)),
                            start, n, kv_heads(model),
                            arithmetic_from(model, cache, len(ids), kept, not_stored))


# The two query positions a pronoun is read from, in the order they are shown.
QUERY_POSITIONS = {
    "deciding": "where the model chooses the pronoun",
    "resolving": "where the model looks once it has read the pronoun",
}


@dataclass
class HeadReading:
    """Where every head's attention goes from one query position, over the earlier words."""

    query: int  # the query token (resolving: the pronoun's last; its tokens' rows are averaged)
    top: list[list[list[tuple[int, float]]]]  # [layer][head]: [(earlier word, weight)], best first
    name_heads: list[tuple[int, int, int, float]]  # (layer, head, word, weight) whose top is a name


@dataclass
class PronounReading:
    """Where each head looks, at word level, from a pronoun and from the token that predicts it."""

    word: int  # the pronoun's word index
    pronoun: str
    char: int  # its first character in the text
    positions: dict[str, HeadReading]  # "deciding", "resolving": those that could be read
    skipped: dict[str, str]  # the other positions: why they have no reading


# Why "it" and "its" get no reading, in place of one.
NOT_A_PERSON = ("'{}' stands for a thing or an animal, not a named character: only he, she, "
                "they and their other forms are read against names")


def _head_reading(capture: AttentionCapture, query: int, rows: np.ndarray, earlier: list[int],
                  k: int) -> HeadReading:
    """Rank each head's attention to the earlier words; rows (L, nh, n_earlier)."""
    order = np.argsort(-rows, axis=-1, kind="stable")[..., :k]
    top = [[[(earlier[j], float(rows[layer, head, j])) for j in order[layer, head]]
            for head in range(rows.shape[1])] for layer in range(rows.shape[0])]
    name_heads = [(layer, head, w, v) for layer, row in enumerate(top)
                  for head, ((w, v), *_) in enumerate(row)
                  if is_name(capture.text, capture.word_spans, w)]
    return HeadReading(query, top, name_heads)


def read_pronouns(capture: AttentionCapture, k: int = 3) -> list[PronounReading]:
    """For each pronoun in view: every head's k most-attended earlier words, deciding and
    resolving; a position that cannot be read is listed in `skipped` with the reason. "it" and
    "its" are listed with both positions skipped: they do not stand for a named character."""
    words = capture.words
    # The words with at least one token inside the window, numbered 0..W-1 among themselves: a
    # long text's other words take no memory (the word-level weights are (L, nh, W, W)).
    seen = {w: i for i, w in enumerate(sorted(set(capture.token_words) - {-1}))}
    in_view = [seen.get(w, -1) for w in capture.token_words]
    word_weights = word_level(capture.weights, in_view, len(seen))  # (L, nh, W, W)
    to_words = key_words(capture.weights, in_view, len(seen))  # (L, nh, T, W)
    readings = []
    for p in seen:
        word = words[p]
        if word not in PRONOUNS:
            continue
        if word not in PERSON_PRONOUNS:  # "it", "its": no name is what they stand for
            why = NOT_A_PERSON.format(word)
            readings.append(PronounReading(p, word, capture.word_spans[p][0], {},
                                           dict.fromkeys(QUERY_POSITIONS, why)))
            continue
        earlier = [w for w in seen if w < p]
        local = [seen[w] for w in earlier]
        positions, skipped = {}, {}
        decider = deciding_token(capture.token_words, p)
        if decider is None:
            skipped["deciding"] = ("it is the first token of the text, so no token chooses it"
                                   if capture.start == 0 else
                                   "it is the first token in view, so the token that chooses it "
                                   "is not in the window")
        elif earlier:
            positions["deciding"] = _head_reading(capture, decider,
                                                  to_words[:, :, decider, local], earlier, k)
        if earlier:
            last = max(t for t, w in enumerate(capture.token_words) if w == p)
            positions["resolving"] = _head_reading(
                capture, last, word_weights[..., seen[p], local], earlier, k)
        for position in QUERY_POSITIONS:
            if position not in positions and position not in skipped:
                skipped[position] = "no earlier word in view"
        readings.append(PronounReading(p, word, capture.word_spans[p][0], positions, skipped))
    return readings
