"""The metrics of tinylm-probe's types (probe_types.py): which heads follow a pronoun to its
antecedent, whether the model prefers a name's pronoun to the wrong one as whole words, which
heads that needs (each zeroed or mean-ablated in turn through tinylm/hooks.py's hook points), and
each head's attention at the deciding position, the token before the pronoun where a causal model
chooses it.

    margins = agreement_margins(model, encoded, new_word_tokens(tokenizer))    # (N,)
    rows = ablate_heads(model, encoded, new_word, method=MEAN_ABLATION)        # one per head
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tinylm.files import json_number
from tinylm.hooks import run_with_cache
from tinylm.inspection.capture import deciding_token, key_words, word_level
from tinylm.inspection.interventions import head_replaced, heads_scaled
from tinylm.inspection.patching import head_output_means, padded
from tinylm.inspection.probe_items import (
    SHIPPED_PROBES,
    EncodedAgreementItem,
    EncodedAttentionItem,
    ProbeItem,
    shipped_probe,
)

# How a head is removed: its output multiplied by 0, or replaced by its mean output over the
# probe's texts at each position (an input the model has seen, unlike a silent head)
ABLATION, MEAN_ABLATION = "zeroed", "mean"
# The other gender in the same case. "her" is object or possessive (him or his), so it has none.
DERIVED_WRONG_PRONOUN = {"she": "he", "he": "she", "him": "her", "his": "her"}
# A head looks at the name when it gives it at least this many times the median head's attention;
# a margin loss smaller than MIN_MARGIN_LOSS nats is noise, not a head the model needs.
OVER_MEDIAN, MIN_MARGIN_LOSS = 2.0, 0.1
# A head carries the name when patching it moves at least this share of the counterfactual's change
MIN_PATCH_EFFECT = 0.1


def probe_files(probe_file: list[str] | None) -> list[Path]:
    """The probe files to read: the given ones, or (None) the shipped sets."""
    if probe_file is not None:
        return [Path(p) for p in probe_file]
    return [shipped_probe(name) for name in SHIPPED_PROBES]


def baselines(items: list[ProbeItem]) -> dict[str, float]:
    """Accuracy of always choosing the character mentioned nearest before the pronoun, or first."""
    nearest = [max(i.antecedent_chars) > max(i.distractor_chars) for i in items]
    first = [min(i.antecedent_chars) < min(i.distractor_chars) for i in items]
    return {"nearest mention": float(np.mean(nearest)), "first mention": float(np.mean(first))}


def attention_to_mentions(weights: np.ndarray, token_words: list[int], n_words: int,
                          pronoun_word: int, mention_words: list[int],
                          position: str = "resolving") -> np.ndarray:
    """Per-head attention (L, nh) to a character's mentions from the pronoun ("resolving") or
    from the token before it ("deciding"); weights (L, nh, T, T) over tokens."""
    if position == "deciding":  # the pronoun is never the first word: a mention is before it
        query = deciding_token(token_words, pronoun_word)
        to_words = key_words(weights[..., query, :], token_words, n_words)  # (L, nh, W)
        return to_words[..., mention_words].sum(-1)
    words = word_level(weights, token_words, n_words)  # (L, nh, W, W)
    return words[..., pronoun_word, mention_words].sum(-1)


def head_accuracy(antecedent: np.ndarray, distractor: np.ndarray) -> np.ndarray:
    """Share of items (axis 0) on which each head attends more to the antecedent; ties are wrong."""
    return (antecedent > distractor).mean(axis=0)


@torch.inference_mode()
def mention_attention(model, encoded: list[EncodedAttentionItem], batch_size: int = 64,
                      position: str = "resolving") -> tuple[np.ndarray, np.ndarray]:
    """Attention (N, L, nh) from each item's pronoun (or the token before it: "deciding") to its
    antecedent and to its distractor."""
    device = next(model.parameters()).device
    antecedent, distractor = [], []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        _, cache = run_with_cache(model, padded([e.ids for e in chunk], device), ["hook_pattern"])
        weights = torch.stack([cache[f"blocks.{i}.attn.hook_pattern"]
                               for i in range(model.config.n_layer)], dim=1)
        weights = weights.float().cpu().numpy()  # (B, L, nh, T, T)
        for row, e in enumerate(chunk):
            w = weights[row, :, :, :len(e.ids), :len(e.ids)]
            for mentions, out in ((e.antecedent_words, antecedent),
                                  (e.distractor_words, distractor)):
                out.append(attention_to_mentions(w, e.token_words, e.n_words, e.pronoun_word,
                                                 mentions, position))
    return np.stack(antecedent), np.stack(distractor)


@torch.inference_mode()
def word_log_probs(model, sequences: list[list[int]], n_context: list[int],
                   new_word: torch.Tensor, head_mask: torch.Tensor | None = None,
                   batch_size: int = 64) -> torch.Tensor:
    """log P(word | context) for each sequence (S,), the word being sequence[n_context:]: the
    chain rule over its tokens, plus log P(the next token starts a new word). head_mask
    (n_layer, n_head) multiplies each head's output (0: zero-ablated)."""
    device = next(model.parameters()).device
    new_word = new_word.to(device)
    result = torch.zeros(len(sequences), dtype=torch.float64)
    # batches of similar lengths waste little work on padding
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        with heads_scaled(model, head_mask) if head_mask is not None else nullcontext():
            logits = model(padded([sequences[i] for i in rows], device)).logits
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
                 batch_size: int = 64, base: torch.Tensor | None = None,
                 method: str = ABLATION) -> list[dict]:
    """Remove each head in turn (`method`: ABLATION zeroes it, MEAN_ABLATION puts its mean output
    over these texts in its place): the agreement mean margin and accuracy, and their changes from
    `base` (the margins with every head on; computed when None)."""
    c = model.config
    if base is None:
        base = agreement_margins(model, encoded, new_word, None, batch_size)
    if method == MEAN_ABLATION:
        means = head_output_means(model, [s for e in encoded for s in (e.written, e.wrong)],
                                  batch_size)  # per layer (T_max, C)
    entries = []
    # a pass over the items per head: minutes for GPT-2's 144 heads, so a bar on a terminal
    heads = tqdm(list(itertools.product(range(c.n_layer), range(c.n_head))),
                 desc=f"ablation ({method})", unit="head", leave=False, disable=None)
    hs = c.n_embd // c.n_head
    for layer, head in heads:
        if method == MEAN_ABLATION:
            with head_replaced(model, layer, head, means[layer][:, head * hs:(head + 1) * hs]):
                m = agreement_margins(model, encoded, new_word, None, batch_size)
        else:
            mask = torch.ones(c.n_layer, c.n_head)
            mask[layer, head] = 0.0
            m = agreement_margins(model, encoded, new_word, mask, batch_size)
        entries.append({
            "layer": layer, "head": head, "method": method,
            "mean_margin": float(m.mean()), "accuracy": float((m > 0).float().mean()),
            "delta_mean_margin": float(m.mean() - base.mean()),
            "delta_accuracy": float((m > 0).float().mean() - (base > 0).float().mean()),
        })
    return entries


def head_entries(values: dict[str, np.ndarray]) -> list[dict]:
    """[{layer, head, <key>: value, ...}] from (L, nh) arrays; NaN becomes None (JSON null)."""
    n_layer, n_head = next(iter(values.values())).shape
    return [{"layer": layer, "head": head,
             **{key: json_number(v[layer, head]) for key, v in values.items()}}
            for layer in range(n_layer) for head in range(n_head)]


def prediction_match(attention_difference: np.ndarray, preference: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Does a head's attention predict what the model says? attention_difference (N, L, nh):
    to the antecedent minus to the distractor; preference (N,): log P(written) - log P(wrong).
    match (L, nh): the share of items where both are positive or both are not; correlation
    (L, nh): Pearson's r over the items (NaN where either side does not vary)."""
    diff = np.asarray(attention_difference, dtype=np.float64)
    pref = np.asarray(preference, dtype=np.float64)
    match = ((diff > 0) == (pref > 0)[:, None, None]).mean(axis=0)
    d = diff - diff.mean(axis=0)
    p = (pref - pref.mean())[:, None, None]
    scale = np.sqrt((d ** 2).sum(axis=0) * (p ** 2).sum(axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        correlation = np.where(scale > 0, (d * p).sum(axis=0) / scale, np.nan)
    return match, correlation


def evidence(attention: list[dict], ablation: list[dict] | None,
             mean_ablation: list[dict] | None = None, patching: list[dict] | None = None
             ) -> list[dict]:
    """Per head, each reading measured: deciding attention to the name, the margin change when
    zeroed and when mean-ablated, the patching effect; `singled_out_by` lists the readings that
    single the head out, `agrees` whether attention and zero-ablation both do."""
    def by_head(entries: list[dict] | None, key: str) -> dict:
        return {(e["layer"], e["head"]): e[key] for e in entries or ()}

    zeroed = by_head(ablation, "delta_mean_margin")
    mean = by_head(mean_ablation, "delta_mean_margin")
    effect = by_head(patching, "effect")
    typical = float(np.median([a["mean_attention"] for a in attention]))
    rows = []
    for a in attention:
        key = (a["layer"], a["head"])
        row = {"layer": a["layer"], "head": a["head"], "mean_attention": a["mean_attention"],
               "delta_mean_margin": zeroed.get(key), "delta_mean_margin_mean": mean.get(key),
               "patching_effect": effect.get(key)}
        singled = {"attention": a["mean_attention"] >= OVER_MEDIAN * typical,
                   "zeroed": zeroed.get(key) is not None and zeroed[key] <= -MIN_MARGIN_LOSS,
                   "mean": mean.get(key) is not None and mean[key] <= -MIN_MARGIN_LOSS,
                   "patching": effect.get(key) is not None and effect[key] >= MIN_PATCH_EFFECT}
        row["singled_out_by"] = [name for name, yes in singled.items() if yes]
        row["agrees"] = singled["attention"] and singled["zeroed"]
        rows.append(row)
    return rows


def deciding_report(model, enc_names: list[EncodedAttentionItem],
                    enc_attention: list[EncodedAttentionItem], scored: list[int],
                    enc_preference: list[EncodedAgreementItem], new_word: torch.Tensor,
                    batch_size: int = 64) -> dict:
    """The report's `deciding` part: attention from the token before the pronoun to the name on
    the agreement items (enc_names), mean over all of them, those with the name first and the
    others; on the two-character items `scored` (the indices of those with a wrong pronoun,
    enc_preference: their two pronouns) whether its preference matches the model's."""
    name_first = np.array([0 in e.antecedent_words for e in enc_names], dtype=bool)
    result: dict = {"agreement_attention": [], "prediction_match": [],
                    "n_agreement": len(enc_names), "n_attention": len(scored),
                    "n_attention_left_out": len(enc_attention) - len(scored),
                    "n_name_first_word": int(name_first.sum())}
    if enc_names:
        to_name, _ = mention_attention(model, enc_names, batch_size, "deciding")  # (N, L, nh)

        def mean(rows: np.ndarray) -> np.ndarray:
            return rows.mean(axis=0) if len(rows) else np.full(to_name.shape[1:], np.nan)
        result["agreement_attention"] = head_entries({
            "mean_attention": mean(to_name),
            "mean_attention_name_first_word": mean(to_name[name_first]),
            "mean_attention_name_later": mean(to_name[~name_first])})
    if scored:
        ante, distr = mention_attention(model, enc_attention, batch_size, "deciding")
        preference = agreement_margins(model, enc_preference, new_word, None, batch_size)
        match, correlation = prediction_match((ante - distr)[scored], preference.numpy())
        result["prediction_match"] = head_entries({"match": match, "correlation": correlation})
    return result
