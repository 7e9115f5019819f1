"""optim=muon: Muon for the Linear matrices of the blocks, AdamW for everything else (built and
scheduled in optim.py).

Muon replaces each matrix's momentum update by the nearest semi-orthogonal matrix (a few
Newton-Schulz iterations), so every direction of the update moves by a similar amount instead of
a few large ones dominating. It is defined for 2-D weights only: embeddings (and the tied LM
head), norms and biases stay with AdamW.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from tinylm.device import has_fast_bf16


class ShapeBatchedMuon(torch.optim.Muon):
    """torch.optim.Muon's update (its arithmetic, state and hyperparameters: checkpoints load in
    either), with the Newton-Schulz iterations of all matrices of one shape run as one batch
    instead of one matrix at a time. They run in `ns_dtype`, or (None) in bf16 as torch's where
    the hardware multiplies bf16 and in fp32 where bf16 is emulated and slow."""

    def __init__(self, params, *, ns_dtype: torch.dtype | None = None, **settings):
        super().__init__(params, **settings)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            updates = []
            for p in params:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - group["momentum"])
                updates.append(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf)
            dtype = self.ns_dtype if self.ns_dtype is not None else (
                torch.bfloat16 if has_fast_bf16(params[0].device) else torch.float32)
            orthogonal = newton_schulz(updates, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], dtype)
            for p, update in zip(params, orthogonal, strict=True):
                rows, cols = p.shape  # a tall matrix moves further: torch's "original" scale
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1.0, rows / cols)))


def newton_schulz(updates: list[Tensor], coefficients: tuple[float, float, float], steps: int,
                  eps: float, dtype: torch.dtype = torch.bfloat16) -> list[Tensor]:
    """Each update's nearest semi-orthogonal matrix, approximately, in `dtype`: wide side first,
    scaled to Frobenius norm 1, then `steps` quintic iterations X <- aX + (bA + cA²)X with
    A = XXᵀ. Matrices of one shape go through as one batch; in fp32, matrices at least twice as
    wide as tall go through their Gram matrix."""
    wide = [u.mT if u.size(0) > u.size(1) else u for u in updates]  # (rows <= cols)
    by_shape: dict[torch.Size, list[int]] = defaultdict(list)
    for i, w in enumerate(wide):
        by_shape[w.shape].append(i)
    result: list[Tensor] = [torch.empty(0)] * len(updates)
    for (rows, cols), indices in by_shape.items():
        x = torch.stack([wide[i] for i in indices]).to(dtype)  # (n, rows, cols)
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
        # bf16 rounds every product: there only torch's own order of operations is safe
        quintic = through_gram if dtype == torch.float32 and cols >= 2 * rows else directly
        x = quintic(x, coefficients, steps)
        for k, i in enumerate(indices):
            result[i] = x[k] if wide[i] is updates[i] else x[k].mT
    return result


def directly(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """The quintic iterations on X (n, rows, cols), as torch.optim.Muon runs them:
    (4·rows²·cols + 2·rows³) FLOPs per matrix and step."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.mT  # A = XXᵀ, (n, rows, rows)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def through_gram(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """The same iterations, run on the small Gram matrix A = XXᵀ (n, rows, rows) instead of X.

    Each step multiplies X by P = aI + bA + cA², so X_s = P_s···P_1 X_0, and the next A = PAP (P
    is symmetric and commutes with A). Only the first A and the final product touch the wide X:
    4·rows²·cols + (8·steps − 6)·rows³ FLOPs against directly's steps·(4·rows²·cols + 2·rows³),
    fewer once cols > 1.5·rows at 5 steps. Exact in fp32 up to rounding, not in bf16.
    """
    a, b, c = coefficients
    gram = x @ x.mT  # (n, rows, rows)
    identity = torch.eye(gram.size(-1), dtype=gram.dtype, device=gram.device)
    product = identity  # P_k···P_1, none yet
    for k in range(steps):
        p = torch.baddbmm(gram, gram, gram, beta=b, alpha=c) + a * identity
        product = p if k == 0 else p @ product  # P_1·I is P_1: no matmul needed
        if k < steps - 1:  # the last step's A is never used
            gram = p @ (gram @ p)
    return product @ x


class MuonWithAdamW:
    """Two optimizers as one, for the trainer, the gradient scaler and checkpoints."""

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
