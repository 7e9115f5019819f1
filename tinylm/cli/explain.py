"""tinylm-explain: attention step by step, computed by tinylm's own attention code.

    tinylm-explain                                   # the worked example of docs/attention.md
    tinylm-explain causal=true                       # ... with the causal mask
    tinylm-explain 'q=[[1,0],[0,1]]' 'v=[[1,2],[3,4]]'   # your own Q and V (K = Q unless given)
    tinylm-explain qkv_file=qkv.yaml                 # q, k, v (lists of rows) from JSON or YAML
    tinylm-explain n_head=2                          # split into heads, concatenate, project
    tinylm-explain checkpoint=runs/x 'text="Lily saw a cat. She"' layer=1 head=0 query=She
    tinylm-explain png=attention.png logdir=runs/explain   # the steps as heatmaps too

The command picks the mode and prints the walkthrough that tinylm.inspection.walkthrough writes.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from tinylm.checkpoint import load_checkpoint
from tinylm.cli import command
from tinylm.config import bad, flag, integer
from tinylm.inspection.walkthrough import (
    MAX_DIGITS,
    QKV_FILE_KEYS,
    Explanation,
    explain_given_multi_head,
    explain_given_qkv,
    explain_model_head,
    read_qkv_file,
    write_figures,
)
from tinylm.train.threads import apply_threads, check_threads_setting, start_sample


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
        if self.digits > MAX_DIGITS:
            raise bad("digits", self.digits, f"must be at most {MAX_DIGITS}: the numbers are "
                      "float32, exact to about 7 significant digits")
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


# ----------------------------------------------------------------------------- the modes


def _explain_checkpoint(cfg: ExplainConfig) -> Explanation:
    """Checkpoint mode: one head of a trained model on cfg.text."""
    cpu_sample = start_sample()
    ckpt = load_checkpoint(cfg.checkpoint)
    apply_threads(cfg.threads, cpu_sample)  # matters little here: one forward pass
    return explain_model_head(ckpt.model, ckpt.tokenizer, cfg.text, cfg.layer, cfg.head,
                              cfg.query, cfg.top, cfg.digits, source=str(ckpt.directory))


def explain(cfg: ExplainConfig) -> str:
    """The walkthrough cfg asks for, as text; writes the figures when png/logdir are set."""
    given = read_qkv_file(cfg.qkv_file) if cfg.qkv_file else {
        "q": cfg.q, "k": cfg.k, "v": cfg.v, "x": cfg.x}
    if cfg.checkpoint is not None:
        result = _explain_checkpoint(cfg)
    elif cfg.n_head is not None:
        result = explain_given_multi_head(given, cfg.n_head, cfg.d_model, cfg.seed, cfg.digits,
                                          cfg.query)
    else:
        result = explain_given_qkv(given, cfg.causal, cfg.query, cfg.digits, cfg.d_model)
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


main = command("tinylm-explain", "explain", ExplainConfig, print_explanation)


if __name__ == "__main__":
    main()
