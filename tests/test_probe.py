"""Behaviour of tinylm.inspection.probe: head scoring, baselines, agreement margins, ablation,
the probe files, bad input and the tinylm-probe command."""

import dataclasses
import inspect
import json
import math
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
import torch
from helpers import compose, run_cli, save_run, to_dataclass
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch import nn

import tinylm.cli.sizes
import tinylm.inspection.probe_types
from tinylm.cli.probe import ProbeConfig, run_probe
from tinylm.files import project_root
from tinylm.inspection import figures
from tinylm.inspection.capture import NAMES, find_words
from tinylm.inspection.patching import PatchingResult, PatchPair
from tinylm.inspection.probe import (
    MEAN_ABLATION,
    ablate_heads,
    agreement_margins,
    attention_to_mentions,
    baselines,
    deciding_report,
    evidence,
    head_accuracy,
    mention_attention,
    prediction_match,
    word_log_probs,
)
from tinylm.inspection.probe_items import (
    SHIPPED_PROBES,
    EncodedAgreementItem,
    EncodedAttentionItem,
    ProbeFileError,
    encode_agreement_item,
    encode_attention_item,
    new_word_tokens,
)
from tinylm.inspection.probe_report import write_probe_figures
from tinylm.inspection.probe_types import (
    PROBE_TYPES,
    Agreement,
    Deciding,
    Patching,
    ProbeType,
    load_probe_file,
    parse_item,
    probe,
)
from tinylm.inspection.tensorboard_plugin import PROBE_PLUGIN_NAME
from tinylm.inspection.tensorboard_plugin.summary import PATCHING_TAG, PROBE_TAG
from tinylm.model import LMOutput, TinyLM
from tinylm.tokenizer import CharTokenizer

PROBES = project_root() / "data" / "probes"


def item(text, pronoun, antecedents, distractors=None, wrong=None, **extra):
    """A probe line for `text`, with offsets found by searching (n-th occurrence: (word, n))."""
    def at(word):
        word, n = word if isinstance(word, tuple) else (word, 0)
        spans = [s for s, e in find_words(text) if text[s:e] == word]
        return spans[n]
    line = {"text": text, "pronoun_char": at(pronoun),
            "antecedent_chars": [at(w) for w in antecedents]}
    if distractors is not None:
        line["distractor_chars"] = [at(w) for w in distractors]
    if wrong is not None:
        line["wrong_pronoun"] = wrong
    return {**line, **extra}


# ---- attention scoring ------------------------------------------------------------------------

def test_a_head_is_right_when_the_pronoun_attends_more_to_the_antecedents_subwords():
    # tokens: "Li" "ly" " and" " Tom" "." " s" "he": words Lily 0, and 1, Tom 2, she 3
    token_words = [0, 0, 1, 2, -1, 3, 3]
    t = len(token_words)
    weights = np.tril(np.ones((1, 3, t, t)))
    weights /= weights.sum(-1, keepdims=True)
    rows = {  # each of the pronoun's two tokens: weights over the 7 tokens
        0: [[0.3, 0.3, 0.0, 0.4, 0, 0, 0], [0.3, 0.3, 0.0, 0.4, 0, 0, 0]],  # Lily 0.6 > Tom 0.4
        1: [[0.1, 0.1, 0.0, 0.8, 0, 0, 0], [0.1, 0.1, 0.3, 0.5, 0, 0, 0]],  # Tom wins
        2: [[0.5, 0.0, 0.0, 0.5, 0, 0, 0], [0.0, 0.5, 0.0, 0.5, 0, 0, 0]],  # a tie is not right
    }
    for head, (first, second) in rows.items():
        weights[0, head, 5], weights[0, head, 6] = first, second
    lily = attention_to_mentions(weights, token_words, 4, pronoun_word=3, mention_words=[0])
    tom = attention_to_mentions(weights, token_words, 4, pronoun_word=3, mention_words=[2])
    np.testing.assert_allclose(lily[0], [0.6, 0.2, 0.5])  # summed over "Li"+"ly", mean of rows
    np.testing.assert_allclose(tom[0], [0.4, 0.65, 0.5])
    np.testing.assert_array_equal(head_accuracy(lily[None], tom[None]), [[1.0, 0.0, 0.0]])
    # two mentions of one character add up
    both = attention_to_mentions(weights, token_words, 4, pronoun_word=3, mention_words=[0, 1])
    np.testing.assert_allclose(both[0], [0.6, 0.35, 0.5])
    # accuracy is the share of items: right on 1 of 2 items
    assert head_accuracy(np.array([[0.6], [0.1]]), np.array([[0.4], [0.2]])).tolist() == [0.5]


def test_baselines_choose_the_nearest_or_the_first_mentioned_character():
    items = [parse_item(line, f"test, line {n}") for n, line in enumerate([
        item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"]),  # first, not nearest
        item("Lily and Tom ran. He sat.", "He", ["Tom"], ["Lily"]),  # nearest, not first
        item("Tom saw Lily. Tom ran. He sat.", "He", ["Tom", ("Tom", 1)], ["Lily"]),  # both
        item("Tom saw Lily. Tom ran. She sat.", "She", ["Lily"], ["Tom", ("Tom", 1)]),  # neither
    ])]
    assert baselines(items) == {"nearest mention": 0.5, "first mention": 0.5}
    assert baselines(items[2:3]) == {"nearest mention": 1.0, "first mention": 1.0}
    assert baselines(items[3:]) == {"nearest mention": 0.0, "first mention": 0.0}


def test_model_attention_is_read_at_the_pronoun_and_is_the_same_batched_or_alone(model, bpe):
    lines = [item("Lily and Tom went to the park. She saw a big red ball.", "She", ["Lily"],
                  ["Tom"]),
             item("Tom had a kite. Mia had a ball. The wind was strong, and his kite flew.",
                  "his", ["Tom"], ["Mia"])]
    encoded = [encode_attention_item(bpe, parse_item(x, "t"), 64) for x in lines]
    # the text is cut after the pronoun's token: what comes later cannot change its attention
    assert bpe.decode(encoded[0].ids) == "Lily and Tom went to the park. She"
    ante, distr = mention_attention(model, encoded, batch_size=2)
    assert ante.shape == distr.shape == (2, 2, 2)
    for i, e in enumerate(encoded):  # padding in a batch changes nothing
        alone_ante, alone_distr = mention_attention(model, [e])
        np.testing.assert_allclose(ante[i], alone_ante[0], atol=1e-6)
        np.testing.assert_allclose(distr[i], alone_distr[0], atol=1e-6)
    # and it is the model's own weights from the pronoun's token to the name's tokens
    with torch.inference_mode():
        out = model(torch.tensor([encoded[0].ids]), return_attention=True)
    w = torch.stack(out.attentions, dim=1)[0].numpy()  # (L, nh, T, T)
    words = encoded[0].token_words
    she = [t for t, word in enumerate(words) if word == encoded[0].pronoun_word]
    tom = [t for t, word in enumerate(words) if word == 2]
    assert she[-1] == len(words) - 1 and [bpe.decode([encoded[0].ids[t] for t in she])] == [" She"]
    expected = w[:, :, she][..., tom].sum(-1).mean(-1)  # summed over Tom's, averaged over She's
    np.testing.assert_allclose(distr[0], expected, atol=1e-6)


# ---- agreement margins --------------------------------------------------------------------------

class BigramModel(nn.Module):
    """logits[t] = log_probs[idx[t]]: the next token depends on the current one only."""

    def __init__(self, log_probs: torch.Tensor):
        super().__init__()
        self.log_probs = nn.Parameter(log_probs, requires_grad=False)

    def forward(self, idx, targets=None, kv_cache=None, return_attention=False, head_mask=None):
        return LMOutput(self.log_probs[idx], None, None)


def test_margin_is_the_whole_word_log_probability_difference():
    tok = CharTokenizer.train(["Lily ran. she he her sat"])
    v = tok.vocab_size
    table = torch.full((v, v), 1e-9)
    i = {ch: tok.encode(ch)[0] for ch in " .Lhesra"}

    def follow(ch, probs):
        for nxt, p in probs.items():
            table[i[ch], i[nxt]] = p
    follow(".", {" ": 1.0})
    follow(" ", {"s": 0.5, "h": 0.25})
    follow("s", {"h": 0.9, "a": 0.1})
    follow("h", {"e": 0.8})
    follow("e", {" ": 0.5, ".": 0.2, "r": 0.3})  # "r": "he" would be the start of "her"
    model = BigramModel(table.log())  # unnormalised rows are fine: log_softmax renormalises
    probs = table / table.sum(-1, keepdim=True)

    line = parse_item(item("Lily ran. she sat.", "she", ["Lily"], wrong="he"), "t")
    encoded = encode_agreement_item(tok, line, block_size=64)
    assert tok.decode(encoded.written) == "Lily ran. she"
    # the word is read with its space: both continue "Lily ran."
    assert tok.decode(encoded.wrong) == "Lily ran. he" and encoded.n_context == 9
    new_word = new_word_tokens(tok)  # tokens that start a new word: space, '.', <|endoftext|>
    assert new_word.tolist() == [not s.isalnum() for s in tok.token_strings(range(v))]
    log_p = word_log_probs(model, [encoded.written, encoded.wrong], [9, 9], new_word)
    # chain rule over " she" / " he", then "the word ends here" (space or full stop)
    space = math.log(probs[i["."], i[" "]])
    end = math.log(probs[i["e"], i[" "]] + probs[i["e"], i["."]])
    expected_she = (space + math.log(probs[i[" "], i["s"]]) + math.log(probs[i["s"], i["h"]])
                    + math.log(probs[i["h"], i["e"]]) + end)
    expected_he = space + math.log(probs[i[" "], i["h"]]) + math.log(probs[i["h"], i["e"]]) + end
    assert log_p.tolist() == pytest.approx([expected_she, expected_he], abs=1e-5)
    margin = agreement_margins(model, [encoded], new_word)
    assert margin.tolist() == pytest.approx([math.log(0.5 / 0.25 * 0.9)], abs=1e-5)


def test_the_wrong_pronoun_is_tokenized_like_the_written_one(bpe):
    line = parse_item(item("Tom ran. Then the dog saw him. She", "him", ["Tom"], wrong="her"), "t")
    enc = encode_agreement_item(bpe, line, 64)
    n = enc.n_context
    assert bpe.decode(enc.written[n:]) == " him" and bpe.decode(enc.wrong[n:]) == " her"
    assert enc.written[:n] == enc.wrong[:n]
    assert bpe.decode(enc.wrong[:n]) == "Tom ran. Then the dog saw"
    line = parse_item(item("Tom ran. He sat.", "He", ["Tom"], wrong="she"), "t")
    enc = encode_agreement_item(bpe, line, 64)
    assert bpe.decode(enc.wrong[enc.n_context:]) == " She"  # capitalised like "He"
    # whatever pieces the BPE cuts " He" and " She" into, both words start after "."
    assert enc.written[:enc.n_context] == enc.wrong[:enc.n_context]
    assert bpe.decode(enc.written[enc.n_context:]) == " He"


# ---- ablation ---------------------------------------------------------------------------------

F, M, SHE, HE, DOT, X = range(6)  # token ids of the hand-built model


def hand_built_model(tiny_model) -> TinyLM:
    """One layer, two heads. Head 0 carries the name's gender to the pronoun's position; head 1
    computes something that never reaches the output.

    Embeddings are one-hot (x3): F, M, she, he, '.', 'x' on dims 0..5. Head 0 has q = k = 0, so it
    averages over all earlier positions, and its value reads (female - male) feature; out_proj
    writes that to +she / -he. With tied embeddings the logits of she and he then differ by the
    share of female minus male names in the context. The MLP is zero.
    """
    model = tiny_model(6, block_size=16, n_layer=1, n_head=2, n_embd=8, seed=1)
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, :6] = 3 * torch.eye(6)
        model.wpe.weight.zero_()
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        qkv = attn.qkv_proj.weight  # (3C, C): rows q | k | v, head 0 = the first 4 of each
        qkv[0:4].zero_(), qkv[8:12].zero_(), qkv[16:20].zero_()
        qkv[16, F], qkv[16, M] = 1.0, -1.0
        out = attn.out_proj.weight  # (C, C): columns 0..3 head 0, 4..7 head 1
        out.zero_()
        out[SHE, 0], out[HE, 0] = 10.0, -10.0
        mlp.proj.weight.zero_()
    return model


def test_ablating_the_head_that_carries_the_name_removes_the_margin_and_the_other_changes_nothing(
        tiny_model):
    model = hand_built_model(tiny_model)
    # "F x x . she" (wrong: he) and "M x . he" (wrong: she)
    encoded = [EncodedAgreementItem([F, X, X, DOT, SHE], [F, X, X, DOT, HE], 4),
               EncodedAgreementItem([M, X, DOT, HE], [M, X, DOT, SHE], 3)]
    new_word = torch.tensor([False, False, False, False, True, False])  # "." ends a word
    base = agreement_margins(model, encoded, new_word)
    assert (base > 1.0).all()  # the model knows: F -> she, M -> he
    entries = {(e["layer"], e["head"]): e for e in ablate_heads(model, encoded, new_word)}
    assert set(entries) == {(0, 0), (0, 1)}
    needed, unused = entries[0, 0], entries[0, 1]
    assert needed["method"] == unused["method"] == "zeroed"
    # without head 0 nothing tells she from he: the margin falls to 0, accuracy from 1 to 0
    assert needed["mean_margin"] == pytest.approx(0.0, abs=1e-5)
    assert needed["delta_mean_margin"] == pytest.approx(-float(base.mean()), abs=1e-5)
    assert needed["delta_accuracy"] == -1.0
    assert abs(unused["delta_mean_margin"]) < 1e-6 and unused["delta_accuracy"] == 0.0
    assert unused["mean_margin"] == pytest.approx(float(base.mean()))


# ---- the deciding position ----------------------------------------------------------------------

def test_deciding_attention_is_read_from_the_token_before_the_pronoun():
    # tokens: "Li" "ly" " and" " Tom" "." " s" "he": words Lily 0, and 1, Tom 2, she 3
    token_words = [0, 0, 1, 2, -1, 3, 3]
    t = len(token_words)
    weights = np.tril(np.ones((1, 1, t, t)))
    weights /= weights.sum(-1, keepdims=True)
    weights[0, 0, 4] = [0.1, 0.2, 0.0, 0.6, 0.1, 0, 0]  # ".": the row that predicts " s"
    weights[0, 0, 5:] = [[0.5, 0.5, 0, 0, 0, 0, 0], [0.5, 0.5, 0, 0, 0, 0, 0]]  # from "she"
    lily, tom = (attention_to_mentions(weights, token_words, 4, 3, [w], "deciding")
                 for w in (0, 2))
    assert lily[0, 0] == pytest.approx(0.3) and tom[0, 0] == pytest.approx(0.6)
    resolving = attention_to_mentions(weights, token_words, 4, 3, [0])
    assert resolving[0, 0] == pytest.approx(1.0)


def test_prediction_match_compares_signs_and_correlates_the_two_sides():
    diff = np.array([[[0.5, -0.1]], [[-0.2, 0.3]], [[0.1, 0.2]], [[-0.4, 0.0]]])  # (N=4, 1, 2)
    preference = np.array([2.0, -1.0, 0.5, -3.0])
    match, correlation = prediction_match(diff, preference)
    # head 0 agrees in sign on every item; head 1 on item 3 only (0 counts as not positive)
    np.testing.assert_allclose(match, [[1.0, 0.5]])
    np.testing.assert_allclose(correlation[0, 0], np.corrcoef(diff[:, 0, 0], preference)[0, 1])
    _, flat = prediction_match(np.zeros((3, 1, 1)), np.array([1.0, -1.0, 2.0]))
    assert np.isnan(flat[0, 0])  # attention that does not vary has no correlation


def test_evidence_flags_heads_high_on_both_attention_and_margin_loss():
    attention = [{"layer": 0, "head": h, "mean_attention": a}
                 for h, a in enumerate([0.6, 0.5, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])]
    ablation = [{"layer": 0, "head": h, "delta_mean_margin": d}
                for h, d in enumerate([-1.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0])]
    rows = evidence(attention, ablation)
    # twice the median attention (0.2): heads 0 and 1; a loss of 0.1 nats or more: 0 and 2
    assert [r["agrees"] for r in rows] == [True] + [False] * 7
    assert rows[2] == {"layer": 0, "head": 2, "mean_attention": 0.1, "delta_mean_margin": -0.5,
                       "delta_mean_margin_mean": None, "patching_effect": None,
                       "singled_out_by": ["zeroed"], "agrees": False}
    small = [{**a, "delta_mean_margin": -0.05} for a in ablation]  # a loss that is only noise
    assert not any(r["agrees"] for r in evidence(attention, small))


FIRST, ONE = 6, 7  # embedding dims: "at position 0" and a constant


def deciding_model(tiny_model) -> TinyLM:
    """One layer, four heads of 8 dims, built so that the pronoun is decided by attention to the
    name.

    Embeddings are one-hot (x3): F, M, she, he, '.', 'x' on dims 0..5, every token also 3 on dim
    7 (a constant) and position 0 also 3 on dim 6. Head 0 looks from '.' at the names (query: the
    '.' dim, key: the F and M dims) and carries (F - M) to +she / -he. Pre-norm LayerNorm makes a
    name at position 0 a little weaker as a key, so with two names head 0 prefers the later one,
    and so does the model. Head 1 always looks at the first token (query: the constant, key: the
    position-0 dim); heads 2 and 3 spread evenly (q = k = 0). The outputs of heads 1..3 are thrown
    away, and the MLP is zero.
    """
    model = tiny_model(6, block_size=16, n_layer=1, n_head=4, n_embd=32, seed=1)
    c = 32  # rows of qkv_proj: q | k | v, each head's 8 in turn; out_proj columns likewise
    with torch.no_grad():
        model.wte.weight.zero_()
        model.wte.weight[:, :6] = 3 * torch.eye(6)
        model.wte.weight[:, ONE] = 3.0
        model.wpe.weight.zero_()
        model.wpe.weight[0, FIRST] = 3.0
        attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
        qkv = attn.qkv_proj.weight  # (3C, C)
        qkv.zero_()
        qkv[0, DOT] = 4.0  # head 0 query
        qkv[c, F], qkv[c, M] = 4.0, 4.0  # head 0 key: a name
        qkv[2 * c, F], qkv[2 * c, M] = 1.0, -1.0  # head 0 value: which name
        qkv[8, ONE] = 4.0  # head 1 query: everywhere
        qkv[c + 8, FIRST] = 4.0  # head 1 key: position 0
        qkv[2 * c + 8, X] = 1.0  # head 1 value: something that never reaches the output
        out = attn.out_proj.weight  # (C, C)
        out.zero_()
        out[SHE, 0], out[HE, 0] = 10.0, -10.0
        mlp.proj.weight.zero_()
    return model


def names_item(ids, name_positions, distractor_positions=()):
    """An item over the hand-built vocabulary: one word per token, '.' none, the pronoun last."""
    token_words, word = [], 0
    for token in ids:
        token_words.append(-1 if token == DOT else word)
        word += token != DOT
    return EncodedAttentionItem(list(ids), token_words, word, token_words[-1],
                                [token_words[p] for p in name_positions],
                                [token_words[p] for p in distractor_positions])


def test_a_model_built_to_decide_at_the_name_shows_it_in_every_deciding_reading(tiny_model):
    model = deciding_model(tiny_model)
    new_word = torch.tensor([False, False, False, False, True, False])  # "." ends a word
    # agreement items: the name first (two of them) or later (two)
    sequences = [([F, X, X, DOT], SHE, HE, 0), ([M, X, DOT], HE, SHE, 0),
                 ([X, F, X, DOT], SHE, HE, 1), ([X, X, M, DOT], HE, SHE, 2)]
    names = [names_item(context + [written], [name]) for context, written, _, name in sequences]
    agreement = [EncodedAgreementItem(context + [written], context + [wrong], len(context))
                 for context, written, wrong, _ in sequences]
    # two-character items: the antecedent first or second; the model prefers the later name
    pairs = [([F, X, M, X, DOT, SHE], 0, 2), ([M, X, F, X, DOT, SHE], 2, 0),
             ([F, X, M, DOT, HE], 2, 0), ([M, X, F, DOT, HE], 0, 2)]
    characters = [names_item(ids, [a], [d]) for ids, a, d in pairs]
    preference = [EncodedAgreementItem(ids, ids[:-1] + [HE if ids[-1] == SHE else SHE],
                                       len(ids) - 1) for ids, _, _ in pairs]
    margins = agreement_margins(model, preference, new_word)
    assert (margins.numpy() > 0).tolist() == [False, True, True, False]  # the later name wins

    report = deciding_report(model, names, characters, [0, 1, 2, 3], preference, new_word)
    assert report["n_agreement"] == 4 and report["n_name_first_word"] == 2
    assert report["n_attention"] == 4 and report["n_attention_left_out"] == 0
    carrier, first, even, _ = report["agreement_attention"]
    assert [(e["layer"], e["head"]) for e in report["agreement_attention"]] == [
        (0, 0), (0, 1), (0, 2), (0, 3)]
    assert carrier["mean_attention"] > 0.99  # from '.' to the name, wherever it stands
    assert carrier["mean_attention_name_first_word"] > 0.99
    assert carrier["mean_attention_name_later"] > 0.99
    # the control: a head that looks at the first token scores high only when the name is first
    assert first["mean_attention_name_first_word"] > 0.99
    assert first["mean_attention_name_later"] < 0.01
    assert first["mean_attention"] == pytest.approx(0.5, abs=0.01)
    # even attention gives a one-token name 1 / (tokens so far) at the '.'
    assert even["mean_attention"] == pytest.approx((1 / 4 + 1 / 3 + 1 / 4 + 1 / 4) / 4, abs=1e-6)
    matched = {e["head"]: e for e in report["prediction_match"]}
    assert matched[0]["match"] == 1.0 and matched[0]["correlation"] > 0.9  # attention predicts
    assert matched[1]["match"] == 0.0 and matched[1]["correlation"] < -0.9  # the first, wrongly
    # even attention never prefers either character: half the signs match, r undefined
    assert matched[2]["match"] == 0.5 and matched[2]["correlation"] is None

    ablation = ablate_heads(model, agreement, new_word)
    rows = evidence(report["agreement_attention"], ablation)
    assert [r["agrees"] for r in rows] == [True, False, False, False]
    assert rows[0]["delta_mean_margin"] < -1.0
    assert all(abs(r["delta_mean_margin"]) < 1e-6 for r in rows[1:])


def test_her_has_no_derived_wrong_pronoun_and_is_left_out_of_the_match_and_counted(model, bpe):
    lines = [item("Lily and Tom went to the park. She saw a big red ball.", "She", ["Lily"],
                  ["Tom"]),
             item("Tom and Mia went to the park. A dog ran to her.", "her", ["Mia"], ["Tom"]),
             item("Tom and Mia went to the park. A dog ran to her.", "her", ["Mia"], ["Tom"],
                  wrong="him"),
             item("Lily went to the park. After a while, she saw a big dog.", "she", ["Lily"],
                  wrong="he")]
    items = [parse_item(x, f"t{n}") for n, x in enumerate(lines)]
    report = probe(model, bpe, items, ablate=True)
    d = report.get(Deciding)
    assert d.n_attention == 2 and d.n_attention_left_out == 1 and d.n_agreement == 1
    assert len(d.prediction_match) == 4 and len(d.evidence) == 4
    best = report.to_json()["best_deciding"]
    assert set(best) == {"layer", "head", "mean_attention"}
    assert best["mean_attention"] == max(e["mean_attention"] for e in d.agreement_attention)
    # the derived wrong pronoun follows the written one's case: "She" is compared with "He"
    enc = encode_agreement_item(bpe, items[0], 64, "he")
    assert bpe.decode(enc.wrong[enc.n_context:]) == " He"


def test_a_share_whose_chance_is_a_half_centres_its_heatmap_there_and_a_change_on_zero(
        model, bpe, tmp_path, monkeypatch):
    """The colour bar marks the baseline a reader compares each head with: 0.5 for the resolving
    accuracy and the prediction match (a choice between two), 0 for a change or a correlation."""
    lines = [item("Lily and Tom went to the park. She saw a big red ball.", "She", ["Lily"],
                  ["Tom"]),
             item("Lily went to the park. After a while, she saw a big dog.", "she", ["Lily"],
                  wrong="he")]
    report = probe(model, bpe, [parse_item(x, f"t{n}") for n, x in enumerate(lines)], ablate=True)
    centers = {}
    signature = inspect.signature(figures.layer_head_heatmap)
    monkeypatch.setattr(figures, "layer_head_heatmap",
                        lambda *args, **kwargs: signature.bind(*args, **kwargs).arguments)
    monkeypatch.setattr(figures, "log_figure", lambda writer, tag, drawn, png_dir: centers.update(
        {tag.removeprefix("probe/"): drawn.get("center")}))
    write_probe_figures(report, tmp_path, [])
    assert centers == {"attention_accuracy": 0.5, "prediction_match": 0.5,
                       "prediction_correlation": 0.0, "ablation_delta_mean_margin": 0.0,
                       "ablation_delta_accuracy": 0.0, "deciding_attention": None,
                       "deciding_attention_name_first_word": None,
                       "deciding_attention_name_later": None}
    effects = Patching(PatchingResult([PatchPair("a", [1, 2], [3, 2], (4, 5))], [],
                                      np.array([1.0]), np.array([2.0]), np.array([[[[1.0, 1.5]]]]),
                                      np.array([[[1.5]]]), "exact"), []).heatmaps()
    assert effects["probe/patching_effect"].center == 0.0


# ---- probe files --------------------------------------------------------------------------------

def test_shipped_attention_probes_load_and_are_balanced():
    items = load_probe_file(PROBES / "pronouns.jsonl")
    assert len(items) >= 60 and all(i.kind == "attention" for i in items)
    nearer = sum(max(i.antecedent_chars) > max(i.distractor_chars) for i in items)
    assert 0.4 <= nearer / len(items) <= 0.6  # the antecedent is nearer in about half
    assert 0.4 <= baselines(items)["first mention"] <= 0.6
    pronouns = Counter(i.pronoun.lower() for i in items)
    assert pronouns["she"] + pronouns["her"] == pronouns["he"] + pronouns["him"] + pronouns["his"]
    for i in items:  # two named characters; the pronoun is the first gendered word
        names = {i.text[c:c + 10].split()[0].strip(".,") for c in i.antecedent_chars
                 + i.distractor_chars}
        assert len(names) == 2 and names <= NAMES
        words = [i.text[s:e].lower() for s, e in find_words(i.text)]
        gendered = [w for w in words if w in {"she", "he", "her", "him", "his"}]
        assert gendered[0] == i.pronoun.lower()


def test_shipped_agreement_probes_load_and_balance_she_and_he_over_three_forms():
    items = load_probe_file(PROBES / "agreement.jsonl")
    assert len(items) >= 60 and all(i.kind == "agreement" for i in items)
    form = {("she", "he"): "subject", ("he", "she"): "subject", ("her", "him"): "object",
            ("him", "her"): "object", ("her", "his"): "possessive", ("his", "her"): "possessive"}
    female = {"she", "her"}
    counts = Counter((form[i.pronoun.lower(), i.wrong_pronoun], i.pronoun.lower() in female)
                     for i in items)
    assert len(counts) == 6 and len(set(counts.values())) == 1  # every (form, gender) equally
    # the control of the deciding position needs both: the name first in the text, and later
    first = Counter(min(i.antecedent_chars) == 0 for i in items)
    assert first[True] >= 30 and first[False] >= 30
    for i in items:  # one named character, frequent in TinyStories
        names = {i.text[c:c + 10].split()[0].strip(".,") for c in i.antecedent_chars}
        assert len(names) == 1 and names <= NAMES


BAD_LINES = [
    ('{"text": "Lily ran. She sat.", "pronoun_char": 10, "antecedent_chars": [0]',
     "invalid JSON"),
    (item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"]) | {"pronoun_char": 99},
     "pronoun_char=99 is outside the text"),
    (item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"]) | {"antecedent_chars": [1]},
     r"antecedent_chars\[0\]=1 is not at the start of a word"),
    (item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"]) | {"distractor_chars": [-3]},
     r"distractor_chars\[0\]=-3 is outside the text"),
    (item("Lily ran. She saw Tom.", "She", ["Lily"], ["Tom"]),
     r"distractor_chars\[0\]=18 is not before the pronoun"),
    (item("Lily ran. She sat.", "ran", ["Lily"], wrong="he"), "'ran', which is not a pronoun"),
    (item("Lily ran. She sat.", "She", ["Lily"]), "missing wrong_pronoun"),
    (item("Lily ran. She sat.", "She", ["Lily"], wrong="xe"), "wrong_pronoun='xe' is not a known"),
    (item("Lily ran. She sat.", "She", ["Lily"], wrong="she"), "is the pronoun in the text"),
    (item("Lily and Tom ran. She sat.", "She", ["Lily"], ["Tom"], wrong="ze"),
     "wrong_pronoun='ze' is not a known"),  # a two-character item's, for the prediction match
    (item("Lily ran. She sat.", "She", ["Lily"]) | {"antecedent_chars": []}, "non-empty list"),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, line, message):
    good = item("Lily went out. She sat.", "She", ["Lily"], wrong="he")
    path = tmp_path / "probe.jsonl"
    bad = line if isinstance(line, str) else json.dumps(line)
    path.write_text(json.dumps(good) + "\n\n" + bad + "\n")
    with pytest.raises(ProbeFileError, match=f"^{path}, line 3: .*{message}"):
        load_probe_file(path)


def test_a_mixed_file_loads_both_kinds_and_ignores_other_fields(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [item("Lily and Tom ran. He sat.", "He", ["Tom"], ["Lily"], note="x"),
             item("Tom ran. He sat.", "He", ["Tom"], wrong="she", form="subject")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert [i.kind for i in load_probe_file(path)] == ["attention", "agreement"]


# ---- the command ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model, bpe):
    run = tmp_path_factory.mktemp("run")
    # the shipped items are < 128 characters
    return save_run(run, tiny_model(bpe.vocab_size, block_size=128), bpe)


def test_the_ablation_table_lines_up_its_columns_under_their_titles():
    ablation = [{"layer": 1, "head": 0, "mean_margin": 1.605, "accuracy": 0.92,
                 "delta_mean_margin": -0.377, "delta_accuracy": -0.02},
                {"layer": 2, "head": 2, "mean_margin": 0.907, "accuracy": 0.74,
                 "delta_mean_margin": -1.075, "delta_accuracy": -0.19}]
    result = Agreement([None, None], torch.tensor([1.0, 2.0]), True, ablation)  # 2 items
    assert result.console(3, 3, 5)[-4:] == [
        "ablation: each head zeroed in turn, over the 2 agreement items; the 2 heads that move "
        "the mean margin most",
        "  layer  head   Δ mean margin   Δ accuracy   mean margin   accuracy",
        "      2     2          -1.075        -0.19        +0.907       0.74",
        "      1     0          -0.377        -0.02        +1.605       0.92"]


def test_results_that_cannot_say_much_say_why_in_one_line():
    # mean-ablation over one item: each head's mean output is its own, nothing moves
    same = [{"layer": 0, "head": 0, "mean_margin": 1.0, "accuracy": 1.0, "delta_mean_margin": 0.0,
             "delta_accuracy": 0.0}]
    one = Agreement([None], torch.tensor([1.0]), MEAN_ABLATION, same, same).console(1, 1, 5)
    assert one[-1] == ("note: one item, so each head's mean output is its own output there and "
                       "mean-ablation moves (almost) nothing; give more agreement items")
    assert not any("note" in line for line in Agreement(
        [None, None], torch.tensor([1.0, 2.0]), MEAN_ABLATION, same, same).console(1, 1, 5))
    # one pair whose partner (of the same gender) moves m by 0.018 nats
    result = PatchingResult([PatchPair("a", [1, 2], [3, 2], (4, 5))], [], np.array([1.0]),
                            np.array([1.018]), np.array([[[[1.0, 1.009]]]]), np.array([[[1.009]]]),
                            "exact")
    lines = Patching(result, [], [["A", "."]], [["s", "h"]]).console(1, 1, 5)
    assert lines[2:5] == [
        "the name moves m by +0.018 on average (clean +1.000, counterfactual +1.018 nats)",
        "warning: under 0.1 nats, every effect below is a ratio over noise: the model barely "
        "tells the names apart, or the partners share their gender",
        "note: one pair, so the bootstrap intervals (which resample the pairs) have no width; "
        "patch more pairs for an interval"]


def test_probe_yaml_and_config_dataclass_have_the_same_keys():
    cfg = compose("probe", ["checkpoint=x", "ablate=true",
                            "probe_file=data/probes/agreement.jsonl"])
    built = to_dataclass(ProbeConfig, cfg, "probe")
    assert set(OmegaConf.to_container(cfg)) == {f.name for f in dataclasses.fields(ProbeConfig)}
    assert built.ablate is True and built.probe_file == ["data/probes/agreement.jsonl"]
    assert ProbeConfig().probe_file is None


def test_items_the_model_cannot_read_are_skipped_and_counted(run_dir, bpe, tmp_path, capsys):
    """A small-context model (block 128 here; Tiny Shakespeare's is 64 characters) scores the
    items that fit, and says how many it skipped, in the console and in probe.json; so does a
    character model on a character it never saw."""
    path = tmp_path / "long.jsonl"
    long = "Lily went to the park. " + "The sun was hot. " * 60 + "She sat."
    lines = [item(long, "She", ["Lily"], wrong="he"), item("Tom ran. He sat.", "He", ["Tom"],
                                                          wrong="she"),
             item("Lily and Tom ran. " + long, ("She", 0), ["Lily"], ["Tom"])]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=str(path),
                                   logdir=str(tmp_path / "tb"), ablate=True))
    n_long = len(bpe.encode(long[:long.index("She")] + "She"))
    assert report["agreement"]["n"] == 1 and report["n"] == 0 and len(report["ablation"]) == 4
    assert report["n_skipped_items"] == 2 and report["skipped_items"][0] == {
        "source": f"{path}, line 1", "reason": f"the text up to the pronoun is {n_long} tokens, "
        "longer than the model's block_size=128"}
    assert report["skipped_items"][1]["source"] == f"{path}, line 3"
    assert capsys.readouterr().out.splitlines()[0] == (
        f"2 probe items skipped: the model cannot read them (the first: {path}, line 1: the "
        f"text up to the pronoun is {n_long} tokens, longer than the model's block_size=128); "
        "probe.json lists each under skipped_items")
    assert json.loads((tmp_path / "tb" / "probe.json").read_text()) == report


def test_a_character_model_of_a_small_context_probes_the_shipped_sets(tiny_model):
    """Tiny Shakespeare's shape (characters, block 64): the items longer than the context are
    skipped and counted, and patching compares the first characters where the pronouns differ
    ("s" and "h" after the space " she" and " he" begin with, read in both texts)."""
    items = [i for name in SHIPPED_PROBES for i in load_probe_file(PROBES / name)]
    chars = CharTokenizer.train([i.text for i in items] + [i.counterfactual or "" for i in items])
    report = probe(tiny_model(chars.vocab_size, block_size=64), chars, items, patch="exact")
    written = report.to_json()
    reasons = {s["reason"].split(" tokens, ")[1] for s in written["skipped_items"]}
    assert written["n_skipped_items"] > 0 and reasons == {"longer than the model's block_size=64"}
    assert written["agreement"]["n"] + written["n"] + written["n_skipped_items"] == len(items)
    pairs = written["patching"]["pairs"]
    assert len(pairs) > 50
    assert {(chars.decode(p["clean_ids"][-p["shared"]:]), chars.decode(p["target_ids"]))
            for p in pairs} == {(" ", "sh"), (" ", "hs"), (" ", "SH"), (" ", "HS"),
                                (" h", "ei"), (" h", "ie"), (" H", "ei"), (" H", "ie")}


def test_a_batch_that_cannot_be_held_is_refused_before_any_work(run_dir, bpe, tmp_path,
                                                                  monkeypatch):
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps(item("Lily and Tom ran. He sat.", "He", ["Tom"], ["Lily"])) + "\n"
                    + json.dumps(item("Tom ran. He sat.", "He", ["Tom"], wrong="she")) + "\n")
    # a sequence of the longest item (its wrong pronoun) holds its logits, 16 activations of
    # width n_embd per token, and both copies of every head's attention: 4 bytes each
    longest = max(len(bpe.encode(f"Lily and Tom ran. {p}")) for p in ("He", "She"))
    each = 4 * longest * (400 + 16 * 16 + 2 * 2 * 2 * longest)
    monkeypatch.setattr(tinylm.cli.sizes, "psutil", SimpleNamespace(
        virtual_memory=lambda: SimpleNamespace(available=int(each * 1.5))))
    cfg = ProbeConfig(checkpoint=str(run_dir), probe_file=str(path), out=str(tmp_path / "o.json"),
                      logdir=str(tmp_path / "tb"))
    for batch_size in (10**18, 2):  # every pass holds 2 sequences at most: 2 is too many here
        with pytest.raises(ValueError) as err:
            run_probe(dataclasses.replace(cfg, batch_size=batch_size))
        assert str(err.value) == (
            f"batch_size={batch_size} is more than the memory can hold: a forward pass holds "
            f"about {each:,} bytes per sequence of up to {longest} tokens (its logits and every "
            f"head's attention), and 0 MiB are available now; give at most batch_size=1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["both.jsonl"]
    assert run_probe(dataclasses.replace(cfg, batch_size=1))["agreement"]["n"] == 1


@pytest.mark.slow
def test_each_kind_alone_reports_what_it_can(run_dir, tmp_path, capsys):
    attention = tmp_path / "attention.jsonl"
    attention.write_text(json.dumps(item("Lily and Tom ran. He sat.", "He", ["Tom"], ["Lily"]))
                         + "\n")
    report = run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=str(attention),
                                   out=str(tmp_path / "a.json"), logdir=str(tmp_path / "a"),
                                   ablate=True))
    captured = capsys.readouterr()
    assert report["n"] == 1 and report["agreement"] is None and report["ablation"] is None
    assert "ablate=true needs agreement items" in captured.err
    assert "agreement: no one-character items" in captured.out

    agreement = tmp_path / "agreement.jsonl"
    agreement.write_text(json.dumps(item("Tom ran. He sat.", "He", ["Tom"], wrong="she")) + "\n")
    report = run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=str(agreement),
                                   out=str(tmp_path / "b.json"), logdir=str(tmp_path / "b"),
                                   ablate=True))
    assert report["n"] == 0 and report["heads"] == [] and report["best"] is None
    assert report["agreement"]["n"] == 1 and len(report["ablation"]) == 4
    assert "attention: no two-character items" in capsys.readouterr().out
    assert json.loads((tmp_path / "b.json").read_text()) == report


def test_patch_fast_reports_attribution_patching_in_the_same_shape(run_dir, tmp_path, capsys):
    probe_file = str(project_root() / "data" / "probes" / "agreement.jsonl")
    reports = [run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=probe_file,
                                     logdir=str(tmp_path / how), patch=patch))["patching"]
               for how, patch in (("exact", True), ("fast", "fast"))]
    exact, fast = reports
    assert (exact["method"], fast["method"]) == ("exact", "attribution")
    assert "patching (attribution): each head's output copied from the counterfactual text into " \
        "the clean one, estimated to first order from gradients" in capsys.readouterr().out
    assert [p["clean_ids"] for p in fast["pairs"]] == [p["clean_ids"] for p in exact["pairs"]]
    assert [p["m_clean"] for p in fast["pairs"]] == pytest.approx(
        [p["m_clean"] for p in exact["pairs"]], abs=1e-5)
    assert [(h["layer"], h["head"]) for h in fast["heads"]] == \
        [(h["layer"], h["head"]) for h in exact["heads"]]


def test_patching_without_a_pair_says_why_and_writes_the_rest(run_dir, bpe, tmp_path, capsys):
    # a partner one token longer: the pair would misalign every position, so it is skipped
    clean = "Tom ran. He sat."
    longer = next(name for name in ("Amy", "Sue", "Mia", "Zoe", "Ann", "Anna", "Lily", "Sarah")
                  if len(bpe.encode(f"{name} ran.")) > len(bpe.encode("Tom ran.")))
    line = {**item(clean, "He", ["Tom"], wrong="she"), "counterfactual": f"{longer} ran. She sat."}
    probe_file = tmp_path / "one.jsonl"
    probe_file.write_text(json.dumps(line) + "\n")
    report = run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=str(probe_file),
                                   logdir=str(tmp_path / "p"), patch=True))
    assert report["patching"] is None and report["agreement"]["n"] == 1
    said = capsys.readouterr().err
    assert "note: patch=true needs agreement items with a counterfactual" in said
    assert f"1 skipped, the first: {probe_file}, line 1: the counterfactual's context is" in said
    assert (tmp_path / "p" / "probe.json").is_file()


@dataclass
class Lengths(ProbeType):
    """A toy probe type: how many tokens come before the pronoun of each of its items."""

    name: ClassVar[str] = "lengths"
    tokens: list[int]

    @staticmethod
    def recognises(line: dict) -> bool:
        return "lengths" in line

    @classmethod
    def score(cls, probing) -> "Lengths":
        return cls([len(probing.tokenizer.encode(i.text[:i.pronoun_char]))
                    for i in probing.items_of(cls)])

    def to_json(self) -> dict:
        return {"lengths": self.tokens}

    def console(self, n_layer: int, n_head: int, top_heads: int) -> list[str]:
        return [f"lengths: {len(self.tokens)} items, {self.tokens} tokens before the pronoun"]


def test_a_probe_type_registered_in_one_place_is_read_scored_and_reported(run_dir, bpe, tmp_path,
                                                                           monkeypatch, capsys):
    monkeypatch.setattr(tinylm.inspection.probe_types, "PROBE_TYPES", [*PROBE_TYPES, Lengths])
    line = item("Tom ran. He sat.", "He", ["Tom"], wrong="she")
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({**line, "lengths": True}) + "\n" + json.dumps(line) + "\n")
    assert [i.kind for i in load_probe_file(path)] == ["lengths", "agreement"]
    out = tmp_path / "probe.json"
    report = run_probe(ProbeConfig(checkpoint=str(run_dir), probe_file=str(path), out=str(out),
                                   logdir=str(tmp_path / "tb")))
    tokens = [len(bpe.encode("Tom ran. "))]
    # its keys follow the shipped ones; the shipped types read only their own lines
    assert list(report)[-1] == "lengths" and report["lengths"] == tokens
    assert report["agreement"]["n"] == 1 and report["n"] == 0
    assert json.loads(out.read_text()) == report
    console = capsys.readouterr().out.splitlines()
    assert console[-3] == f"lengths: 1 items, {tokens} tokens before the pronoun"  # then timing


def _cli(*args, cwd):
    return run_cli("tinylm.cli.probe", *args, cwd=cwd)


@pytest.mark.slow
def test_cli_scores_heads_agreement_and_ablation_into_json_and_tensorboard(run_dir, tmp_path):
    result = _cli(f"checkpoint={run_dir}", "ablate=true", "top_heads=3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "best head: layer" in out and "nearest mention 0.50, first mention 0.50" in out
    assert "agreement: 108 one-character items, accuracy" in out
    assert "ablation: each head zeroed in turn" in out
    # the deciding position comes first: the evidence table, then the resolving scores
    assert out.index("evidence: ") < out.index("deciding: ") < out.index("resolving: ")
    assert "prediction match: 54 two-character items" in out
    assert "prediction match: 18 two-character items left out" in out
    assert list(tmp_path.iterdir()) == []  # nothing in the working directory
    (logdir,) = (run_dir / "probe").iterdir()  # defaults: inside the run directory
    report = json.loads((logdir / "probe.json").read_text())
    assert report["n"] == 72 and len(report["heads"]) == 4
    assert set(report["heads"][0]) >= {"layer", "head", "accuracy"}
    assert set(report["best"]) == {"layer", "head", "accuracy"}
    assert report["best"]["accuracy"] == max(h["accuracy"] for h in report["heads"])
    assert report["baselines"] == {"nearest mention": 0.5, "first mention": 0.5}
    agreement = report["agreement"]
    assert agreement["n"] == 108 and 0.0 <= agreement["accuracy"] <= 1.0
    margins = [x["margin"] for x in agreement["items"]]
    assert agreement["mean_margin"] == pytest.approx(np.mean(margins))
    assert agreement["accuracy"] == pytest.approx(np.mean([m > 0 for m in margins]))
    assert len(report["ablation"]) == 4
    deciding = report["deciding"]
    assert deciding["n_agreement"] == 108 and deciding["n_name_first_word"] == 64
    assert [set(e) for e in deciding["agreement_attention"]] == [
        {"layer", "head", "mean_attention", "mean_attention_name_first_word",
         "mean_attention_name_later"}] * 4
    assert [set(e) for e in deciding["prediction_match"]] == [
        {"layer", "head", "match", "correlation"}] * 4
    assert [set(e) for e in report["evidence"]] == [
        {"layer", "head", "mean_attention", "delta_mean_margin", "delta_mean_margin_mean",
         "patching_effect", "singled_out_by", "agrees"}] * 4
    assert all(e["delta_mean_margin_mean"] is None and e["patching_effect"] is None
               for e in report["evidence"])  # neither was asked for
    best = max(deciding["agreement_attention"], key=lambda e: e["mean_attention"])
    assert report["best_deciding"] == {k: best[k] for k in ("layer", "head", "mean_attention")}
    for e in report["ablation"]:
        assert e["method"] == "zeroed"
        assert e["delta_mean_margin"] == pytest.approx(e["mean_margin"] - agreement["mean_margin"])
        assert e["delta_accuracy"] == pytest.approx(e["accuracy"] - agreement["accuracy"])
    table = out.split("ablation:")[1].split("report:")[0].strip().splitlines()
    assert len(table) == 2 + 3 + 1  # title, header, top_heads rows, the timing line
    events = EventAccumulator(str(logdir), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    grids = ["attention_accuracy", "ablation_delta_mean_margin", "ablation_delta_accuracy",
             "deciding_attention", "deciding_attention_name_first_word",
             "deciding_attention_name_later", "prediction_match", "prediction_correlation"]
    assert {f"probe/{name}" for name in grids} <= set(events.Tags()["images"])
    assert "probe/report/text_summary" in events.Tags()["tensors"]
    # the resolving accuracy of every head, as the attention tab reads it
    (grid,) = events.Tensors(PROBE_TAG)
    metadata = events.SummaryMetadata(PROBE_TAG).plugin_data
    assert metadata.plugin_name == PROBE_PLUGIN_NAME and json.loads(metadata.content)["n"] == 72
    accuracy = tensor_util.make_ndarray(grid.tensor_proto)
    assert accuracy.size == len(report["heads"]) and [
        accuracy[h["layer"], h["head"]] for h in report["heads"]] == pytest.approx(
        [h["accuracy"] for h in report["heads"]])
    for name in grids:
        assert (logdir / "probe" / f"{name}.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_patching_and_mean_ablation_agree_in_the_report_the_console_and_the_tab(run_dir,
                                                                                tmp_path):
    logdir = tmp_path / "probe"
    result = _cli(f"checkpoint={run_dir}", "ablate=mean", "patch=true", f"logdir={logdir}",
                  "probe_file=data/probes/agreement.jsonl", cwd=project_root())
    assert result.returncode == 0, result.stderr
    report = json.loads((logdir / "probe.json").read_text())
    patching = report["patching"]
    assert patching["method"] == "exact" and patching["n_pairs"] > 0
    # every shipped item has a partner: what is not a pair was skipped, and said why
    assert patching["n_pairs"] + patching["n_skipped"] == 108 == report["agreement"]["n"]
    assert all(s["reason"].startswith(("the counterfactual's context is",
                                       "both pronouns begin with token"))
               for s in patching["skipped"])
    pairs, heads = patching["pairs"], patching["heads"]
    assert {"clean_ids", "counterfactual_ids", "position", "target_ids", "m_clean",
            "m_counterfactual"} <= set(pairs[0])
    assert all(p["position"] == len(p["clean_ids"]) - 1 == len(p["counterfactual_ids"]) - 1
               for p in pairs)
    # each head's effect is a ratio of means over the pairs, inside its bootstrap interval
    change = np.mean([p["m_counterfactual"] - p["m_clean"] for p in pairs])
    for h in heads:
        moved = np.mean([p["m_patched_all"][h["layer"]][h["head"]] - p["m_clean"]
                         for p in pairs])
        assert h["effect"] == pytest.approx(moved / change)
        assert h["interval"][0] <= h["interval"][1]  # (a barely trained model's effects are
        # ratios of small means: the point need not lie inside its percentile interval)
        assert len(h["effect_by_position"]) == max(p["position"] for p in pairs) + 1
    assert [e["method"] for e in report["mean_ablation"]] == ["mean"] * len(heads)
    assert [(e["patching_effect"], e["delta_mean_margin_mean"]) for e in report["evidence"]] \
        == [(h["effect"], m["delta_mean_margin"]) for h, m in zip(heads, report["mean_ablation"],
                                                                  strict=True)]
    # the console's layer x head table shows the same effects
    out = result.stdout
    part = out.split("patching (exact):")[1].split("the 5 strongest")[0]
    table = [line for line in part.splitlines() if line.startswith("layer ")]
    shown = [float(cell) for row in table for cell in row.split()[2::2]]
    assert shown == pytest.approx([h["effect"] for h in heads], abs=0.006)
    assert "the 5 strongest (layer, head, position) cells" in out
    assert (f"the name moves m by {change:+.3f} on average (clean "
            f"{np.mean([p['m_clean'] for p in pairs]):+.3f}") in out
    assert "ablation: each head replaced in turn by its mean output" in out
    # and the tab reads them from the event file, beside the first pairs' attention
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    events.Reload()
    (grid,) = events.Tensors(PATCHING_TAG)
    tab = tensor_util.make_ndarray(grid.tensor_proto)  # (L, nh, 3): effect, low, high
    assert [tab[h["layer"], h["head"], 0] for h in heads] == pytest.approx(
        [h["effect"] for h in heads], abs=1e-6)
    assert "patching/pair_000/step_00000000" in events.Tags()["tensors"]


@pytest.mark.slow
def test_cli_reports_a_bad_line_in_one_line_without_a_traceback(run_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(item("Tom ran. He sat.", "He", ["Tom"])) + "\n")
    out = tmp_path / "report.json"
    result = _cli(f"checkpoint={run_dir}", f"probe_file={path}", f"out={out}", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (f"tinylm-probe: error: {path}, line 1: missing wrong_pronoun;"
                                     " an item without distractor_chars is an agreement item and "
                                     "needs the pronoun to compare with (e.g. \"wrong_pronoun\": "
                                     "\"he\")")
    assert not out.exists()
