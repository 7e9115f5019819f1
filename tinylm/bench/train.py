"""The train section: training steps of tinylm and of a GPT-2 of the same shape, in fp32 and bf16
(where the CPU has bf16 instructions), eager and compiled, with the matmul rates for their MFU.
`training_step` is also the load section's step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from tinylm.bench.config import BenchConfig
from tinylm.bench.sections import Ratio, Row, Section, gpt2_like, time_turns
from tinylm.device import has_fast_bf16
from tinylm.fast import cheaper_dropout
from tinylm.model import ModelConfig, TinyLM
from tinylm.train.optim import OptimConfig, configure_optimizer
from tinylm.train.runtime import flops_per_token

PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


def training_step(model: nn.Module, optim: OptimConfig, x: torch.Tensor, y: torch.Tensor,
                  precision: str, compiled: bool = False) -> Callable[[], None]:
    """One training step of `model` on (x, y) as tinylm-train takes it, as a function."""
    model.train()
    if isinstance(model, TinyLM):
        cheaper_dropout(model)
    optimizer = configure_optimizer(model, optim)
    forward = torch.compile(model) if compiled else model
    dtype = PRECISION[precision]

    def step():
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            if isinstance(model, TinyLM):
                loss = forward(x, y, need_logits=False).loss
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
    """(a call, its FLOPs) doing the forward matmuls of one block and the LM head at `rows`
    tokens: the rate this model's own shapes allow, which small matrices keep below a square's."""
    C, V = model_cfg.n_embd, model_cfg.vocab_size
    shapes = [(C, 3 * C), (C, C), (C, 4 * C), (4 * C, C), (C, V)]
    # into buffers made once: a fresh (rows, V) result's page faults would outweigh the matmul
    operands = [(torch.randn(rows, k).to(dtype), torch.randn(k, n).to(dtype),
                 torch.empty(rows, n, dtype=dtype)) for k, n in shapes]

    def run():
        for a, b, out in operands:
            torch.mm(a, b, out=out)

    return run, sum(2 * rows * k * n for k, n in shapes)


def bench_train(cfg: BenchConfig) -> Section:
    """Tokens/s and MFU of ours and of GPT-2 (sdpa, eager), fp32 and bf16, eager and compiled."""
    model_cfg, optim = cfg.model, cfg.optim
    B, T, n = cfg.train.batch_size, model_cfg.block_size, cfg.train.peak_size
    # emulated bf16 runs a matmul ~80x slower than fp32, and train.precision=auto avoids it
    fast_bf16 = has_fast_bf16(torch.device("cpu"))
    precisions = {p: dtype for p, dtype in PRECISION.items() if fast_bf16 or p == "fp32"}
    x, y = (torch.randint(0, model_cfg.vocab_size, (B, T)) for _ in range(2))
    ours = TinyLM(replace(model_cfg, dropout=0.0))  # like the GPT-2 peer: no dropout
    models = {"tinylm": ours, "GPT-2 sdpa": gpt2_like(model_cfg, "sdpa"),
              "GPT-2 eager": gpt2_like(model_cfg, "eager")}
    # row name -> (model, precision, compiled)
    variants = {f"{name} {p}": (name, p, False) for name in models for p in precisions}
    candidates = {row: training_step(models[name], optim, x, y, p)
                  for row, (name, p, _) in variants.items()}
    notes = [] if fast_bf16 else [
        "bf16 not timed: this CPU has no bf16 instructions (AVX512-BF16 or AMX), so PyTorch "
        "emulates it, far slower than fp32; train.precision=auto trains in fp32 here"]
    if cfg.train.compile:  # in the faster precision only: each compile takes ~25 s
        p = "bf16" if fast_bf16 else "fp32"
        compiled = {f"{name} {p} compiled": (name, p, True) for name in models}
        try:
            candidates |= {row: training_step(models[name], optim, x, y, p, compiled=True)
                           for row, (name, p, _) in compiled.items()}
            variants |= compiled
        except Exception as err:  # e.g. no C++ compiler for inductor: compare eager only
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            notes.append(f"torch.compile failed ({type(err).__name__}: {first_line}), so no "
                         "model is timed compiled; train.compile=false skips the attempt")
    # the matmul rates, timed in the same rounds as the models: a large square (the machine's
    # peak) and the model's own shapes (what it can reach)
    square, shapes = f"matmul {n}x{n}", f"matmuls of the model's shapes, {B * T} rows"
    for p, dtype in precisions.items():
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        candidates[f"{square} {p}"] = lambda a=a, b=b: a @ b
        candidates[f"{shapes} {p}"], shape_flops = model_matmuls(model_cfg, B * T, dtype)
    rows = time_turns(candidates, cfg.repeats, cfg.warmup)

    peaks = {p: 2 * n**3 / rows[f"{square} {p}"].median_s for p in precisions}
    shape_rates = {p: shape_flops / rows[f"{shapes} {p}"].median_s for p in precisions}
    for p in precisions:
        rows[f"{square} {p}"].figures["gflops"] = peaks[p] / 1e9
        rows[f"{shapes} {p}"].figures["gflops"] = shape_rates[p] / 1e9
    # GPT-2's biases add < 0.1% to the work per token: MFU counts tinylm's FLOPs for both
    flops = flops_per_token(ours, T)
    for row_name, (_, p, _) in variants.items():
        row = rows[row_name]
        row.figures["tokens_per_s"] = B * T / row.median_s
        row.figures["mfu"] = flops * row.figures["tokens_per_s"] / peaks[p]

    def best(prefix: str, compiled: bool | None = None) -> Row:
        return min((rows[row] for row, (name, _, c) in variants.items()
                    if name.startswith(prefix) and compiled in (None, c)),
                   key=lambda r: r.median_s)

    def speed(ours_row: Row, gpt2_row: Row, which: str = "", target: float | None = None):
        return Ratio(f"tokens/s {ours_row.name} / {gpt2_row.name}{which}",
                     gpt2_row.median_s / ours_row.median_s, target)

    ours_best, gpt2_best = best("tinylm"), best("GPT-2")
    ours_best.note = gpt2_best.note = "best setting"
    # the one target: each model in its fastest setting, uncompiled; compiled is a figure only
    ratios = [speed(best("tinylm", False), best("GPT-2", False), target=1.25)]
    if any(c for _, _, c in variants.values()):
        ratios.append(speed(best("tinylm", True), best("GPT-2", True), " (both compiled)"))
    best_p = variants[ours_best.name][1]
    ratios += [
        speed(rows["tinylm fp32"], min(rows["GPT-2 sdpa fp32"], rows["GPT-2 eager fp32"],
                                       key=lambda r: r.median_s), " (both in fp32)"),
        Ratio(f"MFU of {ours_best.name} (of the {best_p} {n}x{n} matmul rate)",
              ours_best.figures["mfu"]),
        Ratio(f"MFU of {ours_best.name} (of the {best_p} rate of the model's own matmul "
              "shapes)", ours_best.figures["mfu"] * peaks[best_p] / shape_rates[best_p])]
    return Section("train", list(rows.values()), ratios, [
        f"B={B} T={T} n_layer={model_cfg.n_layer} n_head={model_cfg.n_head} "
        f"n_embd={model_cfg.n_embd} vocab={model_cfg.vocab_size}, random tokens; a step: "
        "forward, loss, backward, clip_grad_norm_, AdamW from tinylm.train.optim (optim: "
        f"lr={optim.lr}, weight_decay={optim.weight_decay}, grad_clip={optim.grad_clip}); "
        "bf16: torch.autocast; compiled: torch.compile(model), compiled before any timing",
        f"MFU = {flops / 1e6:.2f}M FLOPs per token x tokens/s / the {n}x{n} matmul rate of "
        "the same precision; the model's shapes: (B*T, C) x (C, n) for n in 3C, C, 4C, V, "
        "and (B*T, 4C) x (4C, C)",
        "GPT-2 as transformers builds it: biases, tanh GELU, Conv1D layers", *notes])
