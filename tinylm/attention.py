"""Multi-head causal self-attention, written out step by step.

The arithmetic, explained with a worked example in docs/attention.md:

    scores  = Q Kᵀ / √d                      how well each query matches each key
    scores  = masked_fill(mask, -inf)        the causal mask hides future positions (and, in a
                                             local layer, those a window or more back)
    weights = softmax(scores - row max)      each row sums to 1; the max keeps exp() finite
    output  = weights V                      each query's output is a weighted sum of values

Try that worked example (`tinylm-explain` prints every step of it):

    python -c "import torch, tinylm.attention as a; q = torch.tensor([[1., 0], [0, 1], [1, 1]]);
    print(a.scaled_dot_product_attention(q, q, torch.tensor([[1., 0], [0, 2], [1, 1]])))"
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tinylm.dropout import Dropout, dropout

LOG2_E = math.log2(math.e)  # e^x = 2^(x·log₂e)


@lru_cache(maxsize=64)
def causal_mask(t_q: int, t_k: int, device: torch.device | str = "cpu",
                window: int | None = None) -> torch.Tensor:
    """Upper-triangular causal mask of shape (t_q, t_k): True where a query must not look.

    The queries are the *last* t_q of the t_k positions (with a KV cache, t_q new tokens follow
    t_k - t_q cached ones), so query i sits at absolute position p = t_k - t_q + i and may see keys
    0 .. p. With a `window` (a local layer, as in GPT-Neo) it sees only p - window + 1 .. p: the
    triangle becomes a band (docs/pretrained.md draws both). Built once per (t_q, t_k, device,
    window) and cached; treat it as read-only.
    """
    if t_q > t_k:
        raise ValueError(f"causal_mask: t_q={t_q} queries cannot follow only t_k={t_k} keys")
    # a normal tensor even when first asked for under inference_mode (generation): autograd
    # reuses the cached mask later and cannot save an inference tensor for backward
    with torch.inference_mode(False):
        ones = torch.ones(t_q, t_k, dtype=torch.bool, device=device)
        future = ones.triu(diagonal=t_k - t_q + 1)
        if window is None:
            return future
        return future | ones.tril(diagonal=t_k - t_q - window)  # keys window or more back


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
    t_q, t_k = q.size(-2), k.size(-2)

    scores = q @ k.transpose(-2, -1)  # (..., T_q, T_k)
    # softmax is computed in fp32 even under bf16 autocast: exp() of bf16 scores loses digits
    scaled = scores.float() / math.sqrt(d) if scale is None else scores.float() * scale

    hidden = mask
    if is_causal:
        causal = causal_mask(t_q, t_k, q.device)
        hidden = causal if hidden is None else (hidden | causal)
    # masked_fill(hidden, -inf) written as where(): the same values, faster on a CPU with a mask
    # broadcast over the batch and heads
    masked = scaled if hidden is None else torch.where(hidden, float("-inf"), scaled)

    # Subtracting the row max leaves softmax unchanged and keeps every exponent <= 0, so exp()
    # cannot overflow. A fully hidden row has max -inf; use 0 there so it gives zeros, not NaN.
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    shifted = masked - row_max
    # exp(x) computed as 2^(x·log₂e), within 6e-8 of exp (the exps are <= 1): PyTorch's CPU exp
    # takes a slow path for exp(-inf), the hidden half of every causal row.
    exps = torch.exp2(shifted * LOG2_E)
    exp_sum = exps.sum(dim=-1, keepdim=True)
    weights = exps / exp_sum.clamp_min(torch.finfo(exps.dtype).tiny)

    mixing = dropout(weights, dropout_p)
    output = mixing.to(v.dtype) @ v  # (..., T_q, d_v)
    return AttentionSteps(scores, scaled, masked, row_max, shifted, exps, exp_sum, weights, output)


def unshifted_exps(steps: AttentionSteps) -> torch.Tensor:
    """exp(masked) without the row max subtracted, as softmax is written on paper: exps · e^row_max.

    The factor e^row_max is the same across a row, so it cancels in the division and the weights
    do not change; exp(masked) itself overflows float32 once a score passes ~88.7.
    """
    return steps.exps * steps.row_max.exp()  # (..., T_q, T_k)


def value_terms(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each key's term of each query's output: weights[..., i, j] · v[..., j, :].

    weights (..., T_q, T_k), v (..., T_k, d_v) -> (..., T_q, T_k, d_v); summed over the keys
    (dim -2) the terms are attention_steps' output.
    """
    return weights.unsqueeze(-1) * v.unsqueeze(-3)


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | None = None, is_causal: bool = False,
                                 dropout_p: float = 0.0, scale: float | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ/√d, masked) · v. Returns (output (..., T_q, d_v), weights (..., T_q, T_k))."""
    steps = attention_steps(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                            scale=scale)
    return steps.output, steps.weights


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dropout_p: float = 0.0, scale: float | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention_steps(...).output keeping no step: the fast path on a CPU for bf16,
    where it beats PyTorch's fused kernel, and for dropout, which that kernel lacks.

    The same arithmetic in fewer passes: the mask is added as 0 / -inf (exp(-inf) = 0) in the
    same kernel that scales q·kᵀ, and PyTorch's softmax subtracts the row max just as
    attention_steps does. PyTorch's CPU softmax computes in fp32 even for bf16 scores and rounds
    only its result, the rounding attention_steps applies before weights·v, so no separate cast
    pass is needed. Queries are the last T_q of T_k positions, as in causal_mask; `scale` and
    `window` as there and in attention_steps.
    """
    *batch, t_q, d = q.shape
    t_k = k.size(-2)
    # causal_mask as an additive bias: -inf strictly above the diagonal of the last T_q rows.
    # Built here rather than taken from causal_mask's cache, which torch.compile cannot trace.
    far = torch.full((t_q, t_k), float("-inf"), dtype=q.dtype, device=q.device)
    hidden = far.triu(t_k - t_q + 1)
    if window is not None:  # a local layer: -inf also on the keys window or more back
        hidden = hidden + far.tril(t_k - t_q - window)
    # (b, T_q, T_k) with b = B * nh: bmm-shaped views, since baddbmm takes 3-d tensors
    scores = torch.baddbmm(hidden, q.reshape(-1, t_q, d), k.reshape(-1, t_k, d).transpose(1, 2),
                           alpha=1 / math.sqrt(d) if scale is None else scale)
    weights = torch.softmax(scores, dim=-1)
    weights = dropout(weights, dropout_p)
    return (weights @ v.reshape(-1, t_k, v.size(-1))).view(*batch, t_q, v.size(-1))


class KVCache:
    """Keys and values of every attention layer, kept across decoding steps.

    Preallocated to `max_len` positions so that each step writes in place instead of
    concatenating (which would copy the whole cache at every token). Each layer writes its new
    keys/values through its `layer(i)` slot; the model then calls `advance(T)` once, after the
    last layer, so all layers always hold the same `length` positions.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layer, batch_size, n_head, max_len, head_size)
        self._k = torch.zeros(shape, dtype=dtype, device=device)
        self._v = torch.zeros(shape, dtype=dtype, device=device)
        # each layer's view, made once: indexing the 5-d buffers anew costs more than the write
        # itself at one token a step
        self._layer_k = [self._k[i] for i in range(n_layer)]
        self._layer_v = [self._v[i] for i in range(n_layer)]
        self._length = 0

    @property
    def length(self) -> int:
        """Positions cached so far; the next token's position."""
        return self._length

    @property
    def max_len(self) -> int:
        return self._k.size(3)

    def layer(self, i: int) -> LayerCache:
        """Layer i's slot, which MultiHeadAttention writes to."""
        return LayerCache(self, i)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new keys/values (B, nh, T_new, hs) after the cached positions;
        return that layer's keys/values up to them (B, nh, length + T_new, hs)."""
        start, new = self._length, k.size(2)
        if start + new > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; {start + new} were "
                             "asked for")
        keys, values = self._layer_k[layer], self._layer_v[layer]  # (B, nh, max_len, hs)
        keys.narrow(2, start, new).copy_(k)
        values.narrow(2, start, new).copy_(v)
        return keys.narrow(2, 0, start + new), values.narrow(2, 0, start + new)

    def advance(self, n: int) -> None:
        """Count n new positions as cached, once every layer has written them."""
        if n < 0 or self._length + n > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot advance "
                             f"{self._length} by {n}")
        self._length += n

    def reset(self) -> None:
        """Forget every position; the buffers are kept and overwritten by the next writes."""
        self._length = 0

    def rewind(self, pos: int) -> None:
        """Keep only the first `pos` positions (0 <= pos <= length); the next token goes at pos."""
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= self._length:
            raise ValueError(f"cannot rewind the KV cache to position {pos!r}: it must be an "
                             f"integer from 0 to the {self._length} positions cached")
        self._length = pos


class LayerCache(NamedTuple):
    """One layer's slot in a KVCache (KVCache.layer(i))."""

    cache: KVCache
    index: int

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (B, nh, T_new, hs); return all cached so far (B, nh, T, hs).

        The cache's length moves on only at KVCache.advance, after the last layer.
        """
        return self.cache.write(self.index, k, v)


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention: project to Q/K/V, attend per head, concatenate, project.

    forward(x, need_weights=True) takes the explicit path above and returns the per-head weights
    (B, n_head, T_q, T_k). Otherwise a fast path computes the same thing: PyTorch's fused kernel,
    or softmax_attention for bf16 or dropout on a CPU; tests/test_attention.py checks that the
    paths agree. Two options that pretrained models need (tinylm/pretrained.py): `scale`
    multiplies q·kᵀ instead of 1/√head_size (GPT-Neo: 1.0, no scaling), and `window` makes a
    local layer, whose queries see only the last `window` positions (themselves included).
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float = 0.0, bias: bool = True,
                 scale: float | None = None, window: int | None = None):
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.head_size = n_embd, n_head, n_embd // n_head
        self.dropout, self.scale, self.window = dropout, scale, window
        # one matmul for Q, K and V together; split afterwards
        self.qkv_proj = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = Dropout(dropout)

    def project_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> each head's q, k, v, (B, nh, T, hs) each."""
        B, T, C = x.size()
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_head, self.head_size)
        # (3, B, nh, T, hs), then one (B, nh, T, hs) view each: fewer calls than split, view
        # and transpose per tensor, which counts when decoding one token at a time
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              dropout_p: float = 0.0) -> AttentionSteps:
        """attention_steps with this layer's mask and scale; q (..., T_q, hs), k/v (..., T_k, hs)
        as project_heads gives them (queries are the last T_q of T_k positions)."""
        mask = causal_mask(q.size(-2), k.size(-2), q.device, self.window)
        return attention_steps(q, k, v, mask=mask, dropout_p=dropout_p, scale=self.scale)

    def forward(self, x: torch.Tensor, kv_cache: LayerCache | None = None,
                need_weights: bool = False, head_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C) -> (y (B, T, C), weights (B, n_head, T_q, T_k) or None).

        `kv_cache` (this layer's slot of a KVCache) stores this step's keys/values after the
        cached ones, and the queries attend over all of them.
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
        else:
            weights = None
            if q.device.type == "cpu" and (q.dtype == torch.bfloat16 or dropout_p > 0):
                # PyTorch's fused CPU kernel is slow in bf16, where plain bmm + softmax beats
                # it, and has no dropout (PyTorch then falls back to F.dropout's costlier mask)
                y = softmax_attention(q, k, v, dropout_p, self.scale, self.window)
            else:
                y = self._fused_attention(q, k, v, dropout_p)

        if head_mask is not None:
            y = y * head_mask.view(1, self.n_head, 1, 1).to(y.dtype)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # concatenate heads: (B, T, nh*hs)
        y = self.resid_dropout(self.out_proj(y))
        return y, weights

    def _fused_attention(self, q, k, v, dropout_p: float) -> torch.Tensor:
        """PyTorch's fused kernel on q (B, nh, T, hs) and the cached k, v (B, nh, T_k, hs)."""
        T, t_k = q.size(2), k.size(2)
        if self.window is None or t_k <= self.window:  # no key is yet a window back
            if T == t_k:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                      is_causal=True, scale=self.scale)
            if T == 1:  # one new token sees every cached position: nothing to mask
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                      scale=self.scale)
        # the fused kernel's is_causal aligns queries to the first keys, not the last, and
        # knows no band
        visible = ~causal_mask(T, t_k, q.device, self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout_p,
                                              scale=self.scale)
