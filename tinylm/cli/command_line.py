"""A command's command line checked against conf/ before Hydra runs it, and the entry point of
the print-only commands.

Every command checks its command line before Hydra runs it (check_command_line_or_exit):
Hydra's own composition errors span several lines and do not say what is allowed, so a bad
override ends the command with one line naming the key and the keys allowed there.

Two things are read from Hydra beyond its public API, each in one function that falls back to
Hydra's own behaviour when a Hydra release changes them: the command-line parser
(`_overrides_to_check`) and the wording of its errors (`_key_named_in`). pyproject.toml bounds
hydra-core to the releases tested.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Callable
from typing import TypeVar

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from omegaconf import BooleanNode, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from tinylm.cli import print_what_stdout_can, run_or_exit
from tinylm.config import ConfigError, config_dir, register_schemas, to_dataclass

T = TypeVar("T")

# How Hydra's messages name the key they refuse (hydra-core 1.3): "Could not override 'x'",
# "Key 'x' is not in struct".
KEY_IN_HYDRA_ERROR = (re.compile(r"Could not (?:override|delete|append to) '([^']+)'"),
                      re.compile(r"Key '([^']+)' is not in struct"))


def without_hydra(cfg: DictConfig) -> DictConfig:
    """The composed config less its hydra node (check_command_line composes with it)."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def checked_config(schema: type[T], name: str) -> Callable[[DictConfig], T]:
    """A command's config dataclass from Hydra's composition: every value checked."""
    return lambda cfg: to_dataclass(schema, without_hydra(cfg), name)


def console_entry(command: str, config_name: str, build: Callable[[DictConfig], T],
                  action: Callable[[T], object],
                  errors: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)
                  ) -> Callable[[], None]:
    """The `main` of a print-only command (its conf/<config_name>.yaml includes
    hydra/print_only): check the command line (one line per mistake), let Hydra compose it,
    then `action(build(cfg))`; a bad input (`errors`) exits with one line."""
    @hydra.main(version_base="1.3", config_path=str(config_dir(register=False)),
                config_name=config_name)
    def compose_and_run(cfg: DictConfig) -> None:
        run_or_exit(command, lambda: action(build(cfg)), errors=errors)

    def main() -> None:
        print_what_stdout_can()
        check_command_line_or_exit(command, config_name, build)
        run_or_exit(command, compose_and_run, errors=())  # a Ctrl-C while starting: 130
    return main


def check_command_line_or_exit(command: str, config_name: str,
                               build: Callable[[DictConfig], object] | None = None
                               ) -> DictConfig | None:
    """Check sys.argv's overrides for `config_name` (conf/<name>.yaml); exit with one line if
    one is bad. Returns the composed config, or None when there is nothing to check: --help and
    the like, or a Hydra without the private parser this reads the command line with.
    """
    given = _overrides_to_check(sys.argv[1:])
    run_or_exit(command, register_schemas)  # Hydra composes conf/ even for --help
    if given is None:
        return None
    overrides, chosen_config = given
    return run_or_exit(command, lambda: check_command_line(
        overrides, chosen_config or config_name, build))


def _overrides_to_check(argv: list[str]) -> tuple[list[str], str | None] | None:
    """(the overrides, --config-name) in `argv` as Hydra reads them; None when there is nothing
    to check (--help and the like) or when this Hydra's private parser is not the one known:
    Hydra then parses the command line itself and reports a bad override in its own words."""
    try:
        # a private API: imported here, where its absence costs only the early check
        from hydra._internal.utils import get_args_parser

        args = get_args_parser().parse_args(argv)
        if args.help or args.hydra_help or args.info or args.shell_completion:
            return None
        return list(args.overrides), args.config_name
    except (ImportError, AttributeError):
        return None


def check_command_line(overrides: list[str], config_name: str,
                       build: Callable[[DictConfig], object] | None = None) -> DictConfig:
    """Compose conf/<config_name>.yaml with `overrides`, then `build` it (e.g. into dataclasses,
    which check the values); ConfigError with one line on bad input.

    A sweep (`-m key=a,b`) is checked value by value. Returns the composition of the first
    value of each sweep, with the hydra node (for hydra.run.dir).
    """
    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except HydraException as err:
        culprit = next((o for o in overrides if not _parses(parser, o)), None)
        raise ConfigError(_condense(err, culprit, None)) from None
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    sweeps = []
    for o in parsed:
        if o.is_sweep_override():
            try:
                values = list(o.sweep_string_iterator())
            except Exception:  # e.g. interval(...) for an optimizing sweeper: nothing to list
                continue
            sweeps.append([f"{o.get_key_element()}={v}" for v in values])
    # each sweep value once, next to the first value of the other sweeps
    firsts = [values[0] for values in sweeps]
    candidates = [firsts] + [firsts[:i] + [v] + firsts[i + 1:]
                             for i, values in enumerate(sweeps) for v in values[1:]]
    composed = []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3",
                               job_name=config_name):
        for overrides_now in (fixed + extra for extra in candidates):
            try:
                cfg = compose(config_name, overrides_now, return_hydra_config=True)
                _refuse_loose_bools(cfg, parser.parse_overrides(overrides_now))
                if build is not None:
                    build(cfg)
            except (HydraException, OmegaConfBaseException) as err:
                # name the override to blame: the first one that fails on its own
                culprit = next((o for o in overrides_now if _fails(config_name, o)), None)
                defaults = compose(config_name, [], return_hydra_config=True)
                raise ConfigError(_condense(err, culprit, defaults)) from None
            composed.append(cfg)
    return composed[0]


def _refuse_loose_bools(cfg: DictConfig, overrides: list) -> None:
    """OmegaConf reads "no", "off" or "0" given to a bool field as false; tinylm takes only true
    or false there, so that a typo never flips a setting silently."""
    for override in overrides:
        key, value = override.key_or_group, override.value()
        node = cfg
        for part in key.split("."):  # a group's choice (experiment=...) is no node: skipped
            node = node._get_node(part, validate_access=False) \
                if isinstance(node, DictConfig) else None
        if isinstance(node, BooleanNode) and not isinstance(value, bool):
            raise ConfigError(f"{key}={value} is not allowed: must be true or false")


def _type_rule(error) -> str:
    """What the schema field that refused a value takes, e.g. "must be a float, or null"."""
    kinds = {bool: "true or false", int: "an integer", float: "a float", str: "a string",
             list: "a list, e.g. [a, b]", dict: "a mapping"}
    if not dataclasses.is_dataclass(error.object_type):
        return "of another type"
    hint = typing.get_type_hints(error.object_type).get(error.key)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = [kinds.get(typing.get_origin(t) or t) for t in options if t is not type(None)]
    rule = "must be " + " or ".join(n for n in names if n)
    return rule + ", or null" if type(None) in options else rule


def _parses(parser, override: str) -> bool:
    try:
        parser.parse_overrides([override])
    except Exception:
        return False
    return True


def _fails(config_name: str, override: str) -> bool:
    try:
        compose(config_name, [override])
    except Exception:
        return True
    return False


def _key_named_in(err: Exception) -> str | None:
    """The config key that Hydra's message (or its cause's) refuses, or None when the message
    is worded otherwise than in the Hydra releases tested."""
    text = f"{err} {err.__cause__ or ''}"
    found = next((m for pattern in KEY_IN_HYDRA_ERROR if (m := pattern.search(text))), None)
    return found.group(1) if found else None


def _condense(err: Exception, override: str | None, defaults: DictConfig | None) -> str:
    """One line out of Hydra's multi-line composition errors; `defaults` (the config composed
    without overrides) tells which keys and groups are allowed. A message this cannot read
    comes out as its first line, after the override to blame."""
    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").split("/")[0]
        options = sorted(o for o in err.options if o != "schema")  # the base, not a choice
        return (f"{override or err.missing_cfg_file}: there is no {err.missing_cfg_file}.yaml; "
                f"allowed {group} options: {', '.join(options) or 'none'}")
    wrong_type = err if isinstance(err, ValidationError) else err.__cause__
    if isinstance(wrong_type, ValidationError) and wrong_type.full_key:
        value = override.split("=", 1)[1] if override and "=" in override else wrong_type.value
        return f"{wrong_type.full_key}={value} is not allowed: {_type_rule(wrong_type)}"
    key = _key_named_in(err)
    if key is not None and defaults is not None:
        group = key.split(".")[0]
        where = f" (in {override})" if override else ""
        if "." in key and isinstance(defaults.get(group), DictConfig):
            return (f"unknown config key {key}{where}; allowed under {group}: "
                    f"{', '.join(defaults[group])}")
        # top-level keys, and the groups chosen in the defaults list without a key of their
        # own (experiment=...)
        groups = [g for g in defaults.hydra.runtime.choices if not g.startswith("hydra")]
        allowed = [k for k in defaults if k != "hydra"]
        allowed += [g for g in groups if g not in allowed]
        kind = "config key or group" if groups else "config key"
        return f"unknown {kind} {group}{where}; allowed: {', '.join(allowed)}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else type(err).__name__
    return f"{override}: {first}" if override else first
