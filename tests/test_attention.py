"""Behaviour of tinylm.attention: the worked example, masking, stability, both paths, the cache,
the hook points and the head interventions built on them."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import attention_with_weights
from torch import nn

import tinylm.fast
from tinylm.attention import (
    MultiHeadAttention,
    attention_steps,
    causal_mask,
    scaled_dot_product_attention,
    unshifted_exps,
    weighted_values,
)
from tinylm.hooks import caching, hook_points, hooks
from tinylm.inspection.interventions import head_replaced, heads_scaled
from tinylm.kv_cache import KVCache

# The worked example of docs/attention.md: 3 tokens, d = 2, K = Q
Q = K = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])


def test_worked_example_first_query_weights_and_output():
    output, weights = scaled_dot_product_attention(Q, K, V)
    assert torch.allclose(weights[0], torch.tensor([0.401, 0.198, 0.401]), atol=5e-4)
    assert torch.allclose(output[0], torch.tensor([0.802, 0.797]), atol=5e-4)
    assert torch.allclose(weights.sum(-1), torch.ones(3))


def test_worked_example_intermediate_steps():
    steps = attention_steps(Q, K, V)
    assert steps.scores[0].tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(steps.scaled[0], torch.tensor([0.7071, 0.0, 0.7071]), atol=1e-4)
    # the row max (0.7071) is subtracted before exp, so the exps are the textbook ones divided
    # by e^0.7071; the weights do not change
    unshifted = steps.exps[0] * math.exp(steps.row_max[0].item())
    assert torch.allclose(unshifted, torch.tensor([2.028114981, 1.0, 2.028114981]), atol=1e-6)
    assert torch.allclose(steps.exp_sum[0] * math.exp(steps.row_max[0].item()),
                          torch.tensor([5.056229962]), atol=1e-6)
    assert torch.equal(steps.shifted, steps.masked - steps.row_max)
    assert torch.equal(unshifted_exps(steps)[0], unshifted)


def test_weighted_values_sum_to_the_output():
    steps = attention_steps(Q, K, V)
    terms = weighted_values(steps.weights, V)  # (T_q, T_k, d_v)
    assert terms.shape == (3, 3, 2)
    assert torch.allclose(terms[0, 1], steps.weights[0, 1] * V[1])
    torch.testing.assert_close(terms.sum(-2), steps.output)


def test_causal_mask_is_strictly_upper_triangular():
    mask = causal_mask(4, 4)
    expected = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]).bool()
    assert torch.equal(mask, expected)


def test_causal_mask_for_queries_that_follow_cached_keys():
    # 2 new queries after 3 cached keys sit at positions 3 and 4
    mask = causal_mask(2, 5)
    expected = torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_causal_weights_are_zero_above_the_diagonal():
    _, weights = scaled_dot_product_attention(Q, K, V, is_causal=True)
    assert torch.all(weights.triu(diagonal=1) == 0)
    assert weights[0].tolist() == [1.0, 0.0, 0.0]  # the first token can only look at itself
    assert torch.allclose(weights.sum(-1), torch.ones(3))


def test_exps_are_exp_of_the_shifted_scores_and_the_masked_ones_give_exact_zeros():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 8) * 3 for _ in range(3))  # shifted scores down to ~ -40
    steps = attention_steps(q, k, v, is_causal=True)
    hidden = causal_mask(16, 16)
    assert torch.equal(steps.masked, steps.scaled.masked_fill(hidden, float("-inf")))
    assert steps.shifted.masked_select(~hidden).min() < -20
    assert torch.equal(steps.exps, torch.exp(steps.shifted))  # as the docstring writes it
    assert torch.all(steps.exps.masked_select(hidden) == 0)


def test_huge_scores_give_finite_weights_that_sum_to_one():
    q = torch.tensor([[1e4, -1e4], [3e4, 2e4]])
    k = torch.tensor([[1e4, 0.0], [0.0, 1e4], [-1e4, 1e4]])
    _, weights = scaled_dot_product_attention(q, k, torch.randn(3, 4))
    assert torch.isfinite(weights).all()
    assert torch.allclose(weights.sum(-1), torch.ones(2))


def test_fully_masked_row_gives_zeros_not_nan():
    mask = torch.tensor([[True, True, True], [False, True, True], [False, False, False]])
    output, weights = scaled_dot_product_attention(Q, K, V, mask=mask)
    assert not torch.isnan(output).any() and not torch.isnan(weights).any()
    assert weights[0].tolist() == [0.0, 0.0, 0.0] and output[0].tolist() == [0.0, 0.0]
    assert torch.allclose(weights[1:].sum(-1), torch.ones(2))


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="last dimension"):
        scaled_dot_product_attention(torch.randn(3, 2), torch.randn(3, 4), torch.randn(3, 2))
    with pytest.raises(ValueError, match="positions"):
        scaled_dot_product_attention(torch.randn(3, 2), torch.randn(3, 2), torch.randn(4, 2))


def _mha(seed=0, n_embd=32, n_head=4, bias=True):
    torch.manual_seed(seed)
    return MultiHeadAttention(n_embd, n_head, dropout=0.0, bias=bias).eval()


def test_explicit_path_equals_fused_path_outputs_and_gradients():
    mha = _mha()
    x = torch.randn(3, 10, 32)
    x_fused, x_explicit = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_fused = mha(x_fused)
    y_fused.square().sum().backward()
    grads_fused = [p.grad.clone() for p in mha.parameters()]
    mha.zero_grad()
    y_explicit, weights = attention_with_weights(mha, x_explicit)
    y_explicit.square().sum().backward()

    assert weights.shape == (3, 4, 10, 10)
    assert (y_fused - y_explicit).abs().max() <= 1e-5
    assert (x_fused.grad - x_explicit.grad).abs().max() <= 1e-5
    for g_fused, p in zip(grads_fused, mha.parameters(), strict=True):
        assert (g_fused - p.grad).abs().max() <= 1e-5


def test_matches_torch_multihead_attention_with_the_same_weights():
    mha = _mha(seed=1)
    reference = nn.MultiheadAttention(32, 4, bias=True, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(mha.qkv_proj.weight)
        reference.in_proj_bias.copy_(mha.qkv_proj.bias)
        reference.out_proj.weight.copy_(mha.out_proj.weight)
        reference.out_proj.bias.copy_(mha.out_proj.bias)
    x = torch.randn(2, 7, 32)
    ours, our_weights = attention_with_weights(mha, x)
    theirs, their_weights = reference(x, x, x, attn_mask=causal_mask(7, 7),
                                      need_weights=True, average_attn_weights=False)
    assert (ours - theirs).abs().max() <= 1e-5
    assert (our_weights - their_weights).abs().max() <= 1e-5


@pytest.mark.parametrize("read_weights", [False, True])
def test_kv_cache_gives_the_same_output_as_the_full_sequence(read_weights):
    mha = _mha(seed=2)
    x = torch.randn(2, 9, 32)
    full = mha(x)
    cache = KVCache(1, 2, 4, max_len=16, head_size=8)
    # a 4-token prefill, a 3-token chunk (queries after cached keys), then one token at a time
    pieces = [x[:, :4], x[:, 4:7], x[:, 7:8], x[:, 8:9]]
    outputs = []
    for piece in pieces:
        if read_weights:
            y, weights = attention_with_weights(mha, piece, kv_cache=cache.layer(0))
            assert weights.shape == (2, 4, piece.size(1), cache.length + piece.size(1))
        else:
            y = mha(piece, kv_cache=cache.layer(0))
        outputs.append(y)
        cache.advance(piece.size(1))
    assert cache.length == 9
    assert (torch.cat(outputs, dim=1) - full).abs().max() <= 1e-5


def test_kv_cache_refuses_to_overflow():
    cache = KVCache(1, 1, 2, max_len=4, head_size=3)
    cache.layer(0).append(torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3))
    cache.advance(4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.layer(0).append(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))


# ---- hook points ------------------------------------------------------------------------------

POINTS = ["hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z"]


def test_hook_points_have_their_documented_names_and_shapes():
    mha = _mha(seed=7)
    assert list(hook_points(mha)) == POINTS  # in the order the forward pass reaches them
    with caching(mha, POINTS) as cache:
        mha(torch.randn(2, 5, 32))
    assert {name: tuple(t.shape) for name, t in cache.items()} == {
        "hook_q": (2, 4, 5, 8), "hook_k": (2, 4, 5, 8), "hook_v": (2, 4, 5, 8),
        "hook_pattern": (2, 4, 5, 5), "hook_z": (2, 4, 5, 8)}
    with pytest.raises(KeyError, match="no hook point 'hook_attn'; there are hook_k, hook_pattern"):
        with caching(mha, ["hook_attn"]):
            pass


def test_hook_pattern_reads_the_explicit_paths_weights_and_leaves_the_output_of_the_fast_one():
    mha = _mha(seed=8)
    x = torch.randn(2, 7, 32)
    with caching(mha, ["hook_q", "hook_k", "hook_v"]) as qkv:  # the fast path: no pattern read
        fast = mha(x)
    y, weights = attention_with_weights(mha, x)
    steps = mha.steps(qkv["hook_q"], qkv["hook_k"], qkv["hook_v"])
    assert torch.equal(weights, steps.weights)
    assert (y - fast).abs().max() <= 1e-5
    # the head outputs are the weights' mix of the values, as hook_z shows them
    with caching(mha, ["hook_z"]) as cache:
        mha(x)
    assert (cache["hook_z"] - steps.output).abs().max() <= 1e-5


def test_a_hook_that_returns_a_replacement_changes_what_follows():
    mha = _mha(seed=9)
    x = torch.randn(1, 6, 32)
    plain = mha(x)
    with hooks(mha, {"hook_v": torch.zeros_like}):  # nothing to mix: only out_proj's bias
        torch.testing.assert_close(mha(x), mha.out_proj.bias.expand(1, 6, 32))
    # every query spreads its weight evenly over the keys it sees: each output is a mean
    uniform = (~causal_mask(6, 6)).float()
    uniform = uniform / uniform.sum(-1, keepdim=True)
    with hooks(mha, {"hook_pattern": lambda w: uniform.expand_as(w)}), \
            caching(mha, ["hook_v", "hook_z"]) as cache:
        replaced = mha(x)
    torch.testing.assert_close(cache["hook_z"], uniform @ cache["hook_v"])
    assert not torch.allclose(replaced, plain)
    with hooks(mha, {"hook_q": lambda q: q}):  # a hook that returns its input changes nothing
        assert torch.equal(mha(x), plain)


def test_reading_a_hook_point_changes_no_number():
    mha = _mha(seed=10)
    x = torch.randn(2, 6, 32)
    plain = mha(x)
    with caching(mha, ["hook_q", "hook_k", "hook_v", "hook_z"]):
        assert torch.equal(mha(x), plain)


def _as_layer_0(mha: MultiHeadAttention) -> nn.Module:
    """A module holding `mha` where a model holds layer 0's attention (blocks.0.attn), so that the
    interventions find its hook points by their names in a model."""
    block, model = nn.Module(), nn.Module()
    block.attn = mha
    model.blocks = nn.ModuleList([block])
    return model


def test_heads_scaled_removes_exactly_that_heads_share_of_the_output():
    mha = _mha(seed=3, bias=False)
    x = torch.randn(1, 5, 32)
    model = _as_layer_0(mha)
    with caching(mha, ["hook_z"]) as cache:
        plain = mha(x)
    with heads_scaled(model, torch.tensor([[1.0, 1.0, 1.0, 1.0]])):
        assert not any(p.hooked for p in hook_points(mha).values())  # all 1: nothing to do
        assert torch.equal(mha(x), plain)
    with heads_scaled(model, torch.tensor([[1.0, 0.0, 1.0, 1.0]])):
        without_head_1 = mha(x)
    with heads_scaled(model, torch.tensor([[1.0, 0.5, 1.0, 1.0]])):
        half_head_1 = mha(x)
    # head 1's share: its output (hook_z) times its slice of out_proj
    head_1 = cache["hook_z"][:, 1] @ mha.out_proj.weight[:, 8:16].T
    torch.testing.assert_close(plain - without_head_1, head_1)
    torch.testing.assert_close(plain - half_head_1, 0.5 * head_1)
    with pytest.raises(ValueError, match="a mask of 2 heads per layer, but layer 0 has 4"):
        with heads_scaled(model, torch.tensor([[1.0, 0.0]])):
            mha(x)


def test_head_replaced_puts_its_values_in_one_head_where_asked():
    mha = _mha(seed=11, bias=False)
    x = torch.randn(2, 5, 32)
    model = _as_layer_0(mha)
    plain = mha(x)
    with heads_scaled(model, torch.tensor([[1.0, 1.0, 0.0, 1.0]])):
        zeroed = mha(x)
    with head_replaced(model, 0, 2, torch.zeros(5, 8)):  # zeros: zero-ablation
        torch.testing.assert_close(mha(x), zeroed)
    where = torch.zeros(2, 5, dtype=torch.bool)
    where[1, 3] = True  # one position of one sequence
    values = torch.randn(2, 5, 8)
    with head_replaced(model, 0, 2, values, where), caching(mha, ["hook_z"]) as cache:
        patched = mha(x)
    assert torch.equal(cache["hook_z"][1, 2, 3], values[1, 3])
    changed = (patched != plain).any(-1)  # (B, T): a position's output is its own heads' mix
    assert changed.tolist() == where.tolist()
    with pytest.raises(ValueError, match="a sequence of 5 tokens, but values for only 4 "
                                         "positions to put in head 2"):
        with head_replaced(model, 0, 2, torch.zeros(4, 8)):
            mha(x)
    with pytest.raises(ValueError, match=r"values of shape \(5, 6\); a head's output in layer 0 "
                                         r"is \(positions, 8\)"):
        with head_replaced(model, 0, 2, torch.zeros(5, 6)):
            mha(x)


def test_no_hook_is_left_registered_after_any_context_even_one_that_raised():
    mha = _mha(seed=12)
    model, x = _as_layer_0(mha), torch.randn(1, 4, 32)
    contexts = [lambda: hooks(mha, {"hook_q": lambda q: q, "hook_pattern": lambda w: None}),
                lambda: caching(mha, POINTS),
                lambda: heads_scaled(model, torch.tensor([[0.0, 1.0, 1.0, 1.0]])),
                lambda: head_replaced(model, 0, 1, torch.zeros(4, 8))]
    for context in contexts:
        with context():
            assert any(p.hooked for p in hook_points(mha).values())
            mha(x)
        assert not any(p.hooked for p in hook_points(mha).values())
        with pytest.raises(RuntimeError, match="stop"), context():
            raise RuntimeError("stop")
        assert not any(p.hooked for p in hook_points(mha).values())


def test_n_embd_must_divide_into_heads():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(30, 4)


def test_fast_path_under_bf16_autocast_stays_close_to_fp32_and_passes_gradients():
    mha = _mha(seed=4)
    x = torch.randn(2, 12, 32, requires_grad=True)
    reference = mha(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mha(x)
    assert y.dtype == torch.bfloat16
    assert (y.float() - reference).abs().max() <= 2e-2
    y.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_bf16_fast_path_matches_the_explicit_path_under_autocast():
    mha = _mha(seed=6)
    x = torch.randn(2, 12, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = mha(x)
        explicit, _ = attention_with_weights(mha, x)
    assert fast.dtype == explicit.dtype == torch.bfloat16
    assert (fast.float() - explicit.float()).abs().max() <= 1e-2


def test_with_dropout_the_fast_path_drops_what_the_explicit_path_drops(monkeypatch):
    # with the explicit path's F.dropout in the fast path too (whose own cheaper mask
    # tests/test_fast.py checks), the same seed draws the same mask for both paths, so training
    # with dropout gives the same outputs and gradients whichever path runs
    monkeypatch.setattr(tinylm.fast, "dropout", lambda x, p: F.dropout(x, p))
    torch.manual_seed(5)
    mha = MultiHeadAttention(32, 4, dropout=0.3, bias=True).train()
    x = torch.randn(3, 10, 32)
    results = []
    for read_weights in (False, True):
        mha.zero_grad()
        x_path = x.clone().requires_grad_()
        torch.manual_seed(6)
        y = attention_with_weights(mha, x_path)[0] if read_weights else mha(x_path)
        y.square().sum().backward()
        results.append((y, x_path.grad, [p.grad.clone() for p in mha.parameters()]))
    (y_fast, gx_fast, grads_fast), (y_explicit, gx_explicit, grads_explicit) = results
    assert (y_fast - y_explicit).abs().max() <= 1e-5
    assert (gx_fast - gx_explicit).abs().max() <= 1e-5
    for g_fast, g_explicit in zip(grads_fast, grads_explicit, strict=True):
        assert (g_fast - g_explicit).abs().max() <= 1e-5
    torch.manual_seed(6)
    assert not torch.allclose(mha(x), mha.eval()(x))  # dropout did drop something
