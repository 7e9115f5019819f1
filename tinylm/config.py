"""Where the Hydra configs live, their typed schemas, and the checks every config value meets.

Hydra stays at the edge: entry points compose conf/, call `to_dataclass` for each group and pass
plain dataclasses to the package's functions, which never see an OmegaConf object.

Each default is written once, in its dataclass (Hydra's "structured configs as schema"):

- `register_schemas` stores every config dataclass in Hydra's ConfigStore: a group's as
  `<group>/schema` (ModelConfig as model/schema, ...), a command's as `<command>_schema`.
- Every YAML file starts from its schema in its defaults list (`defaults: [schema, _self_]` in
  conf/<group>/*.yaml, `- <command>_schema` in conf/<command>.yaml) and writes only the values that
  differ from the dataclass, with comments on why. tests/test_config.py checks that every YAML
  key is a schema field and that no YAML value repeats the dataclass default.
- OmegaConf then refuses a wrong type at composition, naming the key; tinylm/cli turns that into
  one line, `model.dropout=abc is not allowed: must be a float`.
- Ranges are checked in each dataclass's __post_init__ with the few validators below
  (`integer`, `number`, `one_of`, `flag`, `divisible`), so a dataclass built from Python is
  checked the same way.

Adding a field: give it a type, a default and a comment in the dataclass, check its range in
__post_init__ with a validator, and write it into a YAML file only where that file's value
differs. A new choice of a group (e.g. conf/optim/muon.yaml) starts with `defaults: [schema,
_self_]` too; a choice with fields of its own needs them in the group's dataclass (e.g. an
optimizer `name` field that says which one they belong to).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

PACKAGE_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the key, the value and the rule."""


def config_dir(register: bool = True) -> Path:
    """The conf/ directory (packaged inside tinylm/ in a wheel, at the repo root in a checkout),
    with the schemas its YAML files extend registered: it cannot be composed without them.

    register=False skips importing the dataclasses (and torch): for the console scripts'
    import, where a Ctrl-C must still end the command in one line (they register it later).
    """
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            if register:
                register_schemas()
            return candidate
    raise FileNotFoundError(
        f"tinylm's configs were not found in {PACKAGE_DIR / 'conf'} or "
        f"{PACKAGE_DIR.parent / 'conf'}; reinstall tinylm (pip install -e . from a checkout)")


def project_root() -> Path | None:
    """The checkout that holds conf/, or None when tinylm runs from an installed wheel."""
    root = PACKAGE_DIR.parent
    return root if (root / "conf" / "config.yaml").is_file() else None


def shipped_dir(in_checkout: str, in_wheel: str) -> Path:
    """A folder of files tinylm ships: `in_checkout` under the checkout's root, or `in_wheel`
    inside the installed package (pyproject's force-include maps one to the other)."""
    root = project_root()
    return root / in_checkout if root is not None else PACKAGE_DIR / in_wheel


def schemas() -> dict[str, type]:
    """ConfigStore name -> the dataclass that is the schema of that group or command config."""
    # imported here: these modules import this one for its validators, and they bring torch
    from tinylm.cli.bench import BenchConfig
    from tinylm.cli.explain import ExplainConfig
    from tinylm.cli.generate import GenerateConfig
    from tinylm.cli.probe import ProbeConfig
    from tinylm.data import DataConfig
    from tinylm.model import ModelConfig
    from tinylm.train.optim import OptimConfig
    from tinylm.tokenizer import TokenizerConfig
    from tinylm.train.run_config import TrainConfig

    return {"model/schema": ModelConfig, "data/schema": DataConfig,
            "tokenizer/schema": TokenizerConfig, "optim/schema": OptimConfig,
            "train/schema": TrainConfig, "generate_schema": GenerateConfig,
            "probe_schema": ProbeConfig, "explain_schema": ExplainConfig,
            "bench_schema": BenchConfig}


@cache
def register_schemas() -> None:
    """Store every config dataclass in Hydra's ConfigStore, where the YAML files find them."""
    # Hydra is imported here and OmegaConf in to_dataclass, not at the top: the library modules
    # import this one for its validators and never need either
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, cls in schemas().items():
        group, _, leaf = name.rpartition("/")
        store.store(group=group or None, name=leaf, node=cls)


def to_dataclass(cls: type[T], node: Any, prefix: str) -> T:
    """Build dataclass `cls` from a mapping (an OmegaConf node or dict) found at key `prefix`.

    Unknown keys are refused with one line naming them and the allowed keys; the dataclass's own
    __post_init__ checks the values. Errors come out as ConfigError.
    """
    from omegaconf import DictConfig, OmegaConf  # here: see register_schemas

    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    values = dict(values or {})
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown config key {', '.join(f'{prefix}.{k}' for k in unknown)}; "
                          f"allowed under {prefix}: {', '.join(allowed)}")
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err


# ------------------------------------------------------------------------------ validators
# Each raises ConfigError "<key>=<value> is not allowed: <rule>"; `null`, where given, says what
# None means and allows it.


def bad(key: str, value: Any, rule: str) -> ConfigError:
    """The one error every check raises."""
    return ConfigError(f"{key}={value!r} is not allowed: {rule}")


def _or_null(rule: str, null: str | None) -> str:
    return f"{rule}, or null {null}" if null else rule


def integer(key: str, value: Any, least: int | None = None, null: str | None = None) -> None:
    """An int (not a bool, not 2.5) >= `least`."""
    if value is None and null:
        return
    rule = "must be an integer" + (f" >= {least}" if least is not None else "")
    if not isinstance(value, int) or isinstance(value, bool) or (
            least is not None and value < least):
        raise bad(key, value, _or_null(rule, null))


def number(key: str, value: Any, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, null: str | None = None) -> None:
    """A finite number (NaN and inf never make sense as a setting) within [low, high]; an open
    end excludes the bound, e.g. dropout: number(key, p, 0, 1, high_open=True) for [0, 1)."""
    if value is None and null:
        return
    if low is not None and high is not None:
        where = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        where = f" {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        where = f" {'<' if high_open else '<='} {high:g}"
    else:
        where = ""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise bad(key, value, _or_null(f"must be a finite number{where}", null))


def one_of(key: str, value: Any, allowed: tuple) -> None:
    """One of the `allowed` values (e.g. the names of a choice)."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: "
                          f"{', '.join(str(a) for a in allowed)}")


def flag(key: str, value: Any) -> None:
    """true or false (not "no", which is a true-ish string)."""
    if not isinstance(value, bool):
        raise bad(key, value, "must be true or false")


def divisible(key: str, value: int, by_key: str, by: int) -> None:
    """`value` a multiple of `by` (the value of key `by_key`)."""
    if value % by:
        raise bad(key, value, f"must be divisible by {by_key}={by}")
