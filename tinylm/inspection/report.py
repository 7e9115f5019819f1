"""What `tinylm-generate ... inspect=true` writes for each text: TensorBoard (the attention tab's
data, an image per layer, texts), the images as PNG files, attention.npz, pronouns.md (the console
summary and the pronoun tables) and inspect.json (the readings as records).

    inspect_texts(model, tokenizer, [text], "runs/inspect", out=print)   # out: progress lines
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tinylm.files import published_atomically
from tinylm.inspection.capture import (
    NOT_A_PERSON,
    PERSON_PRONOUNS,
    PRONOUN_GENDER,
    QUERY_POSITIONS,
    AttentionCapture,
    HeadReading,
    PronounReading,
    capture_attention,
    is_name,
    kv_groups,
    kv_head,
    other_gender,
    read_pronouns,
)
from tinylm.inspection.figures import AttentionGridImages, event_writer, label_step, log_image
from tinylm.inspection.tensorboard_plugin.summary import write_attention

# Long texts stay readable by labelling 1 token in k, so that an axis has at most this many labels
# (pronouns are labelled in any case); the pictures always show every token.
GRID_LABELS = 32

# A 12 x 12 model (GPT-2) would list 144 heads on the console: it names the strongest LISTED_HEADS.
LISTED_HEADS = 12


def _md(text: str) -> str:
    """Escape text for TensorBoard's markdown (tables, emphasis, HTML)."""
    text = re.sub(r"([\\`*_{}\[\]<>#|])", r"\\\1", text)
    return text.replace("\n", " ")


def query_label(capture: AttentionCapture, reading: PronounReading, position: str) -> str:
    """Which token a position reads from, in words: "from '.' before 'She'", "from 'She'"."""
    if position == "resolving":
        return f"from {reading.pronoun!r}"
    return f"from {capture.tokens[reading.positions[position].query]!r} before {reading.pronoun!r}"


def not_read(reading: PronounReading) -> str | None:
    """Why a pronoun is not read against names ("it" stands for no named character), or None."""
    return None if reading.pronoun in PERSON_PRONOUNS else NOT_A_PERSON.format(reading.pronoun)


def name_label(capture: AttentionCapture, reading: PronounReading, w: int,
               markdown: bool = False) -> str:
    """An earlier word as a reading lists it (markdown: escaped, a name in italics); a name of the
    other gender than the pronoun is flagged: a head that looks there looks at the wrong one."""
    word = capture.words[w]
    label = _md(word) if markdown else word
    if markdown and is_name(capture.text, capture.word_spans, w):
        label = f"*{label}*"
    return f"{label} (other gender)" if other_gender(reading.pronoun, word) else label


def pronoun_table(capture: AttentionCapture, reading: PronounReading) -> str:
    """Markdown tables, deciding then resolving: one row per head, its top earlier words."""
    heading = f"**{_md(reading.pronoun)}** (word {reading.word}, character {reading.char})"
    if not_read(reading):
        return f"{heading}: not read: {_md(not_read(reading))}"
    parts = [f"{heading}: attention to earlier words, summed over sub-word tokens; *name* in "
             "italics, flagged where it is of the other gender than the pronoun"]
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
                cells = [f"{name_label(capture, reading, w, markdown=True)} {v:.2f}"
                         for w, v in ranked]
                lines.append(f"| {layer} | {head} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def pronoun_summary(capture: AttentionCapture, readings: Sequence[PronounReading]) -> list[str]:
    """Console lines per pronoun, deciding then resolving: the heads whose top earlier word is a
    name, or why a position was skipped."""
    n_heads = capture.weights.shape[0] * capture.weights.shape[1]
    lines = []
    for r in readings:
        if not_read(r):
            lines.append(f"{r.pronoun!r} at character {r.char}: not read: {not_read(r)}")
            continue
        for position in QUERY_POSITIONS:
            head = f"{r.pronoun!r} at character {r.char}, {position}"
            if position in r.skipped:
                lines.append(f"{head}: skipped: {r.skipped[position]}")
                continue
            found = sorted(r.positions[position].name_heads, key=lambda x: -x[3])
            where = query_label(capture, r, position)
            if found:
                heads = ", ".join(f"L{layer}H{h} -> {name_label(capture, r, w)} {v:.2f}"
                                  for layer, h, w, v in found[:LISTED_HEADS])
                more = f", and {len(found) - LISTED_HEADS} more (inspect.json has every head)" \
                    if len(found) > LISTED_HEADS else ""
                wrong = sum(other_gender(r.pronoun, capture.words[w]) for _, _, w, _ in found)
                of_which = f" ({wrong} at a name of the other gender)" if wrong else ""
                lines.append(f"{head} ({where}): {len(found)}/{n_heads} heads point at a name"
                             f"{of_which}: {heads}{more}")
            else:
                lines.append(f"{head} ({where}): no head's top word is a name")
    return lines


def pronoun_records(capture: AttentionCapture, readings: Sequence[PronounReading]) -> list[dict]:
    """The readings as inspect.json's records: words by text, names and those of the other
    gender than the pronoun flagged."""
    words = capture.words
    shared = capture.shared_kv_heads

    def heads(reading: HeadReading, pronoun: str) -> list[dict]:
        # with grouped-query attention, the key/value head each query head reads
        return [{"layer": layer, "head": head,
                 **({"kv_head": kv_head(head, len(row), shared[layer])} if shared else {}),
                 "top": [{"word": words[w], "word_index": w, "weight": v,
                          "name": is_name(capture.text, capture.word_spans, w),
                          "other_gender": other_gender(pronoun, words[w])}
                         for w, v in ranked]}
                for layer, row in enumerate(reading.top) for head, ranked in enumerate(row)]

    return [{"pronoun": r.pronoun, "word_index": r.word, "char": r.char,
             # female, male or null (they, them, their): what other_gender compares names with
             "gender": PRONOUN_GENDER.get(r.pronoun), "reads_names": not not_read(r),
             **{position: ({"query_token": r.positions[position].query,
                            "query": capture.tokens[r.positions[position].query],
                            "heads": heads(r.positions[position], r.pronoun)}
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


def write_inspection(capture: AttentionCapture, folder: str | Path, prompt_chars: int = 0,
                     top_words: int = 3, meta: dict | None = None) -> list[str]:
    """Write one text's attention into `folder` (inspect_texts publishes it whole): TensorBoard
    (the tab's data, attention/layer_LL/all_heads images, also as PNG, and the texts), the
    arrays, pronouns.md and inspect.json (`meta`, the readings, any shared key/value heads);
    returns the console summary lines."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    readings = read_pronouns(capture, top_words)
    pronoun_tokens = [i for i, w in enumerate(capture.token_words)
                      if w in {r.word for r in readings}]
    summary = pronoun_summary(capture, readings)

    step = label_step(capture.weights.shape[-1], GRID_LABELS)
    labelled = "every token" if step == 1 else f"1 token in {step}"
    notes = [capture.window_note(),
             f"heatmap labels: {labelled} on the all-heads maps; pronouns always, in red"]
    shared = capture.shared_kv_heads
    if shared:  # the heads of a group attend with the same keys: say which they are
        notes.append(kv_groups(capture.weights.shape[1], shared))

    with event_writer(folder) as writer:
        write_attention(writer, "inspect", capture, 0)  # the "tinylm attention" tab
        prompt, rest = capture.text[:prompt_chars].rstrip(), capture.text[prompt_chars:]
        rest = capture.text[len(prompt):prompt_chars] + rest  # keep emphasis off trailing spaces
        writer.add_text("text/generated", (f"**{_md(prompt)}**" if prompt.strip() else "")
                        + _md(rest) + "\n\n(prompt in bold; " + "; ".join(notes) + ")", 0)
        writer.add_text("text/tokens", tokens_table(capture), 0)
        writer.add_text("pronouns/summary", "\n\n".join(summary) or "no pronouns in the text", 0)
        for n, r in enumerate(readings):
            writer.add_text(f"pronouns/{n:02d}_{r.pronoun}", pronoun_table(capture, r), 0)
        # the layers share tokens, labels and colour bar: one layout, then only the heatmaps
        grids = AttentionGridImages(capture.tokens, GRID_LABELS, pronoun_tokens)
        for layer, weights in enumerate(capture.weights):
            log_image(writer, f"attention/layer_{layer:02d}/all_heads",
                      grids(weights, f"layer {layer}"), png_dir=folder)

    np.savez_compressed(
        folder / "attention.npz", weights=capture.weights, ids=np.array(capture.ids),
        tokens=np.array(capture.tokens), offsets=np.array(capture.offsets).reshape(-1, 2),
        word_spans=np.array(capture.word_spans).reshape(-1, 2),
        token_words=np.array(capture.token_words), text=np.array(capture.text),
        start=np.array(capture.start), n_text_tokens=np.array(capture.n_text_tokens))
    (folder / "pronouns.md").write_text("\n\n".join(
        [*summary, *(pronoun_table(capture, r) for r in readings)]) + "\n", encoding="utf-8")
    record = {**(meta or {}), **({"kv_heads": shared} if shared else {}),
              "pronouns": pronoun_records(capture, readings)}
    (folder / "inspect.json").write_text(json.dumps(record, indent=2, default=str) + "\n",
                                         encoding="utf-8")
    return notes + summary


def inspect_texts(model, tokenizer, texts: Sequence[str], logdir: str | Path,
                  prompt_chars: int = 0, top_words: int = 3, meta: dict | None = None,
                  out: Callable[[str], None] | None = None) -> list[Path]:
    """Capture and write each text's attention (several texts: one TensorBoard run each); every
    file arrives in `logdir` at the end, whole, or none does (a full disk: NotWritten). `out`
    (e.g. print) gets the progress and summary lines, one call per line."""
    say = out or (lambda line: None)
    logdir = Path(logdir)
    dirs = []
    with published_atomically(logdir) as folder:
        for i, text in enumerate(texts):
            sample = Path() if len(texts) == 1 else Path(f"sample_{i + 1}")
            if not text:
                say(f"\nnothing to inspect in sample {i + 1}: the text is empty")
                continue
            # drawing the first layer's image takes about a second: say what is going on
            which = "the text" if len(texts) == 1 else f"sample {i + 1}"
            say(f"\nwriting the attention of {which} to {logdir / sample} ...")
            lines = write_inspection(capture_attention(model, tokenizer, text), folder / sample,
                                     prompt_chars, top_words, meta)
            for line in lines:
                say(f"  {line}")
            dirs.append(logdir / sample)
    return dirs
