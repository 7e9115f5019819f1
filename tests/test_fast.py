"""tinylm.fast: each faster path gives what the readable code it stands in for gives."""

import pytest
import torch
import torch.nn.functional as F

import tinylm.fast
from tinylm.attention import attention_steps, causal_mask
from tinylm.fast import (
    LEVELS,
    Dropout,
    cheaper_dropout,
    cpu_decoding,
    dropout,
    fused_attention,
    lm_head_cross_entropy,
    softmax_attention,
)
from tinylm.model import ModelConfig, TinyLM

# ---- attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("t_q, t_k", [(9, 9), (3, 9), (1, 9)])
def test_softmax_attention_equals_the_explicit_path_outputs_and_gradients(t_q, t_k):
    """The bf16 CPU fast path is attention_steps' arithmetic: same output and gradients in fp32,
    also when the queries are the last t_q of t_k positions (the KV-cache case)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 3, t, 8, requires_grad=True) for t in (t_q, t_k, t_k))
    fast = softmax_attention(q, k, v, 0.0)
    explicit = attention_steps(q, k, v, is_causal=True).output
    assert (fast - explicit).abs().max() <= 1e-5
    g = torch.randn_like(fast)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g)
    grads_explicit = torch.autograd.grad(explicit, (q, k, v), g)
    for a, b in zip(grads_fast, grads_explicit, strict=True):
        assert (a - b).abs().max() <= 1e-5

@pytest.mark.parametrize("t_q, t_k", [(9, 9), (3, 9), (1, 9)])
@pytest.mark.parametrize("band", [None, 4])
def test_the_fused_kernel_as_called_equals_the_explicit_path(t_q, t_k, band):
    """PyTorch's fused kernel with is_causal, without a mask (one query after the cache) or with
    a mask (queries after cached keys; keys a band back hidden too): attention_steps' output."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 3, t, 8) for t in (t_q, t_k, t_k))
    hidden, scale = None, None
    if band is not None:  # an unscaled layer whose queries see the last `band` positions
        hidden = causal_mask(t_q, t_k) | torch.ones(t_q, t_k, dtype=torch.bool).tril(
            diagonal=t_k - t_q - band)
        scale = 1.0
    fused = fused_attention(q, k, v, 0.0, scale, hidden)
    explicit = attention_steps(q, k, v, mask=hidden, is_causal=True, scale=scale).output
    assert (fused - explicit).abs().max() <= 1e-5


# ---- dropout: F.dropout's behaviour with a mask drawn from a quarter of the random numbers

N = 1 << 20


def _binomial_bound(p_keep: float, n: int) -> float:
    return 5 * (p_keep * (1 - p_keep) / n) ** 0.5  # five standard deviations of a kept fraction


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_each_of_the_four_lanes_of_a_draw_keeps_1_minus_p_and_scales_by_its_inverse(p):
    torch.manual_seed(0)
    y = dropout(torch.ones(N), p)
    kept_levels = round((1 - p) * LEVELS)
    survivors = y[y != 0]
    assert torch.all(survivors == LEVELS / kept_levels)  # the exact inverse of k/65536
    assert abs(kept_levels / LEVELS - (1 - p)) <= 1 / (2 * LEVELS)
    # element i takes 16 bits i % 4 of a 64-bit draw: a lane that were not uniform (the sign bit
    # of a draw that is never negative) would keep another fraction than the other three
    for lane in range(4):
        kept = (y[lane::4] != 0).double().mean().item()
        assert abs(kept - (1 - p)) <= _binomial_bound(1 - p, N // 4), (lane, kept)
    assert abs(y.double().mean().item() - 1) <= _binomial_bound(1 - p, N) / (1 - p)


def test_neighbouring_elements_are_dropped_independently():
    torch.manual_seed(1)
    kept = (dropout(torch.ones(N), 0.5) != 0).double()
    both = (kept[:-1] * kept[1:]).mean().item()  # the next element shares a draw 3 times in 4
    assert abs(both - 0.25) <= _binomial_bound(0.25, N)


def test_the_mask_follows_torch_manual_seed_and_keeps_the_input_shape():
    x = torch.randn(3, 5, 7)
    torch.manual_seed(2)
    first = dropout(x, 0.3)
    torch.manual_seed(2)
    again = dropout(x, 0.3)
    other = dropout(x, 0.3)
    assert first.shape == x.shape and torch.equal(first, again)
    assert not torch.equal(first, other)
    kept = first != 0
    assert torch.equal(first[kept], x[kept] * (LEVELS / round(0.7 * LEVELS)))


def test_the_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(3)
    x = torch.randn(4, 9, requires_grad=True)
    y = dropout(x, 0.25)
    y.backward(torch.ones_like(y))
    factor = torch.where(y != 0, y / x, torch.zeros_like(y))  # 0 or 65536/k for each element
    assert torch.allclose(x.grad, factor.detach())
    assert torch.equal(x.grad.unique(), torch.tensor([0.0, LEVELS / round(0.75 * LEVELS)]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_dtype_gives_torch_wheres_values_and_gradient(dtype):
    """fp32 and fp64 carry the scale in a float mask, bf16 (which would round it) does not:
    either way the values are those of torch.where(kept, x, 0) * 65536/k, bit for bit."""
    scale = LEVELS / round(0.8 * LEVELS)
    torch.manual_seed(5)
    kept = dropout(torch.ones(4096, dtype=dtype), 0.2) != 0  # the mask this seed draws
    x = torch.randn(4096, dtype=dtype, requires_grad=True)
    torch.manual_seed(5)
    y = dropout(x, 0.2)
    y.backward(torch.ones_like(y))
    assert y.dtype == dtype and 0 < kept.sum() < kept.numel()
    assert torch.equal(y, torch.where(kept, x, 0.0) * scale)
    assert torch.equal(x.grad, torch.where(kept, torch.ones_like(x), 0.0) * scale)


def test_eval_p_zero_and_the_ends_of_the_range():
    x = torch.randn(6)
    assert dropout(x, 0.5, training=False) is x and dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros(6))
    assert dropout(x, 1e-7) is x  # below what 16 bits resolve: nothing dropped
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=f"must be in \\[0, 1\\], got {bad}"):
            dropout(x, bad)


def test_the_module_drops_in_training_only_and_training_swaps_it_in():
    module = Dropout(0.5)
    x = torch.ones(1000)
    assert (module(x) == 0).any() and repr(module) == "Dropout(p=0.5)"
    assert module.eval()(x) is x
    model = TinyLM(ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 3  # as written
    assert cheaper_dropout(model) is model
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert sum(isinstance(m, Dropout) for m in model.modules()) == 3  # embeddings, attn, mlp
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, Dropout))


@pytest.mark.slow
def test_torch_compile_keeps_pytorchs_own_dropout():
    torch.manual_seed(4)
    expected = F.dropout(torch.ones(64), 0.5)
    torch.manual_seed(4)
    compiled = torch.compile(lambda x: dropout(x, 0.5), backend="eager")(torch.ones(64))
    assert torch.equal(compiled, expected)


# ---- the LM head's loss: the chunked cross-entropy equals F.cross_entropy, loss and gradients

@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 rows, so a few dozen rows take several chunks and a ragged last one."""
    monkeypatch.setattr(tinylm.fast, "CHUNK_LOGITS", 8 * 50)
    monkeypatch.setattr(tinylm.fast, "MIN_ROWS_PER_CHUNK", 1)


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


# ---- decoding (tests/test_generate.py checks oneDNN and the matrices' layout through generate) ---

def test_decoding_sets_the_eval_models_dropout_modules_aside_and_puts_them_back():
    model = TinyLM(ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    before = list(model.modules())
    idx = torch.randint(0, 32, (1, 8))
    logits = model.eval()(idx).logits
    with cpu_decoding(model):
        assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
        torch.testing.assert_close(model(idx).logits, logits)  # other kernels: last digits
    assert list(model.modules()) == before
    with cpu_decoding(model.train()):  # a model in training keeps dropping
        assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 3
