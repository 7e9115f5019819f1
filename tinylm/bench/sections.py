"""What a benchmark section returns, how it times (in turns, so that load from elsewhere falls
on every candidate alike), and the sections that run in this process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from tinylm.attention import MultiHeadAttention, causal_mask
from tinylm.bench.config import BenchConfig
from tinylm.corpus import data_root, read_rows, resolve_files
from tinylm.fast import cpu_decoding
from tinylm.generate import generate
from tinylm.hooks import caching
from tinylm.model import ModelConfig, TinyLM
from tinylm.tokenizer import train_tokenizer


@dataclass
class Row:
    """One candidate: median seconds per call, every timed call, and figures derived from them."""

    name: str
    median_s: float
    times_s: list[float]
    figures: dict[str, float] = field(default_factory=dict)  # keys of report.FIGURES
    note: str = ""


@dataclass
class Ratio:
    """A ratio of two medians and its target: met when value >= target (<= if `at_most`)."""

    name: str
    value: float
    target: float | None = None  # None: shown for context, no target
    at_most: bool = False
    met: bool | None = field(init=False)  # None: no target

    def __post_init__(self):
        self.met = None if self.target is None else (
            self.value <= self.target if self.at_most else self.value >= self.target)


@dataclass
class Section:
    """What one benchmark section measured."""

    name: str
    rows: list[Row]
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def time_turns(candidates: dict[str, Callable[[], object]], repeats: int, warmup: int,
               per_call: int = 1) -> dict[str, Row]:
    """`warmup` untimed calls of each candidate, then `repeats` rounds of one timed call each;
    a Row each, in seconds per call / `per_call`."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for round_ in range(repeats):
        # the order flips every round, so no candidate always runs right after another
        for name in names if round_ % 2 == 0 else reversed(names):
            start = time.perf_counter()
            candidates[name]()
            times[name].append((time.perf_counter() - start) / per_call)
    return {name: Row(name, statistics.median(ts), ts) for name, ts in times.items()}


def set_tokens_per_s(rows: dict[str, Row], tokens: int) -> None:
    """The tokens/s figure of each row that handles `tokens` tokens per call."""
    for row in rows.values():
        row.figures["tokens_per_s"] = tokens / row.median_s


def bench_attention(cfg: BenchConfig) -> Section:
    """One causal attention layer, fwd + bwd: our two paths and torch nn.MultiheadAttention."""
    a = cfg.attention
    B, T, C = a.batch_size, a.seq_len, a.n_embd
    ours = MultiHeadAttention(C, a.n_head, bias=False)
    peer = nn.MultiheadAttention(C, a.n_head, bias=False, batch_first=True)
    x = torch.randn(B, T, C, requires_grad=True)
    mask = causal_mask(T, T)

    def explicit() -> None:
        with caching(ours, ["hook_pattern"]):  # read weights: the explicit path
            y = ours(x)
        y.sum().backward()

    rows = time_turns({
        "tinylm explicit path": explicit,
        "tinylm fast path": lambda: ours(x).sum().backward(),
        # is_causal=True beside the mask lets torch hand the fused kernel is_causal instead
        "torch nn.MultiheadAttention": lambda: peer(
            x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0].sum().backward(),
    }, cfg.repeats, cfg.warmup)
    set_tokens_per_s(rows, B * T)
    fast_s, peer_s = rows["tinylm fast path"].median_s, rows["torch nn.MultiheadAttention"].median_s
    return Section(
        "attention", list(rows.values()),
        [Ratio("speed of the fast path / nn.MultiheadAttention", peer_s / fast_s, 1.0),
         Ratio("time of the explicit path / fast path (the cost of keeping every step)",
               rows["tinylm explicit path"].median_s / fast_s)],
        [f"B={B} T={T} n_head={a.n_head} d_model={C}, fp32, no biases, forward + backward of "
         "y.sum(); nn.MultiheadAttention(batch_first=True) gets the causal mask with "
         "is_causal=True, need_weights=False"])


def gpt2_like(cfg: ModelConfig, attn_implementation: str) -> nn.Module:
    """A random transformers GPT2LMHeadModel of the shape of `cfg`, without dropout."""
    try:  # transformers is optional (the bench extra), so it is imported only here
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("the GPT-2 peer needs transformers, from the bench extra: "
                                  'pip install -c constraints.txt -e ".[bench]"') from err

    logging.set_verbosity_error()  # else: "loss_type=None ... unrecognized" (the default is right)
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=4 * cfg.n_embd,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=True)
    return GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)


def bench_generate(cfg: BenchConfig) -> Section:
    """Greedy batch-1 decoding: ours with and without the KV cache, GPT-2's generate; latency."""
    g = cfg.generate
    shape = replace(cfg.model, block_size=g.block_size)
    ours = TinyLM(shape).eval()
    peer = gpt2_like(shape, "sdpa").eval()
    prompt = torch.randint(0, shape.vocab_size, (1, g.prompt_len))
    n = g.new_tokens

    @torch.inference_mode()
    def peer_generate():
        return peer.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)

    candidates = {
        "tinylm KV cache": lambda: generate(ours, prompt, n, temperature=0.0),
        "GPT-2 generate": peer_generate,
        "tinylm no cache": lambda: generate(ours, prompt, n, temperature=0.0, use_cache=False),
    }
    for name, fn in candidates.items():  # fewer tokens than asked would flatter a candidate
        got = fn().size(1) - g.prompt_len
        if got != n:
            raise RuntimeError(f"{name} generated {got} tokens instead of {n}")
    # that check was the first warm-up (these are the slowest calls of the benchmark)
    rows = time_turns(candidates, cfg.repeats, max(cfg.warmup - 1, 0))
    set_tokens_per_s(rows, n)

    # one cached step (a token's forward + argmax) at two positions: the cache filled once up to
    # the position, rewound to it before every step
    token = torch.zeros(1, 1, dtype=torch.long)

    def decode_at(position: int) -> Callable[[], None]:
        cache = ours.new_kv_cache(1)
        with torch.inference_mode():
            ours(torch.randint(0, shape.vocab_size, (1, position)), kv_cache=cache)

        @torch.inference_mode()
        def steps():
            for _ in range(g.latency_steps):
                cache.rewind(position)
                ours(token, kv_cache=cache).logits[:, -1].argmax(-1)
        return steps

    early, late = (f"tinylm step at position {p}" for p in (g.early_position, g.late_position))
    with cpu_decoding(ours):  # as generate runs its steps
        latency = time_turns({early: decode_at(g.early_position),
                              late: decode_at(g.late_position)},
                             cfg.repeats, cfg.warmup, per_call=g.latency_steps)
    set_tokens_per_s(latency, 1)
    return Section(
        "generate", [*rows.values(), *latency.values()],
        [Ratio("tokens/s tinylm KV cache / GPT-2 generate",
               rows["GPT-2 generate"].median_s / rows["tinylm KV cache"].median_s, 2.0),
         Ratio(f"latency at position {g.late_position} / {g.early_position}",
               latency[late].median_s / latency[early].median_s, 1.5, at_most=True)],
        [f"batch 1, greedy, {g.prompt_len}-token random prompt, {n} new tokens (prefill "
         f"included), random weights, block_size={g.block_size}, fp32; GPT-2: "
         "generate(do_sample=False, use_cache=True, min_new_tokens=max_new_tokens), sdpa",
         f"step rows: one cached step (a token's forward + argmax, set up as generate does), "
         f"{g.latency_steps} steps per timed call"])


def bench_inspect(cfg: BenchConfig) -> Section:
    """Eval forward returning every layer's attention weights, against the plain forward."""
    B, T = cfg.inspect.batch_size, cfg.inspect.seq_len or cfg.model.block_size
    model = TinyLM(cfg.model).eval()
    idx = torch.randint(0, cfg.model.vocab_size, (B, T))

    @torch.inference_mode()
    def forward(return_attention: bool) -> None:
        model(idx, return_attention=return_attention)

    rows = time_turns({"forward": lambda: forward(False),
                       "forward + attention weights": lambda: forward(True)},
                      cfg.repeats, cfg.warmup)
    set_tokens_per_s(rows, B * T)
    plain, inspected = rows["forward"], rows["forward + attention weights"]
    return Section(
        "inspect", [plain, inspected],
        [Ratio("time with weights / without", inspected.median_s / plain.median_s, 1.3,
               at_most=True)],
        [f"B={B} T={T}, eval, inference_mode, fp32; with weights = "
         "model(idx, return_attention=True): the explicit path in every layer"])


def bench_data(cfg: BenchConfig) -> Section:
    """Tokenizer training and encoding throughput on the local corpus."""
    data, tok = cfg.data, cfg.tokenizer
    if data.source != "local":
        raise ValueError(f"data.source={data.source!r}: the data section reads local files "
                         "only; use data.source=local")
    root, why = data_root(data.data_root)
    files = resolve_files(root, data.files, data.name, why)
    # rows cut as tinylm-prepare cuts them
    texts = [row for path in files for row in read_rows(path, data.sample_by,
                                                         data.on_decode_error)]
    text = data.joiner.join(texts)
    megabytes = len(text.encode("utf-8")) / 1e6
    # no progress bars: they would clutter the tables and be drawn inside the timed calls
    tokenizer = train_tokenizer(tok, texts, show_progress=False)
    n_tokens = len(tokenizer.encode(text))

    rows = time_turns({
        f"{tok.name} tokenizer training": lambda: train_tokenizer(tok, texts, show_progress=False),
        "encode_batch (rows, as tinylm-prepare)": lambda: tokenizer.encode_batch(texts),
        "encode (one string)": lambda: tokenizer.encode(text),
    }, cfg.repeats, cfg.warmup)
    for row in rows.values():
        row.figures["mb_per_s"] = megabytes / row.median_s
        if row.name.startswith("encode"):
            row.figures["tokens_per_s"] = n_tokens / row.median_s
    return Section(
        "data", list(rows.values()), [],
        [f"{megabytes:.2f} MB of text in {len(texts)} {data.row_unit}s from "
         f"{', '.join(f.name for f in files)}; tokenizer={tok.name} "
         f"vocab_size={tokenizer.vocab_size}; {n_tokens} tokens "
         f"({len(text) / n_tokens:.2f} characters per token); HF tokenizers picks its own "
         "threads"])
