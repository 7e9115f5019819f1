"""tinylm.files: an output file is replaced whole or left as it was."""

import json

import pytest

from tinylm.files import replaced_atomically, write_json_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"loss": 1.5})
    with pytest.raises(OSError, match="disk full"):
        with replaced_atomically(path) as tmp:
            tmp.write_text('{"loss": ')  # half a report, then the writer dies
            raise OSError("disk full")
    assert json.loads(path.read_text()) == {"loss": 1.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_finished_write_replaces_the_file_and_makes_missing_directories(tmp_path):
    path = tmp_path / "new" / "dir" / "pronouns.md"
    write_text_atomic(path, "old\n")
    write_text_atomic(path, "'She' → Lily\n")
    assert path.read_text(encoding="utf-8") == "'She' → Lily\n"
    assert [p.name for p in path.parent.iterdir()] == ["pronouns.md"]


def test_a_full_disk_is_one_line_and_leaves_the_old_file(small_disk):
    from conftest import fill_disk

    from tinylm.files import NotWritten
    disk = small_disk(256)
    path = disk / "probe.json"
    write_json_atomic(path, {"loss": 1.5})
    fill_disk(disk)
    with pytest.raises(NotWritten) as caught:
        write_text_atomic(path, "x" * 100_000)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "MiB free on" in message
    assert json.loads(path.read_text()) == {"loss": 1.5}
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "probe.json"]


def test_published_files_arrive_together_or_not_at_all(tmp_path):
    from tinylm.files import published_atomically
    logdir = tmp_path / "run" / "probe" / "inspect"
    with pytest.raises(RuntimeError):
        with published_atomically(logdir) as build:
            (build / "events.out").write_text("half")
            raise RuntimeError("the writer died")
    assert list(tmp_path.iterdir()) == []
    with published_atomically(logdir) as build:
        (build / "sub").mkdir()
        (build / "sub" / "a.png").write_text("png")
        (build / "events.out").write_text("events")
    assert sorted(str(p.relative_to(logdir)) for p in logdir.rglob("*")) == \
        ["events.out", "sub", "sub/a.png"]
    assert [p.name for p in logdir.parent.iterdir()] == ["inspect"]


def test_leftovers_of_a_dead_process_are_swept_and_a_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from tinylm.files import sweep_leftovers, temporary_name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".data-bpe.tmp-{dead}-0a1b2c3d").mkdir()
    (tmp_path / f".report.json.tmp-{dead}-00ff00ff").write_text("{")
    mine = temporary_name(tmp_path / "data-char")
    mine.mkdir()
    (tmp_path / "data-bpe").mkdir()
    assert sorted(sweep_leftovers(tmp_path)) == [f".data-bpe.tmp-{dead}-0a1b2c3d",
                                                 f".report.json.tmp-{dead}-00ff00ff"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "data-bpe"])
    assert str(os.getpid()) in mine.name


# a writer killed (SIGKILL) in the middle of each kind of write, at its temporary name
KILLED_WRITER = """
import os, signal, sys
from tinylm.files import published_atomically, replaced_atomically
place, kind = sys.argv[1:]
if kind == "file":
    with replaced_atomically(place) as tmp:
        open(tmp, "w").write("half")
        os.kill(os.getpid(), signal.SIGKILL)
with published_atomically(place, replace=kind == "replaced folder") as build:
    (build / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("kind", ["file", "folder", "replaced folder"])
def test_what_a_killed_writer_left_is_swept_by_the_next_write_to_the_same_place(tmp_path, kind):
    import subprocess
    import sys

    from tinylm.files import published_atomically, write_text_atomic
    place = tmp_path / "out"
    if kind == "replaced folder":
        place.mkdir()
        (place / "old.txt").write_text("old")
    other = tmp_path / ".other.tmp-999999999-00000000"  # another place's: not this write's
    other.write_text("")
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(place), kind])
    assert killed.returncode == -9
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".out.")]) == 1
    if kind == "file":
        write_text_atomic(place, "whole")
        assert place.read_text() == "whole"
    else:
        if kind == "replaced folder":  # killed before the old folder was set aside
            assert (place / "old.txt").exists()
        with published_atomically(place, replace=kind == "replaced folder") as build:
            (build / "new.txt").write_text("new")
        assert sorted(p.name for p in place.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "out"]


def test_a_folder_set_aside_by_a_killed_replace_is_put_back_not_swept(tmp_path):
    import subprocess
    import sys

    from tinylm.files import sweep_leftovers
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    aside = tmp_path / f".cache.old-{dead}-0a1b2c3d"
    aside.mkdir()
    (aside / "train.bin").write_text("the only copy")
    assert sweep_leftovers(tmp_path, "cache") == []
    assert (tmp_path / "cache" / "train.bin").read_text() == "the only copy"


def test_a_replaced_folder_is_swapped_whole_or_kept_as_it_was(tmp_path, monkeypatch):
    import errno
    import os

    from tinylm.files import NotWritten, published_atomically
    cache = tmp_path / "toy-bpe"
    with published_atomically(cache) as build:
        (build / "train.bin").write_text("old")
        (build / "stale.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with published_atomically(cache, replace=True) as build:
            (build / "train.bin").write_text("half")
            raise KeyboardInterrupt  # Ctrl-C halfway through a rebuild

    rename = os.rename

    def refused(source, target):  # the new folder cannot go in once the old one is aside
        if target == cache and ".tmp-" in source.name:
            raise PermissionError(errno.EACCES, "Permission denied")
        rename(source, target)
    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(NotWritten, match=f"^{cache} could not be written: Permission denied"):
        with published_atomically(cache, replace=True) as build:
            (build / "train.bin").write_text("new")
    monkeypatch.undo()
    assert {p.name: p.read_text() for p in cache.iterdir()} == {"train.bin": "old",
                                                                 "stale.txt": "old"}
    with published_atomically(cache, replace=True) as build:
        (build / "train.bin").write_text("new")
    assert {p.name: p.read_text() for p in cache.iterdir()} == {"train.bin": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["toy-bpe"]  # no build, nothing set aside


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_every_file_written_whole_gets_the_umasks_mode_even_one_its_writer_made_private(
        tmp_path, umask, mode):
    import os

    import torch
    from safetensors.torch import save_file

    from tinylm.files import published_atomically

    def private(file):
        save_file({"w": torch.zeros(2)}, str(file))  # safetensors creates its file 0600

    old = os.umask(umask)
    try:
        with replaced_atomically(tmp_path / "alone.safetensors") as tmp:
            private(tmp)
        with published_atomically(tmp_path / "folder") as build:
            private(build / "model.safetensors")
            (build / "config.json").write_text("{}")
    finally:
        os.umask(old)
    files = [tmp_path / "alone.safetensors", *(tmp_path / "folder").iterdir()]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        "alone.safetensors": oct(mode), "model.safetensors": oct(mode), "config.json": oct(mode)}
