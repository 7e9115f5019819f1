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
from tinylm.hooks import HookPoint
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


def weighted_values(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each key's term of each query's output, weights[..., i, j] · v[..., j, :]: (..., T_q, T_k,
    d_v) from weights (..., T_q, T_k) and v (..., T_k, d_v); summed over the keys, the output."""
    return weights.unsqueeze(-1) * v.unsqueeze(-3)


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention: project to Q/K/V, attend per head, concatenate, project.

    Its activations pass through hook points (tinylm/hooks.py): hook_q, hook_k, hook_v (B, nh,
    T, hs), hook_pattern (B, nh, T_q, T_k), hook_z (B, nh, T_q, hs). While a hook is on
    hook_pattern the explicit path above runs, whose weights it reads; otherwise tinylm/fast.py
    computes the same output faster.
    """

    scale: float | None = None  # multiplies q·kᵀ; None: 1/√d, the textbook's

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.head_size = n_embd, n_head, n_embd // n_head
        self.dropout = dropout
        # one matmul for Q, K and V together; split afterwards
        self.qkv_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern, self.hook_z = HookPoint(), HookPoint()

    def project_heads(self, x: torch.Tensor, start: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) at positions start.. -> each head's q, k, v, (B, nh, T, hs) each."""
        B, T, C = x.size()
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_head, self.head_size)
        # (3, B, nh, T, hs), then a (B, nh, T, hs) view each: fewer calls than split + transpose
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def hidden(self, t_q: int, t_k: int, device: torch.device | str) -> torch.Tensor | None:
        """What a query may not see besides the later positions (the causal mask): nothing."""
        return None

    def steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> AttentionSteps:
        """attention_steps, causal, with this layer's scale (and anything else it hides); q
        (..., T_q, hs), k/v (..., T_k, hs): the queries are the last T_q of T_k positions."""
        mask = self.hidden(q.size(-2), k.size(-2), q.device)
        return attention_steps(q, k, v, mask=mask, is_causal=True, dropout_p=dropout_p,
                               scale=self.scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ/√d, masked)·v per head: (B, nh, T_q, hs) from q and k/v (B, nh, T_k, hs)."""
        dropout_p = self.dropout if self.training else 0.0
        if self.hook_pattern.hooked:  # the weights are read (or replaced): the explicit path
            steps = self.steps(q, k, v, dropout_p)
            weights = self.hook_pattern(steps.weights)
            if weights is steps.weights:
                return self.hook_z(steps.output)
            return self.hook_z(F.dropout(weights, dropout_p).to(v.dtype) @ v)
        # the same output, faster, without the weights (tested equal)
        hidden = self.hidden(q.size(-2), k.size(-2), q.device)
        if hidden is not None:
            hidden = hidden | causal_mask(q.size(-2), k.size(-2), q.device)
        return self.hook_z(fast.attention(q, k, v, dropout_p, self.scale, hidden))

    def combine_heads(self, y: torch.Tensor) -> torch.Tensor:
        """Concatenate the heads' outputs y (B, nh, T, hs) and project: (B, T, C)."""
        B, _, T, _ = y.size()
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)  # (B, T, nh*hs)
        return self.resid_dropout(self.out_proj(y))

    def forward(self, x: torch.Tensor, kv_cache: LayerCache | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C).

        `kv_cache` (this layer's slot of a KVCache, tinylm/kv_cache.py) stores this step's
        keys/values after the cached ones, and the queries attend over all of them.
        """
        start = kv_cache.length if kv_cache is not None else 0
        q, k, v = self.project_heads(x, start)  # (B, nh, T, hs) each
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # (B, nh, T_k, hs), T_k >= T
        return self.combine_heads(self.attend(q, k, v))
