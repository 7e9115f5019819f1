"""Multi-head causal self-attention, written out step by step.

The arithmetic, explained with a worked example in docs/attention.md:

    scores  = Q Kᵀ / √d                      how well each query matches each key
    scores  = masked_fill(mask, -inf)        the causal mask hides future positions
    weights = softmax(scores - row max)      each row sums to 1; the max keeps exp() finite
    output  = weights V                      each query's output is a weighted sum of values

Try that worked example (`tinylm-explain` prints every step of it):

    python -c "import torch, tinylm.attention as a; q = torch.tensor([[1., 0], [0, 1], [1, 1]]);
    print(a.scaled_dot_product_attention(q, q, torch.tensor([[1., 0], [0, 2], [1, 1]])))"
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tinylm import fast
from tinylm.kv_cache import LayerCache


def causal_mask(t_q: int, t_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Upper-triangular causal mask of shape (t_q, t_k): True where a query must not look.

    The queries are the *last* t_q of the t_k positions (with a KV cache, t_q new tokens follow
    t_k - t_q cached ones), so query i sits at absolute position p = t_k - t_q + i and may see
    keys 0 .. p.
    """
    if t_q > t_k:
        raise ValueError(f"causal_mask: t_q={t_q} queries cannot follow only t_k={t_k} keys")
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).triu(diagonal=t_k - t_q + 1)


class AttentionSteps(NamedTuple):
    """Every intermediate of scaled dot-product attention, for teaching and inspection."""

    scores: torch.Tensor  # q·kᵀ, (..., T_q, T_k)
    scaled: torch.Tensor  # scores / √d (scores · scale, where a scale is given)
    masked: torch.Tensor  # scaled with hidden positions set to -inf
    row_max: torch.Tensor  # max over each row's visible scores, (..., T_q, 1)
    shifted: torch.Tensor  # masked - row_max: what exp() is taken of, every entry <= 0
    exps: torch.Tensor  # exp(shifted); 0 where hidden
    exp_sum: torch.Tensor  # (..., T_q, 1)
    weights: torch.Tensor  # exps / exp_sum: the attention weights, rows sum to 1
    output: torch.Tensor  # weights · v, (..., T_q, d_v)


def attention_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None = None, is_causal: bool = False,
                    dropout_p: float = 0.0, scale: float | None = None) -> AttentionSteps:
    """Scaled dot-product attention, keeping each step. Shapes: q (..., T_q, d), k/v (..., T_k, d).

    `mask` is boolean and broadcastable to (..., T_q, T_k); True marks a position the query must
    not see. `is_causal` adds the causal mask (queries are the last T_q of T_k positions).
    `dropout_p` drops weights before they mix the values (training only); the returned weights
    are the ones before dropout. `scale` multiplies the scores instead of 1/√d (GPT-Neo: 1.0).
    """
    d = q.size(-1)
    if k.size(-1) != d:
        raise ValueError(f"q and k must share their last dimension, got {d} and {k.size(-1)}")
    if k.size(-2) != v.size(-2):
        raise ValueError(f"k and v must have as many positions, got {k.size(-2)} and {v.size(-2)}")

    scores = q @ k.transpose(-2, -1)  # (..., T_q, T_k)
    # softmax is computed in fp32 even under bf16 autocast: exp() of bf16 scores loses digits
    scaled = scores.float() / math.sqrt(d) if scale is None else scores.float() * scale

    hidden = mask
    if is_causal:
        causal = causal_mask(q.size(-2), k.size(-2), q.device)
        hidden = causal if hidden is None else (hidden | causal)
    masked = scaled if hidden is None else scaled.masked_fill(hidden, float("-inf"))

    # Subtracting the row max leaves softmax unchanged and keeps every exponent <= 0, so exp()
    # cannot overflow. A fully hidden row has max -inf; use 0 there so it gives zeros, not NaN.
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    shifted = masked - row_max
    exps = torch.exp(shifted)
    exp_sum = exps.sum(dim=-1, keepdim=True)
    weights = exps / exp_sum.clamp_min(torch.finfo(exps.dtype).tiny)

    output = F.dropout(weights, dropout_p).to(v.dtype) @ v  # (..., T_q, d_v)
    return AttentionSteps(scores, scaled, masked, row_max, shifted, exps, exp_sum, weights, output)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, is_causal: bool = False,
                                 dropout_p: float = 0.0, scale: float | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ/√d, masked) · v. Returns (output (..., T_q, d_v), weights (..., T_q, T_k))."""
    steps = attention_steps(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                            scale=scale)
    return steps.output, steps.weights


def unshifted_exps(steps: AttentionSteps) -> torch.Tensor:
    """exp(masked) without the row max subtracted, as softmax is written on paper: exps · e^row_max
    (the factor cancels in the division; exp(masked) overflows float32 past a score of ~88.7)."""
    return steps.exps * steps.row_max.exp()  # (..., T_q, T_k)


def value_terms(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each key's term of each query's output, weights[..., i, j] · v[..., j, :]: (..., T_q, T_k,
    d_v) from weights (..., T_q, T_k) and v (..., T_k, d_v); summed over the keys, the output."""
    return weights.unsqueeze(-1) * v.unsqueeze(-3)


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention: project to Q/K/V, attend per head, concatenate, project.

    forward(x, need_weights=True) takes the explicit path above and returns the per-head weights
    (B, n_head, T_q, T_k); otherwise tinylm/fast.py computes the same output faster. `variant`
    is what a pretrained model's layer does otherwise (Variant, below); None: the textbook.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 variant: Variant | None = None):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.head_size = n_embd, n_head, n_embd // n_head
        self.dropout, self.variant = dropout, variant or Variant()
        # one matmul for Q, K and V together; split afterwards
        self.qkv_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> each head's q, k, v, (B, nh, T, hs) each."""
        B, T, C = x.size()
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_head, self.head_size)
        # (3, B, nh, T, hs), then a (B, nh, T, hs) view each: fewer calls than split + transpose
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> AttentionSteps:
        """attention_steps with this layer's mask and scale; q (..., T_q, hs), k/v (..., T_k, hs)
        as project_heads gives them (queries are the last T_q of T_k positions)."""
        mask = self.variant.mask(q.size(-2), k.size(-2), q.device)
        return attention_steps(q, k, v, mask=mask, dropout_p=dropout_p, scale=self.variant.scale)

    def forward(self, x: torch.Tensor, kv_cache: LayerCache | None = None,
                need_weights: bool = False, head_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C) -> (y (B, T, C), weights (B, n_head, T_q, T_k) or None).

        `kv_cache` (this layer's slot of a KVCache, tinylm/kv_cache.py) stores this step's
        keys/values after the cached ones, and the queries attend over all of them.
        `head_mask` (n_head,) scales each head's output before the heads are concatenated;
        a 0 removes that head (ablation).
        """
        B, T, C = x.size()
        q, k, v = self.project_heads(x)  # (B, nh, T, hs) each
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, nh, T_k, hs), T_k >= T
        dropout_p = self.dropout if self.training else 0.0

        if need_weights:
            steps = self.steps(q, k, v, dropout_p)
            y, weights = steps.output, steps.weights
        else:  # the same output, faster, without the weights (tested equal)
            y, weights = fast.attention(q, k, v, dropout_p, self.variant), None

        if head_mask is not None:
            y = y * head_mask.view(1, self.n_head, 1, 1).to(y.dtype)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate heads: (B, T, nh*hs)
        y = self.resid_dropout(self.out_proj(y))
        return y, weights


# ---- the seam for pretrained models (tinylm/pretrained.py, docs/pretrained.md) -----------------
class Variant(NamedTuple):
    """How one layer of a pretrained model departs from the textbook; the defaults are it."""

    scale: float | None = None  # multiplies q·kᵀ instead of 1/√d (GPT-Neo: 1.0, unscaled)
    window: int | None = None  # a local layer (GPT-Neo): queries see the last `window` positions

    def mask(self, t_q: int, t_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """causal_mask, in a local layer also hiding the keys `window` or more back: a band."""
        hidden = causal_mask(t_q, t_k, device)
        if self.window is None:
            return hidden
        return hidden | torch.ones_like(hidden).tril(diagonal=t_k - t_q - self.window)
