"""The YAML files and their dataclass schemas agree, each default is written once, each rule is
named once (check) and the shared validators refuse what they should in one line."""

import dataclasses
import math
from dataclasses import dataclass

import pytest
import yaml
from helpers import compose, schemas

from tinylm.bench.config import LoadBenchConfig
from tinylm.cli import config_dir
from tinylm.cli.explain import ExplainConfig
from tinylm.cli.generate import GenerateConfig
from tinylm.config import (
    ConfigError,
    at_least,
    check,
    choice,
    flag,
    integer,
    number,
    one_of,
    within,
)
from tinylm.data import DataConfig
from tinylm.model import ModelConfig
from tinylm.train.optim import OptimConfig
from tinylm.train.run_config import TrainConfig

CONF = config_dir()
GROUP_FILES = sorted(p for p in CONF.glob("*/*.yaml")
                     if p.parent.name not in ("experiment", "hydra"))
# config.yaml is the training run's; prepare.yaml composes it (both tested below)
COMMAND_FILES = sorted(p for p in CONF.glob("*.yaml") if p.stem not in ("config", "prepare"))


def _schema_of(path):
    return schemas()[f"{path.parent.name}/schema" if path.parent != CONF else f"{path.stem}_schema"]


def _values(path):
    return {k: v for k, v in (yaml.safe_load(path.read_text()) or {}).items()
            if k not in ("defaults", "hydra")}


def _differences(cls, values, where):
    """Keys of `values` that are no field of `cls`, or that repeat the field's default."""
    defaults = cls()
    problems = []
    for key, value in values.items():
        default = getattr(defaults, key, KeyError)
        if default is KeyError:
            problems.append(f"{where}.{key} is no field of {cls.__name__}")
        elif dataclasses.is_dataclass(default):
            problems += _differences(type(default), value, f"{where}.{key}")
        elif value == default and type(value) is type(default):
            problems.append(f"{where}.{key}: {value!r} repeats {cls.__name__}'s default")
    return problems


@pytest.mark.parametrize("path", GROUP_FILES + COMMAND_FILES, ids=lambda p: p.name)
def test_every_yaml_key_is_a_schema_field_and_no_default_is_written_twice(path):
    assert _differences(_schema_of(path), _values(path), path.stem) == []
    assert _schema_of(path).__name__ in path.read_text()  # the header names its schema


@pytest.mark.parametrize("path", GROUP_FILES + COMMAND_FILES, ids=lambda p: p.name)
def test_every_yaml_file_starts_from_its_schema_and_composes_every_field(path):
    schema_entry = "schema" if path.parent != CONF else f"{path.stem}_schema"
    assert yaml.safe_load(path.read_text())["defaults"][0] == schema_entry
    if path.parent == CONF:
        cfg = compose(path.stem)
    else:
        cfg = compose("config", [f"{path.parent.name}={path.stem}"])[path.parent.name]
    fields = [f.name for f in dataclasses.fields(_schema_of(path))]
    assert list(cfg) == fields  # the reverse: every schema field reaches the composed config


def test_prepare_composes_the_training_runs_data_and_tokenizer_without_a_run_directory():
    overrides = ["experiment=shakespeare_char", "tokenizer.vocab_size=80"]
    train = compose("config", overrides, return_hydra_config=True)
    prepare = compose("prepare", overrides, return_hydra_config=True)
    assert prepare.data == train.data and prepare.tokenizer == train.tokenizer
    assert (prepare.hydra.run.dir, prepare.hydra.output_subdir) == (".", None)
    # the logging stays training's: a library's warnings still reach the terminal
    choices = prepare.hydra.runtime.choices
    assert (choices["hydra/job_logging"], choices["hydra/hydra_logging"]) == ("none", "default")


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: p.name)
def test_the_print_only_commands_write_no_run_directory_and_no_log(path):
    assert "hydra/print_only" in yaml.safe_load(path.read_text())["defaults"]
    hydra = compose(path.stem, return_hydra_config=True).hydra
    assert (hydra.run.dir, hydra.output_subdir) == (".", None)
    assert (hydra.runtime.choices["hydra/job_logging"],
            hydra.runtime.choices["hydra/hydra_logging"]) == ("disabled", "disabled")


def test_experiment_keys_are_schema_fields():
    for path in CONF.glob("experiment/*.yaml"):
        for group, values in _values(path).items():
            cls = schemas()[f"{group}/schema"]
            fields = {f.name for f in dataclasses.fields(cls)}
            assert set(values) <= fields, (path.name, group, set(values) - fields)


@pytest.mark.parametrize("check, message", [
    (lambda: integer("train.batch_size", 2.5, least=1),
     "train.batch_size=2.5 is not allowed: must be an integer >= 1"),
    (lambda: integer("model.n_layer", True, least=1),
     "model.n_layer=True is not allowed: must be an integer >= 1"),
    (lambda: integer("top_k", 0, least=1, null="for no limit"),
     "top_k=0 is not allowed: must be an integer >= 1, or null for no limit"),
    (lambda: number("model.dropout", 1.0, 0, 1, high_open=True),
     "model.dropout=1.0 is not allowed: must be a finite number in [0, 1)"),
    (lambda: number("optim.lr", math.nan, low=0),
     "optim.lr=nan is not allowed: must be a finite number >= 0"),
    (lambda: number("optim.lr", math.inf, low=0),
     "optim.lr=inf is not allowed: must be a finite number >= 0"),
    (lambda: number("top_p", 0.0, 0, 1, low_open=True), "top_p=0.0 is not allowed: must be a "
                                                          "finite number in (0, 1]"),
    (lambda: flag("model.bias", "no"), "model.bias='no' is not allowed: must be true or false"),
    (lambda: one_of("prefer", "first", ("best", "last")),
     "prefer='first' is not allowed; allowed: best, last"),
    (lambda: ModelConfig(n_embd=30, n_head=4),
     "model.n_embd=30 is not allowed: must be divisible by model.n_head=4"),
])
def test_shared_validators_refuse_in_one_line(check, message):
    with pytest.raises(ConfigError) as refused:
        check()
    assert str(refused.value) == message


def test_shared_validators_accept_what_is_allowed():
    integer("top_k", None, least=1, null="for no limit")
    number("model.dropout", 0, 0, 1, high_open=True)
    number("top_p", 1.0, 0, 1, low_open=True)
    flag("model.bias", False)
    ModelConfig(n_embd=32, n_head=4)


@dataclass
class Toy:
    size: int = 2
    rate: float = 0.5
    kind: str = "a"
    on: bool = True  # no rule given: its type's
    seed: int = 0
    scale: float = 1.0
    name: str | None = None  # no rule, and no type rule for str or unions

    def __post_init__(self):
        check(self, "toy", size=at_least(1), rate=within(0, 1), kind=choice("a", "b"))


@pytest.mark.parametrize("values, message", [
    ({"size": 0}, "toy.size=0 is not allowed: must be an integer >= 1"),
    ({"rate": 1.5}, "toy.rate=1.5 is not allowed: must be a finite number in [0, 1]"),
    ({"kind": "c"}, "toy.kind='c' is not allowed; allowed: a, b"),
    ({"on": "no"}, "toy.on='no' is not allowed: must be true or false"),
    ({"seed": 2.5}, "toy.seed=2.5 is not allowed: must be an integer"),
    ({"scale": math.inf}, "toy.scale=inf is not allowed: must be a finite number"),
])
def test_check_holds_each_field_to_its_rule_else_its_types(values, message):
    with pytest.raises(ConfigError) as refused:
        Toy(**values)
    assert str(refused.value) == message
    Toy(name=3)  # nothing declared for it: not checked


@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(n_layer=True), "model.n_layer=True is not allowed: must be an integer "
                                        ">= 1"),
    (lambda: ModelConfig(bias="no"), "model.bias='no' is not allowed: must be true or false"),
    (lambda: ModelConfig(vocab_size=0), "model.vocab_size=0 is not allowed: must be an integer "
                                        ">= 1, or null to take it from the tokenizer"),
    (lambda: OptimConfig(lr=math.nan), "optim.lr=nan is not allowed: must be a finite number "
                                       ">= 0"),
    (lambda: OptimConfig(min_lr=0.1, lr=0.01), "optim.min_lr=0.1 is not allowed: must be <= "
                                               "optim.lr=0.01"),
    (lambda: TrainConfig(batch_size=2.5), "train.batch_size=2.5 is not allowed: must be an "
                                          "integer >= 1"),
    (lambda: TrainConfig(threads=0), "train.threads=0 is not allowed: must be auto or an "
                                     "integer >= 1"),
    (lambda: DataConfig(split="random"), "data.split='random' is not allowed; allowed: auto, "
                                         "tail, documents"),
    (lambda: GenerateConfig(temperature=math.nan), "temperature=nan is not allowed: must be 0 "
                                                   "(greedy) or a finite number >= 0.001"),
    (lambda: ExplainConfig(causal=1), "causal=1 is not allowed: must be true or false"),
    (lambda: LoadBenchConfig(settle_s=math.nan), "load.settle_s=nan is not allowed: must be a "
                                                 "finite number"),
])
def test_a_config_built_from_python_is_refused_in_the_commands_line(build, message):
    with pytest.raises(ConfigError) as refused:
        build()
    assert str(refused.value) == message


def test_a_rule_for_no_field_is_a_mistake_in_the_code():
    with pytest.raises(AssertionError, match="a rule for no field of Toy"):
        check(Toy(), "toy", sise=at_least(1))
