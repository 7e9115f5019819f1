"""optim=muon: Muon for the Linear matrices of the blocks, AdamW for everything else.

Muon (torch.optim.Muon) replaces each matrix's momentum update by the nearest semi-orthogonal
matrix (a few Newton-Schulz iterations, in bf16), so every direction of the update moves by a
similar amount instead of a few large ones dominating. It is defined for 2-D weights only; the
embeddings (and the LM head tied to the token embedding), norms and biases stay with AdamW.

    tinylm-train optim=muon                          # conf/optim/muon.yaml
    tinylm-train experiment=shakespeare_char optim.muon_lr=0.03

Both optimizers follow the same warmup + cosine schedule: the trainer sets every group's lr to
the scheduled lr times the group's `lr_scale` (muon_lr / lr for Muon's group).
"""

from __future__ import annotations

import torch
from torch import nn


class MuonWithAdamW:
    """Two optimizers stepped as one: what the trainer, the gradient scaler and checkpoints use
    (param_groups, step, zero_grad, state_dict, load_state_dict)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def muon(matrices: list[nn.Parameter], optim) -> torch.optim.Muon:
    """Muon over `matrices` (decayed) from an OptimConfig; its group's `lr_scale` makes the
    schedule reach muon_lr where AdamW's groups reach lr."""
    return torch.optim.Muon(
        [{"params": matrices, "lr_scale": optim.muon_lr / optim.lr if optim.lr else 1.0}],
        lr=optim.muon_lr, weight_decay=optim.weight_decay, momentum=optim.muon_momentum,
        nesterov=True)
