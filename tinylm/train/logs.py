"""What a training run shows in TensorBoard: scalars, a sample, attention maps, hyperparameters.
Rank 0 keeps one TrainingLogs per run; a helper process draws its figures (figure_process.py).

    logs = TrainingLogs(train_cfg, tokenizer, block_size, n_head)   # the helper starts
    logs.open(run_dir / "tensorboard", step, run_config)
    logs.train_scalars(step, loss, grad_norm, lr, tokens_per_s, mfu)
    logs.evaluation(model, step, val_loss, perplexity, device)
    logs.close(wait=True)                # waits for the figures still being drawn
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import yaml
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams

from tinylm.generate import encode_prompt, generate
from tinylm.inspection.capture import capture_attention, token_window
from tinylm.inspection.probe import deciding_name_attention, shipped_name_items
from tinylm.inspection.tensorboard_plugin.summary import write_attention
from tinylm.model import TinyLM
from tinylm.train.figure_process import (
    Extras,
    attention_grid_summaries,
    lay_out_attention_grid,
    layer_head_summaries,
)
from tinylm.train.run_config import TrainConfig

log = logging.getLogger("tinylm.train")  # the trainer's: Hydra's log lines name the package


class TrainingLogs:
    """One run's TensorBoard writer and the helper process that draws its figures."""

    def __init__(self, cfg: TrainConfig, tokenizer, block_size: int, n_head: int):
        """Start the figure helper; tokenize the shipped agreement items once (each evaluation
        then costs one forward pass and one small image)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.writer: SummaryWriter | None = None  # open() opens it
        self.extras = Extras()
        self.name_items = shipped_name_items(tokenizer, block_size)
        if cfg.probe_prompt:
            ids = token_window(tokenizer, cfg.probe_prompt, block_size)[0]
            self.extras.start(lay_out_attention_grid, list(tokenizer.token_strings(ids)), n_head)
        elif self.name_items:
            self.extras.start()

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
        """The training scalars, and the figures the helper has finished drawing."""
        self.extras.write_finished(self.writer)
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        w.add_scalar("train/grad_norm", grad_norm, step)
        w.add_scalar("train/tokens_per_sec", tokens_per_s, step)
        w.add_scalar("train/mfu", mfu, step)

    def evaluation(self, model: TinyLM, step: int, val_loss: float, perplexity: float,
                   device: torch.device) -> None:
        """The val scalars, a sample, every layer's attention maps and the deciding-attention
        grid (the figures are handed to the helper)."""
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
        if cfg.probe_prompt:  # every layer's heads on probe_prompt
            capture = capture_attention(model, self.tokenizer, cfg.probe_prompt)
            write_attention(self.writer, "probe_prompt", capture, step)  # "tinylm attention" tab
            self.extras.submit(step, attention_grid_summaries, capture.weights, capture.tokens)
        if self.name_items:
            # each head's attention from the token before the pronoun to the name: the layer x
            # head grid in which the head that carries the name appears
            grid = deciding_name_attention(model, self.name_items)
            self.extras.submit(step, layer_head_summaries, "probe/deciding_attention", grid,
                               f"deciding attention to the name, step {step} "
                               f"({len(self.name_items)} items)", "attention")
        model.train()

    def close(self, wait: bool = True) -> None:
        """Write the figures still being drawn (wait=True) or drop them and say so (wait=False,
        or a Ctrl-C while waiting), then close the files."""
        try:
            dropped = self.extras.close(self.writer, wait)
        except KeyboardInterrupt:
            dropped = self.extras.close(self.writer, wait=False)
        if dropped:
            log.warning(f"dropped the figures of {dropped} evaluation(s) still being drawn")
        if self.writer is not None:
            self.writer.close()
