"""Each command's --help lists its own options, each with the comment beside its field, its value
and what its check allows; training's lists its config groups with their real choices. The
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
from tinylm.cli import field_comments, refuse_schema_choice
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
    """The row of option `key` in a help text, its wrapped lines joined."""
    found = re.search(rf"^  {re.escape(key)}=.*(?:\n {{5,}}\S.*)*", text, re.MULTILINE)
    assert found, f"no row for {key}"
    return " ".join(found[0].split())


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
def test_a_command_lists_its_own_options_with_their_comments_and_no_training_group(
        prog, monkeypatch, capsys):
    said = help_of(prog, monkeypatch=monkeypatch, capsys=capsys)
    comments = field_comments(OPTIONS[prog])
    for field in dataclasses.fields(OPTIONS[prog]):
        assert " ".join(comments[field.name].split()) in row(said, field.name)
    assert not [group for group in TRAINING_GROUPS if re.search(f"^  {group}=", said, re.M)]
    assert "Config groups" not in said


def test_probe_help_shows_each_option_with_its_default_and_what_it_is(monkeypatch, capsys):
    said = help_of("tinylm-probe", monkeypatch=monkeypatch, capsys=capsys)
    assert row(said, "batch_size").startswith("batch_size=64 sequences per forward pass")
    assert row(said, "checkpoint").startswith("checkpoint=null a run directory")


def test_help_shows_the_values_the_command_line_gives(monkeypatch, capsys):
    said = help_of("tinylm-probe", "batch_size=8", "prefer=last", monkeypatch=monkeypatch,
                   capsys=capsys)
    assert row(said, "batch_size").startswith("batch_size=8 ")
    assert row(said, "prefer").startswith("prefer=last ")
    said = help_of("tinylm-train", "optim=adamw", monkeypatch=monkeypatch, capsys=capsys)
    assert row(said, "optim").startswith("optim=adamw ")


@pytest.mark.parametrize("prog, override", [
    ("tinylm-probe", "prefer=worst"), ("tinylm-probe", "ablate=half"),
    ("tinylm-generate", "top_p=2"), ("tinylm-bench", "section=everything"),
    ("tinylm-explain", "digits=-1")])
def test_the_values_help_allows_are_those_the_command_accepts(prog, override, monkeypatch,
                                                              capsys):
    said = help_of(prog, monkeypatch=monkeypatch, capsys=capsys)
    refused = refusal(MAINS[prog], override, monkeypatch=monkeypatch)
    rule = re.split(r"is not allowed[:;] (?:must be )?", refused)[1]
    assert f"({rule})" in row(said, override.split("=")[0])


def test_training_help_lists_its_groups_with_their_real_choices(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    said = help_of("tinylm-train", monkeypatch=monkeypatch, capsys=capsys)
    chosen = compose("config", return_hydra_config=True).hydra.runtime.choices
    for group in TRAINING_GROUPS:
        listed = row(said, group)
        assert listed.startswith(f"{group}={chosen[group] or 'null'} ")
        # Hydra's own list of the group's options, as it names them when one is missing
        hydra_lists = refusal(MAINS["tinylm-train"], f"{group}=nope", monkeypatch=monkeypatch)
        assert listed.split("choices: ")[1] == hydra_lists.split("options: ")[1]
    assert not re.search(r"^  \w+\.", said, re.MULTILINE)  # groups, not each of their keys


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


@dataclasses.dataclass
class Commented:
    """Fields described in each way the config dataclasses describe theirs."""

    beside: int = 1  # said beside it
    # said above it,
    # over two lines
    above: str = "a # in a string"
    bare: bool = False
    spread: list = dataclasses.field(  # said where it starts
        default_factory=list)


def test_field_comments_reads_the_comment_beside_or_above_each_field():
    assert field_comments(Commented) == {"beside": "said beside it",
                                         "above": "said above it, over two lines", "bare": "",
                                         "spread": "said where it starts"}
