"""tinylm-train at the edges (issue 35): a refused command leaves the disk as it was, a start
that fails before its first checkpoint leaves no run directory, and a full disk mid-run stops in
one line that names the last good checkpoint and the command that continues from it."""

import subprocess
import sys

import pytest
from conftest import fill_disk
from helpers import TINY

import tinylm.cli.train
from tinylm.checkpoint import load_checkpoint, resolve_checkpoint_dir

HOLD_LOCK = """
import sys, time
from tinylm.checkpoint import run_dir_lock
with run_dir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def tinylm_train(monkeypatch, corpus, *argv):
    """Run tinylm-train's console entry in this process; returns the exit line, or None."""
    monkeypatch.setattr(sys, "argv", ["tinylm-train", *TINY,
                                      f"data.files=[{corpus / 'stories.txt'}]",
                                      f"data.cache_dir={corpus / 'cache'}", *argv])
    try:
        tinylm.cli.train.main()
    except SystemExit as stopped:
        assert isinstance(stopped.code, str) and "\n" not in stopped.code, stopped.code
        return stopped.code
    return None


def contents(directory):
    """Every file under `directory` with its bytes, and every folder."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*"))}


@pytest.mark.slow
def test_a_refused_command_leaves_the_run_and_its_record_as_they_were(
        corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    assert tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}",
                        "train.max_steps=10") is None
    assert {".hydra", "train.log", "checkpoints", "tensorboard"} <= \
        {p.name for p in run_dir.iterdir()}
    assert "train.max_steps=10" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    before = contents(run_dir)

    said = [tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}", "train.max_steps=20"),
            tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}", "train.resume=true",
                         "model.n_embd=64"),
            tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}", "train.resume=true",
                         "model.n_embd=65536", "model.n_layer=8")]
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said.append(tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}",
                                 "train.resume=true", "train.max_steps=20"))
    finally:
        holder.kill()
        holder.wait()
    assert "already holds checkpoints" in said[0]
    # a resume continues the run as it was started: another shape is named, not tried
    assert "1 override given now differs: model.n_embd: 32 when the run started, 64 now" \
        in said[1]
    assert ("2 overrides given now differ: model.n_embd: 32 when the run started, 65536 now; "
            "model.n_layer: ") in said[2]
    assert f"in use by another process (pid {holder.pid})" in said[3]
    after = contents(run_dir)
    after.pop(".lock.pid", None)  # the killed holder's, swept by the next run that takes the lock
    assert after == before


@pytest.mark.slow
def test_a_start_that_fails_before_its_first_checkpoint_leaves_no_run_directory(
        corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = tinylm_train(monkeypatch, corpus, "model.n_embd=65536")  # runs/<date>/<time>
    assert said.startswith("tinylm-train: error: the model does not fit in memory: ")
    said = tinylm_train(monkeypatch, corpus, "train.resume=true")
    assert "holds no checkpoint" in said
    said = tinylm_train(monkeypatch, corpus, "hydra.run.dir=new", "train.compile=true",
                        "train.device=nope")
    assert "device='nope' is not a device" in said
    said = tinylm_train(monkeypatch, corpus, "model.n_embd=7,9", "-m")  # a sweep's first run
    assert "model.n_embd=7 is not allowed" in said
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "notes").write_text("mine")
    for named in ("notes", "notes/run"):
        said = tinylm_train(monkeypatch, corpus, f"hydra.run.dir={named}")
        assert said == (f"tinylm-train: error: hydra.run.dir={named} cannot hold the run: notes "
                        "is a file; name a folder with hydra.run.dir=/path/to/folder")
    (tmp_path / "notes").unlink()
    (tmp_path / "mine").mkdir()  # a directory the user made is theirs: it stays
    tinylm_train(monkeypatch, corpus, "hydra.run.dir=mine", "train.resume=true")
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and not any((tmp_path / "mine")
                                                                          .iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("room", [0, 60_000])  # bytes left: the record fails, or a checkpoint
def test_a_full_disk_is_one_line_the_last_checkpoint_stays_and_the_resume_works(
        room, corpus, small_disk, monkeypatch):
    disk = small_disk(8192)
    monkeypatch.chdir(disk.parent)
    run_dir = disk / "run"
    assert tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}",
                        "train.max_steps=10") is None
    last = resolve_checkpoint_dir(run_dir, "last")
    fill_disk(disk, leave=room)
    said = tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}", "train.resume=true")
    assert said is not None and said.startswith("tinylm-train: error: ")
    assert "could not be written: " in said and "No space left on device" in said
    assert "MiB free on" in said
    assert said.endswith(f"the last good checkpoint, {last}, is intact; once there is room, "
                         f"continue with: tinylm-train train.resume=true "
                         f"hydra.run.dir={run_dir}")
    assert resolve_checkpoint_dir(run_dir, "last") == last
    load_checkpoint(run_dir)  # the tags name complete checkpoints
    assert not [p.name for p in run_dir.rglob("*") if ".tmp" in p.name]

    (disk / "filler").unlink()  # room made
    assert tinylm_train(monkeypatch, corpus, f"hydra.run.dir={run_dir}",
                        "train.resume=true") is None
    assert resolve_checkpoint_dir(run_dir, "last").name == "step-0000030"
