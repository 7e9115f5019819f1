"""The data cache on a bad day: a full or read-only disk, a cache_dir that cannot be a folder,
and what a killed or terminated prepare leaves (real disks and real processes)."""

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_data import configs, prepare, write_corpus

from tinylm.data import prepare_data
from tinylm.files import NotWritten


def entries(folder):
    """Everything in a folder, hidden build and trash folders included."""
    return sorted(p.name for p in Path(folder).iterdir()) if Path(folder).is_dir() else []


def run_prepare_cli(monkeypatch, *args):
    """tinylm-prepare in this process; returns the line it exited with (None if it did not)."""
    from tinylm.cli.prepare import main

    monkeypatch.setattr(sys, "argv", ["tinylm-prepare", *args])
    try:
        main()
    except SystemExit as stop:
        return str(stop.code)
    return None


# --------------------------------------------------------------------- a full or read-only disk

@pytest.fixture
def small_cache(tmp_path, small_disk):
    """A cache of a small corpus prepared on a 128 KiB disk, and a corpus beside it (big.txt)
    whose ids do not fit there: (the cache's configs, its meta.json's text)."""
    disk = small_disk(128)
    write_corpus(tmp_path / "corpus")
    cfgs = configs(tmp_path, tokenizer="char", cache_dir=str(disk))
    prepared, _ = prepare(*cfgs)
    write_corpus(tmp_path / "corpus", n=3000, name="big.txt")  # ~600 KiB of ids
    return cfgs, (prepared.directory / "meta.json").read_text()


def test_a_full_disk_raises_not_written_naming_the_cache_and_keeps_the_last_one(small_cache):
    (data_cfg, tok_cfg), meta_before = small_cache
    data_cfg.files = ["big.txt"]
    cache = Path(data_cfg.cache_dir) / "toy-char"
    with pytest.raises(NotWritten, match=rf"^{cache} could not be written: No space left on "
                                         r"device \([\d.]+ MiB free on .*\)$"):
        prepare_data(data_cfg, tok_cfg, log=print)
    assert (cache / "meta.json").read_text() == meta_before
    assert entries(data_cfg.cache_dir) == ["toy-char"]  # no build folder left


def test_prepare_on_a_full_disk_ends_in_one_line_with_the_commands_that_continue(
        tmp_path, monkeypatch, small_cache):
    (data_cfg, _), meta_before = small_cache
    monkeypatch.chdir(tmp_path / "corpus")
    args = ["data=text", "data.name=toy", "data.files=[big.txt]", "tokenizer=char",
            f"data.cache_dir={data_cfg.cache_dir}"]
    line = run_prepare_cli(monkeypatch, *args)
    cache = f"{data_cfg.cache_dir}/toy-char"
    assert "\n" not in line
    assert line.startswith(f"tinylm-prepare: error: {cache} could not be written: No space left "
                           "on device (")
    assert f"; {cache}/ is as it was, and no build folder is left; " in line
    again = shlex.join(["tinylm-prepare", *args])
    elsewhere = shlex.join(["tinylm-prepare", *args[:-1], "data.cache_dir=/path/with/room"])
    assert line.endswith(f"run the same command again: {again}; or prepare on a disk with room: "
                         f"{elsewhere}")
    assert (Path(cache) / "meta.json").read_text() == meta_before
    assert entries(data_cfg.cache_dir) == ["toy-char"]


def test_a_read_only_disk_serves_its_cache_and_refuses_a_rebuild_in_one_line(small_cache):
    (data_cfg, tok_cfg), _ = small_cache
    subprocess.run(["mount", "-o", "remount,ro", data_cfg.cache_dir], check=True)
    assert prepare(data_cfg, tok_cfg)[0].from_cache
    data_cfg.val_fraction = 0.2
    with pytest.raises(ValueError, match=rf"^data.cache_dir={data_cfg.cache_dir}: "
                                         rf"{data_cfg.cache_dir} cannot be written \(a read-only "
                                         r"disk or no permission\); name a folder you can write"):
        prepare(data_cfg, tok_cfg)


# ----------------------------------------------------------- a cache_dir that is not a folder

@pytest.mark.parametrize("case", ["file", "under a file", "link to nowhere", "link loop",
                                  "cache folder is a file"])
def test_a_cache_dir_that_cannot_be_a_folder_is_refused_before_anything_is_made(tmp_path, case):
    write_corpus(tmp_path / "corpus")
    place = tmp_path / "place"
    if case in ("file", "under a file"):
        place.write_text("not a folder")
        what = "a file"
    elif case == "cache folder is a file":
        place.mkdir()
        (place / "toy-bpe").write_text("not a folder")
        what = "a file"
    else:
        place.symlink_to(tmp_path / ("nowhere" if case == "link to nowhere" else "place"))
        what = f"a link to {place.readlink()}, which leads to no folder"
    cache_dir = place / "sub" if case == "under a file" else place
    bad = place / "toy-bpe" if case == "cache folder is a file" else place
    before = {p: p.stat(follow_symlinks=False).st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(ValueError, match=f"^data.cache_dir={cache_dir} cannot hold the prepared "
                                         f"data: {bad} is {what}; name a folder with "
                                         r"data.cache_dir=/path/to/folder$"):
        prepare(*configs(tmp_path, cache_dir=str(cache_dir)))
    assert {p: p.stat(follow_symlinks=False).st_mtime_ns for p in tmp_path.rglob("*")} == before


@pytest.mark.slow
def test_prepare_command_refuses_a_file_as_cache_dir_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "hostname").write_text("box\n")
    monkeypatch.chdir(tmp_path)
    line = run_prepare_cli(monkeypatch, f"data.cache_dir={tmp_path / 'hostname'}")
    assert line == (f"tinylm-prepare: error: data.cache_dir={tmp_path / 'hostname'} cannot hold "
                    f"the prepared data: {tmp_path / 'hostname'} is a file; name a folder with "
                    "data.cache_dir=/path/to/folder")
    assert entries(tmp_path) == ["hostname"]


# ------------------------------------------------------------- a killed or terminated prepare

@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """A folder holding big.txt: a corpus whose char-level build takes a few seconds."""
    folder = tmp_path_factory.mktemp("big")
    write_corpus(folder, n=200_000, name="big.txt")
    return folder


def start_prepare(corpus, cache):
    """tinylm-prepare of corpus/big.txt into `cache`, started; returns (the process, its build
    folder once it has appeared)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tinylm.cli.prepare", "data=text", "data.files=[big.txt]",
         "tokenizer=char", f"data.cache_dir={cache}"],
        cwd=corpus, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        builds = list(cache.glob(f".text-char.tmp-{process.pid}-*"))
        if builds:
            return process, builds[0]
        time.sleep(0.01)
    process.kill()
    pytest.fail(f"prepare made no build folder: {process.communicate()}")


@pytest.mark.slow
def test_the_next_prepare_sweeps_a_killed_builds_folder_but_not_a_live_one(big_corpus, tmp_path):
    write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    small = configs(tmp_path, tokenizer="char", cache_dir=str(cache))
    process, build = start_prepare(big_corpus, cache)
    try:
        _, out = prepare(*small)  # in the same cache folder, while the other one builds
        assert build.is_dir() and "Removed" not in out
    finally:
        process.kill()  # SIGKILL: no cleanup runs
        process.wait()
    assert build.is_dir()
    small[0].name = "other"
    _, out = prepare(*small)
    assert out.splitlines()[0] == (f"Removed what an interrupted prepare left in {cache}/: "
                                   f"{build.name}")
    assert entries(cache) == ["other-char", "toy-char"]
    _, out = prepare(*small)
    assert "Removed" not in out  # said once


@pytest.mark.slow
def test_a_terminated_prepare_leaves_no_build_folder(big_corpus, tmp_path):
    process, build = start_prepare(big_corpus, tmp_path / "cache")
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == \
        "tinylm-prepare: interrupted (no partial cache is left behind)"
    assert not build.exists() and entries(tmp_path / "cache") == []
