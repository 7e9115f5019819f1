"""Plain-text tables for the console: numbers that share one precision, blocks set side by side,
prose wrapped. tinylm-explain, tinylm-probe and tinylm-bench print through these."""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import torch

MAX_WIDTH = 100  # tables are set side by side while they fit in this many columns


def decimals(values: list[float], digits: int) -> int:
    """Fewest decimals (at most `digits`) that show every finite value as it shows at `digits`."""
    need = 0
    for x in values:
        if math.isfinite(x):
            target = round(x, digits)
            while need < digits and round(x, need) != target:
                need += 1
    return need


def number(x: float, dec: int) -> str:
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    text = f"{x:.{dec}f}"
    return text.lstrip("-") if float(text) == 0 else text  # no "-0.0000"


def vector(values: torch.Tensor | Sequence[float], digits: int) -> str:
    """A short vector as "[0.8022, 0.7967]", with the fewest decimals (<= digits) it needs."""
    values = [float(x) for x in values]
    dec = decimals(values, digits)
    return "[" + ", ".join(number(x, dec) for x in values) + "]"


def table(title: str, values: Any, rows: Sequence[str], cols: Sequence[str], digits: int,
          mark: int | None = None) -> list[str]:
    """A titled table; numbers share one precision, strings are shown as they are, and row `mark`
    gets a ">" (the query the walkthrough follows)."""
    cells = [[float(x) if not isinstance(x, str) else x for x in row] for row in
             (values.tolist() if isinstance(values, torch.Tensor) else values)]
    dec = decimals([x for row in cells for x in row if isinstance(x, float)], digits)
    text = [[x if isinstance(x, str) else number(x, dec) for x in row] for row in cells]
    lines = columns(["", *cols], [[label, *row] for label, row in zip(rows, text, strict=True)],
                    "<" + ">" * len(cols), indent="  ")
    if mark is not None:
        lines[1 + mark] = ">" + lines[1 + mark][1:]
    return [title, *lines]


def side_by_side(blocks: Sequence[list[str]], gap: int = 4) -> list[str]:
    """Blocks of lines next to each other while they fit in MAX_WIDTH, else one under another."""
    widths = [max(len(line) for line in block) for block in blocks]
    if sum(widths) + gap * (len(blocks) - 1) > MAX_WIDTH:
        out = []
        for block in blocks:
            out += block + [""]
        return out[:-1]
    return [(" " * gap).join(line.ljust(w) for line, w in zip(row, widths, strict=True)).rstrip()
            for row in itertools.zip_longest(*blocks, fillvalue="")]


def paragraph(text: str, indent: str = "") -> list[str]:
    """Prose wrapped to MAX_WIDTH columns."""
    return textwrap.wrap(text, MAX_WIDTH, initial_indent=indent, subsequent_indent=indent)


def columns(header: Sequence[str], rows: Sequence[Sequence[str]], align: str,
            gaps: int | Sequence[int] = 2, indent: str = "") -> list[str]:
    """Formatted cells under their titles, each column as wide as its widest entry; `align` has
    "<" or ">" per column, `gaps` the spaces before each column but the first (one for all or
    one per column)."""
    widths = [max(len(line[i]) for line in (header, *rows)) for i in range(len(header))]
    spaces = [0, *([gaps] * (len(header) - 1) if isinstance(gaps, int) else gaps)]
    return [(indent + "".join(" " * gap + f"{cell:{side}{width}}" for cell, side, width, gap in
                              zip(line, align, widths, spaces, strict=True))).rstrip()
            for line in (header, *rows)]
