"""Corpus preparation (split, cache, atomic builds, bad inputs) and the batch sampler."""

import json
import os
import socket
import sys

import numpy as np
import pytest
import torch
from helpers import compose, to_dataclass

import tinylm.data
from tinylm.data import (
    BatchSampler,
    DataConfig,
    check_enough_tokens,
    prepare_data,
    warn_if_small,
)
from tinylm.tokenizer import EOT, TokenizerConfig, train_tokenizer

NAMES = [("Lily", "She"), ("Tom", "He"), ("Mia", "She"), ("Ben", "He")]
THINGS = ["red ball", "big box", "little bird", "shiny stone", "blue kite"]


def paragraph(i: int) -> str:
    name, pronoun = NAMES[i % len(NAMES)]
    return (f"Once upon a time, {name} found a {THINGS[i % len(THINGS)]}. {pronoun} played "
            f"with it all day, and {pronoun.lower()} was happy. Café number {i} 😀.")


def write_corpus(root, n=60, name="stories.txt"):
    """n paragraphs separated by blank lines, as the TinyStories files are; returns the text."""
    root.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(paragraph(i) for i in range(n)) + "\n"
    (root / name).write_text(text, encoding="utf-8")
    return text


def configs(tmp_path, tokenizer="bpe", **data):
    """A corpus of your own text, read by paragraph as data=text reads it."""
    data = {"name": "toy", "files": ["stories.txt"], "data_root": str(tmp_path / "corpus"),
            "cache_dir": str(tmp_path / "data"), "sample_by": "paragraph", **data}
    vocab_size = 300 if tokenizer == "bpe" else None
    return DataConfig(**data), TokenizerConfig(name=tokenizer, vocab_size=vocab_size)


def prepare(data_cfg, tok_cfg, **kwargs):
    """prepare_data, returning (prepared, the lines it printed)."""
    lines = []
    return prepare_data(data_cfg, tok_cfg, log=lines.append, **kwargs), "\n".join(lines)


def read_ids(prepared, split):
    return np.fromfile(getattr(prepared, f"{split}_path"), dtype=prepared.meta["dtype"])


def cache_entries(tmp_path):
    """Everything in the cache folder, hidden build leftovers included."""
    root = tmp_path / "data"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


# --------------------------------------------------------------------------------- preparation

def test_prepare_writes_ids_that_decode_back_to_the_corpus(tmp_path):
    text = write_corpus(tmp_path / "corpus")
    prepared, out = prepare(*configs(tmp_path))
    assert prepared.directory == tmp_path / "data" / "toy-bpe"
    assert {p.name for p in prepared.directory.iterdir()} == {
        "train.bin", "val.bin", "tokenizer.json", "meta.json"}
    meta = prepared.meta
    assert (meta["corpus"], meta["source"], meta["tokenizer"], meta["dtype"]) == (
        "toy", "local", "bpe", "uint16")
    assert meta["vocab_size"] == prepared.tokenizer.vocab_size <= 300
    assert len(meta["fingerprint"]) == 64 and meta["inputs"][0]["bytes"] == len(text.encode())
    train, val = read_ids(prepared, "train"), read_ids(prepared, "val")
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    # The train stream, a paragraph break, then the held-out tail: exactly the file.
    tok = prepared.tokenizer
    assert tok.decode(train) + "\n\n" + tok.decode(val) == text
    assert 0.05 < len(tok.decode(val)) / len(text) < 0.15  # val_fraction 0.1, whole paragraphs
    assert f"{meta['train_tokens']:,} tokens" in out and "Wrote" in out


def test_second_run_reuses_the_cache_and_says_so(tmp_path):
    write_corpus(tmp_path / "corpus")
    first, _ = prepare(*configs(tmp_path))
    stamp = first.train_path.stat().st_mtime_ns
    second, out = prepare(*configs(tmp_path))
    assert second.from_cache and not first.from_cache
    assert "Reusing" in out and "same inputs and settings" in out
    assert second.meta == first.meta and second.train_path.stat().st_mtime_ns == stamp


def test_a_bpe_vocabulary_large_for_the_corpus_gets_one_warning_built_or_reused(tmp_path):
    write_corpus(tmp_path / "corpus")
    for _ in range(2):  # tinylm-train reusing what tinylm-prepare wrote warns as well
        prepared, out = prepare(*configs(tmp_path))
        tokens = prepared.meta["train_tokens"]
        warnings = [line for line in out.splitlines() if line.startswith("Warning:")]
        assert warnings == [
            f"Warning: the training split holds {tokens:,} tokens, {tokens / 300:.1f} per id of "
            "the 300-token BPE vocabulary (fewer than 20 per id: most are seen too rarely to "
            "learn, expect a high val perplexity); use tokenizer=char, or more text"]
    _, out = prepare(*configs(tmp_path, tokenizer="char"))
    assert "Warning" not in out


@pytest.mark.parametrize("tokens, advice", [
    (20_000, "use tokenizer.vocab_size=512 or tokenizer=char, or more text"),
    (50_000, "use tokenizer.vocab_size=2048 or tokenizer=char, or more text"),
    (5_000, "use tokenizer=char, or more text"),
    (223_331, None),  # the default run: 55 tokens per id
])
def test_the_warning_suggests_a_vocabulary_the_training_text_fills(tokens, advice):
    lines = []
    warn_if_small({"tokenizer": "bpe", "vocab_size": 4096, "train_tokens": tokens}, lines.append)
    assert lines == ([] if advice is None else [lines[0]])
    assert advice is None or lines[0].endswith(advice)


def test_the_corpus_line_names_three_files_and_counts_the_rest(tmp_path):
    sizes = [len(write_corpus(tmp_path / "corpus", n=20 + i, name=f"part{i}.txt").encode())
             for i in range(5)]
    _, out = prepare(*configs(tmp_path, files=["part*.txt"]))
    line = out.splitlines()[0]
    shown = ", ".join(f"part{i}.txt ({sizes[i]:,} bytes)" for i in range(3))
    assert line == (f"Corpus toy: local files under {tmp_path / 'corpus'}: {shown}, "
                    f"and 2 more ({sum(sizes):,} bytes in all)")


@pytest.mark.parametrize("change", ["contents", "val_fraction", "vocab_size"])
def test_changed_contents_or_settings_rebuild(tmp_path, change):
    text = write_corpus(tmp_path / "corpus")
    data_cfg, tok_cfg = configs(tmp_path)
    first, _ = prepare(data_cfg, tok_cfg)
    if change == "contents":
        # same size and modification time: only the contents tell the change
        path = tmp_path / "corpus" / "stories.txt"
        stat = path.stat()
        path.write_text(text.replace("Lily", "Lucy"), encoding="utf-8")
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.stat().st_size == stat.st_size
    elif change == "val_fraction":
        data_cfg, _ = configs(tmp_path, val_fraction=0.3)
    else:
        tok_cfg = TokenizerConfig(name="bpe", vocab_size=290)
    second, out = prepare(data_cfg, tok_cfg)
    assert not second.from_cache
    assert "Rebuilding" in out and "inputs or settings changed" in out
    assert second.meta["fingerprint"] != first.meta["fingerprint"]
    assert cache_entries(tmp_path) == ["toy-bpe"]  # the old build is gone, no leftovers


def test_single_document_is_split_at_the_same_character_as_nanogpt(tmp_path):
    text = write_corpus(tmp_path / "corpus", n=40)
    prepared, out = prepare(*configs(tmp_path, tokenizer="char", sample_by="document"))
    cut = int(len(text) * 0.9)  # nanoGPT: data[:int(n*0.9)], data[int(n*0.9):]
    assert prepared.meta["train_tokens"] == cut and prepared.meta["val_tokens"] == len(text) - cut
    assert prepared.tokenizer.decode(read_ids(prepared, "train")) == text[:cut]
    assert prepared.tokenizer.decode(read_ids(prepared, "val")) == text[cut:]
    assert "1 document" in out


def test_document_split_is_deterministic_and_separates_documents_with_endoftext(tmp_path):
    for i in range(10):  # one story per file
        write_corpus(tmp_path / "corpus", n=3 + i % 3, name=f"story{i}.txt")
    data_cfg, tok_cfg = configs(tmp_path, files=["story*.txt"], sample_by="document",
                                split="documents", val_fraction=0.2)
    a, out = prepare(data_cfg, tok_cfg)
    assert (a.meta["train_rows"], a.meta["val_rows"]) == (8, 2) and "2 of 10 documents" in out
    train = read_ids(a, "train")
    assert (train == a.tokenizer.eot_id).sum() == 8 - 1  # between documents, not after the last
    assert a.tokenizer.decode(train).count(EOT) == 7

    again, _ = prepare(*configs(tmp_path, files=["story*.txt"], sample_by="document",
                                split="documents", val_fraction=0.2,
                                cache_dir=str(tmp_path / "again")))
    assert np.array_equal(read_ids(again, "train"), train)
    assert np.array_equal(read_ids(again, "val"), read_ids(a, "val"))

    seeds = set()
    for seed in range(5):
        other, _ = prepare(*configs(tmp_path, files=["story*.txt"], sample_by="document",
                                    split="documents", val_fraction=0.2, split_seed=seed))
        seeds.add(other.tokenizer.decode(read_ids(other, "val")))
    assert len(seeds) > 1  # the seed picks which documents are held out


def test_stories_ended_by_endoftext_lines_are_rows_joined_by_endoftext(tmp_path):
    """The raw TinyStories format, as the shipped sample now has it: a line holding only
    <|endoftext|> ends a story of several paragraphs; each story is one row, whole in one split,
    and train.bin holds the end-of-text id between two stories, not the text of the mark."""
    stories = [f"{paragraph(i)}\n\n{paragraph(i + 1)}" for i in range(0, 40, 2)]
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "stories.txt").write_text(f"\n{EOT}\n".join(stories) + f"\n{EOT}\n",
                                      encoding="utf-8")
    prepared, out = prepare(*configs(tmp_path, sample_by="document", val_fraction=0.12))
    meta, eot = prepared.meta, prepared.tokenizer.eot_id
    assert (meta["train_rows"], meta["val_rows"]) == (18, 2)
    assert "Split (tail): last 2 of 20 documents held out" in out
    train, val = read_ids(prepared, "train"), read_ids(prepared, "val")
    assert (train == eot).sum() == 17
    assert prepared.tokenizer.decode(train) == EOT.join(stories[:18])
    assert prepared.tokenizer.decode(val) == EOT.join(stories[18:])


def test_a_cache_written_in_an_older_format_is_rebuilt(tmp_path, monkeypatch):
    """Same inputs and settings, but written by a tinylm that cut them otherwise (format 1 read
    the TinyStories sample by paragraph): the fingerprint holds the format, so it is rebuilt."""
    write_corpus(tmp_path / "corpus")
    assert tinylm.data.FORMAT_VERSION >= 2
    monkeypatch.setattr(tinylm.data, "FORMAT_VERSION", 1)
    old, _ = prepare(*configs(tmp_path))
    monkeypatch.undo()
    new, out = prepare(*configs(tmp_path))
    assert not new.from_cache and "Rebuilding" in out and "inputs or settings changed" in out
    assert new.meta["format"] == tinylm.data.FORMAT_VERSION != old.meta["format"]


@pytest.fixture
def fake_hub(monkeypatch):
    """A stand-in for roneneldan/TinyStories: load_dataset streams a few thousand stories per
    split, rows with the real columns; HF_ENDPOINT is a local socket, so the reachability check
    connects without leaving the machine. Yields the calls made and the stories."""
    import datasets

    splits = {"train": [paragraph(i) + "\n\n" + paragraph(i + 1) for i in range(3000)],
              "validation": [f"Validation story {i}. " + paragraph(i) for i in range(400)]}
    calls = []

    def fake_load_dataset(path, split=None, streaming=False, **kwargs):
        calls.append((path, split, streaming))
        rows = datasets.Dataset.from_dict({"text": splits[split]})
        return rows.to_iterable_dataset() if streaming else rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as hub:
        hub.bind(("127.0.0.1", 0))
        hub.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.getsockname()[1]}")
        yield calls, splits


def hub_preset(tmp_path, *overrides):
    """data=tinystories_hub as the command line composes it, made small."""
    cfg = compose("config", ["data=tinystories_hub", f"data.cache_dir={tmp_path / 'data'}",
                             "tokenizer.vocab_size=300", *overrides])
    return (to_dataclass(DataConfig, cfg.data, "data"),
            to_dataclass(TokenizerConfig, cfg.tokenizer, "tokenizer"))


@pytest.mark.slow
def test_hub_preset_streams_the_official_splits_with_endoftext_between_stories(
        tmp_path, fake_hub):
    calls, splits = fake_hub
    prepared, out = prepare(*hub_preset(tmp_path))
    # streamed, never downloaded whole: the BPE's pass stops early, the ids' pass reads all
    assert set(calls) == {("roneneldan/TinyStories", "train", True),
                          ("roneneldan/TinyStories", "validation", True)}
    meta, tok = prepared.meta, prepared.tokenizer
    assert (meta["split"], meta["train_rows"], meta["val_rows"]) == ("hub", 3000, 400)
    assert "its 'validation' split validates (400)" in out
    train = read_ids(prepared, "train")
    assert (train == tok.eot_id).sum() == 3000 - 1
    assert tok.decode(train).split(EOT) == splits["train"]
    assert tok.decode(read_ids(prepared, "val")).split(EOT) == splits["validation"]


@pytest.mark.slow
def test_hub_bpe_learns_on_at_most_train_bytes_and_max_documents_bounds_both_splits(
        tmp_path, fake_hub, monkeypatch):
    import tinylm.data

    _, splits = fake_hub
    seen = []

    def spy(cfg, texts, **kwargs):  # what the BPE trainer is given
        texts = list(texts)
        seen.append(sum(len(t.encode()) for t in texts))
        return train_tokenizer(cfg, texts, **kwargs)

    monkeypatch.setattr(tinylm.data, "train_tokenizer", spy)
    small, _ = prepare(*hub_preset(tmp_path, "data.max_documents=500",
                                   "tokenizer.train_bytes=5000"))
    assert seen == [5000]  # the story that crosses the limit is cut there
    assert (small.meta["train_rows"], small.meta["val_rows"]) == (500, 50)
    assert small.tokenizer.decode(read_ids(small, "train")).split(EOT) == splits["train"][:500]
    assert small.tokenizer.decode(read_ids(small, "val")).split(EOT) == splits["validation"][:50]


@pytest.mark.slow
def test_hub_without_a_validation_split_holds_out_whole_stories_by_seed(tmp_path, fake_hub):
    _, splits = fake_hub
    held_out = []
    for seed in (1, 1, 2):
        prepared, out = prepare(*hub_preset(tmp_path, "data.hub_val_split=null",
                                            f"data.split_seed={seed}", f"data.name=s{seed}"),
                                force=True)
        tok = prepared.tokenizer
        train = tok.decode(read_ids(prepared, "train")).split(EOT)
        val = tok.decode(read_ids(prepared, "val")).split(EOT)
        assert sorted(train + val) == sorted(splits["train"])  # whole stories, each on one side
        assert 0.07 < len(val) / 3000 < 0.13 and f"{len(val):,} of 3,000 documents" in out
        held_out.append(val)
    assert held_out[0] == held_out[1] != held_out[2]


def test_prepare_makes_no_network_calls(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    prepared, _ = prepare(*configs(tmp_path))
    assert prepared.meta["train_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("corpus, tokenizer, counts, rows", [
    # nanoGPT's shakespeare_char: the same split and ids (65 characters, then <|endoftext|>)
    ("tinyshakespeare", "char", (1_003_854, 111_540), (1, 1)),
    ("tinystories", "bpe", (221_521, 24_615), (1_007, 115)),  # stories: 218 + 904 in the files
])
def test_embedded_corpora_prepare_to_the_pinned_splits(tmp_path, monkeypatch, corpus, tokenizer,
                                                      counts, rows):
    from tinylm.corpus import embedded_dir

    monkeypatch.delenv("TINYLM_DATA_ROOT", raising=False)
    shakespeare = corpus == "tinyshakespeare"
    data_cfg = DataConfig(name=corpus, cache_dir=str(tmp_path / "data"),
                          files=["tinyshakespeare/input.txt"] if shakespeare
                          else DataConfig().files)  # both read by document, the default
    tok_cfg = TokenizerConfig(name=tokenizer, vocab_size=None if shakespeare else 4096)
    prepared, out = prepare(data_cfg, tok_cfg)
    meta = prepared.meta
    assert (meta["train_tokens"], meta["val_tokens"]) == counts
    assert (meta["train_rows"], meta["val_rows"]) == rows
    assert f"local files under {embedded_dir().resolve()}" in out
    if shakespeare:
        text = (embedded_dir() / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
        chars = sorted(set(text))
        assert prepared.tokenizer.vocab_size == len(chars) + 1 == 66
        expected = np.array([chars.index(c) for c in text[:1000]], dtype=np.uint16)
        assert np.array_equal(read_ids(prepared, "train")[:1000], expected)


# ---------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("content, message", [
    (None, r"corpus 'toy': no missing\.txt under .*corpus \(data\.data_root\)"),
    (b"", r"missing\.txt is empty \(0 bytes\)"),
    (b" \n\n \n", r"missing\.txt holds only whitespace"),
    (b"Good text.\n\nBad \xff byte.", r"missing\.txt is not valid UTF-8: byte offset 16 \(line 3\)"
                                      r".*data\.on_decode_error=replace"),
])
def test_bad_corpus_files_are_refused_and_leave_no_cache(tmp_path, content, message):
    (tmp_path / "corpus").mkdir()
    if content is not None:
        (tmp_path / "corpus" / "missing.txt").write_bytes(content)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare(*configs(tmp_path, files=["missing.txt"]))
    assert cache_entries(tmp_path) == []


def test_invalid_utf8_is_replaced_when_asked(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "stories.txt").write_bytes(
        ("\n\n".join(paragraph(i) for i in range(30))).encode() + b"\n\nBad \xff byte.")
    prepared, out = prepare(*configs(tmp_path, on_decode_error="replace"))
    assert "replacing bad bytes with U+FFFD" in out
    assert prepared.tokenizer.decode(read_ids(prepared, "val")).endswith("Bad \ufffd byte.")


def test_a_failed_build_leaves_the_previous_cache_whole(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus")
    good, _ = prepare(*configs(tmp_path))
    meta_before = (good.directory / "meta.json").read_text()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C halfway through

    monkeypatch.setattr("tinylm.data.write_ids", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(*configs(tmp_path, val_fraction=0.2))
    assert (good.directory / "meta.json").read_text() == meta_before
    assert cache_entries(tmp_path) == ["toy-bpe"]
    with pytest.raises(KeyboardInterrupt):
        prepare(*configs(tmp_path, name="fresh"))
    assert cache_entries(tmp_path) == ["toy-bpe"]  # no half-written toy-fresh either


@pytest.mark.parametrize("damage", ["truncate", "meta"])
def test_cache_not_matching_its_meta_is_rebuilt(tmp_path, damage):
    write_corpus(tmp_path / "corpus")
    first, _ = prepare(*configs(tmp_path))
    if damage == "truncate":
        data = first.train_path.read_bytes()
        first.train_path.write_bytes(data[:-10])
        reason = f"train.bin holds {first.meta['train_tokens'] - 5:,} tokens but meta.json says"
    else:
        (first.directory / "meta.json").write_text("{")
        reason = "meta.json is missing or unreadable"
    second, out = prepare(*configs(tmp_path))
    assert not second.from_cache and reason in out
    assert read_ids(second, "train").size == second.meta["train_tokens"]


def test_corpus_shorter_than_one_window_is_refused(tmp_path):
    write_corpus(tmp_path / "corpus", n=20)
    prepared, _ = prepare(*configs(tmp_path))
    n_val = prepared.meta["val_tokens"]
    check_enough_tokens(prepared, block_size=n_val - 1)  # exactly one window fits
    with pytest.raises(ValueError, match=rf"val\.bin holds {n_val} tokens.*"
                                         rf"model\.block_size \+ 1 = {n_val + 1}"):
        check_enough_tokens(prepared, block_size=n_val)


def test_bad_data_configs_are_refused_by_name():
    with pytest.raises(ValueError, match=r"data\.source='web' is not allowed; allowed: local, hub"):
        DataConfig(source="web")
    with pytest.raises(ValueError, match=r"data\.val_fraction=1\.0 is not allowed"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match=r"data\.files is empty"):
        DataConfig(files=[])
    with pytest.raises(ValueError, match=r"data\.files='notes.txt' is not allowed: must be a list"):
        DataConfig(files="notes.txt")


# ------------------------------------------------------------------------------- the sampler

@pytest.fixture
def counting_bin(tmp_path):
    """A token file holding 0, 1, 2, ...: every window shows where it was cut from."""
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    return path


def test_batches_are_windows_with_targets_shifted_by_one(counting_bin):
    x, y = BatchSampler(counting_bin, block_size=16, batch_size=4, seed=0).next_batch("cpu")
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # each target is the next token
    assert torch.equal(x, x[:, :1] + torch.arange(16))  # a contiguous stretch of the file
    assert int(y.max()) <= 4999


def test_sampler_is_reproducible_from_its_seed(counting_bin):
    def draw(seed):
        sampler = BatchSampler(counting_bin, block_size=8, batch_size=4, seed=seed)
        return torch.cat([sampler.next_batch()[0] for _ in range(3)])

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_resumed_sampler_continues_the_same_batches(counting_bin, tmp_path):
    straight = BatchSampler(counting_bin, block_size=8, batch_size=4, seed=3)
    expected = [straight.next_batch()[0] for _ in range(5)]

    first = BatchSampler(counting_bin, block_size=8, batch_size=4, seed=3)
    for _ in range(2):
        first.next_batch()
    torch.save(first.state_dict(), tmp_path / "sampler.pt")
    resumed = BatchSampler(counting_bin, block_size=8, batch_size=4, seed=999)
    resumed.load_state_dict(torch.load(tmp_path / "sampler.pt", weights_only=True))
    assert all(torch.equal(resumed.next_batch()[0], e) for e in expected[2:])
    assert resumed.batches_drawn == 5

    other_shape = BatchSampler(counting_bin, block_size=16, batch_size=4, seed=3)
    with pytest.raises(ValueError, match="saved block_size=8, this run has block_size=16"):
        other_shape.load_state_dict(first.state_dict())


def test_ranks_draw_different_slices_of_one_global_batch(counting_bin):
    whole = BatchSampler(counting_bin, block_size=8, batch_size=8, seed=5).next_batch()[0]
    parts = [BatchSampler(counting_bin, block_size=8, batch_size=4, seed=5, rank=r,
                          world_size=2).next_batch()[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(parts[0], parts[1])


# ------------------------------------------------------------------------------------ the CLI

@pytest.mark.parametrize("data", ["tinystories", "tinyshakespeare", "text"])
@pytest.mark.parametrize("tokenizer", ["bpe", "char"])
def test_every_data_and_tokenizer_config_builds_its_dataclass(data, tokenizer):
    cfg = compose("config", [f"data={data}", f"tokenizer={tokenizer}", "data.files=[notes.txt]"])
    data_cfg = to_dataclass(DataConfig, cfg.data, "data")
    tok_cfg = to_dataclass(TokenizerConfig, cfg.tokenizer, "tokenizer")
    assert (data_cfg.name, tok_cfg.name) == (data, tokenizer)


@pytest.mark.slow
def test_prepare_command_writes_only_the_cache(tmp_path, monkeypatch, capsys):
    from tinylm.cli.prepare import main

    write_corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    args = ["tinylm-prepare", "data=text", "data.files=[corpus/stories.txt]",
            "tokenizer=char"]
    for expected in ("Wrote data/text-char/", "Reusing data/text-char/"):
        monkeypatch.setattr(sys, "argv", list(args))
        main()
        assert expected in capsys.readouterr().out
    # no Hydra run directory, .hydra/ or log file: only the cache (and the corpus we wrote)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"]

    monkeypatch.setattr(sys, "argv", [*args[:2], "data.files=[corpus/nothing.txt]"])
    with pytest.raises(SystemExit, match="tinylm-prepare: error: corpus 'text'"):
        main()
