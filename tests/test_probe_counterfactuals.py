"""Counterfactual partners of probe items (tinylm.inspection.probe_items): a text or another line's
id, resolved and checked at load time, and the shipped agreement set's partners."""

import json

import pytest

from tinylm.data import DataConfig, prepare_data
from tinylm.inspection.capture import find_words
from tinylm.inspection.probe_items import (
    ProbeFileError,
    counterfactual_item,
    encode_agreement_item,
    shipped_probe,
)
from tinylm.inspection.probe_types import load_probe_file
from tinylm.tokenizer import CharTokenizer, TokenizerConfig

LILY = {"text": "Lily went to the park. After a while, she saw a dog.", "pronoun_char": 38,
        "antecedent_chars": [0], "wrong_pronoun": "he"}
JACK = "Jack went to the park. After a while, he saw a dog."
OTHER_GENDER = {"she": {"he"}, "he": {"she"}, "her": {"him", "his"}, "him": {"her"},
                "his": {"her"}}


def write(path, *lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_text_partner_becomes_an_agreement_item_with_its_own_pronoun(tmp_path):
    path = write(tmp_path / "p.jsonl", LILY | {"counterfactual": JACK}, LILY)
    item, plain = load_probe_file(path)
    assert item.counterfactual == JACK and plain.counterfactual is None and item.id is None
    partner = counterfactual_item(item)
    assert partner.text == JACK and partner.kind == "agreement"
    assert partner.pronoun == "he" and partner.wrong_pronoun == "she"  # the item's own pronoun
    assert partner.antecedent_chars == [0] and partner.source == f"{path}, line 1 (counterfactual)"
    # a partner whose name is longer moves its words: the mentions follow the word indices
    longer = "One day, Timmy went out. Then he saw a dog."
    item = load_probe_file(write(tmp_path / "q.jsonl", {
        "text": "One day, Amy went out. Then she saw a dog.", "pronoun_char": 28,
        "antecedent_chars": [9], "wrong_pronoun": "he", "counterfactual": longer}))[0]
    partner = counterfactual_item(item)
    assert (partner.pronoun_char, partner.antecedent_chars) == (30, [9])
    assert longer[partner.antecedent_chars[0]:].startswith("Timmy")
    # what build_pairs reads: the partner's context, tokenized as the item's is
    tok = CharTokenizer.train([item.text, longer])
    encoded = encode_agreement_item(tok, partner, 64)
    assert tok.decode(encoded.written[:encoded.n_context]) == "One day, Timmy went out. Then"
    assert tok.decode(encoded.wrong[encoded.n_context:]) == " she"


def test_a_name_with_a_combining_accent_is_one_word_and_its_partner_is_kept(tmp_path):
    amelie = "Ame\u0301lie's dog ran. After a while, she sat."  # é as e and a combining acute
    assert [amelie[s:e] for s, e in find_words(amelie)][:2] == ["Ame\u0301lie's", "dog"]
    path = write(tmp_path / "p.jsonl", {
        "text": amelie, "pronoun_char": amelie.index("she"), "antecedent_chars": [0],
        "wrong_pronoun": "he", "counterfactual": "Jack's dog ran. After a while, he sat."})
    partner = counterfactual_item(load_probe_file(path)[0])
    assert partner.pronoun == "he" and partner.antecedent_chars == [0]


def test_a_partner_named_by_id_is_that_lines_text_before_or_after_it(tmp_path):
    jack = {"text": JACK, "pronoun_char": 38, "antecedent_chars": [0], "wrong_pronoun": "she"}
    path = write(tmp_path / "p.jsonl", LILY | {"id": "lily", "counterfactual": "jack"},
                 jack | {"id": "jack", "counterfactual": "lily"})
    lily, jack = load_probe_file(path)
    assert (lily.id, lily.counterfactual) == ("lily", JACK)
    assert (jack.id, jack.counterfactual) == ("jack", LILY["text"])
    assert counterfactual_item(jack).pronoun == "she"


ATTENTION = {"text": "Lily and Tom ran. She sat.", "pronoun_char": 18, "antecedent_chars": [0],
             "distractor_chars": [9]}
REFUSED = [
    ([LILY | {"counterfactual": "jack"}],
     "line 1: counterfactual 'jack' is neither the id of an item in this file nor a text with "
     "a pronoun as word 9, where the item has 'she'"),
    ([LILY | {"counterfactual": "Jack went to the big park. After a while, he saw a dog."}],
     "line 1: counterfactual .* is neither the id .* as word 9"),
    ([LILY | {"counterfactual": "x"}, {"text": "Max ran to the park. He saw a dog.",
      "pronoun_char": 21, "antecedent_chars": [0], "wrong_pronoun": "she", "id": "x"}],
     "line 1: counterfactual 'x' is the id of .*, line 2, whose text has no pronoun as word 9"),
    ([LILY | {"id": "a"}, LILY, LILY | {"id": "a"}],
     "line 3: id 'a' is already the id of .*, line 1; ids must be unique"),
    ([LILY | {"id": "a", "counterfactual": "a"}], "line 1: counterfactual 'a' is the item itself"),
    ([ATTENTION | {"counterfactual": "Tom and Lily ran. He sat."}],
     "line 1: a counterfactual is for agreement items"),
    ([LILY | {"counterfactual": ["Jack"]}], "line 1: counterfactual must be a non-empty string"),
    ([LILY | {"id": 7}], "line 1: id must be a non-empty string, got 7"),
]


@pytest.mark.parametrize(("lines", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_a_partner_that_cannot_be_used_is_refused_in_one_line(tmp_path, lines, message):
    path = write(tmp_path / "p.jsonl", *lines)
    with pytest.raises(ProbeFileError, match=f"^{path}, {message}") as err:
        load_probe_file(path)
    assert "\n" not in str(err.value)


def test_every_shipped_agreement_item_has_a_partner_of_the_other_gender_and_a_new_name():
    for item in load_probe_file(shipped_probe("agreement.jsonl")):
        partner = counterfactual_item(item)
        assert partner.pronoun.lower() in OTHER_GENDER[item.pronoun.lower()]
        assert partner.pronoun[0].isupper() == item.pronoun[0].isupper()
        assert partner.pronoun_char == item.pronoun_char  # the names have equal lengths
        words, partner_words = ([text[s:e] for s, e in find_words(text)]
                                for text in (item.text, partner.text))
        name, pronoun = (len(find_words(item.text[:c])) for c in (*item.antecedent_chars,
                                                                   item.pronoun_char))
        assert len(words) == len(partner_words), item.source
        differ = [i for i, (a, b) in enumerate(zip(words, partner_words, strict=True)) if a != b]
        assert differ == [name, pronoun], item.source
        assert len(partner_words[name]) == len(words[name]) and partner_words[name][0].isupper()


@pytest.fixture(scope="module")
def default_tokenizer(tmp_path_factory):
    """The tokenizer a default `tinylm-train` run reads with (the shipped TinyStories, BPE 4096)."""
    return prepare_data(DataConfig(cache_dir=str(tmp_path_factory.mktemp("data"))),
                        TokenizerConfig(), log=lambda _: None).tokenizer


def test_shipped_partners_have_the_items_context_tokens_but_the_names(default_tokenizer):
    for item in load_probe_file(shipped_probe("agreement.jsonl")):
        clean = encode_agreement_item(default_tokenizer, item, 128)
        partner = encode_agreement_item(default_tokenizer, counterfactual_item(item), 128)
        ids, partner_ids = clean.written[:clean.n_context], partner.written[:partner.n_context]
        assert len(ids) == len(partner_ids), item.source
        differ = [t for t, (a, b) in enumerate(zip(ids, partner_ids, strict=True)) if a != b]
        name = item.text[item.antecedent_chars[0]:].split()[0]
        assert default_tokenizer.decode([ids[t] for t in differ]).strip() == name, item.source
