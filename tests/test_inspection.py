"""Behaviour of tinylm.inspection.capture and tinylm.inspection.report: attention capture,
word-level aggregation, pronouns, outputs."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_cli
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import tinylm.inspection.capture
from tinylm.hooks import hook_points, run_with_cache
from tinylm.inspection.capture import (
    PRONOUNS,
    AttentionCapture,
    capture_attention,
    find_words,
    is_name,
    key_words,
    other_gender,
    read_pronouns,
    token_word_index,
    word_at,
    word_level,
)
from tinylm.inspection.report import (
    inspect_texts,
    pronoun_records,
    pronoun_summary,
    pronoun_table,
)
from tinylm.tokenizer import CharTokenizer

TEXT = "Lily and Tom went to the park. She saw a big dog. It was happy."


def test_capture_records_every_layer_and_head_as_causal_distributions(model, bpe):
    capture = capture_attention(model, bpe, TEXT)
    t = len(bpe.encode(TEXT))
    assert capture.weights.shape == (2, 2, t, t)
    assert capture.n_text_tokens == t and len(capture.tokens) == t
    np.testing.assert_allclose(capture.weights.sum(-1), 1.0, atol=1e-5)  # rows sum to 1
    upper = np.triu(np.ones((t, t), dtype=bool), k=1)
    assert (capture.weights[..., upper] == 0).all()  # nothing looks at the future
    assert (capture.weights[..., ~upper] > 0).all()


def test_capture_of_a_long_text_keeps_one_block_from_the_start_or_the_end(tiny_model, bpe):
    model = tiny_model(bpe.vocab_size, block_size=8)
    ids, offsets = bpe.encode_with_offsets(TEXT)
    first = capture_attention(model, bpe, TEXT)
    assert first.weights.shape[-1] == 8 and first.ids == ids[:8] and first.start == 0
    assert first.words[first.token_words[0]] == "Lily"
    last = capture_attention(model, bpe, TEXT, keep="last")
    assert last.ids == ids[-8:] and last.offsets == [tuple(o) for o in offsets[-8:]]
    assert last.start == len(ids) - 8 and last.n_text_tokens == len(ids)
    assert last.words[last.token_words[-2]] == "happy"
    assert f"tokens {len(ids) - 8}..{len(ids) - 1}" in last.window_note()


def test_tokens_map_to_words_through_offsets_with_leading_spaces(bpe):
    text = "Tom's cat ran."
    spans = find_words(text)
    assert [text[s:e] for s, e in spans] == ["Tom's", "cat", "ran"]
    # byte-level offsets: " cat" includes its space; "." belongs to no word
    assert token_word_index([(0, 3), (3, 5), (5, 9), (9, 13), (13, 14)], spans, len(text)) == \
        [0, 0, 1, 2, -1]
    ids, offsets = bpe.encode_with_offsets(text)
    words = token_word_index(offsets, spans, len(text))
    assert words[-1] == -1 and sorted(set(words) - {-1}) == [0, 1, 2]
    assert word_at(spans, 6) == 1 and word_at(spans, 7) is None


def test_word_level_sums_over_key_subwords_and_averages_query_subwords():
    # tokens: "Li" "ly" "," "s" "he" -> words Lily (0), she (1); "," is no word
    token_words = [0, 0, -1, 1, 1]
    weights = np.zeros((5, 5))
    weights[0, 0] = 1.0
    weights[1, :2] = [0.4, 0.6]
    weights[2, :3] = [0.2, 0.3, 0.5]
    weights[3, :4] = [0.1, 0.2, 0.3, 0.4]
    weights[4, :5] = [0.5, 0.1, 0.0, 0.2, 0.2]
    words = word_level(weights, token_words, 2)
    # "she" -> "Lily": mean over she's 2 rows of (weight on "Li" + weight on "ly")
    assert words[1, 0] == pytest.approx(((0.1 + 0.2) + (0.5 + 0.1)) / 2)
    assert words[1, 1] == pytest.approx((0.4 + 0.4) / 2)
    assert words[0, 0] == pytest.approx(1.0) and words[0, 1] == 0.0
    batched = word_level(np.stack([weights, weights]), token_words, 2)  # (..., T, T) works too
    np.testing.assert_allclose(batched[1], words)


def hand_made_capture(text, resolving, deciding=None):
    """A char-level capture, uniform over the past except that head (l, h) sends all attention of
    'She' (`resolving`) or of the token before it (`deciding`) to one word."""
    tokenizer = CharTokenizer.train([text])
    ids, offsets = tokenizer.encode_with_offsets(text)
    spans = find_words(text)
    token_words = token_word_index(offsets, spans, len(text))
    t = len(ids)
    weights = np.tril(np.ones((2, 2, t, t)))
    weights /= weights.sum(-1, keepdims=True)  # uniform over the past
    she = text.index("She")
    rows = [(range(she, she + 3), resolving),  # each of the pronoun's 3 tokens
            (range(she - 1, she), deciding or {})]  # the space before it predicts "S"
    for queries, targets in rows:
        for (layer, head), target in targets.items():
            s, e = spans[[text[a:b] for a, b in spans].index(target)]
            for q in queries:
                weights[layer, head, q] = 0.0
                weights[layer, head, q, s:e] = 1.0 / (e - s)
    return AttentionCapture(text, ids, tokenizer.token_strings(ids), offsets,
                            weights.astype(np.float32), spans, token_words)


def test_pronoun_reading_finds_the_heads_that_point_at_a_name():
    text = "Lily met a dog. The dog saw Zed. She smiled."
    capture = hand_made_capture(text, {(0, 0): "met", (0, 1): "Lily", (1, 0): "Zed",
                                       (1, 1): "dog"})
    (reading,) = read_pronouns(capture, k=2)
    assert reading.pronoun == "She" and reading.char == text.index("She")
    resolving = reading.positions["resolving"]
    words = capture.words
    assert words[resolving.top[0][1][0][0]] == "Lily" and resolving.top[0][1][0][1] == \
        pytest.approx(1)
    assert words[resolving.top[1][1][0][0]] == "dog"
    named = {(layer, head): words[w] for layer, head, w, _ in resolving.name_heads}
    assert named == {(0, 1): "Lily", (1, 0): "Zed"}


def test_the_two_query_positions_read_the_pronoun_and_the_token_before_it():
    text = "Lily met a dog. The dog saw Zed. She smiled."
    capture = hand_made_capture(
        text, resolving={(0, 0): "met", (0, 1): "Lily", (1, 0): "Zed", (1, 1): "dog"},
        deciding={(0, 0): "Zed", (0, 1): "dog", (1, 0): "met", (1, 1): "Lily"})
    (reading,) = read_pronouns(capture, k=2)
    assert reading.skipped == {} and list(reading.positions) == ["deciding", "resolving"]
    she = text.index("She")
    deciding, resolving = reading.positions["deciding"], reading.positions["resolving"]
    assert deciding.query == she - 1 and capture.tokens[deciding.query] == " "
    assert resolving.query == she + 2  # the pronoun's last token (its rows are averaged)
    words = capture.words
    for head_reading, targets in ((deciding, ["Zed", "dog", "met", "Lily"]),
                                  (resolving, ["met", "Lily", "Zed", "dog"])):
        tops = [(words[top[0][0]], top[0][1]) for row in head_reading.top for top in row]
        assert tops == [(w, pytest.approx(1.0)) for w in targets]
    assert {(layer, head): words[w] for layer, head, w, _ in deciding.name_heads} == \
        {(0, 0): "Zed", (1, 1): "Lily"}
    lines = pronoun_summary(capture, [reading])
    assert lines[0].startswith(f"'She' at character {she}, deciding (from ' ' before 'She'): "
                               "2/4 heads point at a name: L0H0 -> Zed 1.00, L1H1 -> Lily 1.00")
    assert lines[1].startswith(f"'She' at character {she}, resolving (from 'She'): 2/4 heads")


def test_a_pronoun_that_opens_the_text_has_no_deciding_reading_and_the_rest_is_kept(tiny_model):
    text = "She smiled. Then Lily saw her."
    tokenizer = CharTokenizer.train([text])
    model = tiny_model(tokenizer.vocab_size)
    capture = capture_attention(model, tokenizer, text)
    first, her = read_pronouns(capture)
    assert first.pronoun == "She" and first.positions == {}
    assert first.skipped["deciding"] == "it is the first token of the text, so no token chooses it"
    assert first.skipped["resolving"] == "no earlier word in view"
    assert her.pronoun == "her" and her.skipped == {}
    assert capture.tokens[her.positions["deciding"].query] == " "
    lines = pronoun_summary(capture, [first, her])
    assert lines[0] == ("'She' at character 0, deciding: skipped: it is the first token of the "
                        "text, so no token chooses it")
    assert len(lines) == 4 and lines[2].startswith("'her' at character 26, deciding (from ' '")


def test_it_and_its_are_never_linked_to_a_name_and_he_she_they_are():
    text = "Lily had a dog. It wagged its tail. She and Tom saw it. They smiled at him."
    capture = hand_made_capture(text, {(0, 0): "Lily"}, {(0, 0): "Lily"})
    readings = read_pronouns(capture)
    assert [r.pronoun for r in readings] == ["It", "its", "She", "it", "They", "him"]
    for r in readings:
        if r.pronoun in ("It", "its", "it"):  # a thing or an animal: no reading, a reason
            assert r.positions == {} and r.skipped.keys() == {"deciding", "resolving"}
            assert "stands for a thing or an animal" in r.skipped["deciding"]
        else:
            assert r.positions.keys() == {"deciding", "resolving"}
    assert {(layer, head) for layer, head, _, _ in
            readings[2].positions["resolving"].name_heads} >= {(0, 0)}
    lines = pronoun_summary(capture, readings)
    for line in lines:
        assert not (line.startswith(("'It'", "'its'", "'it'")) and "->" in line), line
    assert lines[0] == ("'It' at character 16: not read: 'It' stands for a thing or an animal, "
                        "not a named character: only he, she, they and their other forms are "
                        "read against names")
    records = pronoun_records(capture, readings)
    assert [(r["pronoun"], r["reads_names"], r["gender"]) for r in records] == [
        ("It", False, None), ("its", False, None), ("She", True, "female"), ("it", False, None),
        ("They", True, None), ("him", True, "male")]
    assert records[0]["deciding"] is records[0]["resolving"] is None


def test_a_reading_that_points_at_a_name_of_the_other_gender_is_flagged():
    text = "Tom met Lily and Zed yesterday. She smiled."  # uniform heads: "yesterday" on top
    capture = hand_made_capture(text, {(0, 0): "Tom", (0, 1): "Lily", (1, 0): "Zed"},
                                {(1, 1): "Tom"})
    (reading,) = read_pronouns(capture)
    assert other_gender("She", "Tom") and other_gender("his", "Lily")
    assert not other_gender("She", "Lily") and not other_gender("She", "Zed")  # Zed: unknown
    assert not other_gender("They", "Tom") and not other_gender("She", "dog")
    deciding, resolving = pronoun_summary(capture, [reading])
    assert ": 1/4 heads point at a name (1 at a name of the other gender): " \
        "L1H1 -> Tom (other gender) 1.00" in deciding
    assert ": 3/4 heads point at a name (1 at a name of the other gender): " in resolving
    assert "L0H0 -> Tom (other gender) 1.00" in resolving and "L0H1 -> Lily 1.00" in resolving
    assert "L1H0 -> Zed 1.00" in resolving  # a name of no listed gender: never flagged
    (record,) = pronoun_records(capture, [reading])
    tops = {(h["layer"], h["head"]): h["top"][0] for h in record["resolving"]["heads"]}
    assert [(tops[k]["word"], tops[k]["other_gender"]) for k in sorted(tops)] == [
        ("Tom", True), ("Lily", False), ("Zed", False), ("yesterday", False)]
    assert "*Tom* (other gender) 1.00" in pronoun_table(capture, reading)


def test_key_words_sums_each_words_tokens_for_one_query_row():
    token_words = [0, 0, -1, 1]
    row = np.array([[0.1, 0.2, 0.3, 0.4]])  # (Q=1, T=4)
    np.testing.assert_allclose(key_words(row, token_words, 2), [[0.3, 0.4]])


def test_names_are_listed_or_capitalised_mid_sentence_words():
    text = 'Once there was Zed. Lily said, "Look!" The ball was red. Pam ran.'
    spans = find_words(text)
    names = {text[s:e] for i, (s, e) in enumerate(spans) if is_name(text, spans, i)}
    # Zed: capitalised mid-sentence; Lily: listed; Look/The/Once/Pam start sentences
    assert names == {"Zed", "Lily"}
    assert {"he", "She", "It", "their", "Them"} <= PRONOUNS and "Lily" not in PRONOUNS


def test_a_long_texts_pronouns_are_read_from_the_words_in_view_at_their_place_in_the_text(
        model, bpe, monkeypatch):
    capture = capture_attention(model, bpe, "Lily and Tom went to the park. She saw a dog. " * 30)
    assert capture.n_text_tokens > 4 * len(capture.ids)  # most words lie beyond the window
    every_word = word_level(capture.weights, capture.token_words, len(capture.words))
    widths = []
    monkeypatch.setattr(tinylm.inspection.capture, "word_level",
                        lambda weights, token_words, n: widths.append(n) or word_level(
                            weights, token_words, n))
    readings = read_pronouns(capture)
    # the word-level weights (L, nh, W, W) hold the words in view only, not the whole text's
    assert widths == [len(set(capture.token_words) - {-1})] and widths[0] < len(capture.words) / 4
    # each "She" in view, placed in the text: 31 characters into each 46-character sentence
    assert len(readings) > 1 and [r.char for r in readings] == [31 + 46 * n
                                                                for n in range(len(readings))]
    for r in readings:
        for layer, row in enumerate(r.positions["resolving"].top):
            for head, ranked in enumerate(row):
                assert [w for w, _ in ranked] == sorted(
                    range(r.word), key=lambda w: -every_word[layer, head, r.word, w])[:3]
                for w, v in ranked:
                    assert v == pytest.approx(every_word[layer, head, r.word, w])


@pytest.mark.slow
def test_inspection_writes_tensorboard_images_text_png_and_npz(model, bpe, tmp_path):
    text = "Lily and Tom went to the park. She saw a big dog."
    inspect_texts(model, bpe, [text], tmp_path, prompt_chars=34)
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = set(events.Tags()["images"])
    # one image per layer, its heads side by side: the tab shows each head and each pronoun
    assert images == {"attention/layer_00/all_heads", "attention/layer_01/all_heads"}
    texts = set(events.Tags()["tensors"])
    assert {"text/generated/text_summary", "text/tokens/text_summary",
            "pronouns/summary/text_summary", "pronouns/00_She/text_summary"} <= texts
    summary = events.Tensors("text/generated/text_summary")[0].tensor_proto.string_val[0].decode()
    assert summary.startswith("**Lily and Tom went to the park. She**")
    image = events.Images("attention/layer_01/all_heads")[0]
    assert image.width > 100 and image.height > 100
    for tag in images:  # the same picture as a file
        assert (tmp_path / f"{tag}.png").read_bytes() == events.Images(tag)[0].encoded_image_string
    saved = np.load(tmp_path / "attention.npz")
    t = len(bpe.encode(text))
    assert saved["weights"].shape == (2, 2, t, t) and list(saved["tokens"]) == \
        bpe.token_strings(bpe.encode(text))
    table = (tmp_path / "pronouns.md").read_text()
    assert "'She' at character 31, deciding (from '.' before 'She')" in table
    assert "'She' at character 31, resolving (from 'She')" in table
    record = json.loads((tmp_path / "inspect.json").read_text())
    (she,) = [p for p in record["pronouns"] if p["pronoun"] == "She"]
    assert she["char"] == 31 and she["skipped"] == {}
    assert she["deciding"]["query"] == "." and she["resolving"]["query"] == " She"
    for position in ("deciding", "resolving"):
        heads = she[position]["heads"]
        assert [(h["layer"], h["head"]) for h in heads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(0 <= w["weight"] <= 1 and w["word"] in text for h in heads for w in h["top"])
    assert not list(tmp_path.rglob(".*.tmp-*"))  # every file renamed into place


DEFAULT_RUN = Path("/work/runs/default")  # the README's trained run, where this machine has one


@pytest.mark.slow
@pytest.mark.parametrize("run", ["default", "tiny"])
def test_inspect_true_on_a_trained_run_links_no_name_to_it(run, trained_run, tmp_path):
    """The README's command on "Lily had a dog. It was happy. She": "It" is the dog, so no
    reading links it to Lily; "She" is read, its heads pointing at Lily."""
    if run == "default":
        if not (DEFAULT_RUN / "checkpoints").is_dir():
            pytest.skip(f"no trained default run at {DEFAULT_RUN}")
        checkpoint = shutil.copytree(DEFAULT_RUN / "checkpoints", tmp_path / "run" / "checkpoints",
                                     symlinks=True).parent
    else:
        checkpoint = trained_run[0]
    logdir = tmp_path / "inspect"
    result = run_cli("tinylm.cli.generate", f"checkpoint={checkpoint}",
                     'prompt="Lily had a dog. It was happy. She"', "inspect=true",
                     "max_new_tokens=0", f"logdir={logdir}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    it_lines = [line for line in result.stdout.splitlines() if line.strip().startswith("'It'")]
    assert it_lines == ["  'It' at character 16: not read: 'It' stands for a thing or an animal, "
                        "not a named character: only he, she, they and their other forms are read "
                        "against names"], result.stdout
    assert "'She' at character 30, deciding (from '.' before 'She')" in result.stdout
    record = json.loads((logdir / "inspect.json").read_text())
    it, she = record["pronouns"]
    assert (it["pronoun"], it["reads_names"], it["deciding"], it["resolving"]) == (
        "It", False, None, None)
    assert she["pronoun"] == "She" and she["reads_names"] and she["gender"] == "female"
    assert "'It'" not in "".join(line for line in (logdir / "pronouns.md").read_text().splitlines()
                                 if "->" in line)


@pytest.mark.slow
def test_an_inspection_that_fails_while_writing_keeps_the_last_good_files(model, bpe, tmp_path,
                                                                          monkeypatch):
    inspect_texts(model, bpe, ["Lily and Tom went to the park. She saw a big dog."], tmp_path)
    before = {name: (tmp_path / name).read_bytes()
              for name in ("attention.npz", "pronouns.md", "inspect.json")}

    def dies_half_way(file, **arrays):  # numpy takes a path or an open file
        with open(file, "wb") if isinstance(file, (str, Path)) else file as out:
            out.write(b"PK\x03\x04 half an archive")
        raise OSError("No space left on device")

    monkeypatch.setattr(np, "savez_compressed", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        inspect_texts(model, bpe, ["Tom ran home. He was late."], tmp_path)
    for name, content in before.items():
        assert (tmp_path / name).read_bytes() == content, name
    assert np.load(tmp_path / "attention.npz")["weights"].ndim == 4
    assert not list(tmp_path.rglob(".*.tmp-*"))


def test_docs_hook_points_example_prints_what_the_docs_quote(capsys):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "inspecting.md").read_text()
    section = doc.split("## Hook points\n", 1)[1].split("\n## ", 1)[0]
    code, printed = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)
    exec(compile(code, "docs/inspecting.md", "exec"), {})
    assert capsys.readouterr().out == printed


def test_capture_reads_the_weights_at_the_hook_points_and_leaves_none_hooked(model, bpe):
    capture = capture_attention(model, bpe, TEXT)
    idx = torch.tensor([bpe.encode(TEXT)])
    _, cache = run_with_cache(model, idx, ["hook_pattern"])
    np.testing.assert_array_equal(capture.weights, torch.stack(
        [w[0] for w in cache.values()]).numpy())
    assert not any(point.hooked for point in hook_points(model).values())
