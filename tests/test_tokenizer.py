"""Tokenizers: training, exact round-trips, character offsets, labels, save/load, bad configs."""

import json
import random
import time

import pytest
from conftest import fill_disk
from tokenizers import pre_tokenizers

from tinylm.files import NotWritten
from tinylm.tokenizer import (
    EOT,
    BPETokenizer,
    CharTokenizer,
    TokenizerConfig,
    _byte_symbols,
    load_tokenizer,
    train_tokenizer,
)

CORPUS = [
    "Once upon a time, there was a little cat named Tom. He liked to play in the sun.",
    "One day, Lily found a red ball. She gave it to her mom, and they played together.",
    "The dog barked at the bird. It flew away, and the dog was sad.",
] * 20

HARD_TEXTS = [
    "plain ASCII, with  two spaces and a tab\tand\nnew lines\n\n",
    "accents: café, naïve, Ærøskøbing, ñandú",
    "emoji: 😀👍🏽 🐈‍⬛",
    "CJK: 日本語のテキスト, 中文, 한국어",
    f"mixed{EOT}after the end of text",
    "",
]


@pytest.fixture(scope="module")
def char():
    return train_tokenizer(TokenizerConfig(name="char", vocab_size=None), CORPUS)


def test_bpe_trains_to_the_asked_vocab_size_with_endoftext(bpe):
    assert isinstance(bpe, BPETokenizer)
    assert bpe.vocab_size == 400  # what conftest's bpe asks train_tokenizer for
    assert bpe.token_strings([bpe.eot_id]) == [EOT]
    assert bpe.encode(EOT) == [bpe.eot_id]
    # merges were learned: a common word is fewer tokens than bytes
    assert len(bpe.encode(" the")) < len(" the")


def test_bpe_trains_in_a_process_without_stdout(monkeypatch):
    # a Windows `pythonw` process (an IDE's runner, a shortcut) has sys.stdout = None
    monkeypatch.setattr("sys.stdout", None)
    tokenizer = BPETokenizer.train(CORPUS, vocab_size=300)
    assert tokenizer.decode(tokenizer.encode("the little cat")) == "the little cat"


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_bpe_round_trips_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_learns_text_without_whitespace_in_bounded_pieces():
    # one 2 MB "word" (minified data): whole, the trainer took minutes at full CPU
    rng = random.Random(0)
    word = "".join(rng.choice("abcdefghij{}:,") for _ in range(2_000_000))
    start = time.perf_counter()
    tok = train_tokenizer(TokenizerConfig(name="bpe", vocab_size=1024), [word])
    assert time.perf_counter() - start < 20
    text = f"short words, then {word[:1000]}  {' ' * 600}end"
    assert tok.decode(tok.encode(text)) == text


def test_bpe_offsets_and_labels_describe_the_text(bpe):
    text = "The cat sat. It purred, café 😀!"
    ids, offsets = bpe.encode_with_offsets(text)
    assert len(ids) == len(offsets)
    # Spans tile the text in order; a character split over several byte tokens repeats its span.
    pieces = []
    for start, end in offsets:
        if not pieces or (start, end) != pieces[-1]:
            pieces.append((start, end))
    assert "".join(text[s:e] for s, e in pieces) == text
    labels = bpe.token_strings(ids)
    # A token holding whole characters is labelled with exactly its text; the bytes of a split
    # multi-byte character (é's 2, the emoji's 4) show as escapes such as '\xf0', not as '�'.
    for label, span in zip(labels, offsets, strict=True):
        if offsets.count(span) == 1:
            assert label == text[slice(*span)]
        else:
            assert label.startswith("\\x") and len(text[slice(*span)].encode()) > 1
    assert any(label.startswith(" ") and len(label) > 1 for label in labels)  # ' s', not 'Ġs'


def test_byte_symbol_table_matches_the_byte_level_alphabet():
    table = _byte_symbols()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n")


def test_char_tokenizer_round_trips_with_offsets_and_endoftext(char):
    assert isinstance(char, CharTokenizer)
    assert char.chars == sorted(set("".join(CORPUS)))
    assert char.vocab_size == len(char.chars) + 1 and char.eot_id == len(char.chars)
    text = f"Tom sat.{EOT}Lily ran."
    ids, offsets = char.encode_with_offsets(text)
    assert char.decode(ids) == text
    assert ids.count(char.eot_id) == 1
    eot_at = ids.index(char.eot_id)
    assert text[slice(*offsets[eot_at])] == EOT
    assert all(text[s:e] == lab for (s, e), lab in zip(offsets, char.token_strings(ids),
                                                       strict=True))


def test_char_tokenizer_names_a_character_it_does_not_know(char):
    with pytest.raises(ValueError, match=r"'é' \(U\+00E9\) at position 3 .*tokenizer=bpe"):
        char.encode("caf\u00e9")


@pytest.mark.parametrize("token_id", [-1, "vocab_size"])
def test_char_tokenizer_refuses_an_id_outside_its_vocabulary_in_one_line(char, token_id):
    # a model wider than its tokenizer (model.vocab_size) can sample such an id
    token_id = char.vocab_size if token_id == "vocab_size" else token_id
    with pytest.raises(ValueError, match=rf"^token id {token_id} is outside this tokenizer's "
                                         rf"vocabulary of {char.vocab_size}$"):
        char.decode([0, token_id])


@pytest.mark.parametrize("kind", ["bpe", "char"])
def test_save_and_load_give_the_same_tokenizer(kind, bpe, char, tmp_path):
    tok = {"bpe": bpe, "char": char}[kind]
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = load_tokenizer(path)
    assert type(loaded) is type(tok)
    assert (loaded.vocab_size, loaded.eot_id) == (tok.vocab_size, tok.eot_id)
    text = "Once upon a time, Lily sat." + EOT
    assert loaded.encode_with_offsets(text) == tok.encode_with_offsets(text)


def test_save_on_a_full_disk_leaves_the_previous_file_whole(bpe, char, small_disk):
    disk = small_disk(64)
    path = disk / "tokenizer.json"
    char.save(path)
    before = path.read_bytes()
    fill_disk(disk)
    with pytest.raises(NotWritten, match=f"^{path} could not be written: No space left on device"):
        bpe.save(path)  # its JSON is larger than the char tokenizer's
    assert path.read_bytes() == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "tokenizer.json"]


def test_load_tokenizer_refuses_missing_and_foreign_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a tokenizer: invalid JSON"):
        load_tokenizer(bad)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="other.json is not a tinylm tokenizer"):
        load_tokenizer(other)


def test_load_tokenizer_refuses_ids_past_its_vocab_size(bpe, tmp_path):
    data = json.loads(bpe.hf.to_str())
    token = next(iter(data["model"]["vocab"]))
    data["model"]["vocab"][token] = 5000  # still vocab_size entries, one id far past them
    crafted = tmp_path / "tokenizer.json"
    crafted.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        load_tokenizer(crafted)
    assert str(err.value).startswith(f"{crafted} gives token {token!r} id 5000, past its "
                                     f"vocab_size {bpe.vocab_size} ")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("chars", [["a", ["b"]], ["a", "bc"], "abc"])
def test_load_tokenizer_refuses_a_char_list_of_other_things(tmp_path, chars):
    crafted = tmp_path / "tokenizer.json"
    crafted.write_text(json.dumps({"kind": "tinylm-char", "version": 1, "chars": chars}))
    with pytest.raises(ValueError, match="without its \"chars\" list of single characters"):
        load_tokenizer(crafted)


@pytest.mark.parametrize("cfg, message", [
    (dict(name="bpe", vocab_size=256), r"vocab_size=256 is not allowed: .* >= 257"),
    (dict(name="bpe", vocab_size=None), r"vocab_size=None is not allowed"),
    (dict(name="char", vocab_size=100), r"vocab_size=100 is not allowed for tokenizer=char"),
    (dict(name="wordpiece"), r"tokenizer.name='wordpiece' is not allowed; allowed: bpe, char"),
])
def test_bad_tokenizer_configs_are_refused_by_name(cfg, message):
    with pytest.raises(ValueError, match=message):
        TokenizerConfig(**cfg)
