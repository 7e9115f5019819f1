"""The checks every config value meets. Each config dataclass names each field's rule once, in its
__post_init__, and check() holds every other bool, int and float field to its type:

    check(self, "model", n_layer=at_least(1), dropout=within(0, 1, high_open=True))

Each raises ConfigError in one line: `<key>=<value> is not allowed: <rule>`. `null`, where a rule
takes it, says what None means and allows it.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the key, the value and the rule."""


def to_dataclass(cls: type[T], node: Mapping[str, Any] | None, prefix: str) -> T:
    """Build dataclass `cls` from the mapping at key `prefix` of a config, refusing unknown keys
    (of a stored or hand-written config) in one line; its __post_init__ checks the values."""
    values = dict(node or {})
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown config key {', '.join(f'{prefix}.{k}' for k in unknown)}; "
                          f"allowed under {prefix}: {', '.join(allowed)}")
    return cls(**values)


def shown(value: Any) -> str:
    """repr(value) for a one-line message: a crafted value (a config.json's) may be huge."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def bad(key: str, value: Any, rule: str) -> ConfigError:
    """The one error every check raises."""
    return ConfigError(f"{key}={shown(value)} is not allowed: {rule}")


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
    # 1 == True in Python: a number is not the flag true
    if value not in allowed or type(value) not in {type(a) for a in allowed}:
        names = (str(a).lower() if isinstance(a, bool) else str(a) for a in allowed)
        raise ConfigError(f"{key}={value!r} is not allowed; allowed: {', '.join(names)}")


def flag(key: str, value: Any) -> None:
    """true or false (not "no", which is a true-ish string)."""
    if not isinstance(value, bool):
        raise bad(key, value, "must be true or false")


Rule = Callable[[str, Any], None]  # refuses `value` of `key` with a ConfigError


def at_least(least: int, null: str | None = None) -> Rule:
    """An integer >= `least`; None too, where `null` says what it means."""
    return lambda key, value: integer(key, value, least, null)


def within(low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False, null: str | None = None) -> Rule:
    """A finite number in [low, high] (see number)."""
    return lambda key, value: number(key, value, low, high, low_open, high_open, null)


def choice(*allowed: Any) -> Rule:
    """One of `allowed`."""
    return lambda key, value: one_of(key, value, allowed)


TYPE_RULES = {bool: flag, int: integer, float: number}  # a field's rule where none is given


def check(config: Any, prefix: str = "", **rules: Rule) -> None:
    """Refuse a field of dataclass `config` that breaks its rule in `rules`, else its type's (a
    bool, int or float field); the error names the key `<prefix>.<field>`."""
    names = [f.name for f in dataclasses.fields(config)]
    assert set(rules) <= set(names), f"a rule for no field of {type(config).__name__}"
    types = typing.get_type_hints(type(config))
    for name in names:
        rule = rules.get(name) or TYPE_RULES.get(types[name])
        if rule is not None:
            rule(f"{prefix}.{name}" if prefix else name, getattr(config, name))
