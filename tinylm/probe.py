"""Which heads follow a pronoun to its antecedent, whether the model knows a name's pronoun, and
which heads that knowledge needs.

    tinylm-probe checkpoint=<run dir>                    # both shipped probe sets in data/probes/
    tinylm-probe checkpoint=<run dir> probe_file=data/probes/agreement.jsonl ablate=true

One JSONL file format, one item per line, two kinds of item (a file may mix them; other fields
are ignored). Character offsets point at the first character of a word.

- attention item, two characters of different gender before the pronoun:
  {"text", "pronoun_char", "antecedent_chars": [...], "distractor_chars": [...]}
  A head is right on it when its attention from the pronoun to the antecedent's mentions exceeds
  its attention to the distractor's. Word level, as in tinylm.inspection: attention to a mention
  sums its sub-word tokens; attention from the pronoun averages the pronoun's tokens (a BPE
  pronoun is one token, so that is its row). Baselines: always pick the character mentioned
  nearest before the pronoun, or the one mentioned first.
- agreement item, one character before the pronoun:
  {"text", "pronoun_char", "antecedent_chars": [...], "wrong_pronoun"}
  margin = log P(pronoun as written) - log P(wrong pronoun), where the pronoun would be read. Both
  are whole-word probabilities: the text before the pronoun plus the word, tokenized as it would
  be in running text (the word keeps the space before it, " she"; the wrong pronoun takes the
  written one's capitalisation, "She" -> "He"), scored by the chain rule over the tokens after the
  shared context, times the probability that the next token starts a new word (so "he" is not
  credited with "her").
  Agreement accuracy is the share of positive margins. (A wrong_pronoun on an attention item is
  not needed: with two characters before it, either pronoun could be right. It serves the
  deciding position's prediction match, below.)

Both kinds are also read at the deciding position, the token just before the pronoun, where a
causal model chooses it (tinylm.deciding): on agreement items each head's attention from there to
the name (also split by whether the name is the text's first word: a head that always looks at
the first token would score high there); on attention items whether the sign of (attention to
antecedent - attention to distractor) matches the sign of the model's own preference log
P(pronoun) - log P(wrong pronoun). The wrong pronoun is the item's wrong_pronoun, else derived
(she/he, he/she, him/her, his/her); "her" has none, and such items are left out and counted.

Attention weights alone are not explanations, so `ablate=true` zeroes each head in turn (its
output times 0, through the model's head_mask) and measures how the agreement margins change;
the evidence table puts that beside each head's deciding attention to the name.

Output: a console summary; a JSON report (`out`, default <logdir>/probe.json) with `n` (attention
items), `heads` ([{layer, head, accuracy, mean_antecedent_attention, mean_distractor_attention}]),
`best`, `baselines` ({"nearest mention", "first mention"}), `agreement` ({n, accuracy,
mean_margin, items}) and `ablation` ([{layer, head, method: "zeroed", mean_margin, accuracy,
delta_mean_margin, delta_accuracy}]), `deciding` ({"agreement_attention": [{layer, head,
mean_attention, mean_attention_name_first_word, mean_attention_name_later}], "prediction_match":
[{layer, head, match, correlation}], "n_agreement", "n_attention", "n_attention_left_out",
"n_name_first_word"}), `evidence` ([{layer, head, mean_attention, delta_mean_margin, agrees}],
with ablate=true) and `best_deciding` ({layer, head, mean_attention});
layer x head heatmaps in TensorBoard (`logdir`, default
<run dir>/probe/<timestamp>), also saved as PNG. Nothing is written until everything is computed.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tinylm import deciding
from tinylm.config import flag, integer, one_of
from tinylm.inspection import (
    PRONOUNS,
    deciding_token,
    find_words,
    key_words,
    token_word_index,
    word_at,
    word_level,
)
from tinylm.threads import apply_threads, check_threads_setting, start_sample

SHIPPED_PROBES = ("pronouns.jsonl", "agreement.jsonl")  # in data/probes/ (a wheel: tinylm/probes/)
ABLATION = "zeroed"  # how a head is removed: its output is multiplied by 0
WORD_CHAR = re.compile(r"\w")


@dataclass
class ProbeConfig:
    """Options of tinylm-probe; the schema of conf/probe.yaml (defaults: here only)."""

    checkpoint: str | None = None  # a run directory, its checkpoints/, or one checkpoint directory
    # JSONL file(s); None: the shipped data/probes/ sets. Any: OmegaConf has no "str or list"
    probe_file: Any = None
    out: str | None = None  # the JSON report; None: <logdir>/probe.json
    logdir: str | None = None  # TensorBoard heatmaps; None: <run dir>/probe/<timestamp>
    ablate: bool = False  # zero each head in turn and measure the agreement margins
    top_heads: int = 5  # rows of the console ablation table
    batch_size: int = 64  # sequences per forward pass
    device: str = "auto"
    prefer: str = "best"  # which checkpoint of a run: best or last
    threads: int | str = "auto"  # torch intra-op threads; auto: the idle usable cores

    def __post_init__(self):
        if isinstance(self.probe_file, str):
            self.probe_file = [self.probe_file]
        if self.probe_file is not None and (not self.probe_file or not all(
                isinstance(p, str) for p in self.probe_file)):
            raise ValueError(f"probe_file={self.probe_file!r} is not allowed: give a JSONL path, "
                             "a list of them, or null for the shipped probe sets")
        for key in ("top_heads", "batch_size"):
            integer(key, getattr(self, key), least=1)
        flag("ablate", self.ablate)
        one_of("prefer", self.prefer, ("best", "last"))
        check_threads_setting("threads", self.threads)


class ProbeFileError(ValueError):
    """A probe line that cannot be used; the message starts with `<file>, line <n>:`."""


@dataclass
class ProbeItem:
    """One validated probe line."""

    source: str  # "<file>, line <n>", for messages
    text: str
    pronoun_char: int
    antecedent_chars: list[int]
    distractor_chars: list[int] | None  # attention items
    wrong_pronoun: str | None  # agreement items; optional on attention items

    @property
    def kind(self) -> str:
        """"attention" (two characters) or "agreement" (one character)."""
        return "attention" if self.distractor_chars is not None else "agreement"

    @property
    def pronoun(self) -> str:
        """The pronoun as written in the text."""
        return self.text[self.pronoun_char:_word_end(self.text, self.pronoun_char)]

    def error(self, message: str) -> ProbeFileError:
        """An error about this item, naming its file and line."""
        return ProbeFileError(f"{self.source}: {message}")


# ----------------------------------------------------------------------------- reading probe files

def _word_end(text: str, start: int) -> int:
    return next(end for s, end in find_words(text) if s == start)


def _offsets(obj: dict, key: str, where: str) -> list[int]:
    value = obj.get(key)
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, int) and not isinstance(c, bool) for c in value)):
        raise ProbeFileError(f"{where}: {key} must be a non-empty list of character offsets, "
                             f"got {value!r}")
    return value


def parse_item(obj, where: str) -> ProbeItem:
    """Check one decoded JSONL line and turn it into a ProbeItem (ProbeFileError if unusable)."""
    if not isinstance(obj, dict):
        raise ProbeFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
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

    kinds = {"antecedent": "antecedent_chars"}
    if "distractor_chars" in obj:
        kinds["distractor"] = "distractor_chars"
    mentions: dict[str, list[int]] = {}
    seen: dict[int, str] = {}
    for role, key in kinds.items():
        mentions[role] = _offsets(obj, key, where)
        for i, char in enumerate(mentions[role]):
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
    return ProbeItem(where, text, p, mentions["antecedent"], mentions.get("distractor"), wrong)


def load_probe_file(path: str | Path) -> list[ProbeItem]:
    """Read and check every line of a JSONL probe file; the first bad line raises ProbeFileError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"probe file {path} does not exist")
    items = []
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
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
                raise ProbeFileError(f"{where}: JSON nested too deeply to be a probe item"
                                     ) from None
            items.append(parse_item(obj, where))
    if not items:
        raise ProbeFileError(f"{path}: no probe items (the file is empty)")
    return items


# ------------------------------------------------------------------------------ attention scoring

def baselines(items: list[ProbeItem]) -> dict[str, float]:
    """Accuracy of always choosing the nearer-mentioned, or the first-mentioned, character."""
    nearest = [max(i.antecedent_chars) > max(i.distractor_chars) for i in items]
    first = [min(i.antecedent_chars) < min(i.distractor_chars) for i in items]
    return {"nearest mention": float(np.mean(nearest)), "first mention": float(np.mean(first))}


def attention_to_mentions(weights: np.ndarray, token_words: list[int], n_words: int,
                          pronoun_word: int, mention_words: list[int],
                          position: str = "resolving") -> np.ndarray:
    """Per-head attention (L, nh) to a character's mentions, from the pronoun ("resolving") or
    from the token just before it, where the pronoun is predicted ("deciding").

    weights (L, nh, T, T) over tokens; word-level as tinylm.inspection.word_level: summed over each
    mention's sub-word tokens (and over the mentions), averaged over the pronoun's tokens.
    """
    if position == "deciding":
        query = deciding_token(token_words, pronoun_word)
        if query is None:
            raise ValueError("the pronoun is the first token: no token before it decides it")
        to_words = key_words(weights[..., query, :], token_words, n_words)  # (L, nh, W)
        return to_words[..., mention_words].sum(-1)
    words = word_level(weights, token_words, n_words)  # (L, nh, W, W)
    return words[..., pronoun_word, mention_words].sum(-1)


def head_accuracy(antecedent: np.ndarray, distractor: np.ndarray) -> np.ndarray:
    """Share of items (axis 0) on which each head attends more to the antecedent; ties are wrong."""
    return (np.asarray(antecedent) > np.asarray(distractor)).mean(axis=0)


@dataclass
class EncodedAttentionItem:
    """An item as tokens: the text up to the pronoun's last token, and word indices (an
    agreement item has no distractor words)."""

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
                         f"model's block_size={block_size}; shorten the item")


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


def _padded(sequences: list[list[int]], device) -> torch.Tensor:
    """(B, T_max) ids, right-padded with 0: under the causal mask padding is never looked at."""
    idx = torch.zeros(len(sequences), max(len(s) for s in sequences), dtype=torch.long)
    for row, seq in enumerate(sequences):
        idx[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return idx.to(device)


@torch.inference_mode()
def mention_attention(model, encoded: list[EncodedAttentionItem], batch_size: int = 64,
                      position: str = "resolving") -> tuple[np.ndarray, np.ndarray]:
    """Attention (N, L, nh) from each item's pronoun (or the token before it: "deciding") to its
    antecedent and to its distractor."""
    device = next(model.parameters()).device
    antecedent, distractor = [], []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        out = model(_padded([e.ids for e in chunk], device), return_attention=True)
        weights = torch.stack(out.attentions, dim=1).float().cpu().numpy()  # (B, L, nh, T, T)
        for row, e in enumerate(chunk):
            t = len(e.ids)
            w = weights[row, :, :, :t, :t]
            antecedent.append(attention_to_mentions(w, e.token_words, e.n_words, e.pronoun_word,
                                                    e.antecedent_words, position))
            distractor.append(attention_to_mentions(w, e.token_words, e.n_words, e.pronoun_word,
                                                    e.distractor_words, position))
    return np.stack(antecedent), np.stack(distractor)


# ------------------------------------------------------------------------------------- agreement

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
    """Tokenize the text before the pronoun followed by each pronoun, as running text would be.

    The wrong pronoun: `wrong_pronoun`, else the item's."""
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
        if n_context == 0:
            raise item.error("no text before the pronoun")
        _check_length(item, len(ids), block_size)
        encoded.append((ids, n_context))
    (ids_written, n), (ids_wrong, n_wrong) = encoded
    if ids_written[:n] != ids_wrong[:n_wrong]:
        raise item.error(f"the text before the pronoun tokenizes differently before {written!r} "
                         f"and before {wrong!r}")
    return EncodedAgreementItem(ids_written, ids_wrong, n)


@torch.inference_mode()
def word_log_probs(model, sequences: list[list[int]], n_context: list[int],
                   new_word: torch.Tensor, head_mask: torch.Tensor | None = None,
                   batch_size: int = 64) -> torch.Tensor:
    """log P(word | context) for each sequence (S,); the word is sequence[n_context:].

    Chain rule over the word's tokens, plus log P(the next token starts a new word).
    """
    device = next(model.parameters()).device
    new_word = new_word.to(device)
    if head_mask is not None:
        head_mask = head_mask.to(device)
    result = torch.zeros(len(sequences), dtype=torch.float64)
    # batches of similar lengths waste little work on padding
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        logits = model(_padded([sequences[i] for i in rows], device), head_mask=head_mask).logits
        # Per sequence of length t with context c: rows c-1 .. t-2 of its logits predict the
        # word's tokens, row t-1 what follows the word. Gather them all, normalise once.
        batch, pos, seq_of, last = [], [], [], []
        for row, i in enumerate(rows):
            c, t = n_context[i], len(sequences[i])
            batch += [row] * (t - c + 1)
            pos += range(c - 1, t)
            seq_of += [i] * (t - c + 1)
            last.append(len(pos) - 1)
        log_p = logits[batch, pos].float().log_softmax(dim=-1)  # (K, V)
        targets = [tok for i in rows for tok in sequences[i][n_context[i]:] + [-1]]
        picked = log_p.gather(1, torch.tensor(targets, device=device).clamp_min(0)[:, None])[:, 0]
        picked[last] = log_p[last][:, new_word].logsumexp(dim=-1)  # P(the word ends here)
        result.index_add_(0, torch.tensor(seq_of), picked.double().cpu())
    return result


def agreement_margins(model, encoded: list[EncodedAgreementItem], new_word: torch.Tensor,
                      head_mask: torch.Tensor | None = None, batch_size: int = 64
                      ) -> torch.Tensor:
    """log P(written pronoun) - log P(wrong pronoun) per item, (N,)."""
    sequences = [s for e in encoded for s in (e.written, e.wrong)]
    n_context = [e.n_context for e in encoded for _ in range(2)]
    log_p = word_log_probs(model, sequences, n_context, new_word, head_mask, batch_size)
    return log_p[0::2] - log_p[1::2]


def ablate_heads(model, encoded: list[EncodedAgreementItem], new_word: torch.Tensor,
                 batch_size: int = 64, base: torch.Tensor | None = None) -> list[dict]:
    """Zero each head in turn; its agreement mean margin and accuracy, and their changes.

    `base`: the margins with every head on, if already computed.
    """
    c = model.config
    if base is None:
        base = agreement_margins(model, encoded, new_word, None, batch_size)
    entries = []
    for layer in range(c.n_layer):
        for head in range(c.n_head):
            mask = torch.ones(c.n_layer, c.n_head)
            mask[layer, head] = 0.0
            m = agreement_margins(model, encoded, new_word, mask, batch_size)
            entries.append({
                "layer": layer, "head": head, "method": ABLATION,
                "mean_margin": float(m.mean()), "accuracy": float((m > 0).float().mean()),
                "delta_mean_margin": float(m.mean() - base.mean()),
                "delta_accuracy": float((m > 0).float().mean() - (base > 0).float().mean()),
            })
    return entries


# --------------------------------------------------------------------------------- the whole run

def probe(model, tokenizer, items: list[ProbeItem], ablate: bool = False, batch_size: int = 64
          ) -> dict:
    """Score every head on the attention items, measure agreement (and ablations), and read every
    head at the deciding position; the report."""
    c = model.config
    attention = [i for i in items if i.kind == "attention"]
    agreement = [i for i in items if i.kind == "agreement"]
    # the model's own preference on a two-character item needs a wrong pronoun: "her" has none
    wrong = [i.wrong_pronoun or deciding.derived_wrong_pronoun(i.pronoun) for i in attention]
    scored = [k for k, w in enumerate(wrong) if w is not None]
    # tokenize everything first: a bad item stops the run before any model work or output
    enc_attention = [encode_attention_item(tokenizer, i, c.block_size) for i in attention]
    enc_agreement = [encode_agreement_item(tokenizer, i, c.block_size) for i in agreement]
    enc_names = [encode_attention_item(tokenizer, i, c.block_size) for i in agreement]
    enc_preference = [encode_agreement_item(tokenizer, attention[k], c.block_size, wrong[k])
                      for k in scored]

    report: dict = {"n": len(attention), "heads": [], "best": None, "baselines": None,
                    "agreement": None, "ablation": None, "deciding": None, "evidence": None,
                    "best_deciding": None}
    new_word = new_word_tokens(tokenizer)
    if attention:
        ante, distr = mention_attention(model, enc_attention, batch_size)
        accuracy = head_accuracy(ante, distr)
        report["heads"] = [
            {"layer": layer, "head": head, "accuracy": float(accuracy[layer, head]),
             "mean_antecedent_attention": float(ante[:, layer, head].mean()),
             "mean_distractor_attention": float(distr[:, layer, head].mean())}
            for layer in range(c.n_layer) for head in range(c.n_head)]
        best = max(report["heads"], key=lambda h: h["accuracy"])  # first of ties: lowest layer
        report["best"] = {k: best[k] for k in ("layer", "head", "accuracy")}
        report["baselines"] = baselines(attention)
    if agreement:
        margins = agreement_margins(model, enc_agreement, new_word, None, batch_size)
        report["agreement"] = {
            "n": len(agreement), "accuracy": float((margins > 0).float().mean()),
            "mean_margin": float(margins.mean()),
            "items": [{"source": i.source, "pronoun": i.pronoun,
                       "wrong_pronoun": match_case(i.wrong_pronoun, i.pronoun),
                       "margin": float(m)} for i, m in zip(agreement, margins, strict=True)]}
        if ablate:
            report["ablation"] = ablate_heads(model, enc_agreement, new_word, batch_size, margins)
    if attention or agreement:
        report["deciding"] = deciding_report(model, enc_names, enc_attention, scored,
                                             enc_preference, new_word, batch_size)
    names = report["deciding"]["agreement_attention"] if report["deciding"] else []
    if names:
        best = max(names, key=lambda h: h["mean_attention"])
        report["best_deciding"] = {k: best[k] for k in ("layer", "head", "mean_attention")}
    if names and report["ablation"]:
        report["evidence"] = deciding.evidence(names, report["ablation"])
    return report


def deciding_report(model, enc_names: list[EncodedAttentionItem],
                    enc_attention: list[EncodedAttentionItem], scored: list[int],
                    enc_preference: list[EncodedAgreementItem], new_word: torch.Tensor,
                    batch_size: int = 64) -> dict:
    """The report's `deciding` part: attention from the token before the pronoun to the name on
    the agreement items (enc_names); on the two-character items whether the attention's
    preference matches the model's (scored: the indices of those with a wrong pronoun,
    enc_preference: their written and wrong pronoun)."""
    name_first = np.array([0 in e.antecedent_words for e in enc_names], dtype=bool)
    result: dict = {"agreement_attention": [], "prediction_match": [],
                    "n_agreement": len(enc_names), "n_attention": len(scored),
                    "n_attention_left_out": len(enc_attention) - len(scored),
                    "n_name_first_word": int(name_first.sum())}
    if enc_names:
        to_name, _ = mention_attention(model, enc_names, batch_size, "deciding")
        result["agreement_attention"] = deciding.agreement_attention(to_name, name_first)
    if scored:
        ante, distr = mention_attention(model, enc_attention, batch_size, "deciding")
        preference = agreement_margins(model, enc_preference, new_word, None, batch_size)
        match, correlation = deciding.prediction_match((ante - distr)[scored], preference.numpy())
        result["prediction_match"] = deciding.head_entries(
            {"match": match, "correlation": correlation})
    return result


def _grid(report: dict, key: str, n_layer: int, n_head: int, entries: list[dict]) -> np.ndarray:
    grid = np.full((n_layer, n_head), np.nan)
    for e in entries:
        grid[e["layer"], e["head"]] = np.nan if e[key] is None else e[key]
    return grid


def format_report(report: dict, n_layer: int, n_head: int, top_heads: int = 5) -> list[str]:
    """The console summary: the deciding position first (evidence table, attention to the name,
    prediction match), then the resolving head accuracy table, baselines, agreement, ablation."""
    lines = (deciding.format_deciding(report, n_layer, n_head, top_heads)
             if report["deciding"] else [])
    if report["heads"]:
        grid = _grid(report, "accuracy", n_layer, n_head, report["heads"])
        best = report["best"]
        lines += [f"resolving: {report['n']} two-character items; accuracy = share of items on "
                  "which the head's attention",
                  "from the pronoun goes more to the antecedent than to the distractor (* = best)"]
        lines += deciding.layer_head_lines({(layer, h): f"{grid[layer, h]:.2f}" for layer in
                                    range(n_layer) for h in range(n_head)},
                                   n_layer, n_head, (best["layer"], best["head"]))
        b = report["baselines"]
        lines.append(f"best head: layer {best['layer']} head {best['head']}, accuracy "
                     f"{best['accuracy']:.2f}; baselines: nearest mention "
                     f"{b['nearest mention']:.2f}, first mention {b['first mention']:.2f}")
    else:
        lines.append("attention: no two-character items (with distractor_chars) in the probe set")
    agreement = report["agreement"]
    if agreement:
        lines.append(f"agreement: {agreement['n']} one-character items, accuracy "
                     f"{agreement['accuracy']:.2f} (share with log P(pronoun) > log P(wrong "
                     f"pronoun)), mean margin {agreement['mean_margin']:+.3f} nats")
    else:
        lines.append("agreement: no one-character items (with wrong_pronoun) in the probe set")
    if report["ablation"]:
        ranked = sorted(report["ablation"], key=lambda e: -abs(e["delta_mean_margin"]))
        lines += [f"ablation: each head {ABLATION} in turn, over the {agreement['n']} agreement "
                  f"items; the {min(top_heads, len(ranked))} heads that move the mean margin most",
                  "  layer  head   Δ mean margin   Δ accuracy   mean margin   accuracy"]
        lines += [f"  {e['layer']:>5d}  {e['head']:>4d}   {e['delta_mean_margin']:+13.3f}   "
                  f"{e['delta_accuracy']:+10.2f}   {e['mean_margin']:+11.3f}   {e['accuracy']:8.2f}"
                  for e in ranked[:top_heads]]
    return lines


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary file, then rename it into place: never a half-written report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_tensorboard(report: dict, logdir: Path, n_layer: int, n_head: int,
                      console: list[str]) -> list[str]:
    """Layer x head heatmaps (images, also saved as PNG) and the console report as text."""
    from torch.utils.tensorboard import SummaryWriter

    from tinylm.plots import layer_head_heatmap, log_figure

    figures = {}  # TensorBoard tag -> figure, also written as <logdir>/<tag>.png
    if report["heads"]:
        figures["probe/attention_accuracy"] = layer_head_heatmap(
            _grid(report, "accuracy", n_layer, n_head, report["heads"]),
            f"pronoun -> antecedent accuracy ({report['n']} items)", "accuracy")
    d = report["deciding"]
    if d and d["agreement_attention"]:
        n_first = d["n_name_first_word"]
        for key, items in (("mean_attention", f"{d['n_agreement']} items"),
                           ("mean_attention_name_first_word",
                            f"{n_first} items with the name first"),
                           ("mean_attention_name_later",
                            f"{d['n_agreement'] - n_first} items with the name later")):
            tag = "probe/deciding_attention" + key.removeprefix("mean_attention")
            figures[tag] = layer_head_heatmap(
                _grid(report, key, n_layer, n_head, d["agreement_attention"]),
                f"deciding: token before the pronoun -> name ({items})", "attention")
    if d and d["prediction_match"]:
        figures["probe/prediction_match"] = layer_head_heatmap(
            _grid(report, "match", n_layer, n_head, d["prediction_match"]),
            f"deciding attention predicts the model's pronoun ({d['n_attention']} items)",
            "share of items")
        figures["probe/prediction_correlation"] = layer_head_heatmap(
            _grid(report, "correlation", n_layer, n_head, d["prediction_match"]),
            "deciding attention difference vs log P difference", "Pearson r", fmt="{:+.2f}",
            center=0.0)
    if report["ablation"]:
        for key in ("delta_mean_margin", "delta_accuracy"):
            figures[f"probe/ablation_{key}"] = layer_head_heatmap(
                _grid(report, key, n_layer, n_head, report["ablation"]),
                f"agreement: change in {key[6:].replace('_', ' ')} with the head {ABLATION}",
                key.replace("_", " "), fmt="{:+.2f}", center=0.0)
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for tag, fig in figures.items():
            log_figure(writer, tag, fig, png_dir=logdir)
        writer.add_text("probe/report", "\n".join("    " + line for line in console), 0)
    finally:
        writer.close()
    return list(figures)


def shipped_probe(name: str) -> Path:
    """A shipped probe set: data/probes/<name> of the checkout; an installed wheel carries them
    as tinylm/probes/."""
    from tinylm.config import shipped_dir

    return shipped_dir("data/probes", "probes") / name


def probe_files(cfg: ProbeConfig) -> list[Path]:
    """The probe files to read: cfg.probe_file, or the shipped sets."""
    if cfg.probe_file is not None:
        return [Path(p) for p in cfg.probe_file]
    return [shipped_probe(name) for name in SHIPPED_PROBES]


def shipped_name_items(tokenizer, block_size: int) -> list[EncodedAttentionItem]:
    """The shipped agreement items as tokens, for deciding_name_attention; an item this tokenizer
    or context cannot read is left out (training goes on without it)."""
    encoded = []
    for item in load_probe_file(shipped_probe("agreement.jsonl")):
        try:
            encoded.append(encode_attention_item(tokenizer, item, block_size))
        except ProbeFileError:
            continue
    return encoded


def deciding_name_attention(model, encoded: list[EncodedAttentionItem], batch_size: int = 128
                            ) -> np.ndarray:
    """(L, nh): each head's mean attention from the token before the pronoun to the name."""
    to_name, _ = mention_attention(model, encoded, batch_size, "deciding")
    return to_name.mean(axis=0)


def run_probe(cfg: ProbeConfig, out=None) -> dict:
    """Load checkpoint and probe files, score, print the summary, write JSON and TensorBoard."""
    import time

    from tinylm.checkpoint import default_logdir, load_checkpoint
    from tinylm.device import resolve_device

    cpu_sample = start_sample()
    out = out or sys.stdout
    if not cfg.checkpoint:
        raise ValueError("checkpoint= is required: a run directory or a checkpoint directory")
    if cfg.out and Path(cfg.out).is_dir():  # refused before the work, not when writing it
        raise ValueError(f"out={cfg.out} is a directory; name the report file, e.g. "
                         f"out={Path(cfg.out) / 'probe.json'}")
    files = probe_files(cfg)
    items = [item for path in files for item in load_probe_file(path)]
    device = resolve_device(cfg.device)
    ckpt = load_checkpoint(cfg.checkpoint, device=device, prefer=cfg.prefer)
    model, c = ckpt.model, ckpt.config
    threads = apply_threads(cfg.threads, cpu_sample)
    print(f"loaded {ckpt.directory} ({c.n_layer} layers x {c.n_head} heads) on {device}"
          f"{f', {threads.describe()}' if device.type == 'cpu' else ''}; "
          f"{len(items)} probe items from {', '.join(map(str, files))}", file=sys.stderr)

    start = time.perf_counter()
    report = probe(model, ckpt.tokenizer, items, cfg.ablate, cfg.batch_size)
    seconds = time.perf_counter() - start
    if cfg.ablate and report["ablation"] is None:
        print("note: ablate=true needs agreement items (with wrong_pronoun), e.g. "
              "probe_file=data/probes/agreement.jsonl; no ablation done", file=sys.stderr)

    logdir = Path(cfg.logdir) if cfg.logdir else default_logdir(ckpt.directory, "probe")
    json_path = Path(cfg.out) if cfg.out else logdir / "probe.json"
    report = {"checkpoint": str(ckpt.directory), "probe_files": [str(p) for p in files],
              "logdir": str(logdir), **report}
    console = format_report(report, c.n_layer, c.n_head, cfg.top_heads)
    # everything is computed; only now is anything written
    write_json_atomic(json_path, report)
    write_tensorboard(report, logdir, c.n_layer, c.n_head, console)
    for line in console:
        print(line, file=out)
    print(f"[{seconds:.1f}s] report: {json_path}\nheatmaps: tensorboard --logdir {logdir}",
          file=out)
    return report

