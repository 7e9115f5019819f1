"""tinylm.loss: the chunked LM-head cross-entropy equals F.cross_entropy, loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

import tinylm.loss
from tinylm.loss import lm_head_cross_entropy


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows, so a few dozen rows take several chunks and a ragged last one."""
    monkeypatch.setattr(tinylm.loss, "CHUNK_LOGITS", 8 * 50)
    monkeypatch.setattr(tinylm.loss, "MIN_ROWS_PER_CHUNK", 1)


def _inputs(n_rows=37, n_embd=16, vocab_size=50, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(n_rows, n_embd, requires_grad=True)
    weight = (torch.randn(vocab_size, n_embd) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab_size, (n_rows,))
    return h, weight, targets


def _loss_and_grads(loss_fn, h, weight, targets):
    loss = loss_fn(h, weight, targets)
    grad_h, grad_weight = torch.autograd.grad(loss, (h, weight))
    return loss, grad_h, grad_weight


def _reference(h, weight, targets):
    return F.cross_entropy((h @ weight.t()).float(), targets, ignore_index=-1)


@pytest.mark.parametrize("ignored_rows", [[], [0, 5, 17, 36]])
def test_equals_cross_entropy_loss_and_gradients_in_fp32(small_chunks, ignored_rows):
    h, weight, targets = _inputs()
    targets[ignored_rows] = -1
    expected = _loss_and_grads(_reference, h, weight, targets)
    ours = _loss_and_grads(lm_head_cross_entropy, h, weight, targets)
    assert abs(ours[0].item() - expected[0].item()) <= 1e-5
    assert (ours[1] - expected[1]).abs().max() <= 1e-6  # dloss/dh
    assert (ours[2] - expected[2]).abs().max() <= 1e-6  # dloss/dweight
    if ignored_rows:  # an ignored row gets no gradient at all
        assert torch.all(ours[1][ignored_rows] == 0)


def test_under_bf16_autocast_stays_close_to_the_unfused_loss(small_chunks):
    h, weight, targets = _inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _loss_and_grads(_reference, h, weight, targets)
        ours = _loss_and_grads(lm_head_cross_entropy, h, weight, targets)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == h.dtype
    assert abs(ours[0].item() - expected[0].item()) <= 1e-3
    for mine, theirs in zip(ours[1:], expected[1:], strict=True):
        assert (mine - theirs).abs().max() <= 2e-2 * theirs.abs().max()


def test_a_scaled_loss_scales_the_gradients(small_chunks):
    """Gradient accumulation divides the loss, a loss scaler multiplies it: backward must follow."""
    h, weight, targets = _inputs(seed=2)
    _, grad_h, grad_weight = _loss_and_grads(lm_head_cross_entropy, h, weight, targets)
    scaled = 0.25 * lm_head_cross_entropy(h, weight, targets)
    scaled_h, scaled_weight = torch.autograd.grad(scaled, (h, weight))
    assert torch.allclose(scaled_h, 0.25 * grad_h) and torch.allclose(scaled_weight,
                                                                        0.25 * grad_weight)


def test_without_gradients_gives_the_same_loss(small_chunks):
    h, weight, targets = _inputs(seed=3)
    with torch.no_grad():
        loss = lm_head_cross_entropy(h, weight, targets)
    assert not loss.requires_grad
    assert abs(loss.item() - _reference(h, weight, targets).item()) <= 1e-5


def test_all_rows_ignored_gives_zero_loss_and_gradient():
    h, weight, targets = _inputs(n_rows=4)
    loss, grad_h, grad_weight = _loss_and_grads(lm_head_cross_entropy, h, weight,
                                                torch.full((4,), -1))
    assert loss.item() == 0.0 and not grad_h.any() and not grad_weight.any()


def test_the_model_without_logits_trains_exactly_like_with_them(tiny_model):
    model = tiny_model(60, seed=4, block_size=16, dropout=0.0)
    idx, targets = torch.randint(0, 60, (3, 16)), torch.randint(0, 60, (3, 16))
    targets[0, :5] = -1
    grads = []
    for need_logits in (True, False):
        model.zero_grad()
        out = model(idx, targets, need_logits=need_logits)
        out.loss.backward()
        grads.append((out.loss.item(), [p.grad.clone() for p in model.parameters()]))
        assert (out.logits is None) == (not need_logits)
    (loss_full, grads_full), (loss_chunked, grads_chunked) = grads
    assert abs(loss_full - loss_chunked) <= 1e-5
    for full, chunked in zip(grads_full, grads_chunked, strict=True):
        assert (full - chunked).abs().max() <= 1e-6


def test_the_model_needs_targets_to_skip_the_logits(tiny_model):
    model = tiny_model(20, block_size=8, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ValueError, match="pass targets"):
        model(torch.zeros(1, 8, dtype=torch.long), need_logits=False)


def test_fp16_autocast_runs_the_head_in_fp32(small_chunks):
    """A loss scaler multiplies the loss only after these gradients exist: in fp16 the small ones
    would underflow to 0, so under fp16 autocast the head gives exactly its fp32 results."""
    h, weight, targets = _inputs(seed=5)
    fp32 = _loss_and_grads(lm_head_cross_entropy, h, weight, targets)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = _loss_and_grads(lm_head_cross_entropy, h, weight, targets)
    for a, b in zip(fp16, fp32, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)
