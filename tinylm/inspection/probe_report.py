"""tinylm-probe's report shown: the console summary (the deciding position, head accuracy,
agreement, ablation as layer x head tables) and its TensorBoard heatmaps; the scores themselves
come from probe.py.

    print("\n".join(format_report(report, n_layer, n_head)))
    write_probe_figures(report, folder, n_layer, n_head, console)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tinylm.inspection.patching import PatchingResult
from tinylm.inspection.probe import ABLATION, MIN_MARGIN_LOSS, MIN_PATCH_EFFECT, OVER_MEDIAN
from tinylm.tables import columns


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


class Reading(NamedTuple):
    """A causal reading the evidence table may set beside attention."""

    part: str  # the report's key for it
    name: str  # in "singled out by"
    title: str  # its column
    key: str  # its value in an evidence row
    fmt: str
    said: str  # in the table's title


READINGS = (Reading("ablation", "zeroed", "Δ margin zeroed", "delta_mean_margin", "+.3f",
                    "the margin it costs when zeroed"),
            Reading("mean_ablation", "mean", "Δ margin mean", "delta_mean_margin_mean", "+.3f",
                    "when mean-ablated"),
            Reading("patching", "patching", "patching", "patching_effect", ".2f",
                    "its patching effect"))


def format_evidence(report: dict, top_heads: int = 5) -> list[str]:
    """The evidence table: per head, attention to the name beside every causal reading measured
    (zero-ablation, mean-ablation, patching), the heads each singles out, and where they part."""
    rows, n = report["evidence"], report["deciding"]["n_agreement"]
    measured = [r for r in READINGS if report.get(r.part)]
    # the heads first by each reading: most attention, then the largest changes either way
    picks = [sorted(rows, key=lambda r: -r["mean_attention"])[:top_heads]]
    for reading in measured:
        picks.append(sorted((r for r in rows if r[reading.key] is not None),
                            key=lambda r: -abs(r[reading.key]))[:top_heads])
    shown = sorted({(r["layer"], r["head"]): r for pick in picks for r in pick}.values(),
                   key=lambda r: -r["mean_attention"])
    rules = [f"attention {OVER_MEDIAN:g}x the median head's"]
    if report["ablation"] or report.get("mean_ablation"):
        rules.append(f"a loss of {MIN_MARGIN_LOSS:g} nats")
    if report.get("patching"):
        rules.append(f"an effect of {MIN_PATCH_EFFECT:g}")
    lines = [f"evidence: each head's attention from the token before the pronoun to the name "
             f"({n} agreement items), beside {', '.join(r.said for r in measured)};",
             f"the {top_heads} heads first by each; a reading singles a head out at "
             f"{', '.join(rules)}"]
    lines += columns(
        ["layer", "head", "attention to name", *(r.title for r in measured), "singled out by"],
        [[str(row["layer"]), str(row["head"]), f"{row['mean_attention']:.2f}",
          *(_number(row[r.key], r.fmt) for r in measured),
          ", ".join(row["singled_out_by"]) or "-"] for row in shown],
        ">>>" + ">" * len(measured) + "<", gaps=2, indent="  ")
    names = ["attention", *(r.name for r in measured)]
    for name in names:
        heads = [f"L{r['layer']}H{r['head']}" for r in rows if name in r["singled_out_by"]]
        lines.append(f"  singled out by {name}: {' '.join(heads) if heads else 'no head'}")
    split = [f"L{r['layer']}H{r['head']} ({', '.join(r['singled_out_by'])})" for r in rows
             if r["singled_out_by"] and len(r["singled_out_by"]) < len(names)]
    lines.append(f"  where they part: {'; '.join(split) if split else 'nowhere'}")
    if report.get("mean_ablation"):  # a silenced head is an input the model never saw
        moved = [f"L{r['layer']}H{r['head']} {r['delta_mean_margin']:+.3f} zeroed, "
                 f"{r['delta_mean_margin_mean']:+.3f} mean" for r in rows
                 if abs(r["delta_mean_margin"]) >= MIN_MARGIN_LOSS
                 and abs(r["delta_mean_margin_mean"]) < MIN_MARGIN_LOSS]
        lines.append("  moved by zeroing, not by mean-ablation (a silent head is an input "
                     f"the model never saw): {'; '.join(moved) if moved else 'no head'}")
    return lines


def format_patching(patching: dict, n_layer: int, n_head: int, top_cells: int = 5
                    ) -> list[str]:
    """Console lines of activation patching: the layer x head effects with their intervals and
    the strongest (layer, head, position) cells with the tokens at that position."""
    heads = patching["heads"]
    how = ("each head's output copied from the counterfactual text (the other name) into the "
           "clean one" if patching["method"] == "exact" else "each head's output copied from the "
           "counterfactual text into the clean one, estimated to first order from gradients")
    skipped = (f"{patching['n_skipped']} skipped: the report lists each and why"
               if patching["n_skipped"] else "none skipped")
    lines = [f"patching ({patching['method']}): {how}, at every position at once, over "
             f"{patching['n_pairs']} pairs ({skipped});",
             "effect = the share of the counterfactual's change in log P(pronoun) - log P(wrong "
             f"pronoun) it moves, [{patching['interval_level']:.0%} bootstrap interval], "
             "* = largest"]
    clean = np.mean([p["m_clean"] for p in patching["pairs"]])
    other = np.mean([p["m_counterfactual"] for p in patching["pairs"]])
    # the effects' common denominator: near 0, they are ratios of noise
    lines.append(f"the name moves m by {other - clean:+.3f} on average (clean {clean:+.3f}, "
                 f"counterfactual {other:+.3f} nats)")
    effects = {(h["layer"], h["head"]): h["effect"] for h in heads}
    strongest = max((k for k in effects if effects[k] is not None),
                    key=lambda k: effects[k], default=None)
    lines += layer_head_lines(
        {(h["layer"], h["head"]): f"{_number(h['effect'], '+.2f')} "
         f"[{_number(h['interval'][0], '+.2f')},{_number(h['interval'][1], '+.2f')}]"
         for h in heads}, n_layer, n_head, strongest)
    cells = [(h["layer"], h["head"], back, value) for h in heads
             for back, value in enumerate(reversed(h["effect_by_position"])) if value is not None]
    cells.sort(key=lambda cell: -abs(cell[3]))
    lines.append(f"the {top_cells} strongest (layer, head, position) cells; positions counted "
                 "back from the deciding token (the one before the pronoun), with the tokens "
                 "found there")
    rows = []
    for layer, head, back, value in cells[:top_cells]:
        tokens = Counter(p["clean_tokens"][p["position"] - back] for p in patching["pairs"]
                         if p["position"] >= back)
        rows.append([str(layer), str(head), "deciding" if back == 0 else f"-{back}",
                     f"{value:+.2f}",
                     ", ".join(f"{t!r} x{k}" for t, k in tokens.most_common(3))])
    lines += columns(["layer", "head", "position", "effect", "tokens there (most frequent)"],
                     rows, ">>>><", gaps=2, indent="  ")
    return lines


def format_deciding(report: dict, n_layer: int, n_head: int, top_heads: int = 5) -> list[str]:
    """Console lines of the deciding position: the evidence table (with ablation), attention to
    the name per head (all items / name first word / name later), the prediction match."""
    d, lines = report["deciding"], []
    if report["evidence"]:
        lines += format_evidence(report, top_heads)
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
    if report.get("patching"):
        lines += format_patching(report["patching"], n_layer, n_head, top_heads)
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
    for entries, how in ((report["ablation"], f"each head {ABLATION} in turn"),
                         (report.get("mean_ablation"), "each head replaced in turn by its mean "
                          "output at each position over the texts")):
        if not entries:
            continue
        ranked = sorted(entries, key=lambda e: -abs(e["delta_mean_margin"]))
        lines.append(f"ablation: {how}, over the {agreement['n']} agreement items; the "
                     f"{min(top_heads, len(ranked))} heads that move the mean margin most")
        lines += columns(
            ["layer", "head", "Δ mean margin", "Δ accuracy", "mean margin", "accuracy"],
            [[str(e["layer"]), str(e["head"]), f"{e['delta_mean_margin']:+.3f}",
              f"{e['delta_accuracy']:+.2f}", f"{e['mean_margin']:+.3f}", f"{e['accuracy']:.2f}"]
             for e in ranked[:top_heads]], ">>>>>>", gaps=(2, 3, 3, 3, 3), indent="  ")
    return lines


def patching_arrays(patching: dict, n_layer: int, n_head: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
    """What the attention tab draws of the report's `patching`: effects (L, nh), intervals
    (L, nh, 2), each pair's own effect at each position of its clean text (P, L, nh, T_max),
    NaN past its end, and the pairs' words."""
    effects = _grid(patching["heads"], "effect", n_layer, n_head)
    intervals = np.full((n_layer, n_head, 2), np.nan)
    for h in patching["heads"]:
        intervals[h["layer"], h["head"]] = np.array(h["interval"], dtype=float)  # null: NaN
    shown = [{"source": p["source"], "tokens": p["clean_tokens"], "position": p["position"],
              "m_clean": p["m_clean"], "m_counterfactual": p["m_counterfactual"],
              "pronoun": p["target_tokens"][0], "wrong_pronoun": p["target_tokens"][1]}
             for p in patching["pairs"]]
    return effects, intervals, PatchingResult.from_json(patching).pair_effects(), shown


def write_probe_figures(report: dict, folder: str | Path, n_layer: int, n_head: int,
                        console: list[str], texts: dict | None = None) -> list[str]:
    """Layer x head heatmaps to TensorBoard (and as <folder>/<tag>.png), the console report as
    text, the accuracy and patching grids for the attention tab and the attention of `texts`
    (name -> AttentionCapture), into `folder` (published_atomically's: the caller moves them
    into place); returns the image tags."""
    # matplotlib and TensorBoard load only once a report is computed: --help, a bad option or a
    # bad probe line answer without waiting for them
    from tinylm.inspection.figures import event_writer, layer_head_heatmap, log_figure
    from tinylm.inspection.tensorboard_plugin.summary import (
        write_attention,
        write_patching,
        write_probe,
    )

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
    for part, how in (("ablation", ABLATION), ("mean_ablation", "mean-ablated")):
        for key in ("delta_mean_margin", "delta_accuracy") if report.get(part) else ():
            figures[f"probe/{part}_{key}"] = heatmap(
                report[part], key,
                f"agreement: change in {key[6:].replace('_', ' ')} with the head {how}",
                key.replace("_", " "), fmt="{:+.2f}", center=0.0)
    patching = report.get("patching")
    if patching:
        figures["probe/patching_effect"] = heatmap(
            patching["heads"], "effect",
            f"patching ({patching['method']}): share of the name's effect each head carries "
            f"({patching['n_pairs']} pairs)", "effect", fmt="{:+.2f}", center=0.0)
    with event_writer(folder) as writer:
        for tag, fig in figures.items():
            log_figure(writer, tag, fig, png_dir=folder)
        writer.add_text("probe/report", "\n".join("    " + line for line in console), 0)
        if report["heads"]:  # a report of agreement items only has no heads to draw
            write_probe(writer, report["n"], _grid(report["heads"], "accuracy", n_layer, n_head))
        if patching:
            write_patching(writer, *patching_arrays(patching, n_layer, n_head),
                           patching["n_skipped"], patching["interval_level"])
        for name, capture in (texts or {}).items():
            write_attention(writer, name, capture, 0)
    return list(figures)
