"""The embedded corpora and their checksums, reading local files as rows, reaching the hub."""

import hashlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tinylm.corpus
from tinylm.corpus import (
    CHECKSUMS,
    OFFLINE_SWITCHES,
    HubError,
    check_hub_reachable,
    embedded_dir,
    hub_rows,
    read_rows,
    scan_file,
)
from tinylm.data import DataConfig, prepare_data
from tinylm.tokenizer import TokenizerConfig

CORPORA = {"tinystories/train-head.txt": 200_111, "tinystories/validation-head.txt": 806_113,
           "tinyshakespeare/input.txt": 1_115_394}


def test_embedded_corpora_match_their_checksums_and_carry_their_licenses():
    root = embedded_dir()
    listed = {}
    for line in (root / CHECKSUMS).read_text(encoding="utf-8").splitlines():
        digest, name = line.split()
        listed[name] = digest
    assert set(listed) == set(CORPORA)
    for name, size in CORPORA.items():
        data = (root / name).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == listed[name], name
    license_text = (root / "tinystories" / "LICENSE").read_text(encoding="utf-8")
    assert "CDLA-Sharing-1.0" in license_text and "arXiv:2305.07759" in license_text
    assert "public domain" in (root / "tinyshakespeare" / "ATTRIBUTION").read_text()


@pytest.fixture
def embedded_copy(tmp_path, monkeypatch):
    """A copy of the embedded corpora standing in for them, free to damage."""
    copy = tmp_path / "corpora"
    shutil.copytree(embedded_dir(), copy)
    monkeypatch.setattr(tinylm.corpus, "embedded_dir", lambda: copy)
    monkeypatch.delenv("TINYLM_DATA_ROOT", raising=False)
    return copy


@pytest.mark.parametrize("damage", ["altered", "missing"])
def test_a_damaged_embedded_file_is_refused_in_one_line_saying_how_to_restore_it(
        embedded_copy, tmp_path, damage):
    path = embedded_copy / "tinystories" / "validation-head.txt"
    if damage == "altered":
        path.write_bytes(path.read_bytes().replace(b"Lily", b"Lucy", 1))
        expected = hashlib.sha256(path.read_bytes()).hexdigest()
    else:
        path.unlink()
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        prepare_data(DataConfig(cache_dir=str(tmp_path / "data")), TokenizerConfig(),
                     log=lambda _: None)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "git checkout data/" in message
    if damage == "altered":
        assert f"SHA-256 is {expected}, SHA256SUMS says 62a0e0c1eb1f" in message
    else:
        assert "is missing" in message
    assert not (tmp_path / "data").exists()


def test_data_root_and_the_environment_override_the_embedded_corpora(tmp_path, monkeypatch):
    (tmp_path / "mine" / "tinystories").mkdir(parents=True)
    for name in ("train-head.txt", "validation-head.txt"):
        (tmp_path / "mine" / "tinystories" / name).write_text(
            "\n\n".join(f"Story {i} about Lily." for i in range(200)), encoding="utf-8")
    logs = []
    monkeypatch.setenv("TINYLM_DATA_ROOT", str(tmp_path / "mine"))
    prepare_data(DataConfig(cache_dir=str(tmp_path / "a")), TokenizerConfig(vocab_size=300),
                 log=logs.append)
    assert f"local files under {tmp_path / 'mine'}:" in logs[0]
    monkeypatch.setenv("TINYLM_DATA_ROOT", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as err:
        prepare_data(DataConfig(cache_dir=str(tmp_path / "b")), TokenizerConfig(),
                     log=lambda _: None)
    assert "\n" not in str(err.value)
    assert f"under {tmp_path / 'nowhere'} ($TINYLM_DATA_ROOT)" in str(err.value)
    logs.clear()  # data.data_root wins over the environment
    prepare_data(DataConfig(data_root=str(tmp_path / "mine"), cache_dir=str(tmp_path / "c")),
                 TokenizerConfig(vocab_size=300), log=logs.append)
    assert f"local files under {tmp_path / 'mine'}:" in logs[0]


TRICKY = ("First line.\r\nSecond line, same paragraph.\n\n\n\nAfter three blank lines.\n"
          "\n\nCafé 😀 at the end\n\n\n") * 40 + "no newline at the end"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mem is Linux's")
def test_a_corpus_file_that_cannot_be_read_is_named_in_one_line_as_bad_input():
    mem = Path("/proc/self/mem")  # a regular file whose first bytes no read may return
    message = r"^corpus file /proc/self/mem could not be read: Input/output error$"
    with pytest.raises(ValueError, match=message):
        scan_file(mem, strict_utf8=True, log=print)
    with pytest.raises(ValueError, match=message):
        next(read_rows(mem, "line"))


@pytest.mark.slow
@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document"])
def test_rows_are_those_of_the_datasets_text_loader_whatever_the_chunk_size(
        tmp_path, monkeypatch, sample_by):
    import datasets

    path = tmp_path / "tricky.txt"
    path.write_bytes(TRICKY.encode())
    expected = datasets.load_dataset("text", data_files=[str(path)], split="train",
                                     sample_by=sample_by, cache_dir=str(tmp_path / "cache"))
    for chunk in (7, 64, 1 << 20):  # chunk borders inside lines, paragraphs and characters
        monkeypatch.setattr(tinylm.corpus, "READ_CHUNK", chunk)
        assert list(read_rows(path, sample_by)) == expected["text"], chunk


MARKED = ("\n<|endoftext|>\nOne story.\r\n\r\nIts second paragraph.\n <|endoftext|> \n"
          "<|endoftext|>\nAnother, Café 😀, with <|endoftext|> inside a line.\n\n\n"
          "<|endoftext|>\nThe last one, no newline at the end") * 30


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])  # borders inside lines and characters
def test_lines_of_endoftext_cut_a_file_into_documents_whatever_the_chunk_size(
        tmp_path, monkeypatch, chunk):
    path = tmp_path / "marked.txt"
    path.write_bytes(MARKED.encode())
    monkeypatch.setattr(tinylm.corpus, "READ_CHUNK", chunk)
    docs = list(read_rows(path, "document"))
    # the texts between the marks, without the line breaks around them; none empty
    assert docs == ["One story.\n\nIts second paragraph.",
                    "Another, Café 😀, with <|endoftext|> inside a line.",
                    "The last one, no newline at the end"] * 30


def test_the_shipped_sample_reads_as_its_stories():
    stories = {name: list(read_rows(embedded_dir() / "tinystories" / name, "document"))
               for name in ("train-head.txt", "validation-head.txt")}
    assert [len(s) for s in stories.values()] == [218, 904]
    first, second = stories["train-head.txt"][:2]
    assert first.startswith("One day, a little girl named Lily found a needle")
    assert first.endswith("They both felt happy because they had shared and worked together.")
    assert first.count("\n\n") == 2  # its three paragraphs
    assert second.startswith("Once upon a time, there was a little car named Beep.")
    assert stories["validation-head.txt"][0].startswith("Spot. Spot saw the shiny car")
    assert not any("<|endoftext|>" in s for ss in stories.values() for s in ss)


def test_the_shipped_marks_are_what_the_script_recovers():
    """scripts/mark_story_boundaries.py, run again on the marked files, changes nothing: the
    shipped files are its output, SHA256SUMS included."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "mark_story_boundaries.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True,
                          text=True, check=True)
    sums = dict(line.split()[::-1] for line in
                (embedded_dir() / CHECKSUMS).read_text(encoding="utf-8").splitlines())
    for name, stories in (("train-head.txt", 218), ("validation-head.txt", 904)):
        line = next(x for x in done.stdout.splitlines() if x.startswith(name))
        assert f" {stories:,} stories " in line
        assert line.endswith(f"sha256 {sums[f'tinystories/{name}']}")


# ----------------------------------------------------------------------------------- the hub

@pytest.fixture
def closed_port():
    """A local port nothing listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("switch", OFFLINE_SWITCHES)
def test_offline_switches_stop_the_hub_at_once_and_name_the_offline_choices(
        monkeypatch, switch):
    import datasets

    for var in OFFLINE_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(switch, "1")
    # read by datasets when it is imported: as a command started with the switch set sees it
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match=rf"switched off \({switch}=1\); offline, train on the "
                                       r"embedded TinyStories sample \(data=tinystories\)"):
        check_hub_reachable()


def test_an_unreachable_hub_is_reported_in_one_line_within_seconds(monkeypatch, closed_port):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    start = time.perf_counter()
    with pytest.raises(HubError) as err:
        prepare_data(DataConfig(source="hub"), TokenizerConfig(), log=lambda _: None)
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert "\n" not in message and f"(127.0.0.1:{closed_port}) is unreachable" in message
    assert "data=tinyshakespeare" in message and "data=text" in message


@pytest.mark.slow
def test_hub_errors_while_streaming_become_one_line(monkeypatch):
    import datasets

    def broken(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub\n(details)")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(HubError, match=r"^could not read 'roneneldan/TinyStories' \(split "
                                       r"'train'\) from the Hugging Face hub: Couldn't reach "
                                       r"'roneneldan/TinyStories' on the Hub; offline"):
        next(hub_rows("roneneldan/TinyStories", "train"))
