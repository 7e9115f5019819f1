"""What a training run shows in TensorBoard: scalars, a sample, the attention tab's data,
hyperparameters. Rank 0 keeps one TrainingLogs per run.

    logs = TrainingLogs(train_cfg, tokenizer)
    logs.open(run_dir / "tensorboard", step, run_config)
    logs.train_scalars(step, loss, grad_norm, lr, tokens_per_s, mfu)
    logs.evaluation(model, step, val_loss, perplexity, device)
    logs.close()
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from tinylm.generate import encode_prompt, generate
from tinylm.inspection.capture import capture_attention
from tinylm.inspection.tensorboard_plugin.summary import write_attention
from tinylm.model import TinyLM
from tinylm.train.run_config import TrainConfig


class TrainingLogs:
    """One run's TensorBoard writer."""

    def __init__(self, cfg: TrainConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.writer: SummaryWriter | None = None  # open() opens it

    def open(self, log_dir: Path, step: int, run_config: dict) -> None:
        """Open the event files of a run starting at `step`; a fresh run writes its
        hyperparameters (TensorBoard's HPARAMS tab, with the val scalars as its metrics)."""
        # purge_step hides what an earlier attempt logged after this checkpoint's step
        self.writer = SummaryWriter(str(log_dir), purge_step=step + 1 if step else None)
        if step:
            return
        flat = {f"{group}.{key}": value if isinstance(value, int | float | str | bool)
                else str(value) for group, values in run_config.items()
                for key, value in values.items()}
        for summary in hparams(flat, {"val/loss": 0.0, "val/perplexity": 0.0}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config",
                             "```\n" + yaml.safe_dump(run_config, sort_keys=False) + "```")

    def train_scalars(self, step: int, loss: float, grad_norm: float, lr: float,
                      tokens_per_s: float, mfu: float) -> None:
        """The training scalars."""
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        w.add_scalar("train/grad_norm", grad_norm, step)
        w.add_scalar("train/tokens_per_sec", tokens_per_s, step)
        w.add_scalar("train/mfu", mfu, step)

    def evaluation(self, model: TinyLM, step: int, val_loss: float, perplexity: float,
                   device: torch.device) -> None:
        """The val scalars, a sample, and every head's attention on the probe prompt (the tab's)."""
        self.writer.add_scalar("val/loss", val_loss, step)
        self.writer.add_scalar("val/perplexity", perplexity, step)
        model.eval()
        cfg = self.cfg
        if cfg.sample_tokens:
            ids, _ = encode_prompt(self.tokenizer, cfg.sample_prompt, model.config.block_size)
            generator = torch.Generator(device=device).manual_seed(cfg.seed)  # the same each time
            out = generate(model, torch.tensor([ids], device=device), cfg.sample_tokens,
                           temperature=0.8, top_k=50, generator=generator,
                           stop_id=self.tokenizer.eot_id)
            text = self.tokenizer.decode(out[0].tolist())
            self.writer.add_text("samples/text", "```\n" + text + "\n```", step)
        if cfg.probe_prompt:  # the "tinylm attention" tab shows every layer's heads on it
            capture = capture_attention(model, self.tokenizer, cfg.probe_prompt)
            write_attention(self.writer, "probe_prompt", capture, step)
        model.train()

    def close(self) -> None:
        """Close the event files (once opened)."""
        if self.writer is not None:
            self.writer.close()
