"""How fast tinylm is beside what users would pick instead, measured side by side.

    python scripts/bench.py                         # every section, a few minutes on 2 cores
    tinylm-bench section=attention repeats=9        # one section, more repeats
    tinylm-bench section=train train.batch_size=32 out=bench.json

Peers: torch.nn.MultiheadAttention for the attention kernel; a Hugging Face `transformers`
GPT2LMHeadModel of the same shape (random weights; from the `bench` extra) for training and
generation. In every section each candidate is warmed up, then all are timed in turns (ours, the
peer, ours, ...; the order flips every round) so that load from elsewhere on the machine falls on
all of them alike, and the median of the repeats is reported. Ratios of medians from one run are
the figures to trust on a busy machine; absolute times are context. docs/benchmarks.md explains
every figure.

In code: `run_bench(BenchConfig(...))` runs the sections and returns the JSON-ready report; each
section is one function `bench_<section>(...) -> Section`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from tinylm.attention import MultiHeadAttention, causal_mask
from tinylm.config import integer, one_of
from tinylm.data import DataConfig
from tinylm.model import ModelConfig, TinyLM
from tinylm.optim import OptimConfig, configure_optimizer
from tinylm.tokenizer import TokenizerConfig

SECTIONS = ("attention", "train", "generate", "inspect", "data", "load", "endtoend")


# --------------------------------------------------------------------------------------------
# Configuration: one dataclass per section, the schema of conf/bench.yaml


@dataclass
class AttentionBenchConfig:
    """One attention layer, forward + backward on a (batch_size, seq_len, n_embd) input."""

    batch_size: int = 8
    seq_len: int = 256
    n_head: int = 8
    n_embd: int = 256


@dataclass
class TrainBenchConfig:
    """Training steps on random tokens of length model.block_size."""

    batch_size: int = 16  # as conf/train/default.yaml
    peak_size: int = 2048  # square matmul that measures the machine's FLOP/s
    compile: bool = True  # also every model under torch.compile, in bf16 (~25 s to compile each)


@dataclass
class GenerateBenchConfig:
    """Greedy decoding of batch 1 with the model's shape, its context raised to block_size."""

    block_size: int = 512  # must hold late_position + 1 and prompt_len + new_tokens
    prompt_len: int = 32
    new_tokens: int = 256
    early_position: int = 32  # per-token latency: one cached step after this many tokens
    late_position: int = 480
    latency_steps: int = 20  # decoding steps per timed call of the latency rows


@dataclass
class InspectBenchConfig:
    """Eval forward with every layer's attention weights returned, against without."""

    batch_size: int = 4
    seq_len: int | None = None  # None: model.block_size


@dataclass
class LoadBenchConfig:
    """Training steps of the default run (and batch-1 decoding) quiet and beside other load."""

    batch_size: int = 16  # as conf/train/default.yaml
    steps_per_call: int = 3  # training steps per timed call
    decode_tokens: int = 16  # greedy batch-1 tokens per timed call; 0: no decoding rows
    fixed_threads: int = 2  # what torch takes by itself on 2 cores: the collapse to compare
    settle_s: float = 0.5  # the load runs this long before auto chooses and timing starts


@dataclass
class EndToEndBenchConfig:
    """`tinylm-train experiment=<experiment>` in a subprocess, with and without the extras."""

    experiment: str | None = "shakespeare_char"  # None: the default run
    overrides: list[str] = field(default_factory=list)  # more tinylm-train overrides
    target_val: float = 1.89  # time until the val loss is at most this
    reference_s: float | None = 50.3  # a reference wall time (nanoGPT, measured earlier)
    reference: str = "nanoGPT, same settings, measured earlier on this machine kind"


@dataclass
class BenchConfig:
    """Options of tinylm-bench; the schema of conf/bench.yaml (defaults: here only)."""

    section: str = "all"  # all, or one of SECTIONS
    threads: int = 2  # torch threads for every candidate (restored afterwards)
    repeats: int = 5  # timed calls per candidate; the median is reported
    warmup: int = 2  # untimed calls per candidate first
    seed: int = 0
    out: str | None = None  # where the JSON report goes; None: nowhere
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=4096))
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    attention: AttentionBenchConfig = field(default_factory=AttentionBenchConfig)
    train: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    generate: GenerateBenchConfig = field(default_factory=GenerateBenchConfig)
    inspect: InspectBenchConfig = field(default_factory=InspectBenchConfig)
    load: LoadBenchConfig = field(default_factory=LoadBenchConfig)
    endtoend: EndToEndBenchConfig = field(default_factory=EndToEndBenchConfig)

    def __post_init__(self):
        one_of("section", self.section, ("all", *SECTIONS))
        for key in ("threads", "repeats"):
            integer(key, getattr(self, key), least=1)
        integer("warmup", self.warmup, least=0)
        if self.model.vocab_size is None:
            raise ValueError("model.vocab_size=None is not allowed here: the benchmark builds "
                             "no tokenizer to take it from; set a number")
        g = self.generate
        if g.late_position + 1 > g.block_size or g.prompt_len + g.new_tokens > g.block_size:
            raise ValueError(f"generate.block_size={g.block_size} is too small: it must hold "
                             "generate.late_position + 1 and generate.prompt_len + "
                             "generate.new_tokens tokens")


PART_CONFIGS = {"model": ModelConfig, "optim": OptimConfig, "data": DataConfig,
                "tokenizer": TokenizerConfig, "attention": AttentionBenchConfig,
                "train": TrainBenchConfig, "generate": GenerateBenchConfig,
                "inspect": InspectBenchConfig, "load": LoadBenchConfig,
                "endtoend": EndToEndBenchConfig}


def bench_config(values: dict) -> BenchConfig:
    """BenchConfig from a nested mapping (the composed conf/bench.yaml), every part checked."""
    from tinylm.config import to_dataclass

    values = dict(values)
    for key, cls in PART_CONFIGS.items():
        if key in values:
            values[key] = to_dataclass(cls, values[key], key)
    return to_dataclass(BenchConfig, values, "bench")


# --------------------------------------------------------------------------------------------
# Results and timing


@dataclass
class Row:
    """One candidate: median seconds per call, every timed call, and figures derived from them."""

    name: str
    median_s: float
    times_s: list[float]
    figures: dict[str, float] = field(default_factory=dict)  # keys of FIGURES
    note: str = ""


@dataclass
class Ratio:
    """A ratio of two medians and its target: met when value >= target (<= if `at_most`)."""

    name: str
    value: float
    target: float | None = None  # None: shown for context, no target
    at_most: bool = False

    @property
    def met(self) -> bool | None:
        if self.target is None:
            return None
        return self.value <= self.target if self.at_most else self.value >= self.target


@dataclass
class Section:
    """What one benchmark section measured."""

    name: str
    rows: list[Row]
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for ratio, out in zip(self.ratios, d["ratios"], strict=True):
            out["met"] = ratio.met
        return d


@dataclass
class Timing:
    """How to time: `repeats` timed calls per candidate after `warmup` untimed ones."""

    repeats: int = 5
    warmup: int = 2

    def run(self, candidates: dict[str, Callable[[], object]],
            per_call: int = 1) -> dict[str, Row]:
        """Time the candidates in turns; a Row each, in seconds per call / `per_call`."""
        for fn in candidates.values():
            for _ in range(self.warmup):
                fn()
        times: dict[str, list[float]] = {name: [] for name in candidates}
        names = list(candidates)
        for round_ in range(self.repeats):
            # the order flips every round, so no candidate always runs right after another
            for name in names if round_ % 2 == 0 else reversed(names):
                start = time.perf_counter()
                candidates[name]()
                times[name].append((time.perf_counter() - start) / per_call)
        return {name: Row(name, statistics.median(ts), ts) for name, ts in times.items()}


# --------------------------------------------------------------------------------------------
# Sections


def bench_attention(cfg: AttentionBenchConfig, timing: Timing) -> Section:
    """One causal attention layer, fwd + bwd: our two paths and torch nn.MultiheadAttention."""
    B, T, C = cfg.batch_size, cfg.seq_len, cfg.n_embd
    ours = MultiHeadAttention(C, cfg.n_head, bias=False)
    peer = nn.MultiheadAttention(C, cfg.n_head, bias=False, batch_first=True)
    x = torch.randn(B, T, C, requires_grad=True)
    mask = causal_mask(T, T)

    def explicit():
        y, _ = ours(x, need_weights=True)
        y.sum().backward()

    def fast():
        y, _ = ours(x)
        y.sum().backward()

    def torch_mha():
        # is_causal=True beside the mask lets torch hand the fused kernel is_causal instead
        y, _ = peer(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)
        y.sum().backward()

    rows = timing.run({"tinylm explicit path": explicit, "tinylm fast path": fast,
                       "torch nn.MultiheadAttention": torch_mha})
    for row in rows.values():
        row.figures["tokens_per_s"] = B * T / row.median_s
    fast_s, peer_s = rows["tinylm fast path"].median_s, rows["torch nn.MultiheadAttention"].median_s
    return Section(
        "attention", list(rows.values()),
        [Ratio("speed of the fast path / nn.MultiheadAttention", peer_s / fast_s, 1.0),
         Ratio("time of the explicit path / fast path (the cost of keeping every step)",
               rows["tinylm explicit path"].median_s / fast_s)],
        [f"B={B} T={T} n_head={cfg.n_head} d_model={C}, fp32, no biases, forward + backward of "
         "y.sum(); nn.MultiheadAttention(batch_first=True) gets the causal mask with "
         "is_causal=True, need_weights=False"])


def gpt2_like(cfg: ModelConfig, attn_implementation: str) -> nn.Module:
    """A randomly initialised transformers GPT2LMHeadModel with the shape of `cfg`, no dropout."""
    try:
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


PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


def training_step(model: nn.Module, optim: OptimConfig, x: torch.Tensor, y: torch.Tensor,
                  precision: str, compiled: bool = False) -> Callable[[], None]:
    """One training step of `model` on (x, y) as a function: forward, loss, backward, clipping,
    the optimizer of tinylm.optim.configure_optimizer."""
    model.train()
    optimizer = configure_optimizer(model, optim)
    forward = torch.compile(model) if compiled else model
    dtype = PRECISION[precision]

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if isinstance(model, TinyLM):
                loss = forward(x, y, need_logits=False).loss  # as tinylm-train runs it
            else:  # GPT-2 shifts its labels by one itself
                loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        if optim.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if compiled:
        step()  # compiles now, so that no timed call includes it, even with warmup=0
    return step


def model_matmuls(model_cfg: ModelConfig, rows: int, dtype: torch.dtype
                  ) -> tuple[Callable[[], None], float]:
    """The forward matmuls of one block and the LM head at `rows` tokens, (rows, C) x (C, n)
    for n in 3C, C, 4C and V, and (rows, 4C) x (4C, C); returns (a call doing all, its FLOPs):
    the rate this model's own shapes allow, which small matrices keep below a square's."""
    C, V = model_cfg.n_embd, model_cfg.vocab_size
    shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C), (C, V)]
    operands = [(torch.randn(rows, k).to(dtype), torch.randn(k, n).to(dtype)) for k, n in shapes]

    def run():
        for a, b in operands:
            a @ b

    return run, sum(2 * rows * k * n for k, n in shapes)


def bench_train(model_cfg: ModelConfig, optim: OptimConfig, cfg: TrainBenchConfig,
                timing: Timing) -> Section:
    """Training steps: tokens/s and MFU of ours and of GPT-2 (sdpa, eager), fp32 and bf16,
    eager and (cfg.compile) compiled."""
    B, T = cfg.batch_size, model_cfg.block_size
    x = torch.randint(0, model_cfg.vocab_size, (B, T))
    y = torch.randint(0, model_cfg.vocab_size, (B, T))

    def step_fn(model: nn.Module, precision: str, compiled: bool) -> Callable[[], None]:
        return training_step(model, optim, x, y, precision, compiled)

    ours = TinyLM(replace(model_cfg, dropout=0.0))  # like the GPT-2 peer: no dropout
    models = {"tinylm": ours, "GPT-2 sdpa": gpt2_like(model_cfg, "sdpa"),
              "GPT-2 eager": gpt2_like(model_cfg, "eager")}
    # (model, precision, compiled) per candidate; compiled only in bf16, every model's faster
    # precision here, as each compile takes ~25 s
    variants = {f"{name} {precision}": (name, precision, False)
                for name in models for precision in PRECISION}
    candidates: dict[str, Callable[[], object]] = {
        row_name: step_fn(models[name], precision, compiled)
        for row_name, (name, precision, compiled) in variants.items()}
    compile_note = None
    if cfg.compile:
        compiled_variants = {f"{name} bf16 compiled": (name, "bf16", True) for name in models}
        try:
            compiled_candidates = {
                row_name: step_fn(models[name], precision, compiled)
                for row_name, (name, precision, compiled) in compiled_variants.items()}
        except Exception as err:  # e.g. no C++ compiler for inductor: compare eager only
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            compile_note = (f"torch.compile failed ({type(err).__name__}: {first_line}), so no "
                            "model is timed compiled; train.compile=false skips the attempt")
        else:
            variants.update(compiled_variants)
            candidates.update(compiled_candidates)
    # The matmul peaks are timed in the same rounds, so they see the same load as the models:
    # a large square (the machine's peak) and the model's own shapes (what it can reach).
    n = cfg.peak_size
    shapes_name = f"matmuls of the model's shapes, {B * T} rows"
    shape_flops = 0.0
    for precision, dtype in PRECISION.items():
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        candidates[f"matmul {n}x{n} {precision}"] = lambda a=a, b=b: a @ b
        candidates[f"{shapes_name} {precision}"], shape_flops = model_matmuls(
            model_cfg, B * T, dtype)
    rows = timing.run(candidates)

    peaks = {p: 2 * n**3 / rows[f"matmul {n}x{n} {p}"].median_s for p in PRECISION}
    shape_rates = {p: shape_flops / rows[f"{shapes_name} {p}"].median_s for p in PRECISION}
    for p in PRECISION:
        rows[f"matmul {n}x{n} {p}"].figures["gflops"] = peaks[p] / 1e9
        rows[f"{shapes_name} {p}"].figures["gflops"] = shape_rates[p] / 1e9
    # Both models do the same useful work per token (GPT-2's biases add < 0.1%), so MFU counts
    # tinylm's FLOPs for both: 6 per parameter plus attention's q·kᵀ and weights·v.
    flops_per_token = ours.flops_per_token(T)
    for row_name, (_, precision, _) in variants.items():
        row = rows[row_name]
        row.figures["tokens_per_s"] = B * T / row.median_s
        row.figures["mfu"] = flops_per_token * row.figures["tokens_per_s"] / peaks[precision]

    def best(prefix: str, eager_only: bool = False) -> Row:
        return min((rows[row_name] for row_name, (name, _, compiled) in variants.items()
                    if name.startswith(prefix) and not (eager_only and compiled)),
                   key=lambda r: r.median_s)

    ours_best, gpt2_best = best("tinylm"), best("GPT-2")
    ours_best.note = gpt2_best.note = "best setting"
    gpt2_fp32 = min(rows["GPT-2 sdpa fp32"], rows["GPT-2 eager fp32"], key=lambda r: r.median_s)
    ratios = [Ratio(f"tokens/s {ours_best.name} / {gpt2_best.name}",
                    gpt2_best.median_s / ours_best.median_s, 1.25)]
    if any(compiled for _, _, compiled in variants.values()):
        ours_eager, gpt2_eager = best("tinylm", eager_only=True), best("GPT-2", eager_only=True)
        ratios.append(Ratio(f"tokens/s {ours_eager.name} / {gpt2_eager.name} (neither compiled)",
                            gpt2_eager.median_s / ours_eager.median_s))
    best_precision = variants[ours_best.name][1]
    ratios += [
        Ratio(f"tokens/s tinylm fp32 / {gpt2_fp32.name} (both in fp32)",
              gpt2_fp32.median_s / rows["tinylm fp32"].median_s),
        # a 2048² square runs faster than any matmul a 128-wide model has: hold 60% to it
        # only where the model's matrices are large enough to get near it
        Ratio(f"MFU of {ours_best.name} (of the {best_precision} {n}x{n} matmul rate)",
              ours_best.figures["mfu"], 0.60 if model_cfg.n_embd >= 256 else None),
        Ratio(f"MFU of {ours_best.name} (of the {best_precision} rate of the model's own "
              "matmul shapes)", ours_best.figures["mfu"] * peaks[best_precision]
              / shape_rates[best_precision], 0.60)]
    return Section(
        "train", list(rows.values()), ratios,
        [f"B={B} T={T} n_layer={model_cfg.n_layer} n_head={model_cfg.n_head} "
         f"n_embd={model_cfg.n_embd} vocab={model_cfg.vocab_size}, random tokens; a step is "
         "forward, loss, backward, clip_grad_norm_, AdamW step from tinylm.optim."
         f"configure_optimizer (optim: lr={optim.lr}, weight_decay={optim.weight_decay}, "
         f"grad_clip={optim.grad_clip}) for every model; bf16 = torch.autocast(bf16); "
         "compiled = torch.compile(model), default mode, compiled before any timing",
         f"MFU = {flops_per_token / 1e6:.2f}M FLOPs per token x tokens/s / the median "
         f"{n}x{n} matmul rate of the same precision, timed in the same rounds",
         f"the model's shapes: (B*T={B * T}, C) x (C, n) for n in 3C, C, 4C, V, and "
         f"(B*T, 4C) x (4C, C), forward, C={model_cfg.n_embd}",
         "GPT-2 as transformers builds it: biases in every layer, tanh-approximated GELU, "
         "Conv1D layers; its attention implementation is sdpa or eager as named",
         *([compile_note] if compile_note else [])])


def bench_generate(model_cfg: ModelConfig, cfg: GenerateBenchConfig, timing: Timing) -> Section:
    """Greedy batch-1 decoding: ours with and without the KV cache, GPT-2's generate; latency."""
    from tinylm.generate import generate

    shape = ModelConfig(**{**asdict(model_cfg), "block_size": cfg.block_size})
    ours = TinyLM(shape).eval()
    prompt = torch.randint(0, shape.vocab_size, (1, cfg.prompt_len))
    n = cfg.new_tokens

    peer = gpt2_like(shape, "sdpa").eval()

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
        got = fn().size(1) - cfg.prompt_len
        if got != n:
            raise RuntimeError(f"{name} generated {got} tokens instead of {n}")
    # that check was the first warm-up (these are the slowest calls of the benchmark)
    rows = Timing(timing.repeats, max(timing.warmup - 1, 0)).run(candidates)
    for row in rows.values():
        row.figures["tokens_per_s"] = n / row.median_s

    # One cached decoding step (forward of one token + argmax) at two positions: the cache is
    # filled once up to the later one, then rewound to the position before every step.
    cache = ours.new_kv_cache(1)
    with torch.inference_mode():
        ours(torch.randint(0, shape.vocab_size, (1, cfg.late_position)), kv_cache=cache)
    token = torch.zeros(1, 1, dtype=torch.long)

    def decode_at(position: int) -> Callable[[], None]:
        @torch.inference_mode()
        def steps():
            for _ in range(cfg.latency_steps):
                for layer_cache in cache:
                    layer_cache.length = position
                ours(token, kv_cache=cache).logits[:, -1].argmax(-1)
        return steps

    early_name = f"tinylm step at position {cfg.early_position}"
    late_name = f"tinylm step at position {cfg.late_position}"
    latency = timing.run({early_name: decode_at(cfg.early_position),
                          late_name: decode_at(cfg.late_position)}, per_call=cfg.latency_steps)
    for row in latency.values():
        row.figures["tokens_per_s"] = 1 / row.median_s
    return Section(
        "generate", [*rows.values(), *latency.values()],
        [Ratio("tokens/s tinylm KV cache / GPT-2 generate",
               rows["GPT-2 generate"].median_s / rows["tinylm KV cache"].median_s, 2.0),
         Ratio(f"latency at position {cfg.late_position} / {cfg.early_position}",
               latency[late_name].median_s / latency[early_name].median_s, 1.5, at_most=True)],
        [f"batch 1, greedy, {cfg.prompt_len}-token random prompt, {n} new tokens (prefill "
         f"included), random weights, block_size={cfg.block_size}, fp32; ours: "
         "tinylm.generate.generate(temperature=0); GPT-2: generate(do_sample=False, "
         "use_cache=True, min_new_tokens=max_new_tokens), sdpa attention",
         f"step rows: median time of one cached step (forward of 1 token + argmax), "
         f"{cfg.latency_steps} steps per timed call"])


def bench_inspect(model_cfg: ModelConfig, cfg: InspectBenchConfig, timing: Timing) -> Section:
    """Eval forward returning every layer's attention weights, against the plain forward."""
    T = cfg.seq_len or model_cfg.block_size
    model = TinyLM(model_cfg).eval()
    idx = torch.randint(0, model_cfg.vocab_size, (cfg.batch_size, T))

    def forward(return_attention: bool) -> Callable[[], None]:
        @torch.inference_mode()
        def run():
            model(idx, return_attention=return_attention)
        return run

    rows = timing.run({"forward": forward(False),
                       "forward + attention weights": forward(True)})
    for row in rows.values():
        row.figures["tokens_per_s"] = cfg.batch_size * T / row.median_s
    plain, inspected = rows["forward"], rows["forward + attention weights"]
    return Section(
        "inspect", [plain, inspected],
        [Ratio("time with weights / without", inspected.median_s / plain.median_s, 1.3,
               at_most=True)],
        [f"B={cfg.batch_size} T={T}, eval, inference_mode, fp32; with weights = "
         "model(idx, return_attention=True): the explicit path in every layer"])


def bench_data(data_cfg: DataConfig, tok_cfg: TokenizerConfig, timing: Timing) -> Section:
    """Tokenizer training and encoding throughput (MB/s of UTF-8 text) on the local corpus."""
    from tinylm.sources import data_root, read_rows, resolve_files
    from tinylm.tokenizer import train_tokenizer

    if data_cfg.source != "local":
        raise ValueError(f"data.source={data_cfg.source!r}: the data section reads local files "
                         "only; use data.source=local")
    root, why = data_root(data_cfg.data_root)
    errors = "replace" if data_cfg.on_decode_error == "replace" else "strict"
    files = resolve_files(root, data_cfg.files, data_cfg.name, why)
    # rows cut as tinylm-prepare cuts them
    texts = [row for path in files for row in read_rows(path, data_cfg.sample_by, errors)]
    text = data_cfg.joiner.join(texts)
    megabytes = len(text.encode("utf-8")) / 1e6
    # no progress bars: they would clutter the tables and be drawn inside the timed calls
    tokenizer = train_tokenizer(tok_cfg, texts, show_progress=False)
    n_tokens = len(tokenizer.encode(text))

    rows = timing.run({
        f"{tok_cfg.name} tokenizer training":
            lambda: train_tokenizer(tok_cfg, texts, show_progress=False),
        "encode_batch (rows, as tinylm-prepare)": lambda: tokenizer.encode_batch(texts),
        "encode (one string)": lambda: tokenizer.encode(text),
    })
    for row in rows.values():
        row.figures["mb_per_s"] = megabytes / row.median_s
        if row.name.startswith("encode"):
            row.figures["tokens_per_s"] = n_tokens / row.median_s
    return Section(
        "data", list(rows.values()), [],
        [f"{megabytes:.2f} MB of text in {len(texts)} {data_cfg.row_unit}s from "
         f"{', '.join(f.name for f in files)}; tokenizer={tok_cfg.name} "
         f"vocab_size={tokenizer.vocab_size}; {n_tokens} tokens "
         f"({len(text) / n_tokens:.2f} characters per token); HF tokenizers picks its own "
         "threads"])


# --------------------------------------------------------------------------------------------
# Running and reporting


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        info["transformers"] = transformers.__version__
    with contextlib.suppress(OSError, AttributeError):
        info["load_average_1m"] = round(os.getloadavg()[0], 2)
    return info


def run_bench(cfg: BenchConfig, print_fn: Callable[[str], None] | None = print) -> dict:
    """Run the chosen sections, printing each table as it finishes; return the report."""
    from tinylm.bench_runs import bench_endtoend, bench_load

    timing = Timing(cfg.repeats, cfg.warmup)
    runners = {
        "attention": lambda: bench_attention(cfg.attention, timing),
        "train": lambda: bench_train(cfg.model, cfg.optim, cfg.train, timing),
        "generate": lambda: bench_generate(cfg.model, cfg.generate, timing),
        "inspect": lambda: bench_inspect(cfg.model, cfg.inspect, timing),
        "data": lambda: bench_data(cfg.data, cfg.tokenizer, timing),
        "load": lambda: bench_load(cfg.model, cfg.optim, cfg.load, timing),
        "endtoend": lambda: bench_endtoend(cfg.endtoend),
    }
    report = {"machine": {**machine(), "threads": cfg.threads}, "config": asdict(cfg),
              "sections": {}}
    load, cpus = report["machine"].get("load_average_1m"), report["machine"]["logical_cpus"]
    if print_fn is not None and load is not None and cpus and load > 0.25 * cpus:
        print_fn(f"note: load average {load} on {cpus} CPUs before the run: other work is "
                 "running, so timings will be noisy; trust the ratios more than absolute times\n")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        for name in SECTIONS if cfg.section == "all" else (cfg.section,):
            torch.manual_seed(cfg.seed)
            start = time.perf_counter()
            section = runners[name]()
            report["sections"][name] = {**section.to_dict(),
                                        "seconds": round(time.perf_counter() - start, 1)}
            if print_fn is not None:
                print_fn(format_section(section))
    finally:
        torch.set_num_threads(threads)
    report["machine"]["load_average_1m_after"] = machine().get("load_average_1m")
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if print_fn is not None:
            print_fn(f"report: {out} ({report['machine']['cpu']}, {cfg.threads} threads)")
    return report


# figure key -> (column title, format)
FIGURES = {"tokens_per_s": ("tokens/s", "{:,.0f}"), "mfu": ("MFU", "{:.1%}"),
           "gflops": ("GFLOP/s", "{:,.1f}"), "mb_per_s": ("MB/s", "{:.2f}"),
           "wall_s": ("wall s", "{:.1f}"), "startup_s": ("start-up s", "{:.2f}"),
           "step_ms": ("ms/step", "{:.1f}"), "val_loss": ("val loss", "{:.4f}"),
           "to_target_s": ("to val s", "{:.1f}")}


def format_section(section: Section) -> str:
    """A plain-text table of one section, then its ratios.

    Figures derive from the median; the min beside it shows how much the load moved the timings.
    """
    keys = [k for k in FIGURES if any(k in r.figures for r in section.rows)]
    table = [["candidate", "median ms", "min ms", *(FIGURES[k][0] for k in keys), "note"]]
    for r in section.rows:
        table.append([r.name, f"{r.median_s * 1e3:,.2f}", f"{min(r.times_s) * 1e3:,.2f}",
                      *(FIGURES[k][1].format(r.figures[k]) if k in r.figures else ""
                        for k in keys), r.note])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [f"== {section.name} =="]
    for line in table:
        cells = [line[0].ljust(widths[0]),
                 *(c.rjust(w) for c, w in zip(line[1:-1], widths[1:-1], strict=True)), line[-1]]
        lines.append("  ".join(cells).rstrip())
    for ratio in section.ratios:
        target = "" if ratio.target is None else (
            f"   target {'<=' if ratio.at_most else '>='} {ratio.target:g}: "
            f"{'met' if ratio.met else 'MISSED'}")
        lines.append(f"  {ratio.name}: {ratio.value:.2f}{target}")
    lines += [f"  note: {note}" for note in section.notes]
    return "\n".join(lines) + "\n"
