"""Thin Hydra entry points behind the tinylm-* console scripts, and what they share.

Every command checks its command line before Hydra runs it (check_command_line_or_exit):
Hydra's own composition errors span several lines and do not say what is allowed, so a bad
override ends the command with one line naming the key and the keys allowed there.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")


def without_hydra(cfg: DictConfig) -> DictConfig:
    """The composed config less its hydra node (check_command_line composes with it)."""
    return OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])


def run_or_exit(command: str, action: Callable[[], T], interrupted: str = "interrupted",
                errors: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)) -> T:
    """Run `action`; a bad input exits with one line `<command>: error: ...`, not a traceback.

    Ctrl-C exits with 130 and SIGTERM with 143 (128 + the signal), as a shell reports a process
    the signal ended: a script running the command sees that it was stopped, not that it failed.
    """
    try:
        return action()
    except errors as err:
        sys.exit(f"{command}: error: {err}")
    except KeyboardInterrupt as err:
        print(f"\n{command}: {interrupted}", file=sys.stderr)
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))


def check_command_line_or_exit(command: str, config_name: str,
                               build: Callable[[DictConfig], object] | None = None
                               ) -> DictConfig | None:
    """Check sys.argv's overrides for `config_name` (conf/<name>.yaml); exit with one line if
    one is bad. Returns the composed config, or None for --help and the like (nothing to check).
    """
    from hydra._internal.utils import get_args_parser

    from tinylm.config import register_schemas

    args = get_args_parser().parse_args(sys.argv[1:])
    run_or_exit(command, register_schemas)  # Hydra composes conf/ even for --help
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return None
    return run_or_exit(command, lambda: check_command_line(
        args.overrides, args.config_name or config_name, build))


def check_command_line(overrides: list[str], config_name: str,
                       build: Callable[[DictConfig], object] | None = None) -> DictConfig:
    """Compose conf/<config_name>.yaml with `overrides`, then `build` it (e.g. into dataclasses,
    which check the values); ConfigError with one line on bad input.

    A sweep (`-m key=a,b`) is checked value by value. Returns the composition of the first
    value of each sweep, with the hydra node (for hydra.run.dir).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tinylm.config import ConfigError, config_dir

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
    from omegaconf import BooleanNode

    from tinylm.config import ConfigError

    for override in overrides:
        key, value = override.key_or_group, override.value()
        node = cfg
        for part in key.split("."):
            node = node._get_node(part) if isinstance(node, DictConfig) else None
        if isinstance(node, BooleanNode) and not isinstance(value, bool):
            raise ConfigError(f"{key}={value} is not allowed: must be true or false")


def _type_rule(error) -> str:
    """What the schema field that refused a value takes, e.g. "must be a float, or null"."""
    import dataclasses
    import types
    import typing

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
    from hydra import compose

    try:
        compose(config_name, [override])
    except Exception:
        return True
    return False


def _condense(err: Exception, override: str | None, defaults: DictConfig | None) -> str:
    """One line out of Hydra's multi-line composition errors; `defaults` (the config composed
    without overrides) tells which keys and groups are allowed."""
    import re

    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").split("/")[0]
        options = sorted(o for o in err.options if o != "schema")  # the base, not a choice
        return (f"{override or err.missing_cfg_file}: there is no {err.missing_cfg_file}.yaml; "
                f"allowed {group} options: {', '.join(options) or 'none'}")
    from omegaconf.errors import ValidationError

    wrong_type = err if isinstance(err, ValidationError) else err.__cause__
    if isinstance(wrong_type, ValidationError) and wrong_type.full_key:
        value = override.split("=", 1)[1] if override and "=" in override else wrong_type.value
        return f"{wrong_type.full_key}={value} is not allowed: {_type_rule(wrong_type)}"
    text = f"{err} {err.__cause__ or ''}"
    found = re.search(r"Could not (?:override|delete|append to) '([^']+)'", text) or \
        re.search(r"Key '([^']+)' is not in struct", text)
    if found and defaults is not None:
        key = found.group(1)
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
