"""tinylm-explain: attention step by step, computed by tinylm's own attention code (examples in
conf/explain.yaml). It reads Q, K, V (command line or qkv_file), picks the mode, prints the
walkthrough of tinylm.inspection.walkthrough and draws its figures."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from tinylm.checkpoint_configs import yaml_in  # JSON is YAML: one reader serves both
from tinylm.cli import command
from tinylm.cli.loading import load_for_command
from tinylm.cli.sizes import QKV_FILE_BYTES, read_if_held, refuse_unprintable
from tinylm.config import ConfigError, at_least, bad, check
from tinylm.device import check_threads_setting
from tinylm.files import published_atomically
from tinylm.inspection.walkthrough import (
    Explanation,
    explain_given_multi_head,
    explain_given_qkv,
    explain_model_head,
)

QKV_FILE_KEYS = ("q", "k", "v", "x")
# The numbers are float32, exact to about 7 significant digits: more decimals show only rounding.
MAX_DIGITS = 9
# The largest magnitude float32 holds; a larger entry would become inf, and the weights NaN.
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class ExplainConfig:
    """What tinylm-explain shows; the schema of conf/explain.yaml (defaults: here only)."""

    q: list | None = None  # queries: list of rows (T_q, d); default: the worked example
    k: list | None = None  # keys (T_k, d); default: K = Q
    v: list | None = None  # values (T_k, d_v); default: V = K, or the example's V
    qkv_file: str | None = None  # JSON/YAML mapping with q, k, v (or x for n_head mode)
    causal: bool = False  # hide the future: the causal mask
    n_head: int | None = None  # set: multi-head mode (MultiHeadAttention on x)
    d_model: int | None = None  # multi-head width when x is random (default 4)
    x: list | None = None  # multi-head input (T, d_model); default seeded random
    seed: int = 0  # for the random x and projection weights of n_head mode
    checkpoint: str | None = None  # run dir / checkpoint dir: explain a trained head
    text: str | None = None  # checkpoint mode: the text whose attention is explained
    layer: int = 0  # checkpoint mode: the layer of the head explained
    head: int = 0  # checkpoint mode: the head explained
    query: int | str | None = None  # row to walk through: an index from 0 (query=0 is q0, the
    #                                 explainer's "query 1"; negative from the end) or, in
    #                                 checkpoint mode, a token's text
    top: int = 8  # checkpoint mode: longer rows are shortened to the `top` largest weights
    digits: int = 4  # decimals shown
    png: str | None = None  # write the scores/weights heatmaps here
    logdir: str | None = None  # ... and/or to TensorBoard in this directory
    threads: int | str = "auto"  # checkpoint mode: torch intra-op threads (tinylm/device.py)

    def __post_init__(self):
        check(self, digits=at_least(0), top=at_least(1), layer=at_least(0), head=at_least(0),
              n_head=at_least(1, null="for the default"),
              d_model=at_least(1, null="for the default"), threads=check_threads_setting)
        if self.digits > MAX_DIGITS:
            raise bad("digits", self.digits, f"must be at most {MAX_DIGITS}: the numbers are "
                      "float32, exact to about 7 significant digits")
        inline = [n for n in QKV_FILE_KEYS if getattr(self, n) is not None]
        if self.qkv_file is not None and inline:
            raise ConfigError(f"give the matrices either in qkv_file={self.qkv_file!r} or on "
                              f"the command line ({', '.join(inline)}), not both")
        if self.checkpoint is not None:
            extra = inline + [n for n in ("qkv_file", "n_head", "d_model")
                              if getattr(self, n) is not None]
            if extra:
                raise ConfigError(f"checkpoint mode takes Q, K, V from the model; drop "
                                  f"{', '.join(extra)}")
            if not self.text:
                raise ConfigError('checkpoint mode needs text=..., e.g. '
                                  '\'text="Lily saw a cat. She"\'')


def to_matrix(name: str, value: Any) -> torch.Tensor:
    """A list of rows of numbers (or one flat row) -> float tensor (rows, cols); clear errors."""
    example = f"e.g. {name}=[[1,0],[0,1]]"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name}={value!r} is not a list of rows of numbers ({example})")
    if len(value) == 0:
        raise ValueError(f"{name} is empty; give at least one row ({example})")
    nested = [isinstance(row, Sequence) and not isinstance(row, str) for row in value]
    if not any(nested):
        value = [value]  # one flat row: a single query, key or value
    elif not all(nested):
        raise ValueError(f"{name} mixes rows and single numbers: {list(value)!r} ({example})")
    for i, row in enumerate(value):
        if len(row) != len(value[0]):
            raise ValueError(f"{name} is ragged: row 0 has {len(value[0])} numbers but row {i} "
                             f"has {len(row)}; every row needs the same count ({example})")
        for j, x in enumerate(row):
            # an int is never inf or NaN, and one too large for a float is caught below
            if isinstance(x, bool) or not isinstance(x, (int, float)) or (
                    isinstance(x, float) and not math.isfinite(x)):
                raise ValueError(f"{name}[{i}][{j}] = {x!r} is not allowed: entries must be "
                                 "finite numbers")
            if abs(x) > FLOAT32_MAX:  # the check above is in float64, the attention in float32
                # an int of hundreds of digits is named by its size, to keep the line short
                shown = repr(x) if isinstance(x, float) else f"about 1e{int(math.log10(abs(x)))}"
                raise ValueError(f"{name}[{i}][{j}] = {shown} does not fit in float32: entries "
                                 f"must be at most {FLOAT32_MAX:.8g} in magnitude")
    if len(value[0]) == 0:
        raise ValueError(f"{name} has rows of 0 numbers ({example})")
    return torch.tensor([[float(x) for x in row] for row in value])


def read_qkv_file(path: str) -> dict[str, Any]:
    """Read a JSON or YAML file that maps some of q, k, v, x to lists of rows."""
    raw = read_if_held("qkv_file", path, QKV_FILE_BYTES,
                       f"reading it holds about {QKV_FILE_BYTES} bytes per byte")
    try:
        data = yaml_in(raw)
    except ValueError as err:
        raise ValueError(f"qkv_file={path!r} is not valid JSON or YAML: {err}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"qkv_file={path!r} must hold a mapping with keys among "
                         f"{', '.join(QKV_FILE_KEYS)}")
    unknown = sorted(str(key) for key in data if key not in QKV_FILE_KEYS)
    if unknown:
        raise ValueError(f"qkv_file={path!r} has unknown key {', '.join(unknown)}; allowed: "
                         f"{', '.join(QKV_FILE_KEYS)}")
    return data


def explain(cfg: ExplainConfig) -> str:
    """The walkthrough cfg asks for, as text: one head of a trained model, n_head mode on x, or
    one head on the given (or the example's) q, k, v; writes the figures when png/logdir are set."""
    given = read_qkv_file(cfg.qkv_file) if cfg.qkv_file else {
        "q": cfg.q, "k": cfg.k, "v": cfg.v, "x": cfg.x}

    def matrix(name: str) -> torch.Tensor | None:
        return None if given.get(name) is None else to_matrix(name, given[name])

    if cfg.checkpoint is not None:
        ckpt = load_for_command(cfg.checkpoint, threads=cfg.threads).checkpoint
        result = explain_model_head(ckpt.model, ckpt.tokenizer, cfg.text, cfg.layer, cfg.head,
                                    cfg.query, cfg.top, cfg.digits, source=str(ckpt.directory))
    elif cfg.n_head is not None:
        unused = [name for name in ("q", "k", "v") if given.get(name) is not None]
        if unused:
            raise ValueError(f"n_head mode projects Q, K, V from x; give x=[[...]] instead of "
                             f"{', '.join(unused)}")
        if cfg.query is not None:
            raise ValueError("query picks the row to follow in the single-head and checkpoint "
                             "modes; n_head mode shows every row")
        result = explain_given_multi_head(cfg.n_head, matrix("x"), cfg.d_model, cfg.seed,
                                          cfg.digits, printable=refuse_unprintable)
    elif given.get("x") is not None or cfg.d_model is not None:
        raise ValueError("x and d_model are for multi-head mode; add n_head=<heads>")
    elif given.get("q") is None and (given.get("k") is not None or given.get("v") is not None):
        raise ValueError("k or v were given without q; give q too")
    else:
        result = explain_given_qkv(matrix("q"), matrix("k"), matrix("v"), cfg.causal,
                                   cfg.query, cfg.digits, printable=refuse_unprintable)
    if cfg.png or cfg.logdir:
        return result.text + "\n\n" + "\n".join(write_figures(result, cfg.png, cfg.logdir))
    return result.text


def write_figures(explanation: Explanation, png: str | None, logdir: str | None) -> list[str]:
    """Write the heatmaps as a PNG and/or to TensorBoard, each whole or (a full disk) neither;
    returns lines saying where."""
    # imported here: only runs that ask for figures wait for matplotlib (and TensorBoard)
    from tinylm.inspection.figures import event_writer, save_figure, steps_figure

    fig = steps_figure(explanation.panels, f"tinylm-explain: {explanation.title}")
    written = []
    with published_atomically(logdir) if logdir else nullcontext() as folder:
        if logdir:
            tag = "explain/" + explanation.title.replace(" ", "_").replace(",", "")
            with event_writer(folder) as writer:
                writer.add_figure(tag, fig, global_step=0, close=False)
            written.append(f"TensorBoard figure {tag!r} written to {logdir} "
                           f"(tensorboard --logdir {shlex.quote(str(logdir))})")
        if png:  # last: a failed event file leaves no PNG either
            written.insert(0, f"Figure written to {save_figure(fig, png)}")
    return written


def print_explanation(cfg: ExplainConfig) -> None:
    """The walkthrough on stdout."""
    text = explain(cfg)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `tinylm-explain | head` stopped reading: fine, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


main = command("tinylm-explain", "explain", ExplainConfig, print_explanation)


if __name__ == "__main__":
    main()
