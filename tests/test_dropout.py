"""tinylm.dropout: F.dropout's behaviour with a mask drawn from a quarter of the random numbers."""

import pytest
import torch
import torch.nn.functional as F

from tinylm.dropout import LEVELS, Dropout, dropout
from tinylm.model import ModelConfig, TinyLM

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


def test_the_module_drops_in_training_only_and_the_model_uses_it():
    module = Dropout(0.5)
    x = torch.ones(1000)
    assert (module(x) == 0).any() and repr(module) == "Dropout(p=0.5)"
    assert module.eval()(x) is x
    model = TinyLM(ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    assert sum(isinstance(m, Dropout) for m in model.modules()) == 3  # embeddings, attn, mlp


@pytest.mark.slow
def test_torch_compile_keeps_pytorchs_own_dropout():
    torch.manual_seed(4)
    expected = F.dropout(torch.ones(64), 0.5)
    torch.manual_seed(4)
    compiled = torch.compile(lambda x: dropout(x, 0.5), backend="eager")(torch.ones(64))
    assert torch.equal(compiled, expected)
