"""Behaviour of tinylm.model: causality, the KV cache, attention capture, hook points, config
checks."""

import pytest
import torch

from tinylm.hooks import caching, hook_points, hooks, run_with_cache
from tinylm.inspection.interventions import heads_scaled
from tinylm.model import ModelConfig
from tinylm.train.runtime import flops_per_token


@pytest.fixture
def tiny_model(tiny_model):
    """conftest's tiny models made to this file's measure: block_size 16, 4 heads, n_embd 32."""
    def build(seed=0, vocab_size=50, **overrides):
        return tiny_model(vocab_size, seed,
                          **{"block_size": 16, "n_head": 4, "n_embd": 32, **overrides})
    return build


def test_logits_at_or_before_t_ignore_later_tokens(tiny_model):
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 12))
    changed = idx.clone()
    changed[:, 7:] = torch.randint(0, 50, (2, 5))
    logits, _, _ = model(idx)
    logits_changed, _, _ = model(changed)
    assert torch.equal(logits[:, :7], logits_changed[:, :7])
    assert not torch.allclose(logits[:, 7:], logits_changed[:, 7:])


@pytest.mark.parametrize("return_attention", [False, True])
def test_gradient_of_output_t_wrt_later_inputs_is_exactly_zero(return_attention, tiny_model):
    model = tiny_model(seed=1)
    idx = torch.randint(0, 50, (1, 10))
    captured = {}

    def keep_embeddings(module, inputs, output):
        output.retain_grad()
        captured["x"] = output

    handle = model.drop.register_forward_hook(keep_embeddings)
    logits, _, _ = model(idx, return_attention=return_attention)
    handle.remove()
    t = 4
    logits[0, t].sum().backward()
    grad = captured["x"].grad[0]  # (T, C): d logits_t / d input embedding at each position
    assert torch.all(grad[t + 1:] == 0)
    assert grad[: t + 1].abs().sum() > 0


def test_loss_is_cross_entropy_of_the_targets(tiny_model):
    model = tiny_model()
    idx = torch.randint(0, 50, (2, 8))
    targets = torch.randint(0, 50, (2, 8))
    logits, loss, _ = model(idx, targets)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 50), targets.view(-1))
    assert torch.allclose(loss, expected)
    # an untrained model starts near uniform: loss close to ln(vocab_size)
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.5
    assert model(idx)[1] is None


def test_attention_weights_of_every_layer_when_asked(tiny_model):
    model = tiny_model()
    _, _, attentions = model(torch.randint(0, 50, (3, 9)), return_attention=True)
    assert len(attentions) == 2
    for weights in attentions:
        assert weights.shape == (3, 4, 9, 9)
        assert torch.allclose(weights.sum(-1), torch.ones(3, 4, 9), atol=1e-6)
        assert torch.all(weights.triu(diagonal=1) == 0)
    assert model(torch.randint(0, 50, (1, 4)))[2] is None


def test_fast_and_explicit_paths_give_the_same_logits(tiny_model):
    model = tiny_model(seed=2)
    idx = torch.randint(0, 50, (2, 16))
    fast = model(idx).logits
    explicit = model(idx, return_attention=True).logits
    assert (fast - explicit).abs().max() <= 1e-5


@pytest.mark.parametrize("return_attention", [False, True])
def test_kv_cache_decoding_matches_full_forward_token_by_token(return_attention, tiny_model):
    model = tiny_model(seed=3)
    idx = torch.randint(0, 50, (2, 14))
    full = model(idx).logits
    cache = model.new_kv_cache(batch_size=2)
    steps = [model(idx[:, :5], kv_cache=cache, return_attention=return_attention).logits]
    for t in range(5, 14):
        out = model(idx[:, t:t + 1], kv_cache=cache, return_attention=return_attention)
        steps.append(out.logits)
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5


def test_rewound_cache_decodes_like_a_fresh_prefill(tiny_model):
    model = tiny_model(seed=5)
    idx = torch.randint(0, 50, (2, 12))
    other = torch.randint(0, 50, (2, 3))  # what follows the first 7 tokens instead
    cache = model.new_kv_cache(batch_size=2)
    model(idx, kv_cache=cache)
    assert cache.length == 12
    cache.rewind(7)
    assert cache.length == 7
    rewound = model(other, kv_cache=cache).logits
    assert cache.length == 10
    fresh = model(torch.cat([idx[:, :7], other], dim=1)).logits[:, 7:]
    assert (rewound - fresh).abs().max() <= 1e-5


def test_reset_cache_starts_a_new_sequence_at_position_0(tiny_model):
    model = tiny_model(seed=6)
    idx = torch.randint(0, 50, (1, 6))
    cache = model.new_kv_cache(1)
    model(torch.randint(0, 50, (1, 9)), kv_cache=cache)
    cache.reset()
    assert cache.length == 0
    assert (model(idx, kv_cache=cache).logits - model(idx).logits).abs().max() <= 1e-5
    cache.rewind(0)  # rewinding to the start is a reset
    assert cache.length == 0


@pytest.mark.parametrize("position", [-1, 6, 2.0, True, None])
def test_rewind_refuses_positions_outside_the_cache(position, tiny_model):
    model = tiny_model()
    cache = model.new_kv_cache(1)
    model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match=f"cannot rewind the KV cache to position {position!r}: "
                                         "it must be an integer from 0 to the 5 positions cached"):
        cache.rewind(position)
    assert cache.length == 5


def test_only_the_cache_moves_its_length(tiny_model):
    cache = tiny_model().new_kv_cache(1)
    with pytest.raises(AttributeError):
        cache.length = 3
    with pytest.raises(ValueError, match="cannot advance 0 by -1"):
        cache.advance(-1)


def test_sequence_longer_than_block_size_is_rejected(tiny_model):
    model = tiny_model()
    with pytest.raises(ValueError, match="longer than block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    cache = model.new_kv_cache(1)
    model(torch.zeros(1, 16, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="17 tokens"):
        model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


def test_lm_head_is_tied_to_token_embedding(tiny_model):
    model = tiny_model()
    assert model.lm_head.weight is model.wte.weight


def test_residual_projections_get_the_smaller_gpt2_init(tiny_model):
    model = tiny_model(n_layer=8, n_embd=64, vocab_size=500)
    assert abs(model.blocks[0].attn.qkv_proj.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / 4) < 0.001


def test_parameter_count_and_flops_per_token(tiny_model):
    model = tiny_model(bias=False)
    c = model.config
    # attention (qkv + out), MLP (4x up + down), two LayerNorm weights
    per_block = 4 * c.n_embd * c.n_embd + 8 * c.n_embd * c.n_embd + 2 * c.n_embd
    expected = c.vocab_size * c.n_embd + c.n_layer * per_block + c.n_embd  # + final norm
    assert model.num_params() == expected
    assert model.num_params(non_embedding=False) == expected + c.block_size * c.n_embd
    assert flops_per_token(model, 8) == 6 * expected + 12 * c.n_layer * c.n_embd * 8


def test_heads_scaled_by_ones_changes_nothing_and_a_zero_changes_the_logits(tiny_model):
    model = tiny_model(seed=4)
    idx = torch.randint(0, 50, (1, 8))
    plain = model(idx).logits
    ones = torch.ones(2, 4)
    with heads_scaled(model, ones):
        assert torch.equal(model(idx).logits, plain)
    ablated = ones.clone()
    ablated[1, 2] = 0
    with heads_scaled(model, ablated):
        assert not torch.allclose(model(idx).logits, plain)
    assert torch.equal(model(idx).logits, plain)  # the hook is gone


def test_hook_points_have_their_documented_names_and_shapes(tiny_model):
    model = tiny_model(seed=7)
    per_layer = ["hook_resid_pre", "attn.hook_q", "attn.hook_k", "attn.hook_v",
                 "attn.hook_pattern", "attn.hook_z", "hook_resid_post"]
    names = [f"blocks.{i}.{point}" for i in range(2) for point in per_layer]
    assert sorted(hook_points(model)) == sorted(names)
    out, cache = run_with_cache(model, torch.randint(0, 50, (3, 9)), names)
    assert list(cache) == names  # filled in the order the forward pass reaches them
    shapes = {"hook_resid_pre": (3, 9, 32), "hook_q": (3, 4, 9, 8), "hook_k": (3, 4, 9, 8),
              "hook_v": (3, 4, 9, 8), "hook_pattern": (3, 4, 9, 9), "hook_z": (3, 4, 9, 8),
              "hook_resid_post": (3, 9, 32)}
    for name, activation in cache.items():
        assert tuple(activation.shape) == shapes[name.rsplit(".", 1)[-1]], name
    assert torch.equal(cache["blocks.0.hook_resid_post"], cache["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(model.lm_head(model.ln_f(cache["blocks.1.hook_resid_post"])),
                               out.logits)
    # a last part names that point in every layer; return_attention reads the same weights
    idx = torch.randint(0, 50, (1, 4))
    _, patterns = run_with_cache(model, idx, ["hook_pattern"])
    assert list(patterns) == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]
    for weights, pattern in zip(model(idx, return_attention=True).attentions, patterns.values(),
                                strict=True):
        assert torch.equal(weights, pattern)


def test_forward_from_a_layers_input_gives_the_states_the_lm_head_reads(tiny_model):
    model = tiny_model(seed=8)
    idx = torch.randint(0, 50, (2, 10))
    logits = model(idx).logits
    _, cache = run_with_cache(model, idx, ["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(model.lm_head(model.forward_from(1, cache[
        "blocks.1.hook_resid_pre"])), logits)
    assert torch.equal(model.lm_head(model.forward_from(0, model.embed(idx))), logits)


def test_a_replacing_hook_changes_the_logits_after_its_point_only(tiny_model):
    model = tiny_model(seed=9)
    idx = torch.randint(0, 50, (1, 8))
    plain = model(idx).logits

    def zero_position_5(x):  # (B, T, C): the residual stream into block 1
        x = x.clone()
        x[:, 5] = 0
        return x
    with hooks(model, {"blocks.1.hook_resid_pre": zero_position_5}):
        changed = model(idx).logits
    assert torch.equal(changed[:, :5], plain[:, :5])  # causal: earlier positions never see it
    assert not torch.allclose(changed[:, 5:], plain[:, 5:])


def test_no_hook_is_left_registered_after_a_forward_pass_with_hooks(tiny_model):
    model = tiny_model(seed=10)
    idx = torch.randint(0, 50, (1, 6))

    def hooked() -> list[str]:
        return [name for name, point in hook_points(model).items() if point.hooked]
    model(idx, return_attention=True)
    run_with_cache(model, idx, ["hook_pattern", "hook_z", "hook_resid_pre"])
    with heads_scaled(model, torch.zeros(2, 4)):
        assert hooked() == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"]
        model(idx)
    with pytest.raises(ValueError, match="longer than block_size"), caching(model, ["hook_q"]):
        model(torch.zeros(1, 17, dtype=torch.long))
    assert hooked() == []


@pytest.mark.parametrize("field,value,message", [
    ("n_embd", 30, "model.n_embd=30 is not allowed: must be divisible by model.n_head=4"),
    ("n_layer", 0, "model.n_layer=0 is not allowed"),
    ("dropout", 1.5, "model.dropout=1.5 is not allowed"),
    ("vocab_size", -3, "model.vocab_size=-3 is not allowed"),
])
def test_impossible_config_values_are_named(field, value, message):
    values = dict(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)
    values[field] = value
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ModelConfig(**values)
