"""Where each head looks: capture attention over a text, aggregate it to words, follow pronouns.

Run it through generation (`tinylm-generate checkpoint=<run> prompt="..." inspect=true`) or call
it directly:

    from tinylm.inspection import capture_attention, inspect_texts
    capture = capture_attention(model, tokenizer, "Lily and Tom went to the park. She")
    capture.weights.shape            # (n_layer, n_head, T, T), each row sums to 1
    inspect_texts(model, tokenizer, [text], "runs/inspect")   # TensorBoard + PNG + .npz

Tokens are mapped to words through the tokenizer's character offsets. Word-level attention *to*
a word sums the weights of its sub-word tokens (the share of attention the word gets); attention
*from* a word averages its tokens' rows (so each row still sums to at most 1).

Each pronoun is read from two query positions. "Resolving": from the pronoun itself, where the
model looks once it has read it (what BERT studies measure). "Deciding": from the token just before
it, where a causal model looks when it chooses the pronoun; its logits predict the pronoun, so
this is where a name's gender has to arrive.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

PRONOUNS = frozenset(
    word for w in ("he", "she", "it", "they", "him", "her", "his", "its", "them", "their")
    for word in (w, w.capitalize()))
# Frequent character names of TinyStories-style text. A word counts as a name when it is listed
# here, or when it is capitalised but does not start a sentence (see `is_name`).
NAMES = frozenset((
    "Lily Tom Tim Timmy Ben Sue Sam Max Mia Anna Lucy Jack Sara Sarah Amy Bob Jane Joe Kate Mary "
    "Emma Molly Billy Jill Zoe Leo Mike Lisa Spot Rex Kitty").split())
WORD_RE = re.compile(r"\w+(?:['’]\w+)*")  # letters/digits, keeping "Tom's" and "don't" whole
SENTENCE_START = re.compile(r"[.!?:\n\"“”]")  # a gap containing these starts a new sentence
# Long texts stay readable by labelling 1 token in k, so that an axis has at most this many labels
# (pronouns are labelled in any case); the pictures always show every token.
GRID_LABELS, HEAD_LABELS = 32, 64


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


def find_words(text: str) -> list[tuple[int, int]]:
    """Character spans (start, end) of the words in `text`; punctuation is not a word."""
    return [m.span() for m in WORD_RE.finditer(text)]


def word_at(word_spans: Sequence[tuple[int, int]], char: int) -> int | None:
    """Index of the word starting exactly at character `char`, else None."""
    for i, (start, _) in enumerate(word_spans):
        if start == char:
            return i
    return None


def token_word_index(offsets: Sequence[tuple[int, int]],
                     word_spans: Sequence[tuple[int, int]], text_len: int) -> list[int]:
    """For each token, the index of the word its characters belong to (-1: none).

    Byte-level tokens often carry the space before a word (" Lily"), so a token is matched by
    the first word character it covers, not by its start.
    """
    char_word = np.full(text_len + 1, -1, dtype=np.int64)
    for i, (start, end) in enumerate(word_spans):
        char_word[start:end] = i
    result = []
    for start, end in offsets:
        covered = char_word[start:max(end, start)]
        hits = covered[covered >= 0]
        result.append(int(hits[0]) if hits.size else -1)
    return result


def key_words(weights: np.ndarray | torch.Tensor, token_words: Sequence[int],
              n_words: int) -> np.ndarray:
    """Token attention (..., Q, T) -> attention to words (..., Q, n_words).

    Column j sums the weights on word j's tokens (the share of attention the word gets). Tokens
    outside every word (token_words == -1) are left out.
    """
    weights = np.asarray(weights, dtype=np.float64)
    t = weights.shape[-1]
    if len(token_words) != t:
        raise ValueError(f"token_words has {len(token_words)} entries for {t} tokens")
    to_word = np.zeros((t, n_words))  # (T, W): one-hot token -> word
    for token, word in enumerate(token_words):
        if word >= 0:
            to_word[token, word] = 1.0
    return weights @ to_word  # (..., Q, W)


def word_level(weights: np.ndarray | torch.Tensor, token_words: Sequence[int],
               n_words: int) -> np.ndarray:
    """Token attention (..., T, T) -> word attention (..., n_words, n_words).

    Column j sums the weights on word j's tokens; row i averages the rows of word i's tokens.
    Tokens outside every word (token_words == -1) are left out.
    """
    to_word = key_words(np.eye(len(token_words)), token_words, n_words)  # (T, W): one-hot
    mean_rows = (to_word / np.maximum(to_word.sum(axis=0), 1.0)).T  # (W, T): average a word's rows
    return mean_rows @ key_words(weights, token_words, n_words)  # (..., W, W)


def deciding_token(token_words: Sequence[int], word: int) -> int | None:
    """The token that predicts `word`'s first token: the one just before it (None: there is none).

    In a causal LM a word is chosen there, one position before the model has read it.
    """
    first = list(token_words).index(word)
    return first - 1 if first > 0 else None


def is_name(text: str, word_spans: Sequence[tuple[int, int]], i: int) -> bool:
    """Heuristic: word i is a name if listed in NAMES, or capitalised but not sentence-initial.

    Sentence-initial means first in the text, or after . ! ? : a newline or a quote mark.
    Pronouns and "I" are never names.
    """
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
    """One forward pass over `text` with return_attention=True, every layer's weights kept.

    A text longer than block_size is cut to its first (keep="first") or last ("last")
    block_size tokens. After generation "first" is right: the window then starts at the prompt,
    and it is exactly the attention the model used while writing those tokens.
    """
    if keep not in ("first", "last"):
        raise ValueError(f"keep={keep!r} is not allowed; allowed: first, last")
    ids, offsets = tokenizer.encode_with_offsets(text)
    if not ids:
        raise ValueError("cannot inspect an empty text")
    n, block_size = len(ids), model.config.block_size
    start = max(0, n - block_size) if keep == "last" else 0
    ids, offsets = list(ids[start:start + block_size]), [tuple(o) for o in offsets]
    offsets = offsets[start:start + block_size]
    device = next(model.parameters()).device
    out = model(torch.tensor([ids], dtype=torch.long, device=device), return_attention=True)
    weights = torch.stack([a[0] for a in out.attentions]).float().cpu().numpy()  # (L, nh, T, T)
    word_spans = find_words(text)
    return AttentionCapture(text, ids, list(tokenizer.token_strings(ids)), offsets, weights,
                            word_spans, token_word_index(offsets, word_spans, len(text)),
                            start, n)


@dataclass
class HeadReading:
    """Where every head's attention goes from one query position, over the earlier words."""

    query: int  # the query token (resolving: the pronoun's last; its tokens' rows are averaged)
    top: list[list[list[tuple[int, float]]]]  # [layer][head]: [(earlier word, weight)], best first
    name_heads: list[tuple[int, int, int, float]]  # (layer, head, word, weight) whose top is a name


# The two query positions a pronoun is read from, in the order they are shown.
QUERY_POSITIONS = {
    "deciding": "where the model chooses the pronoun",
    "resolving": "where the model looks once it has read the pronoun",
}


@dataclass
class PronounReading:
    """Where each head looks, at word level, from a pronoun and from the token that predicts it."""

    word: int  # the pronoun's word index
    pronoun: str
    char: int  # its first character in the text
    positions: dict[str, HeadReading]  # "deciding", "resolving": those that could be read
    skipped: dict[str, str]  # the other positions: why they have no reading


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
    resolving; a position that cannot be read is listed in `skipped` with the reason."""
    words = capture.words
    seen = set(capture.token_words)  # words with at least one token inside the window
    word_weights = word_level(capture.weights, capture.token_words, len(words))  # (L, nh, W, W)
    to_words = key_words(capture.weights, capture.token_words, len(words))  # (L, nh, T, W)
    readings = []
    for p, word in enumerate(words):
        if word not in PRONOUNS or p not in seen:
            continue
        earlier = [w for w in range(p) if w in seen]
        positions, skipped = {}, {}
        decider = deciding_token(capture.token_words, p)
        if decider is None:
            skipped["deciding"] = ("it is the first token of the text, so no token chooses it"
                                   if capture.start == 0 else
                                   "it is the first token in view, so the token that chooses it "
                                   "is not in the window")
        elif earlier:
            positions["deciding"] = _head_reading(capture, decider,
                                                  to_words[:, :, decider, earlier], earlier, k)
        if earlier:
            last = max(t for t, w in enumerate(capture.token_words) if w == p)
            positions["resolving"] = _head_reading(capture, last, word_weights[..., p, earlier],
                                                   earlier, k)
        for position in QUERY_POSITIONS:
            if position not in positions and position not in skipped:
                skipped[position] = "no earlier word in view"
        readings.append(PronounReading(p, word, capture.word_spans[p][0], positions, skipped))
    return readings


def _md(text: str) -> str:
    """Escape text for TensorBoard's markdown (tables, emphasis, HTML)."""
    text = re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text)
    return text.replace("\n", " ")


def query_label(capture: AttentionCapture, reading: PronounReading, position: str) -> str:
    """Which token a position reads from, in words: "from '.' before 'She'", "from 'She'"."""
    if position == "resolving":
        return f"from {reading.pronoun!r}"
    return f"from {capture.tokens[reading.positions[position].query]!r} before {reading.pronoun!r}"


def pronoun_table(capture: AttentionCapture, reading: PronounReading) -> str:
    """Markdown tables, deciding then resolving: one row per head, its top earlier words."""
    words = capture.words
    parts = [f"**{_md(reading.pronoun)}** (word {reading.word}, character {reading.char}): "
             "attention to earlier words, summed over sub-word tokens; *name* in italics"]
    for position, why in QUERY_POSITIONS.items():
        if position in reading.skipped:
            parts.append(f"{position}: skipped: {_md(reading.skipped[position])}")
            continue
        top = reading.positions[position].top
        k = max(len(ws) for row in top for ws in row)
        lines = [f"{position} ({_md(query_label(capture, reading, position))}: {why})", "",
                 "| layer | head | " + " | ".join(f"top {i + 1}" for i in range(k)) + " |",
                 "|---|---|" + "---|" * k]
        for layer, row in enumerate(top):
            for head, ranked in enumerate(row):
                cells = []
                for w, v in ranked:
                    name = _md(words[w])
                    if is_name(capture.text, capture.word_spans, w):
                        name = f"*{name}*"
                    cells.append(f"{name} {v:.2f}")
                lines.append(f"| {layer} | {head} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def pronoun_summary(capture: AttentionCapture, readings: Sequence[PronounReading]) -> list[str]:
    """Console lines per pronoun, deciding then resolving: the heads whose most-attended earlier
    word is a name, or why a position was skipped."""
    words = capture.words
    n_heads = capture.weights.shape[0] * capture.weights.shape[1]
    lines = []
    for r in readings:
        for position in QUERY_POSITIONS:
            head = f"{r.pronoun!r} at character {r.char}, {position}"
            if position in r.skipped:
                lines.append(f"{head}: skipped: {r.skipped[position]}")
                continue
            found = sorted(r.positions[position].name_heads, key=lambda x: -x[3])
            where = query_label(capture, r, position)
            if found:
                heads = ", ".join(f"L{layer}H{h} -> {words[w]} {v:.2f}"
                                  for layer, h, w, v in found)
                lines.append(f"{head} ({where}): {len(found)}/{n_heads} heads point at a name: "
                             f"{heads}")
            else:
                lines.append(f"{head} ({where}): no head's top word is a name")
    return lines


def pronoun_records(capture: AttentionCapture, readings: Sequence[PronounReading]) -> list[dict]:
    """The readings as JSON-ready records (inspect.json): words by text, names flagged."""
    words = capture.words

    def heads(reading: HeadReading) -> list[dict]:
        return [{"layer": layer, "head": head,
                 "top": [{"word": words[w], "word_index": w, "weight": v,
                          "name": is_name(capture.text, capture.word_spans, w)}
                         for w, v in ranked]}
                for layer, row in enumerate(reading.top) for head, ranked in enumerate(row)]

    return [{"pronoun": r.pronoun, "word_index": r.word, "char": r.char,
             **{position: ({"query_token": r.positions[position].query,
                            "query": capture.tokens[r.positions[position].query],
                            "heads": heads(r.positions[position])}
                           if position in r.positions else None)
                for position in QUERY_POSITIONS},
             "skipped": r.skipped} for r in readings]


def tokens_table(capture: AttentionCapture) -> str:
    """Markdown table of the tokens: position, id, token string, the word it belongs to."""
    words = capture.words
    lines = ["| position | id | token | word |", "|---|---|---|---|"]
    for i, (token_id, token, w) in enumerate(zip(capture.ids, capture.tokens,
                                                 capture.token_words, strict=True)):
        lines.append(f"| {i} | {token_id} | {_md(repr(token))} | {_md(words[w]) if w >= 0 else ''}"
                     " |")
    return "\n".join(lines)


def write_inspection(capture: AttentionCapture, logdir: str | Path, prompt_chars: int = 0,
                     top_words: int = 3, meta: dict | None = None) -> list[str]:
    """Write one text's attention to TensorBoard, PNG files, attention.npz, pronouns.md and
    inspect.json (`meta` and the pronoun readings) in `logdir`.

    TensorBoard tags: attention/layer_LL/all_heads, attention/layer_LL/head_HH (images),
    pronouns/NN_<pronoun> (bar charts, deciding beside resolving, and markdown tables),
    text/generated, text/tokens, pronouns/summary (text). PNG files mirror the image tags
    (attention/layer_00/head_03.png). Returns the console summary lines.
    """
    from torch.utils.tensorboard import SummaryWriter

    from tinylm.plots import (
        attention_grid_figure,
        attention_head_figure,
        label_step,
        log_figure,
        pronoun_bar_figure,
    )
    from tinylm.tensorboard_plugin.summary import write_attention

    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    n_layer, n_head, t, _ = capture.weights.shape
    readings = read_pronouns(capture, top_words)
    pronoun_tokens = [i for i, w in enumerate(capture.token_words)
                      if w in {r.word for r in readings}]
    summary = pronoun_summary(capture, readings)
    def labelled(max_labels: int) -> str:
        step = label_step(t, max_labels)
        return "every token" if step == 1 else f"1 token in {step}"

    notes = [capture.window_note(),
             f"heatmap labels: {labelled(GRID_LABELS)} on the all-heads maps, "
             f"{labelled(HEAD_LABELS)} on the one-head maps; pronouns always, in red"]

    writer = SummaryWriter(log_dir=str(logdir))
    try:
        write_attention(writer, "inspect", capture, 0)  # the "tinylm attention" tab
        prompt, rest = capture.text[:prompt_chars].rstrip(), capture.text[prompt_chars:]
        rest = capture.text[len(prompt):prompt_chars] + rest  # keep emphasis off trailing spaces
        writer.add_text("text/generated", (f"**{_md(prompt)}**" if prompt.strip() else "")
                        + _md(rest) + "\n\n(prompt in bold; " + "; ".join(notes) + ")", 0)
        writer.add_text("text/tokens", tokens_table(capture), 0)
        writer.add_text("pronouns/summary", "\n\n".join(summary) or "no pronouns in the text", 0)
        for layer in range(n_layer):
            fig = attention_grid_figure(capture.weights[layer], capture.tokens, f"layer {layer}",
                                        GRID_LABELS, pronoun_tokens)
            log_figure(writer, f"attention/layer_{layer:02d}/all_heads", fig, png_dir=logdir)
            for head in range(n_head):
                fig = attention_head_figure(capture.weights[layer, head], capture.tokens,
                                            f"layer {layer} head {head}", HEAD_LABELS,
                                            pronoun_tokens)
                log_figure(writer, f"attention/layer_{layer:02d}/head_{head:02d}", fig,
                           png_dir=logdir)
        words = capture.words
        for n, r in enumerate(readings):
            tag = f"pronouns/{n:02d}_{r.pronoun}"
            writer.add_text(tag, pronoun_table(capture, r), 0)
            if not r.positions:
                continue  # nothing earlier to look at: the table says why
            panels = {f"{position}: {query_label(capture, r, position)}":
                      [[[(words[w], v) for w, v in ranked] for ranked in row]
                       for row in reading.top] for position, reading in r.positions.items()}
            names = {words[w] for reading in r.positions.values() for row in reading.top
                     for ranked in row for w, _ in ranked
                     if is_name(capture.text, capture.word_spans, w)}
            fig = pronoun_bar_figure(panels, f"{r.pronoun!r} at character {r.char}", names)
            log_figure(writer, tag, fig, png_dir=logdir)
    finally:
        writer.close()

    np.savez_compressed(
        logdir / "attention.npz", weights=capture.weights, ids=np.array(capture.ids),
        tokens=np.array(capture.tokens), offsets=np.array(capture.offsets).reshape(-1, 2),
        word_spans=np.array(capture.word_spans).reshape(-1, 2),
        token_words=np.array(capture.token_words), text=np.array(capture.text),
        start=np.array(capture.start), n_text_tokens=np.array(capture.n_text_tokens))
    (logdir / "pronouns.md").write_text(
        "\n\n".join([*summary, *(pronoun_table(capture, r) for r in readings)]) + "\n")
    record = {**(meta or {}), "pronouns": pronoun_records(capture, readings)}
    (logdir / "inspect.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return notes + summary


def inspect_texts(model, tokenizer, texts: Sequence[str], logdir: str | Path,
                  prompt_chars: int = 0, top_words: int = 3, meta: dict | None = None,
                  echo: bool = True) -> list[Path]:
    """Capture and write each text's attention (several texts: one TensorBoard run each)."""
    logdir = Path(logdir)
    dirs = []
    for i, text in enumerate(texts):
        target = logdir if len(texts) == 1 else logdir / f"sample_{i + 1}"
        if not text:
            if echo:
                print(f"\nnothing to inspect in sample {i + 1}: the text is empty")
            continue
        if echo:  # drawing takes a while (about a second per figure): say what is going on
            which = "the text" if len(texts) == 1 else f"sample {i + 1}"
            print(f"\nwriting the attention of {which} to {target} ...", flush=True)
        lines = write_inspection(capture_attention(model, tokenizer, text), target,
                                 prompt_chars, top_words, meta)
        if echo:
            for line in lines:
                print(f"  {line}")
        dirs.append(target)
    return dirs
