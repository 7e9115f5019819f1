"""Training: the loop that steps, evaluates, logs to TensorBoard (scalars, a sample, the attention
tab's data, hyperparameters) and checkpoints a run.

    metrics = train(RunConfig(run_dir="runs/mine", train=TrainConfig(max_steps=100)))

Under torchrun every process runs the same loop. On CPU a run stopped and resumed reaches bit for
bit the weights and losses of the same run uninterrupted (resume.py saves everything random).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tinylm.checkpoint import (
    CHECKPOINTS_DIR,
    TOKENIZER_FILE,
    NonFiniteWeights,
    resolve_checkpoint_dir,
    run_dir_lock,
    save_checkpoint,
    tagged_checkpoint,
)
from tinylm.config import ConfigError, bad
from tinylm.data import BatchSampler, check_enough_tokens, prepare_data
from tinylm.device import ThreadChoice, apply_threads, resolve_device, start_sample
from tinylm.fast import cheaper_dropout
from tinylm.generate import encode_prompt, generate
from tinylm.inspection.capture import capture_attention
from tinylm.inspection.tensorboard_plugin.summary import write_attention
from tinylm.model import TinyLM
from tinylm.train.optim import configure_optimizer, set_lr
from tinylm.train.resume import (
    checkpoint_to_resume,
    rank_state,
    restore,
    restore_rank,
    trainer_state,
)
from tinylm.train.run_config import RunConfig, TrainConfig
from tinylm.train.runtime import (
    STOP,
    StopSignals,
    TrainingInterrupted,
    all_reduce,
    check_fits_in_memory,
    flops_per_token,
    gather,
    init_distributed,
    matmul_peak_flops,
    mixed_precision,
)

log = logging.getLogger("tinylm.train")  # what Hydra's log lines name: the package, not this file

TENSORBOARD_DIR = "tensorboard"


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN or infinite; the last good checkpoint is kept."""


def train(cfg: RunConfig, on_start: Callable[[], None] | None = None) -> dict:
    """Train a model as `cfg` says; returns the final metrics and where things were written.

    `on_start` is called on rank 0 before the run's first write into its directory, once nothing
    can refuse the run any more. Raises ConfigError (before any work), RunDirInUse,
    TrainingInterrupted (after a checkpoint), TrainingDiverged, CheckpointNotWritten.
    """
    rank, _, _ = init_distributed()
    check_fits_in_memory(cfg.model, cfg.model.vocab_size or cfg.tokenizer.vocab_size or 1,
                         cfg.train.batch_size, resolve_device(cfg.train.device))
    threads = torch.get_num_threads()
    try:
        # rank 0 writes the run directory; the lock keeps a second run from writing it too
        with run_dir_lock(cfg.run_dir) if rank == 0 else contextlib.nullcontext():
            return Trainer(cfg, on_start).run()
    except Exception as err:  # torch.compile builds its kernels in the first step
        found = cfg.train.compile and re.search(r"No working C\+\+ compiler[^\n]*", str(err))
        if not found:
            raise
        raise ValueError(
            f"train.compile=true: torch.compile builds CPU kernels with a C++ compiler and found "
            f"none ({found.group(0)}); install one (g++ or clang++; on Windows, Visual Studio's "
            "Build Tools) or name it in the CXX environment variable, or train with "
            "train.compile=false") from None
    finally:
        torch.set_num_threads(threads)


class Trainer:
    """One run's model, optimizer, sampler and logs, and the steps that move them. Under torchrun
    every rank builds one and steps in lockstep; only rank 0 writes logs and checkpoints."""

    def __init__(self, cfg: RunConfig, on_start: Callable[[], None] | None = None):
        cpu_sample = start_sample()  # threads=auto: how busy the cores are during start-up
        t = self.t = cfg.train
        self.cfg, self.run_dir = cfg, Path(cfg.run_dir)
        self.rank, local_rank, self.world_size = init_distributed()
        self.is_main = self.rank == 0
        self.info = log.info if self.is_main else log.debug
        device = resolve_device(t.device)
        if device.type == "cuda" and self.world_size > 1:
            device = torch.device("cuda", local_rank)
        self.device = device
        self.dtype, self.autocast, self.scaler = mixed_precision(t.precision, device)
        resume_from = checkpoint_to_resume(self.run_dir, t.resume)

        # data: rank 0 prepares it (or finds the cache), then the others read the same cache
        for turn in (True, False):
            if self.is_main == turn:
                prepared = prepare_data(cfg.data, cfg.tokenizer, log=self.info)
            if self.world_size > 1:
                dist.barrier()
        self.tokenizer = prepared.tokenizer
        model_cfg = cfg.model
        if model_cfg.vocab_size is None:
            model_cfg = dataclasses.replace(model_cfg, vocab_size=self.tokenizer.vocab_size)
        elif model_cfg.vocab_size < self.tokenizer.vocab_size:
            raise bad("model.vocab_size", model_cfg.vocab_size, f"the tokenizer has "
                      f"{self.tokenizer.vocab_size} ids; use null or a larger value")
        try:
            check_enough_tokens(prepared, model_cfg.block_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.run_config = dataclasses.replace(cfg, model=model_cfg)
        self.sampler = BatchSampler(prepared.train_path, model_cfg.block_size, t.batch_size,
                                    t.seed, self.rank, self.world_size)
        self.val_ids = np.memmap(prepared.val_path, dtype=prepared.meta["dtype"], mode="r")
        self.tokens_per_step = (t.batch_size * model_cfg.block_size * t.grad_accum_steps
                                * self.world_size)

        # the model and its optimizer, and on resume their saved states
        self.threads = apply_threads(t.threads, cpu_sample)
        self.cpu_sample = start_sample()  # threads=auto: re-chosen at each evaluation from here
        torch.manual_seed(t.seed)
        self.model = TinyLM(model_cfg).to(device)  # the plain module: saved, sampled, probed
        cheaper_dropout(self.model)  # training's faster paths: this and need_logits=False below
        self.writer: SummaryWriter | None = None  # rank 0's TensorBoard event files
        try:
            self.optimizer = configure_optimizer(self.model, cfg.optim)
            self.step, self.best_val, self.tokens_seen = 0, math.inf, 0
            if resume_from is not None:
                self._resume(resume_from, prepared.directory / TOKENIZER_FILE)
            if self.is_main:  # nothing can refuse the run any more: its first writes
                if on_start is not None:
                    on_start()
                self.open_logs()
        except BaseException:  # e.g. a write the disk refused: the event files close
            self.close_logs()
            raise

        # what the steps run: compiled and/or wrapped for DDP, sharing the plain module's weights
        self.forward = torch.compile(self.model) if t.compile else self.model
        if self.world_size > 1:
            self.forward = nn.parallel.DistributedDataParallel(
                self.forward, device_ids=[device.index] if device.type == "cuda" else None)

        if self.is_main:
            # MFU: the FLOPs the model does per token against what the matmuls could do
            self.peak_flops = matmul_peak_flops(device, self.dtype) * self.world_size
            self.info(f"Model: {self.model.num_params() / 1e6:.2f}M parameters "
                      f"({model_cfg.n_layer} layers, {model_cfg.n_head} heads, n_embd "
                      f"{model_cfg.n_embd}, block_size {model_cfg.block_size}, vocab "
                      f"{model_cfg.vocab_size}); {str(self.dtype)[6:]} on {device}"
                      f"{f' x {self.world_size} processes' if self.world_size > 1 else ''}"
                      f"{self.threads.suffix_on(device)}; "
                      f"{self.tokens_per_step:,} tokens per step; run dir {self.run_dir}")

    # ------------------------------------------------------------------------------ the loop

    def run(self) -> dict:
        """Train to max_steps, evaluating, logging and checkpointing; returns the final metrics."""
        t = self.t
        start_step, start_time = self.step, time.perf_counter()
        train_loss, val_loss, losses = math.nan, None, []
        step_seconds = 0.0  # tokens/s counts the training steps, not evaluations or checkpoints
        try:  # the bar is made inside: one a signal left unclosed would print itself at exit
            with STOP.deferring(abort_on_second=self.world_size == 1) as stop, \
                    logging_redirect_tqdm(), \
                    tqdm(total=t.max_steps, initial=self.step, desc="train", unit="step",
                         disable=not self.is_main, dynamic_ncols=True) as bar:
                while self.step < t.max_steps:
                    started = time.perf_counter()
                    train_loss, grad_norm, lr, stopping = self.train_step(stop)
                    step_seconds += time.perf_counter() - started
                    losses.append(train_loss)
                    bar.update(1)
                    step, done = self.step, self.step == t.max_steps

                    if step % t.log_interval == 0 or done:
                        self.log_training(losses, grad_norm, lr, step_seconds, bar)
                        losses, step_seconds = [], 0.0
                    improved = False
                    if step % t.eval_interval == 0 or done:
                        val_loss = self.evaluate()
                        improved = val_loss < self.best_val  # the same on every rank
                        self.best_val = min(self.best_val, val_loss)
                        self.recheck_threads()
                    if improved or done or stopping or (
                            t.checkpoint_interval and step % t.checkpoint_interval == 0):
                        self.save(("last", "best") if improved else ("last",))
                    if stopping and not done:
                        # another rank may have been the one signalled
                        raise TrainingInterrupted(stop.signum or signal.SIGTERM,
                                                  self.last_checkpoint(), step)
        finally:
            self.close_logs()

        seconds = time.perf_counter() - start_time
        trained = self.step - start_step
        metrics = {
            "step": self.step, "train_loss": train_loss, "val_loss": val_loss,
            "val_perplexity": math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
            "best_val_loss": self.best_val, "seconds": seconds,
            "tokens_per_sec": trained * self.tokens_per_step / seconds if trained else None,
            "run_dir": str(self.run_dir), "log_dir": str(self.run_dir / TENSORBOARD_DIR)}
        if self.is_main:
            metrics["checkpoint"] = str(resolve_checkpoint_dir(self.run_dir, "last"))
            metrics["best_checkpoint"] = str(resolve_checkpoint_dir(self.run_dir, "best"))
        return metrics

    def train_step(self, stop: StopSignals) -> tuple[float, float, float, bool]:
        """One optimizer step -> (mean loss, gradient norm, lr, whether any rank must stop)."""
        t = self.t
        lr = set_lr(self.optimizer, self.step, self.cfg.optim, t.max_steps)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(t.grad_accum_steps):
            x, y = self.sampler.next_batch(self.device)  # (B, T) each
            # DDP all-reduces the gradients once, after the last micro-batch
            last_micro = micro == t.grad_accum_steps - 1
            sync = contextlib.nullcontext() if self.world_size == 1 or last_micro \
                else self.forward.no_sync()
            with sync:
                with self.autocast:
                    loss = self.forward(x, y, need_logits=False).loss / t.grad_accum_steps
                self.scaler.scale(loss).backward()
            loss_sum += loss.detach()
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(),
                                             self.cfg.optim.grad_clip or math.inf).item()
        # one small collective per step: the mean loss, and whether some rank must stop
        loss, stopping = all_reduce([loss_sum.item(), float(stop.signum is not None)],
                                    self.world_size)
        loss /= self.world_size
        fp16_overflow = self.scaler.is_enabled()  # the scaler skips such steps by itself
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or fp16_overflow):
            raise self._diverged(f"at step {self.step + 1}: " + (
                f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return loss, grad_norm, lr, bool(stopping)

    # ------------------------------------------------------- logging, evaluation, checkpoints

    def log_training(self, losses: list[float], grad_norm: float, lr: float, seconds: float,
                     bar: tqdm) -> None:
        """On rank 0: the mean loss of the steps since the last log, and their speed."""
        if not self.is_main:
            return
        mean_loss = sum(losses) / len(losses)
        tokens_per_s = len(losses) * self.tokens_per_step / seconds
        bar.set_postfix(loss=f"{mean_loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        mfu = flops_per_token(self.model) * tokens_per_s / self.peak_flops
        for name, value in (("loss", mean_loss), ("lr", lr), ("grad_norm", grad_norm),
                            ("tokens_per_sec", tokens_per_s), ("mfu", mfu)):
            self.writer.add_scalar(f"train/{name}", value, self.step)

    def evaluate(self) -> float:
        """Validation loss (all ranks); on rank 0 its scalars, a sample, and every head's
        attention on the probe prompt (the "tinylm attention" tab's)."""
        t, model, step = self.t, self.model, self.step
        val_loss = validation_loss(self.forward.module if self.world_size > 1 else self.forward,
                                   self.val_ids, t, model.config.block_size, self.device,
                                   self.autocast, self.rank, self.world_size)  # no DDP sync
        if not self.is_main:
            return val_loss
        perplexity = math.exp(min(val_loss, 50.0))
        # said as soon as it is known, before the sample and the probe prompt's forward passes
        self.info(f"step {step}: val loss {val_loss:.4f}, perplexity {perplexity:.2f}"
                  f"{' (best)' if val_loss < self.best_val else ''}")
        self.writer.add_scalar("val/loss", val_loss, step)
        self.writer.add_scalar("val/perplexity", perplexity, step)
        model.eval()
        if t.sample_tokens:
            ids, _ = encode_prompt(self.tokenizer, t.sample_prompt, model.config.block_size)
            generator = torch.Generator(device=self.device).manual_seed(t.seed)  # same each time
            out = generate(model, torch.tensor([ids], device=self.device), t.sample_tokens,
                           temperature=0.8, top_k=50, generator=generator,
                           stop_id=self.tokenizer.eot_id)
            text = self.tokenizer.decode(out[0].tolist())
            self.writer.add_text("samples/text", "```\n" + text + "\n```", step)
        if t.probe_prompt:
            capture = capture_attention(model, self.tokenizer, t.probe_prompt)
            write_attention(self.writer, "probe_prompt", capture, step)
        model.train()
        return val_loss

    def recheck_threads(self) -> None:
        """threads=auto: take this process's share of the cores again, as other programs left
        them since the last look (a program busy at the start may be gone, or one have come)."""
        if self.t.threads != "auto" or self.device.type != "cpu":
            return
        before, self.threads = self.threads.threads, apply_threads("auto", self.cpu_sample)
        self.cpu_sample = start_sample()
        if self.threads.threads != before:
            self.info(f"step {self.step}: threads {before} -> {self.threads.describe()}")

    def save(self, tags: tuple[str, ...]) -> None:
        """Checkpoint the current step (every rank takes part: each hands over its RNG/sampler)."""
        ranks = gather(rank_state(self.sampler, self.device, self.threads.threads),
                       self.world_size)
        if not self.is_main:
            return
        state = trainer_state(self.step, self.best_val, self.tokens_seen, self.optimizer,
                              self.scaler, ranks)
        try:
            save_checkpoint(self.run_dir, self.model, self.tokenizer,
                            self.run_config.to_dict(), self.step, state, tags)
        except NonFiniteWeights as err:
            raise self._diverged(f"by step {self.step}: {err}") from None

    def _resume(self, directory: Path, tokenizer_file: Path) -> None:
        state = restore(directory, self.run_config.to_dict(), tokenizer_file, self.model,
                        self.optimizer, self.scaler, log.warning if self.is_main else log.debug)
        self.step, self.best_val = state["step"], state["best_val_loss"]
        if self.step >= self.t.max_steps:  # no step would run, and so no checkpoint be written
            raise ConfigError(f"cannot resume from {directory}: it is at step {self.step}, and "
                              f"train.max_steps={self.t.max_steps} leaves nothing to train; "
                              f"raise train.max_steps")
        self.tokens_seen = state["tokens_seen"]
        if state["world_size"] == self.world_size:
            # the run's count, so that its steps compute as they did; None: an older state
            saved = int(state["threads"][self.rank]) if state.get("threads") else None
            if saved is not None and self.t.threads == "auto":
                torch.set_num_threads(saved)
                self.threads = ThreadChoice(saved, "resumed run's count")
            elif saved is not None and saved != self.threads.threads:
                log.warning(f"resuming with train.threads={self.threads.threads}, the checkpoint "
                            f"was trained with {saved}: the losses and weights may then differ "
                            "in the last digits from those of an uninterrupted run")
            restore_rank(state, self.rank, self.sampler, self.device)
        else:  # another data order than an uninterrupted run, but not a replay of the first one
            log.warning(f"resuming with {self.world_size} processes instead of "
                        f"{state['world_size']}: batches continue from a fresh random stream")
            t = self.t
            self.sampler = BatchSampler(self.sampler.path, self.model.config.block_size,
                                        t.batch_size, t.seed + self.step, self.rank,
                                        self.world_size)
        self.info(f"Resuming from {directory} at step {self.step}")

    def _diverged(self, when: str) -> TrainingDiverged:
        kept = self.last_checkpoint()
        kept = f"the last good checkpoint is {kept}" if kept else "no checkpoint was saved yet"
        return TrainingDiverged(f"training diverged {when}; {kept}; try a lower optim.lr (now "
                                f"{self.cfg.optim.lr}) or train.precision=fp32")

    def last_checkpoint(self) -> Path | None:
        """The checkpoint tagged last (on rank 0; None elsewhere or before the first)."""
        return tagged_checkpoint(self.run_dir / CHECKPOINTS_DIR, "last") if self.is_main else None

    def open_logs(self) -> None:
        """Rank 0's event files; a fresh run writes its hyperparameters (the HPARAMS tab, with the
        val scalars as its metrics) and its config."""
        # purge_step hides what an earlier attempt logged after this checkpoint's step
        self.writer = SummaryWriter(str(self.run_dir / TENSORBOARD_DIR),
                                    purge_step=self.step + 1 if self.step else None)
        if self.step:
            return
        run_config = self.run_config.to_dict()
        flat = {f"{group}.{key}": value if isinstance(value, int | float | str | bool)
                else str(value) for group, values in run_config.items()
                for key, value in values.items()}
        for summary in hparams(flat, {"val/loss": 0.0, "val/perplexity": 0.0}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config",
                             "```\n" + yaml.safe_dump(run_config, sort_keys=False) + "```")

    def close_logs(self) -> None:
        """Close rank 0's event files, once."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


@torch.no_grad()
def validation_loss(model: nn.Module, val_ids: np.ndarray, cfg: TrainConfig, block_size: int,
                    device: torch.device, autocast=None, rank: int = 0,
                    world_size: int = 1) -> float:
    """Mean loss over cfg.eval_batches batches of windows spread evenly over the val split:
    the same windows at every evaluation and in every run, and a closer estimate of the whole
    split's loss than random ones for the same cost."""
    n = cfg.eval_batches * cfg.batch_size * world_size
    starts = np.linspace(0, len(val_ids) - block_size - 1, n).round().astype(np.int64)
    autocast = autocast or contextlib.nullcontext()
    model.eval()
    total = 0.0
    for batch in np.array_split(starts[rank::world_size], cfg.eval_batches):  # (B,) each
        windows = torch.from_numpy(val_ids[batch[:, None] + np.arange(block_size + 1)]
                                   .astype(np.int64)).to(device)  # (B, T + 1)
        with autocast:
            total += model(windows[:, :-1], windows[:, 1:], need_logits=False).loss.item()
    model.train()
    return all_reduce([total / cfg.eval_batches], world_size)[0] / world_size
