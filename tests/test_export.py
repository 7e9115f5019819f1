"""tinylm-export's refusals of an `out` that would mix the export with other files: a tinylm run
or checkpoint (or a folder inside one), and a folder that already holds files; an export killed
mid-write, whose leftovers the next one sweeps. (The export itself: tests/test_pretrained.py.)"""

import os
import subprocess
import sys

import pytest
from helpers import refusal, save_run

import tinylm.cli.export
from tinylm.cli.export import ExportConfig, run_export


def files_under(folder):
    """Every file and folder under `folder`, with the bytes of each file: what a refusal must
    leave as it was."""
    return {path: path.read_bytes() if path.is_file() else None
            for path in sorted(folder.rglob("*"))}


@pytest.fixture
def run(tiny_model, bpe, tmp_path):
    return save_run(tmp_path / "run", tiny_model(bpe.vocab_size), bpe)


def test_an_out_that_is_or_is_inside_a_run_or_checkpoint_is_refused_and_nothing_written(
        run, tmp_path):
    step = next((run / "checkpoints").glob("step-*"))
    os.symlink(run, tmp_path / "link")
    before = files_under(tmp_path)
    for out, where in [(step, f"the tinylm checkpoint {step}"),
                       (run, f"the tinylm run {run}"),
                       (run / "checkpoints", f"inside the tinylm run {run}"),
                       (run / "exported" / "gpt2", f"inside the tinylm run {run}"),
                       (step / "gpt2", f"inside the tinylm checkpoint {step}"),
                       (tmp_path / "link" / "gpt2", f"inside the tinylm run {run}")]:
        with pytest.raises(ValueError) as refused:
            run_export(ExportConfig(checkpoint=str(run), out=str(out)))
        assert str(refused.value) == (
            f"out={out} is {where}: the export would overwrite or mix with its files; name a "
            "new folder outside it, e.g. out=exported/my-run")
        assert files_under(tmp_path) == before


def test_an_out_that_already_holds_files_is_refused_and_an_empty_one_is_written(
        run, tmp_path, capsys):
    old = tmp_path / "old-export"
    old.mkdir()
    (old / "tokenizer.json").write_text("{}")  # a stale file the new export would be read with
    (old / "pytorch_model.bin").write_bytes(b"old")
    before = files_under(tmp_path)
    with pytest.raises(ValueError) as refused:
        run_export(ExportConfig(checkpoint=str(run), out=str(old)))
    assert str(refused.value) == (
        f"out={old} is a folder that already holds files: old files would stay beside the "
        f"export and be read with it; name a new or empty folder, or remove {old} first")
    assert files_under(tmp_path) == before

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_export(ExportConfig(checkpoint=str(run), out=str(empty))) == empty
    assert (empty / "model.safetensors").is_file() and (empty / "config.json").is_file()


def test_the_command_refuses_in_one_line(run, tmp_path, monkeypatch):
    step = next((run / "checkpoints").glob("step-*"))
    before = files_under(tmp_path)
    said = refusal(tinylm.cli.export.main, f"checkpoint={run}", f"out={step}",
                   monkeypatch=monkeypatch)
    assert said.startswith(f"tinylm-export: error: out={step} is the tinylm checkpoint {step}")
    assert len(said.splitlines()) == 1
    assert files_under(tmp_path) == before


# an export killed (SIGKILL) while it writes model.safetensors, half of it on the disk
KILLED_EXPORT = """
import os, signal, sys
import tinylm.pretrained.gpt2 as gpt2
def dying(tensors, path, **kwargs):
    open(path, "wb").write(b"half")
    os.kill(os.getpid(), signal.SIGKILL)
gpt2.save_file = dying
from tinylm.cli.export import ExportConfig, run_export
run_export(ExportConfig(checkpoint=sys.argv[1], out=sys.argv[2]))
"""


def test_what_a_killed_export_left_is_swept_by_the_next_export_there(run, tmp_path):
    out = tmp_path / "exported" / "gpt2"
    killed = subprocess.run([sys.executable, "-c", KILLED_EXPORT, str(run), str(out)])
    assert killed.returncode == -9
    left = [p.name for p in out.parent.iterdir()]
    assert len(left) == 1 and left[0].startswith(".gpt2.tmp-")  # hidden, half written
    assert run_export(ExportConfig(checkpoint=str(run), out=str(out))) == out
    assert [p.name for p in out.parent.iterdir()] == ["gpt2"]
    assert (out / "model.safetensors").stat().st_size > 4
