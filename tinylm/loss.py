"""The LM head and its cross-entropy in one pass, a slice of rows at a time.

Training needs only the loss and its gradient, never the logits themselves. Yet the logits are
the largest tensor of a training step (a (16, 128) batch over a 4096-token vocabulary: 32 MB in
fp32, more than a processor's caches hold), and computed the usual way every pass over them
(the cast to fp32, log-softmax, its backward, the cast back) streams them through memory.

Here the rows go through in chunks of ~1M logits (CHUNK_LOGITS). Each chunk's logits stay in
cache while its loss *and* its gradient are computed, in the forward pass; backward only scales
the saved gradients. For one row with hidden state h, logits z = W·h and target t:

    loss     = logsumexp(z) - z[t]
    dloss/dz = softmax(z) - onehot(t)
    dloss/dh = Wᵀ·(dloss/dz)            dloss/dW = (dloss/dz)·hᵀ

tests/test_loss.py checks the loss and both gradients against F.cross_entropy.
"""

from __future__ import annotations

import torch

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
    """Computes the gradients in the forward pass (see the module docstring for why)."""

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
