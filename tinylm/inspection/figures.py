"""Matplotlib figures of attention, for TensorBoard and PNG files; built on the Agg canvas with
matplotlib's object API (no pyplot, no display, no global state).

    grids = AttentionGridImages(tokens)             # one layout for every layer of a text
    image = grids(weights[0], "layer 0")            # weights (n_layer, n_head, T, T)
    with published_atomically(logdir) as folder, event_writer(folder) as writer:
        log_image(writer, "attention/layer_00/all_heads", image, png_dir=folder)  # + a PNG file

In every attention heatmap rows are queries, columns keys, the causal upper triangle is blank,
and the colour scale is the square root of the weight, so that small weights spread over many
tokens stay visible next to one large one.
"""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text
from PIL import Image

from tinylm.files import replaced_atomically

# masked cells (the hidden causal upper triangle) are drawn light grey, not as weight 0
ATTENTION_CMAP = colormaps["viridis"].with_extremes(bad="#f2f2f2")


def _label(token: str) -> str:
    """A token string safe to use as a tick label: visible whitespace, no mathtext."""
    text = token.replace("$", r"\$").replace("\n", "\\n").replace("\t", "\\t")
    return text if text.strip() else repr(token)


def label_step(n_tokens: int, max_labels: int) -> int:
    """Label every k-th token so that at most `max_labels` tick labels appear on an axis."""
    return max(1, math.ceil(n_tokens / max_labels))


def _causal_masked(weights: np.ndarray) -> np.ma.MaskedArray:
    """Mask the upper triangle (keys after the query), so it shows blank instead of as zeros."""
    t_q, t_k = weights.shape[-2:]
    # queries are the last t_q of t_k positions, as in tinylm.attention.causal_mask
    hidden = np.triu(np.ones((t_q, t_k), dtype=bool), k=t_k - t_q + 1)
    return np.ma.masked_array(weights, mask=np.broadcast_to(hidden, weights.shape))


def _heatmap(ax, weights: np.ndarray, tokens: Sequence[str], max_labels: int, fontsize: float,
             highlight: Sequence[int], label_x: bool, label_y: bool):
    """Draw one (T, T) attention map, with token labels on the axes asked for; returns the image.
    Tokens in `highlight` (positions) are always labelled, in red."""
    t = weights.shape[-1]
    image = ax.imshow(_causal_masked(weights), cmap=ATTENTION_CMAP,
                      norm=PowerNorm(0.5, vmin=0.0, vmax=1.0), interpolation="nearest",
                      aspect="equal")
    step = label_step(t, max_labels)
    marked = {i for i in highlight if 0 <= i < t}
    # every step-th position from the first token, and the last one; a highlighted token takes
    # the place of regular labels too close to it
    regular = {i for i in [*range(0, t - step // 2, step), t - 1]
               if all(abs(i - m) >= step for m in marked)}
    ticks = sorted(regular | marked)
    labels = [_label(tokens[i]) for i in ticks]
    for axis, labelled in ((ax.xaxis, label_x), (ax.yaxis, label_y)):
        if not labelled:
            axis.set_ticks([])
            continue
        axis.set_ticks(ticks, labels, fontsize=fontsize)
        for i, text in zip(ticks, axis.get_ticklabels(), strict=True):
            if i in marked:
                text.set_color("#d62728")
    ax.tick_params(axis="x", labelrotation=90)
    ax.tick_params(length=2, pad=1)
    return image


def _checked(weights: np.ndarray, tokens: Sequence[str]) -> np.ndarray:
    """weights as float32 (n_head, T, T) for T tokens; else a ValueError."""
    weights = np.asarray(weights, dtype=np.float32)
    if weights.ndim != 3 or weights.shape[-1] != len(tokens):
        raise ValueError(f"weights must be (n_head, T, T) with T={len(tokens)} tokens, got "
                         f"shape {weights.shape}")
    return weights


def _grid_title(title: str, n_tokens: int, max_labels: int) -> str:
    """A grid's title: "layer 0  (40 tokens, 1 in 2 labelled; rows: query, columns: key)"."""
    step = label_step(n_tokens, max_labels)
    labels = f"{n_tokens} tokens" + (f", 1 in {step} labelled" if step > 1 else "")
    return f"{title}  ({labels}; rows: query, columns: key)".strip()


def attention_grid_figure(weights: np.ndarray, tokens: Sequence[str], title: str,
                          max_labels: int, highlight: Sequence[int]) -> tuple[Figure, list, Text]:
    """All heads of one layer, weights (n_head, T, T), as a grid of small labelled heatmaps (past
    `max_labels` tokens 1 in k is labelled, and `highlight` positions always are, in red); with
    the axes of the heads and the figure's title."""
    weights = _checked(weights, tokens)
    n_head, t = weights.shape[0], weights.shape[-1]
    ncols = math.ceil(math.sqrt(n_head))
    nrows = math.ceil(n_head / ncols)
    # panels grow with the sequence so that labels do not overlap, up to a readable maximum
    panel = min(7.0, max(3.0, 0.13 * min(t, max_labels * 1.5)))
    fig = Figure(figsize=(panel * ncols + 1.0, panel * nrows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    fontsize = 6 if t > 16 else 8
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.set_axis_off()
            continue
        # the heads share their tokens: labels on the outer panels only (laying out and drawing
        # labels is most of a figure's cost)
        image = _heatmap(ax, weights[h], tokens, max_labels, fontsize, highlight,
                         label_x=h + ncols >= n_head, label_y=h % ncols == 0)
        ax.set_title(f"head {h}", fontsize=10)
    suptitle = fig.suptitle(_grid_title(title, t, max_labels), fontsize=11)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    return fig, list(axes.flat)[:n_head], suptitle


class AttentionGridImages:
    """attention_grid_figure as RGB images for many weights over one token list, drawing only what
    changes: `AttentionGridImages(tokens)(weights, title)` -> (H, W, 3).

    Tick labels, head titles and the colour bar never change, so the first call draws them once
    as a background; each call pastes it and draws the heatmaps, their frames and the title in a
    whole draw's order: the pixels of a fresh figure, much faster.
    """

    def __init__(self, tokens: Sequence[str], max_labels: int = 32,
                 highlight: Sequence[int] = ()):
        self.tokens, self.max_labels, self.highlight = list(tokens), max_labels, tuple(highlight)
        self._fig: Figure | None = None  # built at the first call, from its weights' shape

    def __call__(self, weights: np.ndarray, title: str = "") -> np.ndarray:
        weights = _checked(weights, self.tokens)
        if self._fig is None:
            self._lay_out(weights, title)
        if weights.shape[0] != len(self._heads):
            raise ValueError(f"weights must have {len(self._heads)} heads, as the first ones "
                             f"drawn; got shape {weights.shape}")
        canvas = self._fig.canvas
        canvas.restore_region(self._background)
        for ax, head_weights in zip(self._heads, weights, strict=True):
            image = ax.images[0]
            image.set_data(_causal_masked(head_weights))
            for artist in (image, *ax.spines.values()):
                ax.draw_artist(artist)
        self._title.set_text(_grid_title(title, len(self.tokens), self.max_labels))
        self._fig.draw_artist(self._title)
        return np.asarray(canvas.buffer_rgba())[..., :3].copy()

    def _lay_out(self, weights: np.ndarray, title: str) -> None:
        fig, self._heads, self._title = attention_grid_figure(weights, self.tokens, title,
                                                              self.max_labels, self.highlight)
        fig.draw_without_rendering()  # the layout, with every artist in place
        fig.set_layout_engine("none")  # kept: a layout without the changing artists would differ
        changing = [self._title, *(artist for ax in self._heads
                                   for artist in (ax.images[0], *ax.spines.values()))]
        for artist in changing:
            artist.set_visible(False)
        fig.canvas.draw()
        self._background = fig.canvas.copy_from_bbox(fig.bbox)
        for artist in changing:
            artist.set_visible(True)
        self._fig = fig


def layer_head_heatmap(values: np.ndarray, title: str = "", label: str = "",
                       fmt: str = "{:.2f}", center: float | None = None) -> Figure:
    """A (n_layer, n_head) table of per-head numbers (accuracy, ablation effect) as a heatmap;
    `center`: a diverging colour map symmetric around this baseline (0 for changes, 0.5 for an
    accuracy whose chance is 0.5), marked on the colour bar."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"values must be (n_layer, n_head), got shape {values.shape}")
    n_layer, n_head = values.shape
    fig = Figure(figsize=(1.0 * n_head + 2.2, 0.7 * n_layer + 1.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    kwargs = {"cmap": "viridis"}
    if center is not None:
        finite = np.abs(values[np.isfinite(values)] - center)
        span = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        kwargs = {"cmap": "RdBu_r", "vmin": center - span, "vmax": center + span}
    image = ax.imshow(values, aspect="auto", interpolation="nearest", **kwargs)
    for layer in range(n_layer):
        for head in range(n_head):
            ax.text(head, layer, fmt.format(values[layer, head]), ha="center", va="center",
                    fontsize=8, color="black",
                    bbox={"facecolor": "white", "alpha": 0.6, "pad": 1, "linewidth": 0})
    ax.set_xticks(range(n_head), [str(h) for h in range(n_head)])
    ax.set_yticks(range(n_layer), [str(layer) for layer in range(n_layer)])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    bar = fig.colorbar(image, ax=ax, label=label)
    if center is not None:  # the baseline a reader compares every cell with
        bar.ax.axhline(center, color="black", linestyle="--", linewidth=1.2)
        bar.set_ticks(sorted({*bar.get_ticks(), center}))
    return fig


def steps_figure(panels: Sequence[tuple], title: str) -> Figure:
    """tinylm-explain's heatmaps (walkthrough.Panel), two per row; small ones carry their numbers.
    Cells hidden by the mask (NaN, -inf) are light grey, labelled "masked" in a legend and, where
    the numbers are written, in the cell."""
    n_rows = math.ceil(len(panels) / 2)
    t = max(matrix.shape[1] for _, matrix, *_ in panels)
    size = min(8.0, max(3.2, 0.3 * t))
    fig = Figure(figsize=(2 * size + 1.5, size * n_rows + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, 2, squeeze=False)
    any_masked = False
    for ax, (name, matrix, rows, cols, weights) in zip(axes.flat, panels, strict=False):
        values = matrix.detach().float().cpu().numpy()
        shown = np.ma.masked_invalid(values)  # -inf (hidden by the mask) is drawn blank
        any_masked = any_masked or bool(shown.mask.any())
        limits = {"vmin": 0.0, "vmax": 1.0} if weights else {}
        image = ax.imshow(shown, cmap=ATTENTION_CMAP, interpolation="nearest", aspect="equal",
                          **limits)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=8)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(name, fontsize=10)
        if values.shape[1] <= 10:
            for (r, c), value in np.ndenumerate(values):
                if np.isfinite(value):
                    ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=8,
                            color="white" if image.norm(value) < 0.5 else "black")
                else:
                    ax.text(c, r, "masked", ha="center", va="center", fontsize=7, color="0.45")
        fig.colorbar(image, ax=ax, shrink=0.8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    if any_masked:  # grey is no colour of the scale: say what it means
        fig.legend(handles=[Patch(facecolor=ATTENTION_CMAP.get_bad(), edgecolor="0.6",
                                  label="masked: key after the query (score -inf, weight 0)")],
                   loc="outside lower center", fontsize=9, frameon=False)
    fig.suptitle(title)
    return fig


def figure_to_image(fig: Figure) -> np.ndarray:
    """Render a figure to an RGB uint8 array (H, W, 3), for SummaryWriter.add_image(..., "HWC")."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write a figure to `path` as PNG or the format its suffix names (.svg, .pdf); the path."""
    path = Path(path)
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, dpi=100, format=path.suffix[1:] or "png")
    return path


def log_figure(writer, tag: str, fig: Figure, step: int = 0,
               png_dir: str | Path | None = None) -> np.ndarray:
    """Render `fig` once and log_image it; returns the image (H, W, 3)."""
    image = figure_to_image(fig)
    log_image(writer, tag, image, step, png_dir)
    return image


def log_image(writer, tag: str, image: np.ndarray, step: int = 0,
              png_dir: str | Path | None = None) -> None:
    """Add an RGB uint8 image (H, W, 3) to a SummaryWriter as image `tag`, and as
    png_dir/<tag>.png (a folder published_atomically moves into place whole, as the writer's):
    one PNG encoding serves both."""
    from tensorboard.compat.proto.summary_pb2 import Summary  # TensorBoard only where it writes

    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    height, width, channels = image.shape
    picture = Summary.Image(height=height, width=width, colorspace=channels,
                            encoded_image_string=png.getvalue())
    writer.file_writer.add_summary(Summary(value=[Summary.Value(tag=tag, image=picture)]), step)
    if png_dir is not None:
        path = Path(png_dir) / f"{tag}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png.getvalue())


@contextmanager
def event_writer(logdir: str | Path) -> Iterator:
    """A TensorBoard SummaryWriter into `logdir` (published_atomically's folder: a failed report
    leaves no half an event file), flushed and closed when the block ends. Its background thread
    writes the event file: a write the disk refuses is raised here, by the flush, and not also
    printed as that thread's traceback."""
    from torch.utils.tensorboard import SummaryWriter  # TensorBoard only where one is written

    previous = threading.excepthook
    threading.excepthook = lambda args: None if issubclass(args.exc_type, OSError) \
        else previous(args)
    try:
        writer = SummaryWriter(log_dir=str(logdir))
        try:
            yield writer
            writer.flush()  # raises what the thread met
        finally:
            writer.close()
    finally:
        threading.excepthook = previous
