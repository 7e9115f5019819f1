"""tinylm-explain: attention step by step, computed by tinylm's own attention code.

    tinylm-explain                                   # the worked example of docs/attention.md
    tinylm-explain causal=true                       # ... with the causal mask
    tinylm-explain 'q=[[1,0],[0,1]]' 'v=[[1,2],[3,4]]'   # your own Q and V (K = Q unless given)
    tinylm-explain qkv_file=qkv.yaml                 # q, k, v (lists of rows) from JSON or YAML
    tinylm-explain n_head=2                          # split into heads, concatenate, project
    tinylm-explain checkpoint=runs/x 'text="Lily saw a cat. She"' layer=1 head=0 query=She
    tinylm-explain png=attention.png logdir=runs/explain   # the steps as heatmaps too

This module reads the command's inputs (the command line, a qkv file, a checkpoint), picks the
mode, prints the walkthrough that tinylm.inspection.walkthrough writes and saves the figures.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml  # JSON is YAML, so one reader serves both

from tinylm.checkpoint import load_checkpoint
from tinylm.cli.command_line import checked_config, console_entry
from tinylm.config import flag, integer
from tinylm.inspection.walkthrough import Explanation, explain_model_head, explain_multi_head, explain_qkv
from tinylm.train.threads import apply_threads, check_threads_setting, start_sample

# The worked example of docs/attention.md: 3 tokens, d = 2, Q = K.
EXAMPLE_Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
EXAMPLE_V = [[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]]
QKV_FILE_KEYS = ("q", "k", "v", "x")


@dataclass
class ExplainConfig:
    """What tinylm-explain shows; the schema of conf/explain.yaml (defaults: here only)."""

    q: list | None = None  # queries: list of rows (T_q, d); default: the worked example
    k: list | None = None  # keys (T_k, d); default: K = Q
    v: list | None = None  # values (T_k, d_v); default: V = K, or the example's V
    qkv_file: str | None = None  # JSON/YAML mapping with q, k, v (or x for n_head mode)
    causal: bool = False
    n_head: int | None = None  # set: multi-head mode (MultiHeadAttention on x)
    d_model: int | None = None  # multi-head width when x is random (default 4)
    x: list | None = None  # multi-head input (T, d_model); default seeded random
    seed: int = 0  # for the random x and projection weights of n_head mode
    checkpoint: str | None = None  # run dir / checkpoint dir: explain a trained head
    text: str | None = None
    layer: int = 0
    head: int = 0
    query: int | str | None = None  # row to walk through: index, or a word in checkpoint mode
    top: int = 8  # checkpoint mode: longer rows are shortened to the `top` largest weights
    digits: int = 4  # decimals shown
    png: str | None = None  # write the scores/weights heatmaps here
    logdir: str | None = None  # ... and/or to TensorBoard in this directory
    threads: int | str = "auto"  # checkpoint mode: torch intra-op threads (tinylm/train/threads.py)

    def __post_init__(self):
        for name, low in (("digits", 0), ("top", 1), ("layer", 0), ("head", 0)):
            integer(name, getattr(self, name), least=low)
        check_threads_setting("threads", self.threads)
        for name in ("n_head", "d_model"):
            integer(name, getattr(self, name), least=1, null="for the default")
        integer("seed", self.seed)
        flag("causal", self.causal)
        inline = [n for n in QKV_FILE_KEYS if getattr(self, n) is not None]
        if self.qkv_file is not None and inline:
            raise ValueError(f"give the matrices either in qkv_file={self.qkv_file!r} or on the "
                             f"command line ({', '.join(inline)}), not both")
        if self.checkpoint is not None:
            extra = inline + [n for n in ("qkv_file", "n_head", "d_model")
                              if getattr(self, n) is not None]
            if extra:
                raise ValueError(f"checkpoint mode takes Q, K, V from the model; drop "
                                 f"{', '.join(extra)}")
            if not self.text:
                raise ValueError('checkpoint mode needs text=..., e.g. '
                                 '\'text="Lily saw a cat. She"\'')


# ----------------------------------------------------------------------------- inputs


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
    rows = []
    for i, row in enumerate(value):
        if len(row) != len(value[0]):
            raise ValueError(f"{name} is ragged: row 0 has {len(value[0])} numbers but row {i} "
                             f"has {len(row)}; every row needs the same count ({example})")
        for j, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ValueError(f"{name}[{i}][{j}] = {x!r} is not allowed: entries must be "
                                 "finite numbers")
        rows.append([float(x) for x in row])
    if len(rows[0]) == 0:
        raise ValueError(f"{name} has rows of 0 numbers ({example})")
    return torch.tensor(rows)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error unless q (T_q, d), k (T_k, d), v (T_k, d_v) fit together."""
    if q.size(1) != k.size(1):
        raise ValueError(f"q rows have {q.size(1)} numbers but k rows have {k.size(1)}: each "
                         "query is dotted with each key, so q and k need the same width d")
    if k.size(0) != v.size(0):
        raise ValueError(f"k has {k.size(0)} rows (tokens) but v has {v.size(0)}: each key needs "
                         "exactly one value")


def read_qkv_file(path: str) -> dict[str, Any]:
    """Read a JSON or YAML file that maps some of q, k, v, x to lists of rows."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"qkv_file={path!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"qkv_file={path!r} is not valid JSON or YAML: {err}") from err
    if not isinstance(data, dict) or not data:
        raise ValueError(f"qkv_file={path!r} must hold a mapping with keys among "
                         f"{', '.join(QKV_FILE_KEYS)}")
    unknown = sorted(str(key) for key in data if key not in QKV_FILE_KEYS)
    if unknown:
        raise ValueError(f"qkv_file={path!r} has unknown key {', '.join(unknown)}; allowed: "
                         f"{', '.join(QKV_FILE_KEYS)}")
    return data


def _given(cfg: ExplainConfig) -> dict[str, Any]:
    """The matrices cfg gives, from its qkv_file or from the command line."""
    return read_qkv_file(cfg.qkv_file) if cfg.qkv_file else {
        "q": cfg.q, "k": cfg.k, "v": cfg.v, "x": cfg.x}


# ----------------------------------------------------------------------------- the three modes


def _explain_qkv(cfg: ExplainConfig) -> Explanation:
    """Single-head mode: the given Q, K, V, or the worked example."""
    given = _given(cfg)
    if given.get("x") is not None or cfg.d_model is not None:
        raise ValueError("x and d_model are for multi-head mode; add n_head=<heads>")
    if given.get("q") is None:
        if given.get("k") is not None or given.get("v") is not None:
            raise ValueError("k or v were given without q; give q too")
        intro = "The explainer's worked example: 3 tokens, d = 2, K = Q."
        given = {"q": EXAMPLE_Q, "v": EXAMPLE_V}
    else:
        intro = ("Your Q, K, V" + ("  (K = Q: k not given)" if given.get("k") is None else "")
                 + ("  (V = K: v not given)" if given.get("v") is None else ""))
    q = to_matrix("q", given["q"])
    k = to_matrix("k", given["k"]) if given.get("k") is not None else q
    v = to_matrix("v", given["v"]) if given.get("v") is not None else k
    check_qkv(q, k, v)
    return explain_qkv(q, k, v, intro, cfg.causal, cfg.query, cfg.digits)


def _explain_multi_head(cfg: ExplainConfig) -> Explanation:
    """n_head mode: MultiHeadAttention on the given x, or on random rows."""
    given = _given(cfg)
    unused = [name for name in ("q", "k", "v") if given.get(name) is not None]
    if unused:
        raise ValueError(f"n_head mode projects Q, K, V from x; give x=[[...]] instead of "
                         f"{', '.join(unused)}")
    if cfg.query is not None:
        raise ValueError("query picks the row to follow in the single-head and checkpoint modes; "
                         "n_head mode shows every row")
    x = to_matrix("x", given["x"]) if given.get("x") is not None else None
    return explain_multi_head(cfg.n_head, x, cfg.d_model, cfg.seed, cfg.digits)


def _explain_checkpoint(cfg: ExplainConfig) -> Explanation:
    """Checkpoint mode: one head of a trained model on cfg.text."""
    cpu_sample = start_sample()
    ckpt = load_checkpoint(cfg.checkpoint)
    apply_threads(cfg.threads, cpu_sample)  # matters little here: one forward pass
    return explain_model_head(ckpt.model, ckpt.tokenizer, cfg.text, cfg.layer, cfg.head,
                              cfg.query, cfg.top, cfg.digits, source=str(ckpt.directory))


def write_figures(explanation: Explanation, png: str | None, logdir: str | None) -> list[str]:
    """Write the heatmaps as a PNG and/or to TensorBoard; returns lines saying where."""
    # imported here, not at the top: only runs that ask for figures wait for matplotlib
    from tinylm.inspection.figures import save_figure, steps_figure

    fig = steps_figure(explanation.panels, f"tinylm-explain: {explanation.title}")
    written = []
    if png:
        written.append(f"Figure written to {save_figure(fig, png)}")
    if logdir:
        from torch.utils.tensorboard import SummaryWriter  # likewise only for logdir=...

        tag = "explain/" + explanation.title.replace(" ", "_").replace(",", "")
        with SummaryWriter(logdir) as writer:
            writer.add_figure(tag, fig, global_step=0)
        written.append(f"TensorBoard figure {tag!r} written to {logdir} "
                       f"(tensorboard --logdir {logdir})")
    return written


def explain(cfg: ExplainConfig) -> str:
    """The walkthrough cfg asks for, as text; writes the figures when png/logdir are set."""
    if cfg.checkpoint is not None:
        result = _explain_checkpoint(cfg)
    elif cfg.n_head is not None:
        result = _explain_multi_head(cfg)
    else:
        result = _explain_qkv(cfg)
    text = result.text
    if cfg.png or cfg.logdir:
        text += "\n\n" + "\n".join(write_figures(result, cfg.png, cfg.logdir))
    return text


# ----------------------------------------------------------------------------- the command


def print_explanation(cfg: ExplainConfig) -> None:
    """The walkthrough on stdout."""
    text = explain(cfg)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `tinylm-explain | head` stopped reading: fine, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


main = console_entry("tinylm-explain", "explain", checked_config(ExplainConfig, "explain"),
                     print_explanation)


if __name__ == "__main__":
    main()
