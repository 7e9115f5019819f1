"""The reports of tinylm-probe, tinylm-generate inspect=true, tinylm-explain and tinylm-bench on a
real full disk (issue 35): each command ends in one line that says what could not be written
where, the free space and the command to run again; a report already in the same place is left
as it was, and no temporary file or folder is left."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import fill_disk

import tinylm.cli.explain
import tinylm.cli.generate
import tinylm.cli.probe
from tinylm.bench.config import bench_config
from tinylm.bench.report import run_bench

# A short item of each kind: the session's trained run reads at most 32 tokens.
PROBE_ITEMS = [
    {"text": "Lily and Tom ran. He sat.", "pronoun_char": 18, "antecedent_chars": [9],
     "distractor_chars": [0]},
    {"text": "Tom ran. He sat.", "pronoun_char": 9, "antecedent_chars": [0],
     "wrong_pronoun": "she"},
]


def console_script(name, *args, cwd):
    """Run the installed console script `name` (.venv/bin/tinylm-probe ...), as a user would."""
    script = Path(sys.executable).with_name(name)
    if not script.is_file():
        pytest.skip(f"{name} is not installed beside {sys.executable} (pip install -e .)")
    return subprocess.run([str(script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def in_process(module, *args, cwd, monkeypatch):
    """Run the command of `module` in this process: the run before the disk fills, quicker than
    a new interpreter."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [module.__name__, *args])
    module.main()


def contents(directory):
    """Every file and folder under `directory` (hidden ones too), files with their bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None
            for p in sorted(directory.rglob("*")) if p.name != "filler"}


def assert_one_line_and_nothing_changed(result, prog, args, written, disk, before):
    """`prog args` stopped on the full disk in one line naming `written`; the disk holds what it
    held before (and the filler), no temporary file or folder."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        # a logdir that holds a report already gets the new one in a subfolder of its own
        re.escape(f"{prog}: error: {written}") + r"(/[\w.-]+)?"
        + re.escape(" could not be written: No space left on device (")
        + rf"[\d.,]+ MiB free on {re.escape(str(disk))}\); nothing was left half-written; once "
        "there is room, run the same command again: " + re.escape(shlex.join([prog, *args])),
        last), last
    assert contents(disk) == before


@pytest.fixture
def probe_file(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in PROBE_ITEMS))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("leave", [0, 100_000])  # nothing free; room for part of the report
def test_probe_on_a_full_disk_stops_in_one_line_and_keeps_the_last_report(
        trained_run, probe_file, small_disk, tmp_path, leave, monkeypatch):
    disk = small_disk(4096)
    args = [f"checkpoint={trained_run[0]}", f"probe_file={probe_file}",
            f"out={disk / 'probe.json'}", f"logdir={disk / 'tb'}", "ablate=true"]
    in_process(tinylm.cli.probe, *args, cwd=tmp_path, monkeypatch=monkeypatch)
    before = contents(disk)
    assert {"probe.json", "tb/probe/attention_accuracy.png"} <= set(before)
    assert any(name.startswith("tb/events.out.tfevents.") for name in before)

    fill_disk(disk, leave)
    again = console_script("tinylm-probe", *args, cwd=tmp_path)
    assert_one_line_and_nothing_changed(again, "tinylm-probe", args, disk / "tb", disk, before)
    assert json.loads((disk / "probe.json").read_text())["n"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("leave", [0, 100_000])
def test_inspect_on_a_full_disk_stops_in_one_line_and_keeps_the_last_inspection(
        trained_run, small_disk, tmp_path, leave, monkeypatch):
    disk = small_disk(4096)
    args = [f"checkpoint={trained_run[0]}", "prompt=Lily and Tom went to the park. She",
            "max_new_tokens=4", "temperature=0", "inspect=true", f"logdir={disk / 'inspect'}"]
    in_process(tinylm.cli.generate, *args, cwd=tmp_path, monkeypatch=monkeypatch)
    before = contents(disk)
    assert {"inspect/inspect.json", "inspect/attention.npz", "inspect/pronouns.md",
            "inspect/attention/layer_00/all_heads.png"} <= set(before)

    fill_disk(disk, leave)
    again = console_script("tinylm-generate", *args, cwd=tmp_path)
    assert_one_line_and_nothing_changed(again, "tinylm-generate", args, disk / "inspect", disk,
                                        before)
    assert again.stdout.startswith("Lily and Tom went to the park. She")  # the text came first


@pytest.mark.slow
@pytest.mark.parametrize("event_file_on_the_full_disk", [True, False])
def test_explain_on_a_full_disk_writes_neither_its_figure_nor_its_event_file(
        small_disk, tmp_path, event_file_on_the_full_disk, monkeypatch):
    disk = small_disk(2048)
    logdir = (disk if event_file_on_the_full_disk else tmp_path) / "tb"
    args = [f"logdir={logdir}", f"png={disk / 'steps.png'}"]
    in_process(tinylm.cli.explain, *args, cwd=tmp_path, monkeypatch=monkeypatch)
    before, events = contents(disk), contents(logdir)
    assert "steps.png" in before and any(name.startswith("events.") for name in events)

    fill_disk(disk)
    again = console_script("tinylm-explain", *args, cwd=tmp_path)
    # the event file is written first: on the full disk it is refused; elsewhere it is built,
    # and then left out with the refused PNG
    assert_one_line_and_nothing_changed(again, "tinylm-explain", args,
                                        logdir if event_file_on_the_full_disk else
                                        disk / "steps.png", disk, before)
    assert contents(logdir) == events and not list(logdir.parent.glob(".tb.tmp-*"))


@pytest.mark.slow
def test_bench_on_a_full_disk_names_its_report_in_one_line(small_disk, tmp_path):
    disk = small_disk(64)
    fill_disk(disk)
    args = ["section=attention", "repeats=1", f"out={disk / 'bench.json'}"]
    result = console_script("tinylm-bench", *args, cwd=tmp_path)
    assert_one_line_and_nothing_changed(result, "tinylm-bench", args, disk / "bench.json", disk,
                                        {})


def test_bench_refuses_a_report_path_that_is_a_folder_before_any_work(tmp_path):
    printed = []
    with pytest.raises(ValueError) as err:
        run_bench(bench_config({"section": "attention", "out": str(tmp_path)}), printed.append)
    assert str(err.value) == (f"out={tmp_path} is a directory; name the report file, e.g. "
                              f"out={tmp_path / 'bench.json'}")
    assert printed == [] and list(tmp_path.iterdir()) == []
