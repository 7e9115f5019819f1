"""Which heads follow a pronoun to its antecedent, whether the model knows a name's pronoun, and
which heads that knowledge needs: the scoring behind tinylm-probe (tinylm/cli/probe.py), on items
read by tinylm.inspection.probe_items.

    report = probe(model, tokenizer, items, ablate=True)    # a JSON-ready dict

- attention items (two characters of different gender before the pronoun): a head is right on
  one when its attention from the pronoun to the antecedent's mentions exceeds its attention to
  the distractor's. Word level, as in tinylm.inspection.capture: attention to a mention sums its sub-word
  tokens; attention from the pronoun averages the pronoun's tokens (a BPE pronoun is one token, so
  that is its row). Baselines: always pick the character mentioned nearest before the pronoun, or
  the one mentioned first.
- agreement items (one character before the pronoun):
  margin = log P(pronoun as written) - log P(wrong pronoun), where the pronoun would be read. Both
  are whole-word probabilities: the text before the pronoun plus the word, tokenized as it would
  be in running text (the word keeps the space before it, " she"; the wrong pronoun takes the
  written one's capitalisation, "She" -> "He"), scored by the chain rule over the tokens after the
  shared context, times the probability that the next token starts a new word (so "he" is not
  credited with "her"). Agreement accuracy is the share of positive margins.

Both kinds are also read at the deciding position, the token just before the pronoun, where a
causal model chooses it (tinylm.inspection.deciding): on agreement items each head's attention from there to
the name (also split by whether the name is the text's first word: a head that always looks at
the first token would score high there); on attention items whether the sign of (attention to
antecedent - attention to distractor) matches the sign of the model's own preference log
P(pronoun) - log P(wrong pronoun). The wrong pronoun is the item's wrong_pronoun, else derived
(she/he, he/she, him/her, his/her); "her" has none, and such items are left out and counted.

Attention weights alone are not explanations, so `ablate=True` zeroes each head in turn (its
output times 0, through the model's head_mask) and measures how the agreement margins change;
the evidence puts that beside each head's deciding attention to the name.

The report: `n` (attention items), `heads` ([{layer, head, accuracy, mean_antecedent_attention,
mean_distractor_attention}]), `best`, `baselines` ({"nearest mention", "first mention"}),
`agreement` ({n, accuracy, mean_margin, items}) and `ablation` ([{layer, head, method: "zeroed",
mean_margin, accuracy, delta_mean_margin, delta_accuracy}]), `deciding` ({"agreement_attention":
[{layer, head, mean_attention, mean_attention_name_first_word, mean_attention_name_later}],
"prediction_match": [{layer, head, match, correlation}], "n_agreement", "n_attention",
"n_attention_left_out", "n_name_first_word"}), `evidence` ([{layer, head, mean_attention,
delta_mean_margin, agrees}], with ablation) and `best_deciding` ({layer, head, mean_attention}).
"""

from __future__ import annotations

import numpy as np
import torch

from tinylm.inspection import deciding
from tinylm.inspection.capture import deciding_token, key_words, word_level
from tinylm.inspection.probe_items import (
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

ABLATION = "zeroed"  # how a head is removed: its output is multiplied by 0


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


# ------------------------------------------------------------------- during training (tinylm.train)

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
