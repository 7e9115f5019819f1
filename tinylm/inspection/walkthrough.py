"""Attention step by step, as text and heatmaps: what tinylm-explain prints and draws.

tinylm.attention computes every number; this module runs it stage by stage, labels the numbers
and checks them against the module's or the model's own forward pass (docs/attention.md).

    explain_given_qkv(torch.tensor([[1., 0.], [0., 1.]]), causal=True).text  # every step, causal
    explain_given_multi_head(n_head=2).text                        # split, attend, concatenate
    explain_model_head(model, tokenizer, "Lily saw a cat. She", layer=1, query="She")
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tinylm.attention import (
    AttentionSteps,
    MultiHeadAttention,
    attention_steps,
    unshifted_exps,
    weighted_values,
)
from tinylm.hooks import caching, run_with_cache
from tinylm.inspection.capture import kv_head
from tinylm.inspection.head_numbers import MASK_POSITIONS, layer_window
from tinylm.tables import MAX_WIDTH, paragraph, side_by_side, table, vector

# The worked example of docs/attention.md: 3 tokens, d = 2, Q = K.
EXAMPLE_Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
EXAMPLE_V = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
# What a command passes to refuse a walkthrough it cannot hold: printable(key, n, unit, numbers)
# is called before any work; the tables hold numbers(n) numbers, n being the `unit`s of `key`.
Printable = Callable[[str, int, str | None, Callable[[int], int]], None]


def resolve_query(query: int | str | None, labels: Sequence[str], default: int,
                  what: str = "queries") -> tuple[int, str]:
    """(index, note): the row `query` names (an index, negative from the end, or a token's text);
    the note says when that word occurs more than once."""
    n = len(labels)
    if query is None:
        return default % n, ""
    if isinstance(query, int) and not isinstance(query, bool):
        if not -n <= query < n:
            raise ValueError(f"query={query} is out of range: there are {n} {what}, so use an "
                             f"index 0..{n - 1} (or -{n}..-1 from the end)")
        return query % n, ""
    word = str(query).strip()
    matches = ([i for i, label in enumerate(labels) if label.strip() == word]  # else "she": "She"
               or [i for i, label in enumerate(labels) if label.strip().lower() == word.lower()])
    if not matches:
        shown = ", ".join(f"{i} {label!r}" for i, label in enumerate(labels[:40]))
        more = f", ... ({n} in all)" if n > 40 else ""
        raise ValueError(f"query={query!r} is not one of the tokens: {shown}{more}; give one of "
                         f"them or an index 0..{n - 1}")
    note = (f"{word!r} occurs at {', '.join(map(str, matches))}; showing {matches[0]} "
            f"(pass query=<index> for another)") if len(matches) > 1 else ""
    return matches[0], note


class MultiHeadWalk(NamedTuple):
    """Each stage of MultiHeadAttention's forward pass on one sequence x (T, C)."""

    q: torch.Tensor  # (T, C): X·W_qᵀ, all heads side by side
    k: torch.Tensor
    v: torch.Tensor
    steps: AttentionSteps  # per-head steps, (nh, T, T) / output (nh, T, hs)
    concat: torch.Tensor  # (T, C): the heads' outputs side by side
    output: torch.Tensor  # (T, C): out_proj(concat)


@torch.no_grad()
def multi_head_walk(attn: MultiHeadAttention, x: torch.Tensor) -> MultiHeadWalk:
    """Run MultiHeadAttention's stages one by one on x (T, C); causal, as the module always is."""
    T, C = x.shape
    q, k, v = attn.project_heads(x[None])  # (1, nh, T, hs) each
    steps = attn.steps(q[0], k[0], v[0])  # every head at once
    concat = steps.output.transpose(0, 1).reshape(T, C)  # (nh, T, hs) -> (T, nh*hs)
    q, k, v = (t[0].transpose(0, 1).reshape(T, C) for t in (q, k, v))  # heads side by side
    return MultiHeadWalk(q, k, v, steps, concat, attn.out_proj(concat))


def example_attention(d_model: int, n_head: int, seed: int, n_tokens: int = 3
                      ) -> tuple[MultiHeadAttention, torch.Tensor]:
    """A small seeded MultiHeadAttention and input x (n_tokens, d_model); weights rounded to 2
    decimals and x to 1, so the printed numbers are the ones used."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        attn = MultiHeadAttention(d_model, n_head, dropout=0.0, bias=False).eval()
        x = torch.randn(n_tokens, d_model).round(decimals=1)
    with torch.no_grad():
        for param in attn.parameters():
            param.copy_(param.round(decimals=2))
    return attn, x


class HeadSteps(NamedTuple):
    """One head's attention steps inside a model, and what its forward pass had for that head."""

    steps: AttentionSteps  # recomputed from the hook points' q, k, v
    v: torch.Tensor  # (T, hs): the values it mixes
    weights: torch.Tensor  # (T, T): the weights at hook_pattern, to check the steps against
    kv_head: int  # the key/value head it reads
    group: int  # the query heads that share each key/value head (1: each has its own)


@torch.no_grad()
def model_head_steps(model, idx: torch.Tensor, layer: int, head: int) -> HeadSteps:
    """One head's attention steps inside a model on token ids idx (T,), recomputed from the q, k,
    v of its forward pass (blocks.{layer}.attn.hook_q/_k/_v), with the pass's own weights."""
    attn = model.blocks[layer].attn
    names = [f"blocks.{layer}.attn.{point}" for point in ("hook_q", "hook_k", "hook_v",
                                                          "hook_pattern")]
    # every layer's pattern, though only this one's is read: every layer then takes the explicit
    # path, as in capture_attention, so this layer's q, k, v carry the digits inspect=true shows
    _, cache = run_with_cache(model, idx[None], [*names, "hook_pattern"])
    q, k, v, weights = (cache[name][0] for name in names)  # (nh or nkv, T, hs); (nh, T, T)
    kv = kv_head(head, q.size(0), k.size(0))
    steps = attn.steps(q[head], k[kv], v[kv])  # its own scale and mask
    return HeadSteps(steps, v[kv], weights[head], kv, q.size(0) // k.size(0))


def _labels(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def shared_kv(kv: int, group: int) -> str:
    """Which query heads share key/value head `kv` (grouped-query attention: `group` each),
    said; "" where each head has its own."""
    if group == 1:
        return ""
    return (f" Its K and V are those of key/value head {kv}, which query heads "
            f"{kv * group}..{(kv + 1) * group - 1} share (grouped-query attention).")


def mask_and_scale(attn: MultiHeadAttention, head_size: int, positions: int) -> str:
    """What a layer does otherwise than plain scaled causal attention (GPT-Neo's layers), said;
    `positions`: how far its mask is looked at."""
    window, band = layer_window(attn, positions)
    said = ""
    if window is not None:
        said = f" and local: each token sees only the last {window} positions (a banded mask)"
    elif not band:
        said = " and masked: some earlier positions are hidden too, besides the later ones"
    if attn.scale is not None and attn.scale != 1 / math.sqrt(head_size):
        said += (f"; the scores are multiplied by {attn.scale:g}, not divided by √d (the '/√d' "
                 "column shows them after that)")
    return said


def steps_tables(steps: AttentionSteps, d: int, q_rows: list[str], k_cols: list[str],
                 digits: int, mark: int | None, hidden: torch.Tensor | None) -> list[str]:
    """Every step of attention for all queries (q·k of width d), one labelled table per step."""

    def step(title: str, values, cols: list[str] = k_cols) -> list[str]:
        return table(title, values, q_rows, cols, digits, mark)

    pairs = [(step("1. Scores S = Q·Kᵀ  (query · key)", steps.scores),
              step(f"2. Scaled: S / √d  (√{d} = {math.sqrt(d):.4f})", steps.scaled))]
    if hidden is not None:
        mask = [["hide" if h else "-" for h in row] for row in hidden.tolist()]
        pairs.append((step("   Causal mask  (hide: key comes after the query)", mask),
                      step("   Masked scores: hidden ones set to -inf", steps.masked)))
    pairs += [(step("3. Row max subtracted  (no exponent > 0)",
                    torch.cat([steps.row_max, steps.shifted], dim=1), ["max"] + k_cols),
               step("4. Exponentials, and each row's sum",
                    torch.cat([steps.exps, steps.exp_sum], dim=1), k_cols + ["sum"])),
              (step("5. Weights = exp / sum  (rows sum to 1)", steps.weights),
               step("6. Output = Weights · V", steps.output, _labels("d", steps.output.size(-1))))]
    lines = []
    for pair in pairs:
        lines += side_by_side(pair) + [""]
    return lines[:-1]


def query_walk(steps: AttentionSteps, i: int, v: torch.Tensor, q_label: str,
               k_labels: Sequence[str], digits: int, top: int | None = None,
               explainer_note: bool = False) -> list[str]:
    """Query i's walk through the steps, one row per key it can see (as docs/attention.md reads
    it); with `top`, only the keys with the largest weights, and the lines say so."""
    visible = [j for j in range(len(k_labels)) if math.isfinite(float(steps.masked[i, j]))]
    shown = visible
    if top is not None and len(visible) > top:
        shown = sorted(sorted(visible, key=lambda j: -float(steps.weights[i, j]))[:top])
    d_v = v.size(1)
    spell_out = d_v <= 4 and len(shown) <= 6  # weight·value per key still fits on a line
    terms = weighted_values(steps.weights, v)[i]  # (T_k, d_v): weight_j · v_j
    cols = ["q·k", "/√d", "-max", "exp", "weight"]
    stages = (steps.scores, steps.scaled, steps.shifted, steps.exps, steps.weights)
    rows = [[float(stage[i, j]) for stage in stages]
            + ([vector(terms[j], digits)] if spell_out else []) for j in shown]
    total = ["", "", "", float(steps.exp_sum[i, 0]), float(steps.weights[i].sum())]
    if spell_out:
        cols.append("weight·v")
        total.append(vector(steps.output[i], digits))
    key_rows = [k_labels[j] for j in shown] + ["sum"]
    lines = table(f"Query {q_label}, key by key:", rows + [total], key_rows, cols, digits)
    if len(shown) < len(visible):
        rest = 1.0 - float(steps.weights[i, shown].sum())
        lines.append(f"  (shortened: the {len(shown)} of {len(visible)} visible keys with the "
                     f"largest weights; the other {len(visible) - len(shown)} carry {rest:.4f})")
    hidden = len(k_labels) - len(visible)
    if hidden:
        lines.append(f"  ({hidden} later key{'s are' if hidden > 1 else ' is'} hidden by the "
                     "causal mask: weight 0)")
    if spell_out:
        for c in range(d_v):
            terms = " + ".join(f"{float(steps.weights[i, j]):.{min(digits, 4)}f}·"
                               f"{vector([v[j, c]], digits)[1:-1]}" for j in shown)
            lines.append(f"  output d{c} = {terms} = {float(steps.output[i, c]):.{digits}f}")
    else:
        lines.append(f"  output = {vector(steps.output[i], digits)}" if d_v <= 8 else
                     f"  output ({d_v} numbers, first 8) = {vector(steps.output[i, :8], digits)}")
    if explainer_note and float(steps.row_max[i, 0]) != 0:
        # the textbook softmax takes exp() of the scaled scores directly; e^max cancels
        raw = unshifted_exps(steps)[i, visible]
        lines += paragraph(
            f"Without subtracting the max (as the explainer does) the exponentials are "
            f"{vector(raw, digits)[1:-1]}, sum {float(raw.sum()):.{digits}f}: each is "
            f"e^{float(steps.row_max[i, 0]):.{digits}f} times larger, so the weights are the "
            "same.", indent="  ")
    return lines


def weights_overview(weights: torch.Tensor, tokens: Sequence[str], digits: int, top: int
                     ) -> list[str]:
    """Every query's weights (T, T), labelled with tokens: the full table when it fits in
    MAX_WIDTH, otherwise each row shortened to its `top` largest weights (and it says so)."""
    labels = [f"{j} {t!r}" for j, t in enumerate(tokens)]
    full = table("Weights of every query (rows) over the keys (columns):", weights, labels,
                 [repr(t) for t in tokens], digits)
    if max(len(line) for line in full) <= MAX_WIDTH:
        return full
    width = max(len(label) for label in labels)
    dec = min(digits, 3)
    lines = [f"Weights of every query, each row shortened to its {top} largest (keys after the "
             "query have weight 0):"]
    for i in range(weights.size(0)):
        row = weights[i, : i + 1]
        best = row.topk(min(top, i + 1)).indices.tolist()
        entries = "  ".join(f"{j}:{tokens[j]!r} {float(row[j]):.{dec}f}" for j in best)
        rest = i + 1 - len(best)
        more = f"  (+{rest} more: {1.0 - float(row[best].sum()):.{dec}f})" if rest else ""
        lines.append(f"  {labels[i]:<{width}}  {entries}{more}")
    return lines


class Panel(NamedTuple):
    """One heatmap of a figure: a (T_q, T_k) matrix with its labels; NaN/-inf cells are blank."""

    title: str
    matrix: torch.Tensor
    rows: list[str]
    cols: list[str]
    weights: bool = False  # colour scale fixed to [0, 1]


class Explanation(NamedTuple):
    """The walkthrough's text, and the heatmaps behind it."""

    text: str
    title: str
    panels: list[Panel]


def _weight_panels(steps: AttentionSteps, rows: list[str], cols: list[str], prefix: str = "",
                   masked: str = " (masked)") -> list[Panel]:
    """Heatmaps of the scores and the weights; hidden weights are NaN, so they show blank."""
    blank_hidden = steps.weights.masked_fill(torch.isinf(steps.masked), float("nan"))
    return [Panel(f"{prefix}scores S/√d{masked}", steps.masked, rows, cols),
            Panel(f"{prefix}weights", blank_hidden, rows, cols, weights=True)]


def refuse_overflow(given: str, *stages: torch.Tensor) -> None:
    """Refuse a walkthrough whose numbers outgrew float32 on the way (the dot products of entries
    of 1e20 do): its weights would be NaN. One line naming the input to make smaller."""
    if not all(bool(torch.isfinite(stage).all()) for stage in stages):
        raise ValueError(f"the numbers overflow float32 on the way (a dot product or sum beyond "
                         f"{torch.finfo(torch.float32).max:.8g} in magnitude), which would make "
                         f"the weights NaN: give smaller numbers in {given}")


def explain_given_qkv(q: torch.Tensor | None = None, k: torch.Tensor | None = None,
                      v: torch.Tensor | None = None, causal: bool = False,
                      query: int | str | None = None, digits: int = 4,
                      printable: Printable | None = None) -> Explanation:
    """tinylm-explain's single-head mode: scaled dot-product attention step by step, following
    row `query`, on q (T_q, d), k (T_k, d), v (T_k, d_v) (K = Q and V = K where missing), or
    without q on the worked example."""
    if q is None:
        intro = "The explainer's worked example: 3 tokens, d = 2, K = Q."
        q, k, v = torch.tensor(EXAMPLE_Q), None, torch.tensor(EXAMPLE_V)
    else:
        intro = ("Your Q, K, V" + ("  (K = Q: k not given)" if k is None else "")
                 + ("  (V = K: v not given)" if v is None else ""))
    k = q if k is None else k
    v = k if v is None else v
    if q.size(1) != k.size(1):
        raise ValueError(f"q rows have {q.size(1)} numbers but k rows have {k.size(1)}: each "
                         "query is dotted with each key, so q and k need the same width d")
    if k.size(0) != v.size(0):
        raise ValueError(f"k has {k.size(0)} rows (tokens) but v has {v.size(0)}: each key needs "
                         "exactly one value")

    t_k, d, d_v = k.size(0), q.size(1), v.size(1)
    if printable is not None:
        printable("q", q.size(0), "rows", lambda t_q: t_q * d + 3 * t_q * d_v + (
            (t_q if k is q else t_k) * (d + d_v + 8 * t_q)))  # Q, output columns; K, V, the steps

    q_rows, k_cols = _labels("q", q.size(0)), _labels("k", k.size(0))
    i, note = resolve_query(query, q_rows, default=0)

    steps = attention_steps(q, k, v, is_causal=causal)
    refuse_overflow("q, k and v", steps.scores, steps.output)
    hidden = (steps.masked == float("-inf")) if causal else None
    lines = [("Causal s" if causal else "S") + "caled dot-product attention, step by step "
             "(numbers computed by tinylm.attention.attention_steps).", intro]
    if causal and q.size(0) != k.size(0):
        lines.append(f"The {q.size(0)} queries are the last of the {k.size(0)} positions.")
    lines += paragraph(f"Rows are queries, columns keys, numbered from 0 (q0 is the explainer's "
                       f"query 1); > marks {q_rows[i]}, followed key by key at the end "
                       "(query=N, from 0).") + ([note] if note else [])
    lines += [""] + side_by_side([
        table("Q: what each token asks for", q, q_rows, _labels("d", q.size(1)), digits, i),
        table("K: what each offers to match", k, k_cols, _labels("d", k.size(1)), digits),
        table("V: what each carries", v, _labels("v", v.size(0)), _labels("d", v.size(1)),
              digits),
    ]) + [""]
    lines += steps_tables(steps, q.size(1), q_rows, k_cols, digits, i, hidden) + [""]
    lines += query_walk(steps, i, v, f"{q_rows[i]} = {vector(q[i], digits)}", k_cols,
                        digits, explainer_note=True)
    if causal:
        plain = attention_steps(q, k, v)
        refuse_overflow("q, k and v", plain.output)  # other weights: other sums
        seen = [", ".join(k_cols[c] for c in range(k.size(0)) if not hidden[r, c]) or "none"
                for r in range(q.size(0))]
        rows = [a + b + [s] for a, b, s in
                zip(steps.output.tolist(), plain.output.tolist(), seen, strict=True)]
        cols = ([f"causal d{c}" for c in range(d_v)] + [f"no mask d{c}" for c in range(d_v)]
                + ["keys seen"])
        lines += [""] + table("How the mask changes each row's output:", rows, q_rows, cols,
                              digits, i)
    return Explanation("\n".join(lines), "causal attention" if causal else "attention",
                       _weight_panels(steps, q_rows, k_cols, masked=" (masked)" if causal else ""))


def explain_given_multi_head(n_head: int, x: torch.Tensor | None = None,
                             d_model: int | None = None, seed: int = 0, digits: int = 4,
                             printable: Printable | None = None) -> Explanation:
    """tinylm-explain's n_head mode: MultiHeadAttention step by step (project, split into heads,
    attend, concatenate, project) on x (T, d_model), or on 3 random rows of width d_model (or 4),
    with weights random with `seed` and rounded so the printed numbers are the ones used."""
    if x is not None and d_model is not None and d_model != x.size(1):
        raise ValueError(f"d_model={d_model} but x rows have {x.size(1)} numbers; "
                         "drop d_model or make them agree")
    d_model = x.size(1) if x is not None else (d_model or 4)
    if d_model % n_head != 0:
        raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}: each head "
                         f"takes d_model / n_head columns; use d_model in "
                         f"{[n_head * m for m in range(1, 4)]}")
    def numbers(t: int, c: int) -> int:
        """What it prints: W_q, W_k, W_v, W_o; X, Q, K, V, concat, output; each head's scores
        and weights."""
        return 4 * c * c + 6 * t * c + 2 * n_head * t * t

    if printable is not None and x is None:  # then d_model sets the size: the random x has 3 rows
        printable("d_model", d_model, None, lambda c: numbers(3, c))
    elif printable is not None:
        printable("x", x.size(0), "rows", lambda t: numbers(t, d_model))
    attn, x_random = example_attention(d_model, n_head, seed)
    x_given = x is not None
    x = x if x_given else x_random
    walk = multi_head_walk(attn, x)
    refuse_overflow("x", walk.q, walk.k, walk.v, walk.steps.scores, walk.output)
    T, hs, dg = x.size(0), d_model // n_head, digits
    rows, d_cols = _labels("t", T), _labels("d", d_model)
    head_cols = [f"h{h}.{c}" for h in range(n_head) for c in range(hs)]
    w_q, w_k, w_v = attn.qkv_proj.weight.split(d_model, dim=0)  # each (C, C): rows = outputs

    lines = paragraph(
        f"Multi-head attention, step by step: n_head={n_head} heads of size {hs} on "
        f"d_model={d_model} (numbers computed by tinylm.attention.MultiHeadAttention). "
        f"Projection weights: random with seed={seed}, rounded to 2 decimals, no biases"
        + ("." if x_given else "; x random, rounded to 1 decimal.")
        + " MultiHeadAttention is causal (a language model must not see later tokens), so every "
        "head below uses the causal mask.") + [""]
    lines += table("X: the input, one row per token", x, rows, d_cols, dg)
    lines += [""] + side_by_side([
        table("W_q (qkv_proj.weight, first third)", w_q, head_cols, d_cols, dg),
        table("W_k (second third)", w_k, head_cols, d_cols, dg),
        table("W_v (last third)", w_v, head_cols, d_cols, dg),
    ]) + [""]
    lines += side_by_side([
        table("Q = X·W_qᵀ", walk.q, rows, head_cols, dg),
        table("K = X·W_kᵀ", walk.k, rows, head_cols, dg),
        table("V = X·W_vᵀ", walk.v, rows, head_cols, dg),
    ])
    lines += ["", f"Split into heads: head h takes columns h.0 .. h.{hs - 1} of Q, K and V, and "
              "attends on its own."]
    panels = []
    for h in range(n_head):
        s = AttentionSteps(*(t[h] for t in walk.steps))
        lines += ["", f"--- head {h} ---"] + side_by_side([
            table(f"Scaled scores S/√{hs}, masked", s.masked, rows, rows, dg),
            table("Weights", s.weights, rows, rows, dg),
            table(f"Output O_{h} = Weights · V_{h}", s.output, rows, _labels(f"h{h}.", hs), dg),
        ])
        panels += _weight_panels(s, rows, rows, prefix=f"head {h}: ")
    # W_o's rows are the output's columns, its columns the concatenated heads' columns
    lines += [""] + side_by_side([
        table("Concatenated heads [O_0 | O_1 ...]", walk.concat, rows, head_cols, dg),
        table("W_o (out_proj.weight): mixes the heads", attn.out_proj.weight, d_cols, head_cols,
              dg),
    ])
    lines += [""] + table("Output Y = concat · W_oᵀ (out_proj)", walk.output, rows, d_cols, dg)
    with torch.no_grad(), caching(attn, ["hook_pattern"]) as cache:
        y = attn(x[None])
    weights = cache["hook_pattern"]  # (1, nh, T, T)
    diff_y = float((y[0] - walk.output).abs().max())
    diff_w = float((weights[0] - walk.steps.weights).abs().max())
    lines += ["", f"Check: MultiHeadAttention.forward(x) gives the same output (max difference "
              f"{diff_y:.1e}) and weights (max difference {diff_w:.1e})."]
    return Explanation("\n".join(lines), f"multi-head attention, {n_head} heads", panels)


def _projections(attn) -> str:
    """Where a layer's Q, K and V come from, said (they are read at its hook points)."""
    if hasattr(attn, "qkv_proj"):
        return ("Q, K, V are this head's slice of blocks[layer].attn.qkv_proj applied to the "
                "layer's normed input")
    return ("Q, K, V are this head's rows of blocks[layer].attn's q, k and v projections of the "
            "layer's normed input, as the model's hook points hook_q, hook_k, hook_v hold them "
            "(rotated by position, where the model rotates them)")


def explain_model_head(model, tokenizer, text: str, layer: int = 0, head: int = 0,
                       query: int | str | None = None, top: int = 8, digits: int = 4,
                       source: str = "model") -> Explanation:
    """One head of a trained TinyLM on `text`, following token `query` (default: the last)
    through the steps; rows longer than `top` keys are shortened to their largest weights."""
    c = model.config
    if layer >= c.n_layer:
        raise ValueError(f"layer={layer} is out of range: the model has {c.n_layer} layers "
                         f"(0..{c.n_layer - 1})")
    if head >= c.n_head:
        raise ValueError(f"head={head} is out of range: the model has {c.n_head} heads per "
                         f"layer (0..{c.n_head - 1})")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError(f"text={text!r} gives no tokens")
    if len(ids) > c.block_size:
        raise ValueError(f"text is {len(ids)} tokens but the model reads at most "
                         f"block_size={c.block_size}; shorten it")
    tokens = tokenizer.token_strings(ids)
    labels = [f"{j} {t!r}" for j, t in enumerate(tokens)]
    i, note = resolve_query(query, tokens, default=-1, what="tokens")

    model.eval()
    device = next(model.parameters()).device
    found = model_head_steps(model, torch.tensor(ids, device=device), layer, head)
    steps = AttentionSteps(*(t.float().cpu() for t in found.steps))
    v, hs = found.v, found.v.size(-1)
    diff = float((found.weights.float().cpu() - steps.weights).abs().max())
    lines = paragraph(
        f"Layer {layer}, head {head} of {source} on {text!r} ({len(ids)} tokens; "
        f"head size {hs}). {_projections(model.blocks[layer].attn)}; attention is causal"
        + mask_and_scale(model.blocks[layer].attn, hs, min(c.block_size, MASK_POSITIONS))
        + "."
        + shared_kv(found.kv_head, found.group))
    lines += paragraph(f"The query is token {labels[i]} (tokens are numbered from 0)."
                       + (f" {note}" if note else "")) + [""]
    lines += weights_overview(steps.weights, tokens, digits, min(top, 4)) + [""]
    lines += query_walk(steps, i, v.float().cpu(), labels[i], labels, digits, top=top)
    lines += ["", f"Check: the model's own forward pass gives this head the same weights (max "
              f"difference {diff:.1e})."]
    short = [repr(t) for t in tokens]
    return Explanation("\n".join(lines), f"layer {layer} head {head}",
                       _weight_panels(steps, short, short))
