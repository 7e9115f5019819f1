"""Where a causal model decides the pronoun: per-head scores at the token before it.

In a causal LM the pronoun is chosen at the position just before it (its logits predict the
pronoun), so that is where a name's gender has to arrive. tinylm.probe reads every head's
attention there ("deciding") beside the attention from the pronoun itself ("resolving"), and this
module turns those readings into the report:

- agreement items: each head's mean attention from the deciding position to the name, over all
  items and separately where the name is the first word (a head that always looks at the first
  token scores high on those) and where it is not;
- two-character items: how often the sign of (attention to antecedent - attention to distractor)
  at the deciding position matches the sign of the model's own preference log P(pronoun as
  written) - log P(wrong pronoun), and the correlation of the two;
- with ablation: the evidence table, each head's deciding attention to the name beside the margin
  it costs when zeroed.
"""

from __future__ import annotations

import numpy as np

# The other gender in the same case. "her" is object or possessive (him or his), so it has none.
DERIVED_WRONG_PRONOUN = {"she": "he", "he": "she", "him": "her", "his": "her"}


def derived_wrong_pronoun(pronoun: str) -> str | None:
    """The pronoun of the other gender in the same case, lower case; None when ambiguous."""
    return DERIVED_WRONG_PRONOUN.get(pronoun.lower())


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


# A margin loss smaller than this (nats) is noise, not a head the model needs.
MIN_MARGIN_LOSS = 0.1


def evidence(attention: list[dict], ablation: list[dict]) -> list[dict]:
    """Per head: deciding attention to the name beside the margin change when it is zeroed.

    A head `agrees` when both readings single it out: it is among the top quarter of heads (at
    least one) by attention to the name and by margin loss, and zeroing it costs at least
    MIN_MARGIN_LOSS nats of mean margin.
    """
    delta = {(e["layer"], e["head"]): e["delta_mean_margin"] for e in ablation}
    rows = [{"layer": a["layer"], "head": a["head"], "mean_attention": a["mean_attention"],
             "delta_mean_margin": delta[a["layer"], a["head"]]} for a in attention]
    quarter = max(1, len(rows) // 4)
    by_attention = sorted(rows, key=lambda r: -r["mean_attention"])[:quarter]
    by_loss = sorted(rows, key=lambda r: r["delta_mean_margin"])[:quarter]
    top = {(r["layer"], r["head"]) for r in by_attention} & {
        (r["layer"], r["head"]) for r in by_loss if r["delta_mean_margin"] <= -MIN_MARGIN_LOSS}
    return [{**r, "agrees": (r["layer"], r["head"]) in top} for r in rows]
