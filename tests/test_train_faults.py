"""tinylm-train at the edges (issues 35, 48): a refused command leaves the disk as it was, a start
that fails before its first checkpoint leaves no run directory, a full disk mid-run stops in one
line that names the last good checkpoint and the command that continues from it, and Ctrl-C, any
number of times and at any moment, ends in one line and never removes a run folder."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import fill_disk
from helpers import TINY
from test_train import ctrl_c_during_step

import tinylm.cli.train
import tinylm.train.trainer
from tinylm.checkpoint import load_checkpoint, resolve_checkpoint_dir
from tinylm.files import project_root

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


# ------------------------------------------------------------------------- Ctrl-C, SIGTERM


@pytest.fixture
def handlers_restored():
    """The test process's SIGINT and SIGTERM handlers as they were, after a command in this
    process installed its own."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def signalled(args, cwd, wait_for, signals, gap=0.03, timeout=120):
    """Start `args` in `cwd`, wait until `wait_for` (a path under cwd, and the text it holds)
    exists, send `signals` `gap` seconds apart: (exit status, stderr)."""
    with open(cwd / "stderr.txt", "w") as stderr:  # a file: a full pipe would block training
        proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + timeout
    file, text = wait_for
    while not ((cwd / file).is_file() and text in (cwd / file).read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {wait_for}: {(cwd / 'stderr.txt').read_text()[-3000:]}")
        time.sleep(0.01)
    for signum in signals:
        proc.send_signal(signum)
        time.sleep(gap)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the command hung after its signals")
    return status, (cwd / "stderr.txt").read_text()


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("signals, when", [
    # Ctrl-C twice, quickly: the second lands in the step or the stop-save
    ([signal.SIGINT] * 2, "Model: "),
    ([signal.SIGINT] * 6, "Model: "),  # and again and again
    ([signal.SIGTERM, signal.SIGINT, signal.SIGTERM], "Model: "),
    ([signal.SIGINT] * 2, ""),  # as soon as the run's record is written
])
def test_ctrl_c_any_number_of_times_before_the_first_checkpoint_keeps_the_run_folder(
        signals, when, corpus, tmp_path):
    args = [sys.executable, str(project_root() / "scripts" / "train.py"), *TINY,
            f"data.files=[{corpus / 'stories.txt'}]", f"data.cache_dir={corpus / 'cache'}",
            "train.max_steps=100000", "train.checkpoint_interval=0",
            "train.eval_interval=100000", "hydra.run.dir=run"]
    status, stderr = signalled(args, tmp_path, ("run/train.log", when), signals)
    # the first signal Python handles: of two pending at once, it takes the lower number first
    assert status in {128 + signum for signum in signals}
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    run_dir = tmp_path / "run"
    kept = {".hydra", "train.log"} | ({"tensorboard"} if when else set())  # opened after
    assert kept <= {p.name for p in run_dir.iterdir()}
    assert "Corpus text: " in (run_dir / "train.log").read_text()
    last = stderr.strip().splitlines()[-1]
    if (run_dir / "checkpoints" / "last").exists():  # the first signal's stop-save finished
        assert last.endswith(f" tinylm-train train.resume=true hydra.run.dir={run_dir}")
    else:
        assert last == (f"tinylm-train: interrupted before the run's first checkpoint; {run_dir} "
                        "keeps its train.log and TensorBoard logs")


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_stop_save_is_written_keeps_the_run_folder(
        corpus, tmp_path, monkeypatch, capsys, handlers_restored):
    monkeypatch.chdir(tmp_path)
    ctrl_c_during_step(monkeypatch, 3)
    save = tinylm.train.trainer.save_checkpoint

    def ctrl_c_again_while_saving(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return save(*args, **kwargs)

    monkeypatch.setattr(tinylm.train.trainer, "save_checkpoint", ctrl_c_again_while_saving)
    monkeypatch.setattr(sys, "argv", ["tinylm-train", *TINY, "train.checkpoint_interval=0",
                                      f"data.files=[{corpus / 'stories.txt'}]",
                                      f"data.cache_dir={corpus / 'cache'}", "hydra.run.dir=run"])
    with pytest.raises(SystemExit) as stopped:
        tinylm.cli.train.main()
    assert stopped.value.code == 130
    run_dir = tmp_path / "run"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"tinylm-train: interrupted before the run's first checkpoint; {run_dir.resolve()} "
        "keeps its train.log and TensorBoard logs")
    assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "tensorboard", "train.log"]
    assert not list(run_dir.rglob("*.tmp*"))  # the stop-save left no half-written folder


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("delay", [0.15, 0.4, 0.8])
def test_ctrl_c_while_the_command_starts_is_one_line_not_a_traceback(delay, tmp_path):
    script = Path(sys.executable).with_name("tinylm-train")
    if not script.is_file():
        pytest.skip(f"tinylm-train is not installed beside {sys.executable} (pip install -e .)")
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([str(script), "hydra.run.dir=run"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    time.sleep(delay)  # well inside the imports of torch, Hydra and the rest
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    said = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in said and said.strip().splitlines()[-1] == "tinylm-train: interrupted"
