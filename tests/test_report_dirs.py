"""A second report never mixes with the first: inspect=true and tinylm-probe give each report a
folder of its own when logdir= (or the default <run>/<kind>/<timestamp>) already holds one; the
attention tab would otherwise show the tokens of one beside the weights of the other, the pairs of
one probe file beside the effects of another."""

import dataclasses
import json
import time
from pathlib import Path

import pytest
from helpers import save_run

from tinylm.cli.generate import GenerateConfig, run_generate
from tinylm.cli.loading import report_dir
from tinylm.cli.probe import ProbeConfig, run_probe

AGREEMENT = Path(__file__).resolve().parent.parent / "data" / "probes" / "agreement.jsonl"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model, bpe):
    """A run of a tiny model whose context holds the shipped probe items."""
    run = tmp_path_factory.mktemp("run")
    return save_run(run, tiny_model(bpe.vocab_size, block_size=128), bpe)


def contents(folder: Path) -> dict:
    """Every file under `folder`, by its path there, with its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_second_inspection_to_the_same_logdir_goes_to_a_folder_of_its_own(saved, tmp_path,
                                                                            capsys):
    logdir = tmp_path / "tb"
    cfg = GenerateConfig(checkpoint=str(saved), prompt="Lily saw Tom. She", max_new_tokens=0,
                         temperature=0, inspect=True, logdir=str(logdir))
    run_generate(cfg)
    first = contents(logdir)
    capsys.readouterr()
    run_generate(dataclasses.replace(cfg, prompt="Tom met Lily. He"))
    out, err = capsys.readouterr()

    (second,) = [p for p in logdir.iterdir() if p.is_dir() and not any(
        p in (logdir / f).parents for f in first)]  # the one folder the first did not write
    assert {f: b for f, b in contents(logdir).items() if second not in (logdir / f).parents} \
        == first  # the first report, byte for byte
    assert f"note: logdir={logdir} holds an earlier report; this one goes to {second}" in err
    assert out.rstrip().endswith(f"tensorboard --logdir {second}")
    read = {folder: json.loads((folder / "inspect.json").read_text())["prompt"]
            for folder in (logdir, second)}
    assert read == {logdir: "Lily saw Tom. She", second: "Tom met Lily. He"}

    run_generate(dataclasses.replace(cfg, prompt="Lily and Tom ran. They"))  # another new one
    assert len([p for p in logdir.iterdir() if p.is_dir() and (p / "inspect.json").exists()]) \
        == 2


def test_a_second_probe_to_the_same_logdir_goes_to_a_folder_of_its_own(saved, tmp_path, capsys):
    lines = AGREEMENT.read_text().splitlines()
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    files[0].write_text("\n".join(lines[:4]) + "\n")
    files[1].write_text("\n".join(lines[4:10]) + "\n")
    logdir = tmp_path / "probe"
    cfg = ProbeConfig(checkpoint=str(saved), probe_file=str(files[0]), logdir=str(logdir),
                      patch=True)
    first_report = run_probe(cfg)
    first = contents(logdir)
    capsys.readouterr()
    second_report = run_probe(dataclasses.replace(cfg, probe_file=[str(files[1])]))
    err = capsys.readouterr().err

    second = Path(second_report["logdir"])
    assert second.parent == logdir and f"this one goes to {second}" in err
    assert {f: b for f, b in contents(logdir).items() if second not in (logdir / f).parents} \
        == first
    for folder, report, file in ((logdir, first_report, files[0]),
                                 (second, second_report, files[1])):
        written = json.loads((folder / "probe.json").read_text())
        assert written == report and written["probe_files"] == [str(file)]


def test_the_default_folder_of_two_reports_in_one_second_is_not_shared(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda *_: "2026-01-01_00-00-00")  # one second
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-0000001"
    first, note = report_dir(None, checkpoint, "inspect")
    assert (first, note) == (run / "inspect" / "2026-01-01_00-00-00", "")
    first.mkdir(parents=True)
    (first / "inspect.json").write_text("{}")
    assert report_dir(None, checkpoint, "inspect")[0] == run / "inspect" / "2026-01-01_00-00-00-2"
    # an empty folder, or none, is the folder asked for; a file there is the writer's to name
    (tmp_path / "empty").mkdir()
    assert report_dir(str(tmp_path / "empty"), checkpoint, "probe") == (tmp_path / "empty", "")
    (tmp_path / "file").write_text("x")
    assert report_dir(str(tmp_path / "file"), checkpoint, "probe") == (tmp_path / "file", "")
