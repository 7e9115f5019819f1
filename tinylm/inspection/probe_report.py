"""tinylm-probe's report shown: the console summary (the deciding position, head accuracy,
agreement, ablation as layer x head tables) and its TensorBoard heatmaps; the scores themselves
come from probe.py.

    print("\n".join(format_report(report, n_layer, n_head)))
    write_probe_figures(report, folder, n_layer, n_head, console)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tinylm.inspection.probe import ABLATION, MIN_MARGIN_LOSS, OVER_MEDIAN
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
    """Layer x head heatmaps to TensorBoard (and as <folder>/<tag>.png), the console report as
    text and the accuracy grid for the attention tab, into `folder` (published_atomically's: the
    caller moves them into place); returns the image tags."""
    # matplotlib and TensorBoard load only once a report is computed: --help, a bad option or a
    # bad probe line answer without waiting for them
    from tinylm.inspection.figures import event_writer, layer_head_heatmap, log_figure
    from tinylm.inspection.tensorboard_plugin.summary import write_probe

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
        if report["heads"]:  # a report of agreement items only has no heads to draw
            write_probe(writer, report["n"], _grid(report["heads"], "accuracy", n_layer, n_head))
    return list(figures)
