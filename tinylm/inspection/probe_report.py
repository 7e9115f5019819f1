"""How tinylm-probe's results are drawn: layer x head tables for the console, heatmaps, and the
TensorBoard event file with them, the console text and what the attention tab reads. Each probe
type (probe_types.py) says what it shows."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np


class Heatmap(NamedTuple):
    """A layer x head heatmap, as figures.layer_head_heatmap draws it."""

    values: np.ndarray  # (n_layer, n_head); NaN: no value
    title: str
    label: str  # of the colour bar
    fmt: str = "{:.2f}"
    center: float | None = None  # a diverging colour map around it (0 for changes, 0.5: chance)


def grid(entries: list[dict], key: str) -> np.ndarray:
    """(n_layer, n_head) of per-head rows: each row's `key` at its layer and head (None: NaN)."""
    values = np.full((1 + max(e["layer"] for e in entries), 1 + max(e["head"] for e in entries)),
                     np.nan)
    for e in entries:
        values[e["layer"], e["head"]] = np.nan if e[key] is None else e[key]
    return values


def number(value: float | None, fmt: str) -> str:
    """`value` formatted, or n/a where it is undefined (None, NaN)."""
    return "n/a" if value is None or not np.isfinite(value) else format(value, fmt)


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


def write_probe_figures(report, folder: str | Path, console: list[str],
                        texts: dict | None = None) -> list[str]:
    """A probe_types.ProbeReport's heatmaps (also as <folder>/<tag>.png), the console text, the
    tab's summaries and the attention of `texts` (name -> AttentionCapture) into `folder`'s event
    file; returns the heatmaps' tags."""
    # matplotlib and TensorBoard load only once a report is computed: --help, a bad option or a
    # bad probe line answer without waiting for them
    from tinylm.inspection.figures import event_writer, layer_head_heatmap, log_figure
    from tinylm.inspection.tensorboard_plugin.summary import write_attention

    heatmaps = {tag: h for result in report.shown() for tag, h in result.heatmaps().items()}
    with event_writer(folder) as writer:
        for tag, heatmap in heatmaps.items():
            log_figure(writer, tag, layer_head_heatmap(*heatmap), png_dir=folder)
        writer.add_text("probe/report", "\n".join("    " + line for line in console), 0)
        for result in report.shown():
            result.summaries(writer)
        for name, capture in (texts or {}).items():
            write_attention(writer, name, capture, 0)
    return list(heatmaps)
