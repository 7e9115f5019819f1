"""The tinylm-* commands, one module each, and what they share. This package is the only code that
knows Hydra, sys.argv and exit codes.

Each command module defines its options (a dataclass, the schema of conf/<command>.yaml) and a
task; `command` makes the console entry point: Hydra composes conf/ once (@hydra.main, its own
sweeper for -m), the options are built and checked (tinylm.config), the task runs. One place,
run_or_exit, ends a command: a bad value in one line naming the key and what is allowed there, a
full disk in one line, a signal with the shell's status.
"""

from __future__ import annotations

from tinylm.cli import starting  # noqa: F401 (first: Ctrl-C while the rest imports)

# isort: split
import contextlib
import dataclasses
import errno
import inspect
import itertools
import os
import re
import shlex
import signal
import sys
import textwrap
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)
from safetensors import SafetensorError

from tinylm.config import ConfigError, flag, to_dataclass
from tinylm.files import PACKAGE_DIR, NotWritten, not_written
from tinylm.train.run_config import RunConfig
from tinylm.train.runtime import STOP

T = TypeVar("T")
ERRORS = (ValueError, FileNotFoundError)  # what a command reports as bad input, in one line
SCHEMA = "schema"  # the option a config group's schema is stored as: the base its files extend


def config_dir() -> Path:
    """The conf/ directory: packaged inside tinylm/ in a wheel, at the repo root in a checkout."""
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"tinylm's configs were not found in {PACKAGE_DIR / 'conf'} or "
                            f"{PACKAGE_DIR.parent / 'conf'}; reinstall tinylm (pip install -e .)")


def run_schemas() -> dict[str, type]:
    """A training run's config groups as the YAML files name their schemas: model/schema, ..."""
    return {f"{group}/{SCHEMA}": cls for group, cls in RunConfig.GROUPS.items()}


def run_schema() -> type:
    """conf/config.yaml's top-level keys as a dataclass: one field per config group."""
    return dataclasses.make_dataclass("RunSchema", list(RunConfig.GROUPS.items()))


def register(schemas: dict[str, type]) -> None:
    """Store schemas in Hydra's ConfigStore, where the YAML files' defaults lists find them."""
    store = ConfigStore.instance()
    for name, cls in schemas.items():
        group, _, leaf = name.rpartition("/")
        store.store(group=group or None, name=leaf, node=cls)


# ------------------------------------------------------------------------------- the entry

Ending = Callable[[Any, Any], str]  # (what ended it, the options built so far, or None) -> text


def command(prog: str, config_name: str, schema: type, run: Callable[[Any], Any],
            build: Callable[[dict], Any] | None = None, schemas: dict[str, type] | None = None,
            groups: tuple[str, ...] = (), errors: tuple[type[Exception], ...] = ERRORS,
            refused: Callable[[], None] | None = None, before: Callable[[], None] | None = None,
            intact: Ending | None = None, interrupted: Ending | None = None
            ) -> Callable[[], Any]:
    """The console entry point: compose conf/<config_name>.yaml with the command line, `build`
    the options (default: the dataclass `schema`, whose fields are the top-level keys) and `run`
    them. `schemas`: what the YAML files extend; `groups`: config groups without a key of their
    own (experiment=...); `refused`: called on a bad config value; `before`: checks the command
    line before Hydra reads it; `intact`, `interrupted`: see run_or_exit, given the options."""
    build = build or (lambda values: to_dataclass(schema, values, config_name))
    built: dict[str, Any] = {}  # the options of the job now running, for the last line

    def ending(action: Callable[[], T]) -> T:
        return run_or_exit(
            prog, action, errors=errors, schema=schema, groups=groups,
            intact=intact and (lambda when: intact(when, built.get("options"))),
            interrupted=interrupted and (lambda err: interrupted(err, built.get("options"))))

    def start(cfg: DictConfig) -> Any:
        try:
            check_overrides(schema, HydraConfig.get().overrides.task)
            built["options"] = build(OmegaConf.to_container(cfg, resolve=True))
        except ConfigError:
            if refused is not None:
                refused()
            raise
        return run(built["options"])

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)
    def compose_and_run(cfg: DictConfig) -> Any:
        # ended here, inside the job: Hydra would print a line of its own over an exception
        return ending(lambda: start(cfg))

    def compose() -> Any:
        refuse_what_hydra_cannot_read(schema, groups)
        if before is not None:
            before()
        return compose_and_run()

    def main() -> Any:
        if hasattr(sys.stdout, "reconfigure"):  # not where a caller put another stream there
            # "?" for a character stdout cannot encode (Windows' code page for a redirected
            # stdout lacks √ and ·), rather than stopping there
            sys.stdout.reconfigure(errors="replace")
        STOP.install()  # from here a signal ends the command through run_or_exit
        register(schemas or {f"{config_name}_schema": schema})
        register_help(prog, config_name, schema, groups)
        # Hydra's documented switch to raise its composition errors (else it prints them over
        # several lines and exits): run_or_exit tells them in one line
        os.environ["HYDRA_FULL_ERROR"] = "1"
        return ending(compose)  # the command line, Hydra's composition, a sweep's check
    return main


def run_or_exit(prog: str, action: Callable[[], T], errors: tuple[type[Exception], ...] = ERRORS,
                intact: Callable[[str], str] | None = None,
                interrupted: Callable[[BaseException], str] | None = None,
                schema: type | None = None, groups: tuple[str, ...] = ()) -> T:
    """Run `action`; end the command in one line `<prog>: error: ...`, never a traceback.

    A write the disk refused says what could not be written where, then `intact(when)`: what is
    still intact and the command that continues `when` (default: the same command again).
    Ctrl-C exits 130 and SIGTERM 143, as a shell reports a process the signal ended (a script
    sees it was stopped, not that it failed), after the line `interrupted(err)` (default
    "interrupted"; "": nothing to say).
    """
    try:
        return action()
    except (HydraException, OmegaConfBaseException) as err:  # some are OSErrors, or ValueErrors
        sys.exit(f"{prog}: error: {one_line(err, schema, groups)}")
    except errors as err:
        sys.exit(f"{prog}: error: {err}")
    except (OSError, SafetensorError) as err:
        if not isinstance(err, NotWritten):
            err = not_written(getattr(err, "filename", None) or "a file", err)
        when = "once there is room" if err.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "once it can be written there"
        sys.exit(f"{prog}: error: {err}; {(intact or same_command_again(prog))(when)}")
    except KeyboardInterrupt as err:
        STOP.ignore()  # one more Ctrl-C on the way out changes nothing
        said = interrupted(err) if interrupted else "interrupted"
        if said:
            print(f"\n{prog}: {said}", file=sys.stderr)
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))


def same_command_again(prog: str) -> Callable[[str], str]:
    """What a command that writes only whole files says after a failed write."""
    return lambda when: (f"nothing was left half-written; {when}, run the same command again: "
                         f"{shlex.join([prog, *sys.argv[1:]])}")


def shell_word(key: str, value: str, quoted: bool = False) -> str:
    """The override `key=value` as one shell word that Hydra reads back as the string `value`:
    bare where Hydra reads it so (runs/x) unless `quoted`, else in Hydra's double quotes."""
    if not quoted:  # does Hydra read the value bare as this string (not a number, a sweep)?
        try:
            quoted = OverridesParser.create().parse_override(f"key={value}").value() != value
        except HydraException:
            quoted = True
    if quoted:
        # inside Hydra's quotes a quote is escaped, and so is a backslash before a quote or the end
        escaped = re.sub(r'(\\*)("|\Z)', lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""),
                         value)
        value = f'"{escaped}"'
    return shlex.quote(f"{key}={value}")


# -------------------------------------------------------------------------- bad input, one line


def refuse_what_hydra_cannot_read(schema: type, groups: tuple[str, ...]) -> None:
    """Refuse `--checkpoint RUN` (Hydra's parser answers with its usage lines) and a value's
    words left unquoted (`prompt=Once upon a time`: Hydra names only "upon") with the override
    to paste."""
    args = sys.argv[1:]
    for i, arg in enumerate(args):
        key, equals, value = arg.lstrip("-").partition("=")
        if arg.startswith("--") and (field_type(schema, key) or key in groups):
            if not equals and args[i + 1:i + 2] and args[i + 1][:1] != "-":
                arg, value = f"{arg} {args[i + 1]}", args[i + 1]
            raise ConfigError(f"{arg}: options are key=value: "
                              f"{pasted(key, value) if value else f'{key}=<value>'}")
        previous = args[i - 1] if i else "-"
        if "=" not in arg and arg[:1] not in "-~" and "=" in previous and previous[0] != "-":
            words = list(itertools.takewhile(lambda a: "=" not in a and a[:1] not in "-~",
                                             args[i:]))
            key, _, first = previous.partition("=")
            raise ConfigError(f"{shlex.join([previous, *words])}: options are key=value, one "
                              f"word each; quote a value with spaces: "
                              f"{shell_word(key, ' '.join([first, *words]), quoted=True)}")


def pasted(key: str, value: str) -> str:
    """key=value as typed, quoted for the shell; in Hydra's quotes too where Hydra needs them."""
    try:
        OverridesParser.create().parse_override(f"{key}={value}")
    except HydraException:
        return shell_word(key, value, quoted=True)
    return shlex.quote(f"{key}={value}")


def check_overrides(schema: type, overrides: list[str]) -> None:
    """Hold a bool given as no, off or 1 (which OmegaConf reads as a bool) to
    tinylm.config.flag's rule, and refuse a group's schema chosen as an option."""
    for override in OverridesParser.create().parse_overrides(overrides):
        if field_type(schema, override.key_or_group) is bool and not override.is_delete():
            flag(override.key_or_group, override.value())
    refuse_schema_choice(overrides)


def refuse_schema_choice(overrides: list[str]) -> None:
    """Refuse group=schema: stored as an option for the group's files to extend, not a choice."""
    for override in overrides:
        group, choice = key_and_value(override)
        if choice == SCHEMA and f"{group}/{SCHEMA}" in run_schemas():
            raise ConfigError(f"{group}={choice} is not allowed: it is what every {group} option "
                              f"starts from, not one of them; allowed {group} options: "
                              f"{', '.join(group_choices(group))}")


def group_choices(group: str) -> list[str]:
    """The options of config group `group`: its files, conf/<group>/*.yaml."""
    return sorted(path.stem for path in (config_dir() / group).glob("*.yaml"))


def field_type(schema: type, key: str) -> Any:
    """The type of the dataclass field at dotted `key` under `schema`; None if there is none."""
    hint: Any = schema
    for part in key.split("."):
        if not (isinstance(hint, type) and dataclasses.is_dataclass(hint)):
            return None
        hint = typing.get_type_hints(hint).get(part)
    return hint


def key_and_value(override: str) -> tuple[str, str]:
    """("model.bias", "no") of the override "model.bias=no" (or "+model.bias=no")."""
    key, _, value = override.lstrip("+~").partition("=")
    return key, value


def given(key: str) -> str | None:
    """The value the command line gives `key`, as typed."""
    return next((value for name, value in map(key_and_value, sys.argv[1:]) if name == key), None)


def one_line(err: Exception, schema: type, groups: tuple[str, ...] = ()) -> str:
    """One line out of Hydra's or OmegaConf's composition error: the key, the value, and what
    is allowed there (the fields of the schema's dataclasses, a group's options)."""
    if isinstance(err, MissingConfigException) and err.options is not None:
        group = (err.missing_cfg_file or "").split("/")[0]
        options = sorted(o for o in err.options if o != SCHEMA)  # the base, not a choice
        choice = given(group)
        return (f"{f'{group}={choice}' if choice else err.missing_cfg_file}: there is no "
                f"{err.missing_cfg_file}.yaml; allowed {group} options: "
                f"{', '.join(options) or 'none'}")
    cause = err if isinstance(err, OmegaConfBaseException) else err.__cause__
    key = getattr(cause, "full_key", None)
    value = given(key)  # as typed: OmegaConf's error holds it converted, or not at all
    if isinstance(cause, ValidationError) and key:
        return f"{key}={cause.value if value is None else value} is not allowed: " \
               f"{type_rule(cause.object_type, cause.key)}"
    if isinstance(cause, ConfigKeyError | ConfigAttributeError) and key:
        where = f" (in {key}={value})" if value is not None else ""
        parent, _, _ = key.rpartition(".")
        node = field_type(schema, parent) if parent else schema
        if parent and dataclasses.is_dataclass(node):
            allowed = ", ".join(f.name for f in dataclasses.fields(node))
            return f"unknown config key {key}{where}; allowed under {parent}: {allowed}"
        if not parent:
            keys = [f.name for f in dataclasses.fields(schema)]
            kind = "config key or group" if groups or any(
                dataclasses.is_dataclass(field_type(schema, k)) for k in keys) else "config key"
            return f"unknown {kind} {key}{where}; allowed: {', '.join([*keys, *groups])}"
    if isinstance(err, OverrideParseException):
        if "=" not in (err.override or "="):
            return f"{err.override}: options are key=value; --help lists them"
        key, value = key_and_value(err.override or "")
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]  # quoted once for Hydra, where a quote inside ended it
        quote = f"; quote the value if it holds spaces or symbols: " \
                f"{shell_word(key, value, quoted=True)}" if value else ""
        return f"{err.override}: {err.message.splitlines()[0]}{quote}"
    ambiguous = re.match(r"Ambiguous value for argument '(.*)'", str(err))
    if ambiguous:  # a comma in a value: Hydra's sweep key=a,b, run without --multirun
        key, value = key_and_value(ambiguous[1])
        if typing.get_origin(field_type(schema, key)) is list:
            return f"{ambiguous[1]}: a list is written in brackets: " \
                   f"{shlex.quote(f'{key}=[{value}]')}"
        return f"{ambiguous[1]}: Hydra reads a comma as a sweep over values; quote the value " \
               f"twice: {shell_word(key, value, quoted=True)}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def type_rule(owner: Any, key: Any) -> str:
    """What the schema field that refused a value takes, e.g. "must be a float, or null"."""
    kinds = {bool: "true or false", int: "an integer", float: "a float", str: "a string",
             list: "a list, e.g. [a, b]", dict: "a mapping"}
    if not (isinstance(owner, type) and dataclasses.is_dataclass(owner)):
        return "of another type"
    hint = typing.get_type_hints(owner).get(key)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = [kinds.get(typing.get_origin(t) or t) for t in options if t is not type(None)]
    rule = "must be " + " or ".join(n for n in names if n)
    return rule + ", or null" if type(None) in options else rule


HELP_WIDTH = 100  # columns --help wraps its lines to


def register_help(prog: str, config_name: str, schema: type, groups: tuple[str, ...]) -> None:
    """Fill in ${tinylm.help:<part>} of conf/hydra/help/tinylm.yaml: the command's name, what it
    does and its examples (the opening comment of conf/<config_name>.yaml: its first line, and
    its lines `#   <prog> ...`), and each config group's choice with its options."""
    def part(name: str, _root_: DictConfig) -> str:
        lines = (config_dir() / f"{config_name}.yaml").read_text(encoding="utf-8").splitlines()
        comment = [line[1:] for line in itertools.takewhile(lambda x: x[:1] == "#", lines)]
        chosen = _root_.hydra.runtime.choices
        text = {
            "prog": lambda: prog,
            "about": lambda: comment[0].strip() if comment else prog,
            "examples": lambda: "\n".join(f"  {line.strip()}" for line in comment
                                          if line.split()[:1] == [prog]),
            "meanings": lambda: meanings(schema),
            "groups": lambda: "".join(
                f"\n  {group}={chosen.get(group) or 'null'}  (choices: "
                f"{', '.join(group_choices(group))})"
                for group in [*(f.name for f in dataclasses.fields(schema)), *groups]
                if group in chosen).replace("\n", "\nConfig groups (group=choice):\n", 1),
        }[name]()
        return text.replace("$", "$$")  # Hydra fills the template in with $NAME
    OmegaConf.register_new_resolver("tinylm.help", part, replace=True)


def meanings(schema: type) -> str:
    """--help's section saying what each option means ("" where no field says)."""
    rows = [textwrap.fill(text, HELP_WIDTH, initial_indent=f"  {key}: ", subsequent_indent="    ")
            for key, text in field_comments(schema).items()]
    return "\n\nWhat each option means:\n" + "\n".join(rows) if rows else ""


def field_comments(cls: type, prefix: str = "") -> dict[str, str]:
    """What each option of dataclass `cls` means: the comment beside its field in the source and
    the comment lines that go on under it, said once; a field that holds a config group's
    dataclass gives that group's options, as group.key."""
    beside = {}
    with contextlib.suppress(OSError, TypeError):  # made at run time (run_schema): no source
        name, column = None, -1
        for line in inspect.getsource(cls).splitlines():
            field = re.match(r"\s*(\w+): [^#]*#\s*", line)
            going_on = re.match(r"\s*#\s*", line)
            if field:
                name, column = field.group(1), field.end()
                beside[name] = line[column:].strip()
            elif name and going_on and abs(going_on.end() - column) <= 2:
                beside[name] += " " + line[going_on.end():].strip()
            else:
                name = None
    described = {}
    for f in dataclasses.fields(cls):
        if isinstance(f.type, type) and dataclasses.is_dataclass(f.type):
            described.update(field_comments(f.type, f"{prefix}{f.name}."))
        elif f.name in beside:
            described[prefix + f.name] = beside[f.name]
    return described
