"""Behaviour of tinylm.inspection.patching: a model built to carry the name through one head,
agreement with the same patch on transformers' GPT-2 and on a Llama with grouped-query heads,
batching, the effect arithmetic, the bootstrap, pairs from probe items, attribution patching,
mean-ablation."""

import functools

import numpy as np
import pytest
import torch
from helpers import save_llama_folder
from torch import nn

from tinylm.files import project_root
from tinylm.hooks import caching
from tinylm.inspection.interventions import head_replaced
from tinylm.inspection.patching import (
    PatchingResult,
    PatchPair,
    attribution_patch,
    build_pairs,
    head_output_means,
    patch_heads,
)
from tinylm.inspection.probe_items import EncodedAgreementItem, ProbeItem
from tinylm.inspection.probe_types import load_probe_file, parse_item
from tinylm.tokenizer import CharTokenizer

F, M, SHE, HE, DOT, X = range(6)  # token ids of the hand-built model
ONE, GENDER, GATE, NAME_SEEN = 6, 7, 8, 9  # its other residual dimensions
CARRIER, GATE_HEAD, LOOKER, IDLE = range(4)


def gated_model(tiny_model):
    """One layer, four heads of 8 dims, LayerNorms removed, built so that one head carries the
    name's gender to the '.' before the pronoun and another is needed without carrying it.

    Embeddings are one-hot (x3) on dims 0..5, and 3 on ONE for every token. CARRIER looks from
    '.' at the name (query: '.', key: F or M) and writes F - M (+1 or -1) to GENDER. GATE_HEAD
    spreads evenly and writes the constant 1 to GATE at every position. LOOKER looks at the name
    like CARRIER but writes F + M ("a name", the same for both genders) to NAME_SEEN, which
    nothing reads. IDLE writes nothing. The MLP multiplies: gelu(s(g + 2k - 2)) - gelu(s(-g +
    2k - 2)) is s·g when k = 1 (gelu(x) - gelu(-x) = x) and ~0 when k = 0; it writes that to
    +she / -he, so the she - he logit difference is 6·GENDER·GATE.
    """
    model = tiny_model(6, block_size=16, n_layer=1, n_head=4, n_embd=32, seed=1)
    c, hs, s = 32, 8, 10.0  # qkv_proj rows: q | k | v, each head's 8 in turn
    block = model.blocks[0]
    block.ln_1, block.ln_2, model.ln_f = nn.Identity(), nn.Identity(), nn.Identity()
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, :6] = 3 * torch.eye(6)
        model.wte.weight[:, ONE] = 3.0
        model.wpe.weight.zero_()
        qkv, out = block.attn.qkv_proj.weight, block.attn.out_proj.weight
        qkv.zero_(), out.zero_()
        for head, value, dim in ((CARRIER, [1.0, -1.0], GENDER), (LOOKER, [1.0, 1.0], NAME_SEEN)):
            qkv[head * hs, DOT] = 4.0  # query: at '.'
            qkv[c + head * hs, [F, M]] = 4.0  # key: a name
            qkv[2 * c + head * hs, [F, M]] = torch.tensor(value)
            out[dim, head * hs] = 1 / 3
        qkv[2 * c + GATE_HEAD * hs, ONE] = 1.0  # q = k = 0: even attention over a constant
        out[GATE, GATE_HEAD * hs] = 1 / 3
        fc, proj = block.mlp.fc.weight, block.mlp.proj.weight
        fc.zero_(), proj.zero_()
        for unit, sign in ((0, 1.0), (1, -1.0)):
            fc[unit, GENDER], fc[unit, GATE], fc[unit, ONE] = sign * s, 2 * s, -2 * s / 3
            proj[SHE, unit], proj[HE, unit] = sign / s, -sign / s
    return model


# (clean context, counterfactual context, clean pronoun, wrong pronoun): the name anywhere
GATED_PAIRS = [([F, X, X, DOT], [M, X, X, DOT], SHE, HE), ([X, M, DOT], [X, F, DOT], HE, SHE),
               ([X, X, F, X, DOT], [X, X, M, X, DOT], SHE, HE), ([M, DOT], [F, DOT], HE, SHE)]


def gated_pairs():
    return [PatchPair(f"pair {n}", clean, other, (written, wrong))
            for n, (clean, other, written, wrong) in enumerate(GATED_PAIRS)]


def test_patching_finds_the_one_head_that_carries_the_name_at_the_deciding_position(tiny_model):
    model = gated_model(tiny_model)
    result = patch_heads(model, gated_pairs())
    np.testing.assert_allclose(result.m_clean, 6.0, atol=1e-4)
    np.testing.assert_allclose(result.m_counterfactual, -6.0, atol=1e-4)
    by_position = result.effects_by_position()  # (L, nh, T_max), the last: the deciding position
    assert by_position.shape == (1, 4, 5)
    assert by_position[0, CARRIER, -1] >= 0.9
    others = np.ones(by_position.shape, dtype=bool)
    others[0, CARRIER, -1] = False
    assert np.abs(by_position[others]).max() <= 0.05
    effects = result.effects()
    assert effects[0, CARRIER] >= 0.9 and np.abs(effects[0, 1:]).max() <= 0.05
    # LOOKER attends to the name as much as CARRIER does: attention alone cannot tell them apart
    weights = model(torch.tensor([[X, X, F, X, DOT]]), return_attention=True).attentions[0]
    assert weights[0, LOOKER, -1, 2] > 0.99 and weights[0, CARRIER, -1, 2] > 0.99


def test_zero_ablation_is_fooled_by_a_needed_head_that_carries_no_name_and_mean_ablation_not(
        tiny_model):
    from tinylm.inspection.probe import ablate_heads, agreement_margins

    model = gated_model(tiny_model)
    encoded = [EncodedAgreementItem(clean + [written], clean + [wrong], len(clean))
               for clean, _, written, wrong in GATED_PAIRS]
    new_word = torch.tensor([False, False, False, False, True, False])  # "." ends a word
    base = agreement_margins(model, encoded, new_word)
    zeroed = {e["head"]: e["delta_mean_margin"] for e in ablate_heads(model, encoded, new_word)}
    # silencing the gate switches the MLP off: as large a drop as removing the carrier
    assert zeroed[GATE_HEAD] < -0.8 * float(base.mean())
    assert zeroed[CARRIER] < -0.8 * float(base.mean())
    # patching: the gate is the same in both texts, so it carries none of the difference
    assert abs(patch_heads(model, gated_pairs()).effects()[0, GATE_HEAD]) < 1e-6
    # mean-ablation puts in what the gate always says, which keeps the margin; the carrier's mean
    # over both genders says neither
    means = head_output_means(model, [s for e in encoded for s in (e.written, e.wrong)])
    mean_ablated = {}
    for head in (CARRIER, GATE_HEAD):
        with head_replaced(model, 0, head, means[0][:, head * 8:(head + 1) * 8]):
            mean_ablated[head] = agreement_margins(model, encoded, new_word)
    torch.testing.assert_close(mean_ablated[GATE_HEAD], base, atol=1e-4, rtol=0)
    assert (mean_ablated[CARRIER].mean() - base.mean()) < -0.5 * float(base.mean())
    torch.testing.assert_close(agreement_margins(model, encoded, new_word), base)  # hook removed


def test_head_output_means_average_the_sequences_that_reach_each_position(tiny_model):
    model = tiny_model(6, block_size=16, n_layer=2, n_head=2, n_embd=16, seed=3)
    sequences = [[F, X, DOT], [M, DOT], [X, X, X, DOT]]
    means = head_output_means(model, sequences, batch_size=2)
    assert len(means) == 2 and means[1].shape == (4, 16)
    heads = []  # each sequence's heads of layer 1 side by side, (T, nh·hs) as out_proj reads them
    with torch.no_grad(), caching(model, ["blocks.1.attn.hook_z"]) as cache:
        for s in sequences:
            model(torch.tensor([s]))
            heads.append(cache["blocks.1.attn.hook_z"][0].transpose(0, 1).flatten(1))
    torch.testing.assert_close(means[1][1], sum(h[1] for h in heads) / 3)
    torch.testing.assert_close(means[1][2], (heads[0][2] + heads[2][2]) / 2)
    torch.testing.assert_close(means[1][3], heads[2][3])  # only the longest reaches position 3
    with pytest.raises(ValueError, match="a sequence of 5 tokens, but values for only 4 positions"):
        with head_replaced(model, 1, 0, means[1][:, :8]), torch.no_grad():
            model(torch.tensor([[X] * 5]))


# ---- the same patch on transformers' models ----------------------------------------------------

def their_m(projections, reference, targets, hs, ids, layer=None, head=None, values=None,
            positions=()):
    """m of `targets` from a transformers model on `ids`, head `head` (`hs` wide) of `layer`
    given `values` at `positions` where the heads' outputs enter `projections[layer]` (the out
    projection: c_proj, o_proj); and what every layer's projection received."""
    seen = {}

    def hook(layer_index):
        def replace(module, args):
            seen[layer_index] = args[0].clone()
            if layer_index != layer:
                return None
            y = args[0].clone()
            for p in positions:
                y[0, p, head * hs:(head + 1) * hs] = values[p, head * hs:(head + 1) * hs]
            return (y,)
        return replace
    handles = [proj.register_forward_pre_hook(hook(i)) for i, proj in enumerate(projections)]
    with torch.no_grad():
        log_p = reference(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    for handle in handles:
        handle.remove()
    return float(log_p[targets[0]] - log_p[targets[1]]), seen


def assert_patching_equals(result, pairs, projections, reference, hs, cells):
    """tinylm's patching `result` over `pairs` against the same patches done with hooks on the
    reference: m clean, counterfactual, (layer, head, position) cells patched one position at a
    time (position None: the deciding one), head 3 of layer 0 patched at every position."""
    for i, pair in enumerate(pairs):
        m = functools.partial(their_m, projections, reference, pair.target_ids, hs)
        m_clean, _ = m(pair.clean_ids)
        m_other, other_heads = m(pair.counterfactual_ids)
        assert result.m_clean[i] == pytest.approx(m_clean, abs=1e-4)
        assert result.m_counterfactual[i] == pytest.approx(m_other, abs=1e-4)
        for layer, head, position in cells:
            position = pair.position if position is None else position
            patched, _ = m(pair.clean_ids, layer, head, other_heads[layer][0], [position])
            assert result.m_patched_by_position[i, layer, head, position] == pytest.approx(
                patched, abs=1e-4)
        patched, _ = m(pair.clean_ids, 0, 3, other_heads[0][0], range(len(pair.clean_ids)))
        assert result.m_patched_all[i, 0, 3] == pytest.approx(patched, abs=1e-4)


def test_patching_equals_the_same_patch_by_hooks_on_transformers_gpt2(bpe, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tinylm.pretrained import load_pretrained

    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=32, n_embd=32, n_layer=3, n_head=4,
        attn_implementation="eager"))
    with torch.no_grad():  # wider than at init, so that a misplaced patch shows
        for name, p in reference.named_parameters():
            if ".ln_" not in name:
                p.normal_(0.0, 0.2)
    reference.eval().save_pretrained(tmp_path, safe_serialization=True)
    bpe.save(tmp_path / "tokenizer.json")
    model, _, _ = load_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    pairs = []
    for n in (6, 9, 4):
        clean = torch.randint(bpe.vocab_size, (n,), generator=g).tolist()
        other = clean.copy()
        other[1] = (other[1] + 7) % bpe.vocab_size
        pairs.append(PatchPair(f"pair {n}", clean, other, (11, 23)))
    result = patch_heads(model, pairs, batch_size=5)
    assert_patching_equals(result, pairs, [block.attn.c_proj for block in reference.transformer.h],
                           reference, 8, [(0, 1, 1), (1, 3, None), (2, 0, 0), (0, 2, 2)])
    assert abs(result.m_patched_by_position[:, 0, 1, 1] - result.m_clean).max() > 1e-3  # moved


def test_patching_a_llama_with_grouped_query_heads_equals_the_same_patch_on_transformers(
        tmp_path):
    """Heads 2 and 3 share key/value head 1: each is patched alone, in its own slice of what
    o_proj receives; the pairs are the shipped agreement items, each text starting with <s>."""
    pytest.importorskip("transformers")
    from tinylm.pretrained import load_pretrained

    reference = save_llama_folder(tmp_path, "llama-gqa-llama3")
    model, tokenizer, _ = load_pretrained(tmp_path)
    items = load_probe_file(project_root() / "data" / "probes" / "agreement.jsonl")
    pairs, _ = build_pairs(tokenizer, items, model.config.block_size)
    pairs = pairs[:3]
    assert all(pair.clean_ids[0] == tokenizer.encode("")[0] for pair in pairs)  # <s>
    result = patch_heads(model, pairs, batch_size=2)  # padded batches, of 2 and 1
    assert_patching_equals(result, pairs, [layer.self_attn.o_proj for layer in
                                           reference.model.layers], reference, 16,
                           [(0, 1, 1), (1, 3, None), (1, 2, None), (0, 2, 2), (1, 0, 0)])
    deciding = [result.m_patched_by_position[i, 1, 3, pair.position]
                for i, pair in enumerate(pairs)]
    assert abs(deciding - result.m_clean).max() > 1e-3  # moved


# ---- batching and positions ---------------------------------------------------------------------

def random_pairs(vocab_size: int, lengths, seed: int = 0) -> list[PatchPair]:
    """Pairs of random texts differing in their first token, with random targets."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for n in lengths:
        clean = torch.randint(vocab_size, (n,), generator=g).tolist()
        other = [(clean[0] + 1) % vocab_size, *clean[1:]]
        a, b = torch.randperm(vocab_size, generator=g)[:2].tolist()
        pairs.append(PatchPair(f"random {n}", clean, other, (a, b)))
    return pairs


def widened(model, factor: float):
    """The model with every weight times `factor`: at init its heads barely move m."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
    return model


def test_batched_runs_give_the_numbers_of_one_pair_at_a_time(tiny_model):
    model = tiny_model(40, seed=2)
    pairs = random_pairs(40, [5, 8, 3, 8, 6])
    one, many = patch_heads(model, pairs, batch_size=1), patch_heads(model, pairs, batch_size=64)
    np.testing.assert_allclose(one.m_patched_by_position, many.m_patched_by_position, atol=1e-5)
    np.testing.assert_allclose(one.m_patched_all, many.m_patched_all, atol=1e-5)
    np.testing.assert_allclose(one.m_clean, many.m_clean, atol=1e-5)
    # each pair's cells stop at its deciding position, its last token
    lengths = np.array([len(p.clean_ids) for p in pairs])
    filled = ~np.isnan(many.m_patched_by_position)  # (P, L, nh, T_max)
    assert (filled.sum(-1) == lengths[:, None, None]).all()
    assert many.m_patched_all.shape == (5, 2, 2) and not np.isnan(many.m_patched_all).any()
    attribution = [attribution_patch(model, pairs, batch_size=b) for b in (1, 64)]
    np.testing.assert_allclose(attribution[0].m_patched_by_position,
                               attribution[1].m_patched_by_position, atol=1e-5)


def test_attribution_patching_is_exact_where_m_is_linear_in_the_heads(tiny_model):
    # one layer, no MLP, no final norm: m at the deciding position is a linear function of the
    # heads' outputs there (and of nothing else they write)
    model = widened(tiny_model(40, n_layer=1, seed=4), 10.0)
    model.ln_f = nn.Identity()
    with torch.no_grad():
        model.blocks[0].mlp.proj.weight.zero_()
    pairs = random_pairs(40, [4, 7, 5])
    exact, estimate = patch_heads(model, pairs), attribution_patch(model, pairs)
    assert estimate.method == "attribution" and exact.method == "exact"
    np.testing.assert_allclose(estimate.m_patched_by_position, exact.m_patched_by_position,
                               atol=1e-4)
    np.testing.assert_allclose(estimate.m_patched_all, exact.m_patched_all, atol=1e-4)
    # linear, so a head's moves add up: every position at once = the sum of one at a time
    moved = exact.m_patched_by_position - exact.m_clean[:, None, None, None]
    one_at_a_time = np.nansum(moved, axis=-1)
    np.testing.assert_allclose(exact.m_patched_all - exact.m_clean[:, None, None], one_at_a_time,
                               atol=1e-4)
    assert np.abs(one_at_a_time).max() > 0.1  # something moved


def test_attribution_patching_correlates_with_exact_patching(tiny_model):
    # wider weights move m by up to ~0.5 nats per cell, where the model is far from linear
    # (r ~0.9 at 3x over seeds, ~0.6 at 5x; 1.0 at init, where m barely moves)
    model = widened(tiny_model(40, n_layer=3, n_head=4, n_embd=32, seed=5), 3.0)
    pairs = random_pairs(40, [6, 9, 7, 5, 8, 6])
    exact, estimate = patch_heads(model, pairs), attribution_patch(model, pairs)
    cells = ~np.isnan(exact.m_patched_by_position)
    exact_moved = (exact.m_patched_by_position - exact.m_clean[:, None, None, None])[cells]
    estimate_moved = (estimate.m_patched_by_position
                      - estimate.m_clean[:, None, None, None])[cells]
    assert np.corrcoef(exact_moved, estimate_moved)[0, 1] > 0.8
    assert np.abs(exact_moved - estimate_moved).max() > 0.01  # an estimate, not the same numbers
    np.testing.assert_allclose(estimate.m_clean, exact.m_clean, atol=1e-5)
    np.testing.assert_allclose(estimate.m_counterfactual, exact.m_counterfactual, atol=1e-5)


# ---- the effect arithmetic ----------------------------------------------------------------------

def hand_made_result() -> PatchingResult:
    """Three pairs of 3, 2 and 3 tokens, one layer of two heads, m chosen by hand."""
    pairs = [PatchPair("a", [1, 2, 3], [4, 2, 3], (5, 6)), PatchPair("b", [1, 3], [4, 3], (5, 6)),
             PatchPair("c", [2, 2, 1], [4, 2, 1], (5, 6))]
    nan = np.nan
    by_position = np.array([  # (P=3, L=1, nh=2, T_max=3): m with head 0 / head 1 patched at t
        [[[1.0, 1.5, 2.0], [1.0, 1.0, 1.0]]],
        [[[3.0, 0.0, nan], [2.0, 2.0, nan]]],
        [[[0.0, 0.0, -4.0], [0.0, 0.0, -1.0]]]])
    at_all = np.array([[[2.0, 1.0]], [[0.0, 2.0]], [[-4.0, -1.0]]])
    return PatchingResult(pairs, [], np.array([1.0, 2.0, 0.0]), np.array([3.0, 0.0, -4.0]),
                          by_position, at_all, "exact")


def test_effects_are_ratios_of_means_and_positions_align_at_the_deciding_one():
    result = hand_made_result()
    # m_cf - m_clean: 2, -2, -4 (mean -4/3); head 0 moves m by 1, -2, -4 at every position at
    # once (mean -5/3), head 1 by 0, 0, -1 (mean -1/3)
    np.testing.assert_allclose(result.effects(), [[(-5 / 3) / (-4 / 3), (-1 / 3) / (-4 / 3)]])
    # pair b is one token shorter: its deciding position (1) lines up with the others' (2)
    by_position = result.effects_by_position()
    assert by_position.shape == (1, 2, 3)
    np.testing.assert_allclose(by_position[0, 0, 2], (1 - 2 - 4) / (2 - 2 - 4))  # all three
    np.testing.assert_allclose(by_position[0, 0, 1], (0.5 + 1 + 0) / (2 - 2 - 4))
    np.testing.assert_allclose(by_position[0, 0, 0], (0 + 0) / (2 - 4))  # a and c reach it
    np.testing.assert_allclose(by_position[0, 1, 0], 0.0)
    # per pair, left-aligned: pair b's own positions 0 and 1, then NaN
    pair_effects = result.pair_effects()
    np.testing.assert_allclose(pair_effects[1, 0, 0], [-0.5, 1.0, np.nan])
    np.testing.assert_allclose(pair_effects[0, 0, 0], [0.0, 0.25, 0.5])


def test_an_undefined_effect_is_nan_and_null_in_json_never_a_crash():
    result = hand_made_result()
    result.m_counterfactual = result.m_clean.copy()  # no difference between the texts
    assert np.isnan(result.effects()).all() and np.isnan(result.effects_by_position()).all()
    assert np.isnan(result.pair_effects()).all() and np.isnan(result.intervals()).all()
    report = result.to_json([{"source": "x", "reason": "no counterfactual"}])
    assert report["heads"][0]["effect"] is None and report["heads"][0]["interval"] == [None] * 2
    assert report["n_skipped"] == 1 and report["skipped"][0]["reason"] == "no counterfactual"


def test_the_bootstrap_interval_holds_the_effect_and_repeats_with_its_seed():
    # 40 one-token pairs, one head that carries 60% of the difference, give or take
    rng = np.random.default_rng(0)
    m_clean = rng.normal(2.0, 0.5, 40)
    m_counterfactual = m_clean - rng.normal(3.0, 1.0, 40)
    at_all = m_clean + 0.6 * (m_counterfactual - m_clean) + rng.normal(0.0, 0.5, 40)
    result = PatchingResult([PatchPair(str(i), [1], [2], (3, 4)) for i in range(40)], [], m_clean,
                            m_counterfactual, at_all[:, None, None, None], at_all[:, None, None],
                            "exact")
    interval = result.intervals(n_resamples=500, level=0.9, seed=3)
    assert interval.shape == (1, 1, 2)
    low, high = interval[0, 0]
    assert low < result.effects()[0, 0] < high and low < 0.6 < high and high - low < 0.3
    np.testing.assert_array_equal(interval, result.intervals(n_resamples=500, level=0.9, seed=3))
    assert not np.array_equal(interval, result.intervals(n_resamples=500, level=0.9, seed=4))
    low_50, high_50 = result.intervals(n_resamples=500, level=0.5, seed=3)[0, 0]
    assert low < low_50 < high_50 < high


def test_a_result_read_back_from_its_json_has_the_same_numbers():
    result = hand_made_result()
    back = PatchingResult.from_json(result.to_json())
    assert back.pairs == result.pairs and back.method == result.method
    for name in ("m_clean", "m_counterfactual", "m_patched_by_position", "m_patched_all"):
        np.testing.assert_array_equal(getattr(back, name), getattr(result, name))
    np.testing.assert_array_equal(back.pair_effects(), result.pair_effects())


def crafted(edit):
    """hand_made_result's JSON section through JSON text, edited by `edit(section)`."""
    import json

    section = json.loads(json.dumps(hand_made_result().to_json()))
    edit(section)
    return json.loads(json.dumps(section))  # what a reader of probe.json gets: 1e400 is inf


def put(path, value):
    """An edit that sets section[path[0]][path[1]]... to `value` (None: deletes the key)."""
    def edit(section):
        *parents, last = path
        for key in parents:
            section = section[key]
        if value is None:
            del section[last]
        else:
            section[last] = value
    return edit


@pytest.mark.parametrize("edit, key, what", [
    (put(["pairs"], []), "pairs", "is not a list of pairs"),
    (put(["pairs"], None), "pairs", "is not a list of pairs"),
    (put(["method"], 3), "method", "is not exact or attribution"),
    (put(["skipped"], [{"source": "x"}]), "skipped", "is not a list of {source, reason}"),
    (put(["pairs", 1], "b"), "pairs[1]", "is not an object"),
    (put(["pairs", 1, "counterfactual_ids"], [4]), "pairs[1]",
     "has no clean_ids and counterfactual_ids of as many token ids"),
    (put(["pairs", 1, "clean_ids"], [1, True]), "pairs[1]",
     "has no clean_ids and counterfactual_ids of as many token ids"),
    (put(["pairs", 0, "target_ids"], "ab"), "pairs[0].target_ids", "are not 2 ids"),
    (put(["pairs", 0, "source"], None), "pairs[0].source", "is not a text"),
    (put(["pairs", 2, "m_clean"], None), "pairs[2].m_clean", "is not a number within ±1e+09"),
    (put(["pairs", 2, "m_clean"], "1e400"), "pairs[2].m_clean", "is not a number within ±1e+09"),
    (put(["pairs", 2, "m_clean"], 1e400), "pairs[2].m_clean", "is not a number within ±1e+09"),
    (put(["pairs", 0, "m_counterfactual"], -1e308), "pairs[0].m_counterfactual",
     "is not a number within ±1e+09"),
    (put(["pairs", 0, "m_patched_all"], [[1.0, 1e308]]), "pairs[0].m_patched_all",
     "is not 1 x 2 numbers within ±1e+09 or null"),
    (put(["pairs", 1, "m_patched_all"], [[1.0]]), "pairs[1].m_patched_all",
     "is not 1 x 2 numbers within ±1e+09 or null"),
    (put(["pairs", 0, "m_patched_all"], [[]]), "pairs[0].m_patched_all",
     "is not a layers x heads list"),
    (put(["pairs", 1, "m_patched_by_position"], [[[3.0, 0.0, 1.0], [2.0, 2.0, 1.0]]]),
     "pairs[1].m_patched_by_position", "is not 1 x 2 x 2 numbers within ±1e+09 or null"),
])
def test_a_crafted_json_section_is_refused_in_one_line_naming_the_key(edit, key, what):
    with pytest.raises(ValueError) as refused:
        PatchingResult.from_json(crafted(edit))
    assert str(refused.value) == f"the patching section's {key} {what}"
    with pytest.raises(ValueError, match="^the patching section is not an object$"):
        PatchingResult.from_json([])


def test_a_json_section_with_null_patched_runs_and_shared_tokens_reads_back():
    result = hand_made_result()
    result.pairs[0].shared = 1
    result.m_patched_all[0, 0, 1] = np.nan  # null in the JSON: NaN again
    back = PatchingResult.from_json(crafted(lambda section: None))
    assert back.pairs[0].shared == 0  # crafted() starts from a fresh hand-made result
    section = result.to_json()
    assert section["pairs"][0]["shared"] == 1 and "shared" not in section["pairs"][1]
    assert section["metric"].endswith("m compares the first token where they differ")
    back = PatchingResult.from_json(section)
    assert back.pairs == result.pairs and np.isnan(back.m_patched_all[0, 0, 1])


def test_the_json_section_holds_what_a_reader_needs_to_recompute_it():
    result = hand_made_result()
    report = result.to_json()
    assert set(report) == {"method", "metric", "n_pairs", "n_skipped", "skipped", "positions",
                           "interval_level", "pairs", "heads"}
    assert report["n_pairs"] == 3 and report["interval_level"] == 0.95
    assert report["pairs"][1] == {"source": "b", "clean_ids": [1, 3], "counterfactual_ids": [4, 3],
                                  "position": 1, "target_ids": [5, 6], "m_clean": 2.0,
                                  "m_counterfactual": 0.0, "m_patched_all": [[0.0, 2.0]],
                                  "m_patched_by_position": [[[3.0, 0.0], [2.0, 2.0]]]}
    # the effects, re-computed from the pairs alone: a ratio of means
    pairs = report["pairs"]
    moved = np.mean([p["m_patched_all"][0][0] - p["m_clean"] for p in pairs])
    change = np.mean([p["m_counterfactual"] - p["m_clean"] for p in pairs])
    assert report["heads"][0]["effect"] == pytest.approx(moved / change)
    head = report["heads"][0]
    assert (head["layer"], head["head"]) == (0, 0)
    assert head["effect"] == pytest.approx(1.25)
    assert head["effect_by_position"] == pytest.approx(list(result.effects_by_position()[0, 0]))
    assert head["interval"] == pytest.approx(list(result.intervals()[0, 0]))


# ---- pairs from probe items ---------------------------------------------------------------------

def agreement(text, pronoun, name, wrong, counterfactual, source="t"):
    from test_probe import item  # here: test_probe imports the whole probe, which these need not

    line = item(text, pronoun, [name], wrong=wrong)
    return ProbeItem(**{**vars(parse_item(line, source)), "counterfactual": counterfactual})


def test_pairs_stop_at_the_deciding_position_and_compare_the_clean_pronouns(bpe):
    items = [agreement("Lily went to the park. After a while, she saw a dog.", "she", "Lily",
                       "he", "Jack went to the park. After a while, he saw a dog.", "line 1")]
    pairs, skipped = build_pairs(bpe, items, 64)
    assert skipped == [] and len(pairs) == 1
    pair = pairs[0]
    assert bpe.decode(pair.clean_ids) == "Lily went to the park. After a while,"
    assert bpe.decode(pair.counterfactual_ids) == "Jack went to the park. After a while,"
    assert pair.position == len(pair.clean_ids) - 1 and pair.source == "line 1"
    she = bpe.encode("Lily went to the park. After a while, she")[len(pair.clean_ids)]
    he = bpe.encode("Lily went to the park. After a while, he")[len(pair.clean_ids)]
    assert pair.target_ids == (she, he) and she != he


def test_pairs_that_cannot_be_aligned_are_skipped_with_their_reason(bpe):
    from test_probe import item

    base = "Lily went to the park. After a while, she saw a dog."
    items = [
        agreement(base, "she", "Lily", "he", None, "none"),
        agreement(base, "she", "Lily", "he",
                  "Bartholomew went to the park. After a while, he saw a dog.", "longer"),
        agreement(base, "she", "Lily", "he",
                  "Lily went to the park. After a while, he saw a dog.", "same"),
        parse_item(item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"]), "attention"),
    ]
    pairs, skipped = build_pairs(bpe, items, 64)
    assert pairs == []  # the attention item is no agreement item: neither paired nor counted
    reasons = {s["source"]: s["reason"] for s in skipped}
    assert reasons["none"] == "no counterfactual"
    n_clean = len(bpe.encode("Lily went to the park. After a while,"))
    n_long = len(bpe.encode("Bartholomew went to the park. After a while,"))
    assert n_long != n_clean
    assert reasons["longer"] == (f"the counterfactual's context is {n_long} tokens, the clean "
                                 f"one {n_clean}")
    assert reasons["same"] == "the counterfactual's context is the clean one's"
    # one token per character: " she" and " he" both begin with " ", which is read in both
    # texts, and m compares "s" with "h"; " he" and " her" differ only once one has ended
    chars = CharTokenizer(sorted(set(base + "Tomr")))
    pairs, skipped = build_pairs(chars, [
        agreement(base, "she", "Lily", "he",
                  "Toms went to the park. After a while, he saw a dog.", "chars"),
        agreement(base.replace("she", "he"), "he", "Lily", "her",
                  "Toms went to the park. After a while, her saw a dog.", "her")], 64)
    assert [pair.source for pair in pairs] == ["chars"] and pairs[0].shared == 1
    assert chars.decode(pairs[0].clean_ids) == "Lily went to the park. After a while, "
    assert chars.decode(pairs[0].counterfactual_ids) == "Toms went to the park. After a while, "
    assert pairs[0].target_ids == tuple(chars.encode("sh"))
    assert skipped == [{"source": "her", "reason": "the pronouns' tokens [' ', 'h', 'e'] and "
                        "[' ', 'h', 'e', 'r'] do not differ before one ends"}]
    _, skipped = build_pairs(chars, [agreement(
        base, "she", "Lily", "he", "Zed went to the park. After a while, he saw a dog.",
        "unseen")], 64)
    assert skipped[0]["reason"].startswith("the counterfactual: cannot tokenize the text: "
                                           "character 'Z'")
