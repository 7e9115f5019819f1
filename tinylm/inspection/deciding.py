"""Where a causal model decides the pronoun: per-head scores at the token before it.

In a causal LM the pronoun is chosen at the position just before it (its logits predict the
pronoun), so that is where a name's gender has to arrive. tinylm.inspection.probe reads every head's
attention there ("deciding") beside the attention from the pronoun itself ("resolving"), and this
module turns those readings into the report:

- agreement items: each head's mean attention from the deciding position to the name, over all
  items and separately where the name is the first word (a head that always looks at the first
  token scores high on those) and where it is not;
- two-character items: how often the sign of (attention to antecedent - attention to distractor)
  at the deciding position matches the sign of the model's own preference log P(pronoun as
  written) - log P(wrong pronoun), and the correlation of the two;
- with ablation: the evidence table, each head's deciding attention to the name beside the margin
  it costs when zeroed;

and formats that part of the console report (`format_deciding`).
"""

from __future__ import annotations

import numpy as np

from tinylm.tables import columns

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


# A head looks at the name when it gives it at least this many times the median head's attention;
# a margin loss smaller than MIN_MARGIN_LOSS nats is noise, not a head the model needs.
OVER_MEDIAN, MIN_MARGIN_LOSS = 2.0, 0.1


def evidence(attention: list[dict], ablation: list[dict]) -> list[dict]:
    """Per head: deciding attention to the name beside the margin change when it is zeroed.

    A head `agrees` when both readings single it out: its attention to the name is at least
    OVER_MEDIAN times the median head's, and zeroing it costs at least MIN_MARGIN_LOSS nats of mean
    margin.
    """
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


# ------------------------------------------------------------------------------------ console

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
