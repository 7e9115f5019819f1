"""Each command's --help is Hydra's: what the command does, its own options with their values as
composed (Hydra's $CONFIG), training's config groups with their real choices, what each option
means, its examples. The
schema every file of a group starts from is no choice: not listed, and refused when chosen."""

import dataclasses
import re
import sys

import pytest
from helpers import compose, refusal

import tinylm.cli.bench
import tinylm.cli.explain
import tinylm.cli.export
import tinylm.cli.generate
import tinylm.cli.prepare
import tinylm.cli.probe
import tinylm.cli.train
from tinylm.cli import refuse_schema_choice
from tinylm.cli.explain import ExplainConfig
from tinylm.cli.export import ExportConfig
from tinylm.cli.generate import GenerateConfig
from tinylm.cli.probe import ProbeConfig
from tinylm.train.run_config import RunConfig

MAINS = {"tinylm-train": tinylm.cli.train.main, "tinylm-generate": tinylm.cli.generate.main,
         "tinylm-probe": tinylm.cli.probe.main, "tinylm-explain": tinylm.cli.explain.main,
         "tinylm-export": tinylm.cli.export.main, "tinylm-prepare": tinylm.cli.prepare.main,
         "tinylm-bench": tinylm.cli.bench.main}
OPTIONS = {"tinylm-generate": GenerateConfig, "tinylm-probe": ProbeConfig,
           "tinylm-explain": ExplainConfig, "tinylm-export": ExportConfig}
TRAINING_GROUPS = [*RunConfig.GROUPS, "experiment"]


def help_of(prog, *argv, monkeypatch, capsys) -> str:
    """What `prog [argv] --help` prints, run in this process; it must exit 0."""
    monkeypatch.setattr(sys, "argv", [prog, *argv, "--help"])
    with pytest.raises(SystemExit) as stopped:
        MAINS[prog]()
    assert stopped.value.code == 0
    return capsys.readouterr().out


def row(text: str, key: str) -> str:
    """The row of option `key` in a help text: `key: value` (an option) or `  key=choice ...`
    (a config group)."""
    found = re.search(rf"^{re.escape(key)}: .*|^  {re.escape(key)}=.*", text, re.MULTILINE)
    assert found, f"no row for {key}"
    return found[0].strip()


@pytest.mark.parametrize("prog", MAINS)
def test_every_help_exits_0_says_what_the_command_does_and_never_names_a_schema(
        prog, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    said = help_of(prog, monkeypatch=monkeypatch, capsys=capsys)
    assert said.startswith(f"{prog}: ")
    assert "schema" not in said.lower()
    assert f"{prog} --cfg job" in said
    assert re.search(rf"^Examples:\n  {prog}", said, re.MULTILINE)
    assert not any(tmp_path.iterdir())  # no run directory, no .hydra/


@pytest.mark.parametrize("prog", OPTIONS)
def test_a_command_lists_each_of_its_own_options_with_its_value_and_no_training_group(
        prog, monkeypatch, capsys):
    said = help_of(prog, monkeypatch=monkeypatch, capsys=capsys)
    for field in dataclasses.fields(OPTIONS[prog]):
        row(said, field.name)
    assert not [group for group in TRAINING_GROUPS if re.search(f"^  {group}=", said, re.M)]
    assert "Config groups" not in said


def test_probe_help_shows_each_option_with_its_default(monkeypatch, capsys):
    said = help_of("tinylm-probe", monkeypatch=monkeypatch, capsys=capsys)
    assert row(said, "batch_size") == "batch_size: 64"
    assert row(said, "checkpoint") == "checkpoint: null"


def meaning(text: str, key: str) -> str:
    """What the help says option `key` means, its wrapped lines joined."""
    found = re.search(rf"^What each option means:\n(?:.*\n)*?  {re.escape(key)}: (.*(?:\n    .*)*)",
                      text, re.MULTILINE)
    assert found, f"no meaning for {key}"
    return " ".join(found[1].split())


def test_help_says_what_each_option_means_in_the_words_beside_its_field(monkeypatch, capsys):
    said = help_of("tinylm-explain", monkeypatch=monkeypatch, capsys=capsys)
    assert meaning(said, "query").startswith("row to walk through: an index from 0 (query=0 is "
                                             "q0, the explainer's \"query 1\"")
    said = help_of("tinylm-generate", monkeypatch=monkeypatch, capsys=capsys)
    assert meaning(said, "prompt_file").endswith("(its last line break dropped: the text goes on "
                                                 "after the last word)")
    said = help_of("tinylm-train", monkeypatch=monkeypatch, capsys=capsys)
    assert meaning(said, "model.block_size") == "longest context, in tokens"
    assert meaning(said, "train.max_steps") == "optimizer steps of the whole run"


def test_help_shows_the_values_the_command_line_gives(monkeypatch, capsys):
    said = help_of("tinylm-probe", "batch_size=8", "prefer=last", monkeypatch=monkeypatch,
                   capsys=capsys)
    assert row(said, "batch_size") == "batch_size: 8"
    assert row(said, "prefer") == "prefer: last"
    said = help_of("tinylm-train", "optim=adamw", "optim.lr=0.5", monkeypatch=monkeypatch,
                   capsys=capsys)
    assert row(said, "optim").startswith("optim=adamw ")
    assert re.search(r"^optim:\n(  .*\n)*  lr: 0.5$", said, re.MULTILINE)


def test_training_help_lists_its_groups_with_their_real_choices(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    said = help_of("tinylm-train", monkeypatch=monkeypatch, capsys=capsys)
    chosen = compose("config", return_hydra_config=True).hydra.runtime.choices
    for group in TRAINING_GROUPS:
        listed = row(said, group)
        assert listed.startswith(f"{group}={chosen[group] or 'null'} ")
        # Hydra's own list of the group's options, as it names them when one is missing
        hydra_lists = refusal(MAINS["tinylm-train"], f"{group}=nope", monkeypatch=monkeypatch)
        assert listed.split("choices: ")[1] == hydra_lists.split("options: ")[1] + ")"


@pytest.mark.parametrize("prog, override, allowed", [
    ("tinylm-train", "model=schema", "allowed model options: default"),
    ("tinylm-train", "optim=schema", "allowed optim options: adamw, muon"),
    ("tinylm-prepare", "tokenizer=schema", "allowed tokenizer options: bpe, char"),
    ("tinylm-bench", "data=schema", "allowed data options: text, tinyshakespeare, tinystories"),
])
def test_a_group_schema_is_refused_in_one_line_naming_the_choices(prog, override, allowed,
                                                                  monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    said = refusal(MAINS[prog], override, monkeypatch=monkeypatch)
    assert said.startswith(f"{prog}: error: {override} is not allowed") and "\n" not in said
    assert allowed in said
    assert not any(tmp_path.iterdir())


def test_a_value_that_reads_schema_outside_a_group_choice_is_a_value():
    refuse_schema_choice(["prompt=schema", "train.sample_prompt=schema", "hydra/help=schema"])
