"""Dropout whose random mask costs a CPU a quarter of the random numbers.

Training zeroes each element with probability p and scales the survivors by 1/(1 - p), so the
expected output is the input. On a CPU, F.dropout draws a random number per element from one
Mersenne Twister on one thread, a large share of a small model's training step. Here each 64-bit
draw from the same generator gives four 16-bit numbers, and an element survives when its number
is among the lowest k = round((1 - p)·65536): the keep probability is k/65536, within 1/131072
of 1 - p, and survivors are scaled by 65536/k, its exact inverse, so the expected output is
still the input. Seeding torch (torch.manual_seed) fixes the mask as before. Elsewhere F.dropout
stays: CUDA draws its mask in the same kernel, and torch.compile fuses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LEVELS = 1 << 16  # the values a 16-bit random number takes


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """F.dropout(x, p, training), with the mask drawn as above on a CPU."""
    if not 0 <= p <= 1:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, training)
    kept_levels = round((1 - p) * LEVELS)
    if kept_levels == 0:  # p within 1/131072 of 1
        return x * 0.0
    if kept_levels == LEVELS:  # p below 1/131072: nothing to drop at this resolution
        return x
    n = x.numel()
    # random_ over the whole int64 range: every bit random, so each 16-bit lane is uniform
    draws = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)
    lanes = draws.view(torch.int16)[:n].view(x.shape)  # uniform in [-32768, 32767]
    keep = lanes < kept_levels - LEVELS // 2  # the lowest kept_levels values
    scale = LEVELS / kept_levels
    if x.dtype in (torch.float32, torch.float64):
        # The scale rides in a float mask: the backward is then one multiply (grad * mask)
        # instead of torch.where's and the scale's, and the values are the same bit for bit
        return x * keep.to(x.dtype).mul_(scale)
    return torch.where(keep, x, 0.0) * scale  # a bf16 mask would round the scale


class Dropout(nn.Module):
    """nn.Dropout through `dropout` above: the same module, a cheaper mask on a CPU."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
