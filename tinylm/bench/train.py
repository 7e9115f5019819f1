"""The train section: training steps of tinylm and of a GPT-2 of the same shape, in fp32 and (where
the CPU has bf16 instructions) bf16, eager and compiled, with the matmul rates that give their
MFU. `training_step` is also the load section's step.
"""

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
    """One training step of `model` on (x, y) as a function: forward, loss, backward, clipping,
    the optimizer of tinylm.train.optim.configure_optimizer."""
    model.train()
    if isinstance(model, TinyLM):
        cheaper_dropout(model)  # as tinylm-train trains it
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
    operands = [(torch.randn(rows, k).to(dtype), torch.randn(k, n).to(dtype),
                 torch.empty(rows, n, dtype=dtype)) for k, n in shapes]

    def run():
        # into buffers made once: a fresh (rows, V) result would be mapped anew for every call,
        # and its page faults would outweigh the matmul
        for a, b, out in operands:
            torch.mm(a, b, out=out)

    return run, sum(2 * rows * k * n for k, n in shapes)


def bench_train(cfg: BenchConfig) -> Section:
    """Training steps: tokens/s and MFU of ours and of GPT-2 (sdpa, eager), fp32 and bf16,
    eager and (train.compile) compiled; bf16 only where the CPU multiplies it in hardware."""
    model_cfg, optim = cfg.model, cfg.optim
    B, T = cfg.train.batch_size, model_cfg.block_size
    # emulated bf16 runs a matmul ~80x slower than fp32, and train.precision=auto avoids it
    fast_bf16 = has_fast_bf16(torch.device("cpu"))
    precisions = {p: dtype for p, dtype in PRECISION.items() if fast_bf16 or p == "fp32"}
    compiled_precision = "bf16" if fast_bf16 else "fp32"  # the faster one on this CPU
    x = torch.randint(0, model_cfg.vocab_size, (B, T))
    y = torch.randint(0, model_cfg.vocab_size, (B, T))
    ours = TinyLM(replace(model_cfg, dropout=0.0))  # like the GPT-2 peer: no dropout
    models = {"tinylm": ours, "GPT-2 sdpa": gpt2_like(model_cfg, "sdpa"),
              "GPT-2 eager": gpt2_like(model_cfg, "eager")}
    # row name -> (model, precision, compiled)
    variants = {f"{name} {p}": (name, p, False) for name in models for p in precisions}
    candidates: dict[str, Callable[[], object]] = {
        row: training_step(models[name], optim, x, y, p) for row, (name, p, _) in variants.items()}
    notes = [] if fast_bf16 else [
        "bf16 not timed: this CPU has no bf16 instructions (AVX512-BF16 or AMX), so PyTorch "
        "emulates it, far slower than fp32; train.precision=auto trains in fp32 here"]
    if cfg.train.compile:  # in the faster precision only: each compile takes ~25 s
        compiled = {f"{name} {compiled_precision} compiled": (name, compiled_precision, True)
                    for name in models}
        try:
            candidates.update({row: training_step(models[name], optim, x, y, p, compiled=True)
                               for row, (name, p, _) in compiled.items()})
            variants.update(compiled)
        except Exception as err:  # e.g. no C++ compiler for inductor: compare eager only
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            notes.append(f"torch.compile failed ({type(err).__name__}: {first_line}), so no "
                         "model is timed compiled; train.compile=false skips the attempt")
    # The matmul rates are timed in the same rounds, so they see the same load as the models:
    # a large square (the machine's peak) and the model's own shapes (what it can reach).
    n = cfg.train.peak_size
    shapes_name = f"matmuls of the model's shapes, {B * T} rows"
    for p, dtype in precisions.items():
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        candidates[f"matmul {n}x{n} {p}"] = lambda a=a, b=b: a @ b
        candidates[f"{shapes_name} {p}"], shape_flops = model_matmuls(model_cfg, B * T, dtype)
    rows = time_turns(candidates, cfg.repeats, cfg.warmup)

    peaks = {p: 2 * n**3 / rows[f"matmul {n}x{n} {p}"].median_s for p in precisions}
    shape_rates = {p: shape_flops / rows[f"{shapes_name} {p}"].median_s for p in precisions}
    for p in precisions:
        rows[f"matmul {n}x{n} {p}"].figures["gflops"] = peaks[p] / 1e9
        rows[f"{shapes_name} {p}"].figures["gflops"] = shape_rates[p] / 1e9
    # Both models do the same useful work per token (GPT-2's biases add < 0.1%), so MFU counts
    # tinylm's FLOPs for both: 6 per parameter plus attention's q·kᵀ and weights·v.
    flops = flops_per_token(ours, T)
    for row_name, (_, p, _) in variants.items():
        row = rows[row_name]
        row.figures["tokens_per_s"] = B * T / row.median_s
        row.figures["mfu"] = flops * row.figures["tokens_per_s"] / peaks[p]

    def best(prefix: str, compiled: bool | None = None) -> Row:
        """The fastest row of a model; compiled=True/False: only compiled/eager rows."""
        return min((rows[row] for row, (name, _, c) in variants.items()
                    if name.startswith(prefix) and compiled in (None, c)),
                   key=lambda r: r.median_s)

    def speed_ratio(ours_row: Row, gpt2_row: Row, which: str = "",
                    target: float | None = None) -> Ratio:
        return Ratio(f"tokens/s {ours_row.name} / {gpt2_row.name}{which}",
                     gpt2_row.median_s / ours_row.median_s, target)

    ours_best, gpt2_best = best("tinylm"), best("GPT-2")
    ours_best.note = gpt2_best.note = "best setting"
    # the one target: each model in its fastest precision and attention, uncompiled, side by
    # side in this run; compiled against compiled is a figure only
    ratios = [speed_ratio(best("tinylm", False), best("GPT-2", False), target=1.25)]
    if any(c for _, _, c in variants.values()):
        ratios.append(speed_ratio(best("tinylm", True), best("GPT-2", True), " (both compiled)"))
    gpt2_fp32 = min(rows["GPT-2 sdpa fp32"], rows["GPT-2 eager fp32"], key=lambda r: r.median_s)
    best_p = variants[ours_best.name][1]
    ratios += [
        speed_ratio(rows["tinylm fp32"], gpt2_fp32, " (both in fp32)"),
        Ratio(f"MFU of {ours_best.name} (of the {best_p} {n}x{n} matmul rate)",
              ours_best.figures["mfu"]),
        Ratio(f"MFU of {ours_best.name} (of the {best_p} rate of the model's own matmul "
              "shapes)", ours_best.figures["mfu"] * peaks[best_p] / shape_rates[best_p])]
    return Section(
        "train", list(rows.values()), ratios,
        [f"B={B} T={T} n_layer={model_cfg.n_layer} n_head={model_cfg.n_head} "
         f"n_embd={model_cfg.n_embd} vocab={model_cfg.vocab_size}, random tokens; a step is "
         "forward, loss, backward, clip_grad_norm_, AdamW step from tinylm.train.optim."
         f"configure_optimizer (optim: lr={optim.lr}, weight_decay={optim.weight_decay}, "
         f"grad_clip={optim.grad_clip}) for every model; bf16 = torch.autocast(bf16); "
         "compiled = torch.compile(model), default mode, compiled before any timing",
         f"MFU = {flops / 1e6:.2f}M FLOPs per token x tokens/s / the median "
         f"{n}x{n} matmul rate of the same precision, timed in the same rounds",
         f"the model's shapes: (B*T={B * T}, C) x (C, n) for n in 3C, C, 4C, V, and "
         f"(B*T, 4C) x (4C, C), forward, C={model_cfg.n_embd}",
         "GPT-2 as transformers builds it: biases in every layer, tanh-approximated GELU, "
         "Conv1D layers; its attention implementation is sdpa or eager as named",
         *notes])
