"""Faster paths a reader may skip: the readable code's arithmetic in fewer passes, or on fewer
random numbers, each one tested equal to what it stands in for (tests/test_fast.py).

- `attention`: what MultiHeadAttention's explicit path (tinylm/attention.py) computes, without
  keeping the weights: PyTorch's fused kernel, or `softmax_attention` for bf16 or dropout on a CPU.
- `Dropout`: nn.Dropout with a mask drawn from a quarter of the random numbers on a CPU; training
  swaps it in with `cheaper_dropout(model)`.
- `lm_head_cross_entropy`: the LM head and its cross-entropy in one pass, a slice of rows at a
  time, without the logits; training asks for it with TinyLM's `need_logits=False`.
- `cpu_decoding`: one-token decoding steps of a float32 CPU model set up to run fastest.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

# ---- attention --------------------------------------------------------------------------------


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
              scale: float | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """MultiHeadAttention's output without its weights: q (B, nh, T_q, hs) the last T_q of T_k
    positions, k/v (B, nh, T_k, hs); `scale` multiplies q·kᵀ (None: 1/√d); `hidden` (T_q, T_k)
    is True where a query may not look (None: the causal mask alone)."""
    if q.device.type == "cpu" and (q.dtype == torch.bfloat16 or dropout_p > 0):
        # PyTorch's fused CPU kernel is slow in bf16, where plain bmm + softmax beats it, and has
        # no dropout (PyTorch then falls back to F.dropout's costlier mask)
        return softmax_attention(q, k, v, dropout_p, scale, hidden)
    return fused_attention(q, k, v, dropout_p, scale, hidden)


def _causal(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """attention.causal_mask: True where query i (at position t_k - t_q + i) must not look."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).triu(diagonal=t_k - t_q + 1)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                    scale: float | None = None, hidden: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """PyTorch's fused kernel on q (B, nh, T, hs) and the cached k, v (B, nh, T_k, hs)."""
    T, t_k = q.size(2), k.size(2)
    if hidden is None:
        if T == t_k:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  scale=scale)
        if T == 1:  # one new token sees every cached position: nothing to mask
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale)
        # the fused kernel's is_causal aligns queries to the first keys, not the last
        hidden = _causal(T, t_k, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden, dropout_p=dropout_p,
                                          scale=scale)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                      scale: float | None = None, hidden: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Causal attention_steps(...).output keeping no step: the fast path on a CPU for bf16,
    where it beats PyTorch's fused kernel, and for dropout, which that kernel lacks.

    The same arithmetic in fewer passes: the mask is added as 0 / -inf (exp(-inf) = 0) in the
    same kernel that scales q·kᵀ, and PyTorch's softmax subtracts the row max just as
    attention_steps does. PyTorch's CPU softmax computes in fp32 even for bf16 scores and rounds
    only its result, the rounding attention_steps applies before weights·v, so no separate cast
    pass is needed. Queries are the last T_q of T_k positions, as in causal_mask.
    """
    *batch, t_q, d = q.shape
    t_k = k.size(-2)
    if hidden is None:
        hidden = _causal(t_q, t_k, q.device)
    # the mask as an additive bias: 0 where seen, -inf where hidden
    bias = torch.zeros(t_q, t_k, dtype=q.dtype, device=q.device).masked_fill_(hidden,
                                                                             float("-inf"))
    # (b, T_q, T_k) with b = B * nh: bmm-shaped views, since baddbmm takes 3-d tensors
    scores = torch.baddbmm(bias, q.reshape(-1, t_q, d), k.reshape(-1, t_k, d).transpose(1, 2),
                           alpha=1 / math.sqrt(d) if scale is None else scale)
    weights = torch.softmax(scores, dim=-1)
    weights = dropout(weights, dropout_p)
    return (weights @ v.reshape(-1, t_k, v.size(-1))).view(*batch, t_q, v.size(-1))


# ---- dropout ----------------------------------------------------------------------------------
# Training zeroes each element with probability p and scales the survivors by 1/(1 - p), so the
# expected output is the input. On a CPU, F.dropout draws a random number per element from one
# Mersenne Twister on one thread, a large share of a small model's training step. Here each 64-bit
# draw from the same generator gives four 16-bit numbers, and an element survives when its number
# is among the lowest k = round((1 - p)·65536): the keep probability is k/65536, within 1/131072
# of 1 - p, and survivors are scaled by 65536/k, its exact inverse, so the expected output is
# still the input. Seeding torch (torch.manual_seed) fixes the mask as before. Elsewhere F.dropout
# stays: CUDA draws its mask in the same kernel, and torch.compile fuses it.

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


def cheaper_dropout(model: nn.Module) -> nn.Module:
    """Swap every nn.Dropout in `model` for Dropout of the same p, in place; returns `model`."""
    for parent, name, child in _dropouts(model):
        setattr(parent, name, Dropout(child.p))
    return model


def _dropouts(model: nn.Module) -> list[tuple[nn.Module, str, nn.Dropout]]:
    """(parent, name, module) of every nn.Dropout in `model`."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if isinstance(child, nn.Dropout)]


# ---- the LM head's loss -----------------------------------------------------------------------
# Training needs only the loss and its gradient, never the logits themselves. Yet the logits are
# the largest tensor of a training step (a (16, 128) batch over a 4096-token vocabulary: 32 MB in
# fp32, more than a processor's caches hold), and computed the usual way every pass over them
# (the cast to fp32, log-softmax, its backward, the cast back) streams them through memory.
#
# Here the rows go through in chunks of ~1M logits (CHUNK_LOGITS). Each chunk's logits stay in
# cache while its loss *and* its gradient are computed, in the forward pass; backward only scales
# the saved gradients. For one row with hidden state h, logits z = W·h and target t:
#
#     loss     = logsumexp(z) - z[t]
#     dloss/dz = softmax(z) - onehot(t)
#     dloss/dh = Wᵀ·(dloss/dz)            dloss/dW = (dloss/dz)·hᵀ

# Rows per chunk: ~1M logits (4 MB in fp32) stay in a CPU's L2/L3 cache, and >= 128 rows keep
# the chunk's matmuls large enough to run near full speed.
CHUNK_LOGITS = 2**20
MIN_ROWS_PER_CHUNK = 128


def lm_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          ignore_index: int = -1) -> torch.Tensor:
    """Mean cross-entropy of the logits h·weightᵀ against targets, without materialising them.

    h (N, C) hidden states, weight (V, C) the LM head, targets (N,) ids; rows whose target is
    `ignore_index` are left out of the mean. Under autocast the matmuls run in the autocast dtype
    and the softmax in fp32, as `F.cross_entropy(lm_head(h).float(), targets)` would (fp16
    autocast excepted: see below).
    """
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    if dtype == torch.float16:
        # the gradients are computed here before a loss scaler multiplies them: unscaled, the
        # small ones would underflow fp16's range (bf16 has fp32's), so the head runs in fp32
        dtype = torch.float32
    # the dtypes are chosen above; autocast would cast the fp32 matmuls of fp16 back to fp16
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _LMHeadCrossEntropy.apply(h, weight, targets, ignore_index, dtype)
        loss, _, _ = _loss_and_gradients(h, weight, targets, ignore_index, dtype,
                                         with_grads=False)
        return loss


class _LMHeadCrossEntropy(torch.autograd.Function):
    """Computes the gradients in the forward pass (see above for why)."""

    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, dtype):
        loss, grad_h, grad_weight = _loss_and_gradients(h, weight, targets, ignore_index, dtype,
                                                        with_grads=True)
        ctx.save_for_backward(grad_h, grad_weight)
        ctx.input_dtypes = h.dtype, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        h_dtype, weight_dtype = ctx.input_dtypes
        # grad_loss is 1 for a plain loss.backward(); anything else (gradient accumulation, a
        # loss scaler) scales the gradients computed in forward
        return ((grad_h * grad_loss).to(h_dtype), (grad_weight * grad_loss).to(weight_dtype),
                None, None, None)


def _loss_and_gradients(h, weight, targets, ignore_index, dtype, with_grads):
    """(mean loss, dloss/dh (N, C) in `dtype`, dloss/dweight (V, C) in fp32); the gradients are
    None unless with_grads."""
    n_rows, vocab_size = h.size(0), weight.size(0)
    h_m, w_m = h.to(dtype), weight.to(dtype)  # the matmul operands: bf16 under bf16 autocast
    counted = targets != ignore_index  # (N,)
    n_counted = counted.sum().clamp_min(1)  # no counted row: loss 0, not 0/0
    row_scale = counted.to(torch.float32) / n_counted  # (N,): 1/n for counted rows, 0 for ignored
    safe_targets = targets.masked_fill(~counted, 0)[:, None]  # (N, 1): a valid index everywhere
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h_m) if with_grads else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if with_grads else None

    step = max(MIN_ROWS_PER_CHUNK, CHUNK_LOGITS // vocab_size)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        logits = (h_m[rows] @ w_m.t()).float()  # (n, V); softmax in fp32 whatever the matmuls
        target_logit = logits.gather(1, safe_targets[rows])  # (n, 1)
        # the stable softmax of the explainer: subtract the row max, so every exp() is <= 1
        row_max = logits.amax(dim=-1, keepdim=True)  # (n, 1)
        exps = logits.sub_(row_max).exp_()  # in place of the logits: one (n, V) buffer in all
        exp_sum = exps.sum(dim=-1, keepdim=True)  # (n, 1)
        lse = row_max + exp_sum.log()  # logsumexp(z)
        total += ((lse - target_logit)[:, 0] * row_scale[rows]).sum()
        if with_grads:
            # d(mean loss)/dz = (softmax(z) - onehot(t)) / n_counted, 0 on ignored rows
            scale = row_scale[rows, None]  # (n, 1)
            dlogits = exps.mul_(scale / exp_sum)
            dlogits.scatter_add_(1, safe_targets[rows], -scale)
            dlogits = dlogits.to(dtype)
            grad_h[rows] = dlogits @ w_m  # (n, C)
            grad_w += (dlogits.t() @ h_m[rows]).float()  # (V, C), summed over the chunks
    return total, grad_h, grad_w


# ---- decoding ---------------------------------------------------------------------------------


@contextmanager
def cpu_decoding(model: nn.Module) -> Iterator[None]:
    """Within: one-token steps of a TinyLM set up to run fastest; every change is undone on the
    way out. 1 and 2 are for a float32 CPU model only (not bf16, autocast or CUDA).

    1. PyTorch's own CPU kernels instead of oneDNN's (a process-wide switch), whose set-up per
       call outweighs one token's work; both compute the exact (erf) GELU.
    2. Every weight matrix stored column by column (same values and shape): a step multiplies
       one row by each weight's transpose, read faster from a contiguous (in, out) copy. The
       copies hold the weights' memory a second time while decoding.
    3. In eval mode, each nn.Dropout (which then returns its input, yet through a call into
       PyTorch) set aside for an nn.Identity.
    """
    weights = next(model.parameters())
    float32_cpu = (weights.device.type == "cpu" and weights.dtype == torch.float32
                   and not torch.is_autocast_enabled("cpu"))
    plain = float32_cpu and torch.backends.mkldnn.enabled
    kept = [(p, p.data) for p in model.parameters() if p.dim() == 2 and p.is_contiguous()] \
        if float32_cpu else []
    dropouts = [] if model.training else _dropouts(model)
    if plain:
        torch.backends.mkldnn.enabled = False
    for p, data in kept:
        p.data = data.t().contiguous().t()  # (out, in) values, (in, out) in memory
    for parent, name, _ in dropouts:
        setattr(parent, name, nn.Identity())
    try:
        yield
    finally:
        for parent, name, dropout_module in dropouts:
            setattr(parent, name, dropout_module)
        for p, data in kept:
            p.data = data
        if plain:
            torch.backends.mkldnn.enabled = True
