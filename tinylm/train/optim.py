"""The optimizer and its schedule: AdamW (or Muon for the blocks' matrices, muon.py) with
weight decay on Linear matrices only, a linear warmup and a cosine decay to min_lr."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tinylm.config import at_least, bad, check, choice, within
from tinylm.train.muon import MuonWithAdamW, ShapeBatchedMuon

OPTIMIZERS = ("adamw", "muon")


@dataclass
class OptimConfig:
    """The optimizer and its schedule: conf/optim/*.yaml's schema and defaults."""

    # adamw | muon (Muon for the blocks' matrices, AdamW for the rest); tinylm-train's
    # conf/config.yaml picks muon, tinylm-bench's conf/bench.yaml adamw (for GPT-2 as for ours)
    name: str = "adamw"
    lr: float = 2e-3  # peak learning rate, reached after warmup_steps
    min_lr: float = 1e-4  # where the cosine ends
    warmup_steps: int = 100
    lr_decay_steps: int | None = None  # None: train.max_steps
    weight_decay: float = 0.1  # on Linear matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    muon_lr: float = 0.02  # optim=muon: peak learning rate of the matrices (scheduled like lr)
    muon_momentum: float = 0.95  # optim=muon: momentum of the matrices' updates (Nesterov)

    def __post_init__(self):
        non_negative, fraction = within(low=0), within(0, 1, high_open=True)
        check(self, "optim", name=choice(*OPTIMIZERS), lr=non_negative, min_lr=non_negative,
              warmup_steps=at_least(0), lr_decay_steps=at_least(1, null="for train.max_steps"),
              weight_decay=non_negative, beta1=fraction, beta2=fraction, grad_clip=non_negative,
              muon_lr=non_negative, muon_momentum=fraction)
        if self.min_lr > self.lr:
            raise bad("optim.min_lr", self.min_lr, f"must be <= optim.lr={self.lr}")


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr."""
    decay_steps = optim.lr_decay_steps or max_steps
    if step < optim.warmup_steps:
        # (step + 1) so that the very first step already moves the weights
        return optim.lr * (step + 1) / (optim.warmup_steps + 1)
    if step >= decay_steps:
        return optim.min_lr
    progress = (step - optim.warmup_steps) / max(1, decay_steps - optim.warmup_steps)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def set_lr(optimizer, step: int, optim: OptimConfig, max_steps: int) -> float:
    """Set every group's learning rate for step `step` times its `lr_scale` (Muon's group:
    muon_lr / lr, so that it peaks at muon_lr); returns the scheduled lr."""
    lr = lr_at(step, optim, max_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr


def configure_optimizer(model: nn.Module, optim: OptimConfig):
    """AdamW with weight decay on Linear matrices only (optim.name=muon: Muon for those).

    Decay pulls weights toward 0: no sensible prior for a norm's gain or a bias, and the token
    embedding (the LM head too) holds rare tokens that get few updates and would shrink to nothing.
    """
    # the matrices of Linear layers, and the rest (the tied LM head is the token embedding)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices, others = [], []
    for p in model.parameters():
        (matrices if p.dim() == 2 and id(p) not in embeddings else others).append(p)
    if optim.name == "adamw":
        return _adamw([{"params": matrices, "weight_decay": optim.weight_decay},
                       {"params": others, "weight_decay": 0.0}], optim)
    muon = ShapeBatchedMuon(
        [{"params": matrices, "lr_scale": optim.muon_lr / optim.lr if optim.lr else 1.0}],
        lr=optim.muon_lr, weight_decay=optim.weight_decay, momentum=optim.muon_momentum,
        nesterov=True)
    return MuonWithAdamW(muon, _adamw([{"params": others, "weight_decay": 0.0}], optim))


def _adamw(groups: list[dict], optim: OptimConfig) -> torch.optim.AdamW:
    # fused: one kernel for all parameters instead of a dozen passes over them
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused)
