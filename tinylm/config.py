"""The checks every config value meets, and the error they raise.

Each config dataclass (ModelConfig, DataConfig, ..., and each command's) checks its values in
__post_init__ with the validators below, so a dataclass built from Python is checked the same
way as one built from the command line. Each raises ConfigError with one line:
`<key>=<value> is not allowed: <rule>`. `null`, where a validator takes it, says what None means
and allows it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the key, the value and the rule."""


def to_dataclass(cls: type[T], node: Mapping[str, Any] | None, prefix: str) -> T:
    """Build dataclass `cls` from the plain mapping found at key `prefix` of a config.

    Unknown keys are refused with one line naming them and the allowed keys; the dataclass's own
    __post_init__ checks the values. Errors come out as ConfigError.
    """
    values = dict(node or {})
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
