"""tinylm-probe's scores on the items of probe_items.py: which heads follow a pronoun to its
antecedent (attention items), whether the model prefers a name's pronoun to the wrong one as whole
words (agreement items), which heads that needs (ablation through head_mask), and each head's
attention at the deciding position, the token before the pronoun where a causal model chooses it.

    report = probe(model, tokenizer, items, ablate=True)    # a JSON-ready dict
    print("\n".join(format_report(report, n_layer, n_head)))
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tinylm.generate import refuse_unless_held
from tinylm.inspection.capture import deciding_token, key_words, word_level
from tinylm.inspection.probe_items import (
    SHIPPED_PROBES,
    EncodedAgreementItem,
    EncodedAttentionItem,
    ProbeFileError,
    ProbeItem,
    encode_agreement_item,
    encode_attention_item,
    load_probe_file,
    match_case,
    new_word_tokens,
    shipped_probe,
)
from tinylm.model import ModelConfig
from tinylm.tables import columns

ABLATION = "zeroed"  # how a head is removed: its output is multiplied by 0
# The other gender in the same case. "her" is object or possessive (him or his), so it has none.
DERIVED_WRONG_PRONOUN = {"she": "he", "he": "she", "him": "her", "his": "her"}
# A head looks at the name when it gives it at least this many times the median head's attention;
# a margin loss smaller than MIN_MARGIN_LOSS nats is noise, not a head the model needs.
OVER_MEDIAN, MIN_MARGIN_LOSS = 2.0, 0.1


def probe_files(probe_file: list[str] | None) -> list[Path]:
    """The probe files to read: the given ones, or (None) the shipped sets."""
    if probe_file is not None:
        return [Path(p) for p in probe_file]
    return [shipped_probe(name) for name in SHIPPED_PROBES]


def baselines(items: list[ProbeItem]) -> dict[str, float]:
    """Accuracy of always choosing the character mentioned nearest before the pronoun, or the one
    mentioned first."""
    nearest = [max(i.antecedent_chars) > max(i.distractor_chars) for i in items]
    first = [min(i.antecedent_chars) < min(i.distractor_chars) for i in items]
    return {"nearest mention": float(np.mean(nearest)), "first mention": float(np.mean(first))}


def attention_to_mentions(weights: np.ndarray, token_words: list[int], n_words: int,
                          pronoun_word: int, mention_words: list[int],
                          position: str = "resolving") -> np.ndarray:
    """Per-head attention (L, nh) to a character's mentions from the pronoun ("resolving") or
    from the token before it ("deciding"); weights (L, nh, T, T) over tokens."""
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


@torch.inference_mode()
def word_log_probs(model, sequences: list[list[int]], n_context: list[int],
                   new_word: torch.Tensor, head_mask: torch.Tensor | None = None,
                   batch_size: int = 64) -> torch.Tensor:
    """log P(word | context) for each sequence (S,), the word being sequence[n_context:]: the
    chain rule over its tokens, plus log P(the next token starts a new word)."""
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
    """log P(written pronoun) - log P(wrong pronoun) per item, (N,): whole-word probabilities,
    so that "he" is not credited with "her"."""
    sequences = [s for e in encoded for s in (e.written, e.wrong)]
    n_context = [e.n_context for e in encoded for _ in range(2)]
    log_p = word_log_probs(model, sequences, n_context, new_word, head_mask, batch_size)
    return log_p[0::2] - log_p[1::2]


def ablate_heads(model, encoded: list[EncodedAgreementItem], new_word: torch.Tensor,
                 batch_size: int = 64, base: torch.Tensor | None = None) -> list[dict]:
    """Zero each head in turn; its agreement mean margin and accuracy, and their changes from
    `base` (the margins with every head on; computed when None)."""
    c = model.config
    if base is None:
        base = agreement_margins(model, encoded, new_word, None, batch_size)
    entries = []
    # a pass over the items per head: minutes for GPT-2's 144 heads, so a bar on a terminal
    heads = tqdm(list(itertools.product(range(c.n_layer), range(c.n_head))), desc="ablation",
                 unit="head", leave=False, disable=None)
    for layer, head in heads:
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


def head_entries(values: dict[str, np.ndarray]) -> list[dict]:
    """[{layer, head, <key>: value, ...}] from (L, nh) arrays; NaN becomes None (JSON null)."""
    n_layer, n_head = next(iter(values.values())).shape
    return [{"layer": layer, "head": head,
             **{key: (float(v[layer, head]) if np.isfinite(v[layer, head]) else None)
                for key, v in values.items()}}
            for layer in range(n_layer) for head in range(n_head)]


def agreement_attention(attention: np.ndarray, name_first: np.ndarray) -> list[dict]:
    """Per head: mean deciding attention to the name (N, L, nh) over all items, over those where
    the name is the first word (name_first, (N,) bool) and over the others."""
    name_first = np.asarray(name_first, dtype=bool)

    def mean(rows: np.ndarray) -> np.ndarray:
        return rows.mean(axis=0) if len(rows) else np.full(attention.shape[1:], np.nan)

    return head_entries({"mean_attention": mean(attention),
                         "mean_attention_name_first_word": mean(attention[name_first]),
                         "mean_attention_name_later": mean(attention[~name_first])})


def prediction_match(attention_difference: np.ndarray, preference: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Does a head's attention predict what the model says? (match, correlation), each (L, nh).

    attention_difference (N, L, nh): attention to the antecedent minus to the distractor;
    preference (N,): log P(pronoun as written) - log P(wrong pronoun). match: the share of items
    on which both are positive or both are not; correlation: Pearson's r over the items (NaN when
    either side does not vary).
    """
    diff = np.asarray(attention_difference, dtype=np.float64)
    pref = np.asarray(preference, dtype=np.float64)
    match = ((diff > 0) == (pref > 0)[:, None, None]).mean(axis=0)
    d = diff - diff.mean(axis=0)
    p = (pref - pref.mean())[:, None, None]
    scale = np.sqrt((d ** 2).sum(axis=0) * (p ** 2).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = np.where(scale > 0, (d * p).sum(axis=0) / scale, np.nan)
    return match, correlation


def evidence(attention: list[dict], ablation: list[dict]) -> list[dict]:
    """Per head: deciding attention to the name beside the margin change when it is zeroed; it
    `agrees` when both single it out (OVER_MEDIAN, MIN_MARGIN_LOSS)."""
    delta = {(e["layer"], e["head"]): e["delta_mean_margin"] for e in ablation}
    typical = float(np.median([a["mean_attention"] for a in attention]))
    rows = []
    for a in attention:
        d = delta[a["layer"], a["head"]]
        rows.append({"layer": a["layer"], "head": a["head"], "mean_attention": a["mean_attention"],
                     "delta_mean_margin": d,
                     "agrees": a["mean_attention"] >= OVER_MEDIAN * typical
                     and d <= -MIN_MARGIN_LOSS})
    return rows


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
        result["agreement_attention"] = agreement_attention(to_name, name_first)
    if scored:
        ante, distr = mention_attention(model, enc_attention, batch_size, "deciding")
        preference = agreement_margins(model, enc_preference, new_word, None, batch_size)
        match, correlation = prediction_match((ante - distr)[scored], preference.numpy())
        result["prediction_match"] = head_entries({"match": match, "correlation": correlation})
    return result


def refuse_batch_beyond_memory(c: ModelConfig, batch_size: int, passes: list[list[list[int]]]
                               ) -> None:
    """Refuse batch_size before any model work when a forward pass over a batch of the longest
    sequences of `passes` (each pass's sequences, as ids) cannot be held: per token its logits
    (float32) and activations (about 16 numbers of width n_embd), and per pair of tokens every
    head's attention, kept twice (the model's, stacked)."""
    longest = max((len(s) for sequences in passes for s in sequences), default=0)
    each = 4 * longest * (c.vocab_size + 16 * c.n_embd + 2 * c.n_layer * c.n_head * longest)
    largest_pass = max(len(sequences) for sequences in passes)
    refuse_unless_held("batch_size", batch_size, batch_size,
                       lambda n: min(n, largest_pass) * each,
                       f"a forward pass holds about {each:,} bytes per sequence of up to "
                       f"{longest} tokens (its logits and every head's attention)")


def probe(model, tokenizer, items: list[ProbeItem], ablate: bool = False, batch_size: int = 64
          ) -> dict:
    """Score every head on the attention items, measure agreement (and ablations), and read every
    head at the deciding position; the report."""
    c = model.config
    attention = [i for i in items if i.kind == "attention"]
    agreement = [i for i in items if i.kind == "agreement"]
    # the model's own preference on a two-character item needs a wrong pronoun: the item's, else
    # the other gender's; "her" has none (such items are left out and counted)
    wrong = [i.wrong_pronoun or DERIVED_WRONG_PRONOUN.get(i.pronoun.lower()) for i in attention]
    scored = [k for k, w in enumerate(wrong) if w is not None]
    # tokenize everything first: a bad item stops the run before any model work or output
    enc_attention = [encode_attention_item(tokenizer, i, c.block_size) for i in attention]
    enc_agreement = [encode_agreement_item(tokenizer, i, c.block_size) for i in agreement]
    enc_names = [encode_attention_item(tokenizer, i, c.block_size) for i in agreement]
    enc_preference = [encode_agreement_item(tokenizer, attention[k], c.block_size, wrong[k])
                      for k in scored]
    refuse_batch_beyond_memory(c, batch_size, [
        [e.ids for e in enc_attention], [e.ids for e in enc_names],
        [s for e in enc_agreement for s in (e.written, e.wrong)],
        [s for e in enc_preference for s in (e.written, e.wrong)]])

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
        report["evidence"] = evidence(names, report["ablation"])
    return report


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


def _grid(entries: list[dict], key: str, n_layer: int, n_head: int) -> np.ndarray:
    """(n_layer, n_head): each entry's `key` at its layer and head; NaN where it has none."""
    grid = np.full((n_layer, n_head), np.nan)
    for e in entries:
        grid[e["layer"], e["head"]] = np.nan if e[key] is None else e[key]
    return grid


def layer_head_lines(cells: dict[tuple[int, int], str], n_layer: int, n_head: int,
                     mark: tuple[int, int] | None = None) -> list[str]:
    """A layer x head table of preformatted cells; `mark` gets a * after its cell."""
    width = max(8, *(len(c) + 1 for c in cells.values()))
    lines = [("         " + "".join(f"  {f'head {h}':<{width}}" for h in range(n_head))).rstrip()]
    for layer in range(n_layer):
        row = "".join(f"  {cells[layer, h] + ('*' if (layer, h) == mark else ''):<{width}}"
                      for h in range(n_head))
        lines.append(f"layer {layer:<3d}{row}".rstrip())
    return lines


def _number(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_deciding(report: dict, n_layer: int, n_head: int, top_heads: int = 5) -> list[str]:
    """Console lines of the deciding position: the evidence table (with ablation), attention to
    the name per head (all items / name first word / name later), the prediction match."""
    d, lines = report["deciding"], []
    if report["evidence"]:
        rows = report["evidence"]
        most_attention = sorted(rows, key=lambda r: -r["mean_attention"])[:top_heads]
        most_loss = sorted(rows, key=lambda r: r["delta_mean_margin"])[:top_heads]
        shown = [r for r in rows if r in most_attention or r in most_loss]
        shown.sort(key=lambda r: -r["mean_attention"])
        lines += [f"evidence: each head's attention from the token before the pronoun to the "
                  f"name, beside the margin it costs when {report['ablation'][0]['method']} "
                  f"({d['n_agreement']} agreement items);",
                  f"the {top_heads} heads with most attention and the {top_heads} with the "
                  f"largest loss; agrees = attention at least {OVER_MEDIAN:g}x the median head's "
                  f"and a loss of at least {MIN_MARGIN_LOSS:g} nats"]
        lines += columns(["layer", "head", "attention to name", "Δ mean margin", "agrees"],
                         [[str(r["layer"]), str(r["head"]), f"{r['mean_attention']:.2f}",
                           f"{r['delta_mean_margin']:+.3f}", "yes" if r["agrees"] else "no"]
                          for r in shown], ">>>><", gaps=(2, 3, 3, 3), indent="  ")
    if d["agreement_attention"]:
        best = report["best_deciding"]
        by_head = {(e["layer"], e["head"]): e for e in d["agreement_attention"]}
        n_first = d["n_name_first_word"]
        lines += [f"deciding: attention from the token before the pronoun (where the model "
                  f"chooses it) to the name, {d['n_agreement']} agreement items;",
                  f"all items (name first word: {n_first} items / name later: "
                  f"{d['n_agreement'] - n_first} items), * = most"]
        lines += layer_head_lines(
            {k: f"{e['mean_attention']:.2f} ({_number(e['mean_attention_name_first_word'], '.2f')}"
                f"/{_number(e['mean_attention_name_later'], '.2f')})" for k, e in by_head.items()},
            n_layer, n_head, (best["layer"], best["head"]))
        lines.append(f"best deciding head: layer {best['layer']} head {best['head']}, attention "
                     f"to the name {best['mean_attention']:.2f}")
    if d["prediction_match"]:
        lines += [f"prediction match: {d['n_attention']} two-character items; share on which the "
                  "head's attention at the deciding position prefers the character",
                  "whose pronoun the model prefers (sign of attention to antecedent - "
                  "distractor vs log P(written) - log P(wrong)), with Pearson's r"]
        lines += layer_head_lines(
            {(e["layer"], e["head"]): f"{e['match']:.2f} r={_number(e['correlation'], '+.2f')}"
             for e in d["prediction_match"]}, n_layer, n_head)
    if d["n_attention_left_out"]:
        lines.append(f"prediction match: {d['n_attention_left_out']} two-character items left "
                     "out: no wrong pronoun (\"her\" is object or possessive, so it has no "
                     "derived one; give wrong_pronoun to score them)")
    return lines


def format_report(report: dict, n_layer: int, n_head: int, top_heads: int = 5) -> list[str]:
    """The console summary: the deciding position first (evidence table, attention to the name,
    prediction match), then the resolving head accuracy table, baselines, agreement, ablation."""
    lines = format_deciding(report, n_layer, n_head, top_heads) if report["deciding"] else []
    if report["heads"]:
        best = report["best"]
        lines += [f"resolving: {report['n']} two-character items; accuracy = share of items on "
                  "which the head's attention",
                  "from the pronoun goes more to the antecedent than to the distractor (* = best)"]
        lines += layer_head_lines({(e["layer"], e["head"]): f"{e['accuracy']:.2f}"
                                   for e in report["heads"]},
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
        lines.append(f"ablation: each head {ABLATION} in turn, over the {agreement['n']} "
                     f"agreement items; the {min(top_heads, len(ranked))} heads that move the "
                     "mean margin most")
        lines += columns(
            ["layer", "head", "Δ mean margin", "Δ accuracy", "mean margin", "accuracy"],
            [[str(e["layer"]), str(e["head"]), f"{e['delta_mean_margin']:+.3f}",
              f"{e['delta_accuracy']:+.2f}", f"{e['mean_margin']:+.3f}", f"{e['accuracy']:.2f}"]
             for e in ranked[:top_heads]], ">>>>>>", gaps=(2, 3, 3, 3, 3), indent="  ")
    return lines


def write_probe_figures(report: dict, folder: str | Path, n_layer: int, n_head: int,
                        console: list[str]) -> list[str]:
    """Layer x head heatmaps to TensorBoard (and as <folder>/<tag>.png) and the console report as
    text, into `folder` (published_atomically's: the caller moves them into place); returns the
    image tags."""
    # matplotlib and TensorBoard load only once a report is computed: --help, a bad option or a
    # bad probe line answer without waiting for them
    from tinylm.inspection.figures import event_writer, layer_head_heatmap, log_figure

    def heatmap(entries: list[dict], key: str, title: str, label: str, **kwargs):
        return layer_head_heatmap(_grid(entries, key, n_layer, n_head), title, label, **kwargs)

    figures = {}  # TensorBoard tag -> figure
    if report["heads"]:
        figures["probe/attention_accuracy"] = heatmap(
            report["heads"], "accuracy", f"pronoun -> antecedent accuracy ({report['n']} items)",
            "accuracy")
    d = report["deciding"]
    if d and d["agreement_attention"]:
        n_first = d["n_name_first_word"]
        for key, items in (("mean_attention", f"{d['n_agreement']} items"),
                           ("mean_attention_name_first_word",
                            f"{n_first} items with the name first"),
                           ("mean_attention_name_later",
                            f"{d['n_agreement'] - n_first} items with the name later")):
            figures["probe/deciding_attention" + key.removeprefix("mean_attention")] = heatmap(
                d["agreement_attention"], key,
                f"deciding: token before the pronoun -> name ({items})", "attention")
    if d and d["prediction_match"]:
        figures["probe/prediction_match"] = heatmap(
            d["prediction_match"], "match",
            f"deciding attention predicts the model's pronoun ({d['n_attention']} items)",
            "share of items")
        figures["probe/prediction_correlation"] = heatmap(
            d["prediction_match"], "correlation",
            "deciding attention difference vs log P difference", "Pearson r", fmt="{:+.2f}",
            center=0.0)
    for key in ("delta_mean_margin", "delta_accuracy") if report["ablation"] else ():
        figures[f"probe/ablation_{key}"] = heatmap(
            report["ablation"], key,
            f"agreement: change in {key[6:].replace('_', ' ')} with the head {ABLATION}",
            key.replace("_", " "), fmt="{:+.2f}", center=0.0)
    with event_writer(folder) as writer:
        for tag, fig in figures.items():
            log_figure(writer, tag, fig, png_dir=folder)
        writer.add_text("probe/report", "\n".join("    " + line for line in console), 0)
    return list(figures)
