"""The tinylm-* commands, one module each, and what they share: how a command is composed by
Hydra, and how it ends on bad input or a signal.

This package is the only code that knows Hydra, sys.argv and exit codes. Each command module
defines its options (a dataclass, the schema of conf/<command>.yaml) and a task; `command` turns
them into a console entry point:

    main = command("tinylm-generate", "generate", GenerateConfig, run_generate)

`run_generate` gets a GenerateConfig built from the composed config; every value checked.

Hydra composes conf/ once, through @hydra.main. A bad override ends the command with one line
naming the key and what is allowed there, built from Hydra's and OmegaConf's exceptions and the
dataclasses' own checks (tinylm.config).
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import inspect
import io
import itertools
import os
import re
import shlex
import signal
import sys
import textwrap
import tokenize
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

from tinylm.config import ConfigError, to_dataclass
from tinylm.files import PACKAGE_DIR, NotWritten, not_written
from tinylm.train.run_config import RunConfig

T = TypeVar("T")
ERRORS = (ValueError, FileNotFoundError)  # what a command reports as bad input, in one line
SCHEMA = "schema"  # the option a config group's schema is stored as: the base its files extend


def config_dir() -> Path:
    """The conf/ directory: packaged inside tinylm/ in a wheel, at the repo root in a checkout."""
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"tinylm's configs were not found in {PACKAGE_DIR / 'conf'} or "
        f"{PACKAGE_DIR.parent / 'conf'}; reinstall tinylm (pip install -e . from a checkout)")


def run_schemas() -> dict[str, type]:
    """The config groups of a training run as the YAML files name their schemas: model/schema
    (conf/model/*.yaml) -> ModelConfig, data/schema -> DataConfig, ..."""
    return {f"{group}/{SCHEMA}": cls for group, cls in RunConfig.GROUPS.items()}


def run_schema() -> type:
    """conf/config.yaml's top-level keys as a dataclass: one field per config group."""
    return dataclasses.make_dataclass("RunSchema", list(RunConfig.GROUPS.items()))


def register(schemas: dict[str, type]) -> None:
    """Store schemas in Hydra's ConfigStore, where the YAML files' defaults lists find them:
    a group's as `<group>/schema` (conf/model/*.yaml start from model/schema), a command's as
    `<command>_schema`."""
    store = ConfigStore.instance()
    for name, cls in schemas.items():
        group, _, leaf = name.rpartition("/")
        store.store(group=group or None, name=leaf, node=cls)


# ------------------------------------------------------------------------------- the entry


def command(prog: str, config_name: str, schema: type, run: Callable[[Any], Any],
            build: Callable[[dict], Any] | None = None, schemas: dict[str, type] | None = None,
            groups: tuple[str, ...] = (), errors: tuple[type[Exception], ...] = ERRORS,
            refused: Callable[[], None] | None = None) -> Callable[[], Any]:
    """The console entry point of a command: compose conf/<config_name>.yaml with the command
    line through @hydra.main, `build` the options from it and `run` them.

    `schema` is the dataclass whose fields are the config's top-level keys: it names what is
    allowed in an error, and `build` defaults to it. `schemas`: what the YAML files extend
    (default: `schema` as `<config_name>_schema`); `groups`: the config groups chosen in the
    defaults list that have no key of their own (experiment=...). A bad input (`errors`) ends
    the command in one line; a bad config value calls `refused` first.
    """
    build = build or (lambda values: to_dataclass(schema, values, config_name))

    def start(cfg: DictConfig) -> Any:
        try:
            refuse_loose_bools(schema, HydraConfig.get().overrides.task)
            refuse_schema_choice(HydraConfig.get().overrides.task)
            options = build(OmegaConf.to_container(cfg, resolve=True))
        except ConfigError:
            if refused is not None:
                refused()
            raise
        return run(options)

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=config_name)
    def compose_and_run(cfg: DictConfig) -> Any:
        return run_or_exit(prog, lambda: start(cfg), errors=errors)

    def main() -> Any:
        print_what_stdout_can()
        stop_on_sigterm()
        register(schemas or {f"{config_name}_schema": schema})
        register_help(prog, config_name, schema, groups)
        # Hydra prints its composition errors over several lines and exits, unless this
        # documented switch asks it to raise them: then they are told here in one line.
        os.environ["HYDRA_FULL_ERROR"] = "1"

        def compose_or_one_line() -> Any:
            try:
                return compose_and_run()
            except (HydraException, OmegaConfBaseException) as err:  # some are OSErrors
                sys.exit(f"{prog}: error: {one_line(err, schema, groups)}")
        return run_or_exit(prog, compose_or_one_line, errors=())
    return main


def run_or_exit(prog: str, action: Callable[[], T], interrupted: str = "interrupted",
                errors: tuple[type[Exception], ...] = ERRORS,
                intact: Callable[[str], str] | None = None) -> T:
    """Run `action`; a bad input exits with one line `<prog>: error: ...`, not a traceback.

    A write the disk refused (a full disk) is one line too: what could not be written where, the
    free space, and then `intact(when)`: what is still intact and the command that continues
    `when` (e.g. "once there is room"); by default, the same command again.

    Ctrl-C exits with 130 and SIGTERM with 143 (128 + the signal), as a shell reports a process
    the signal ended: a script running the command sees that it was stopped, not that it failed.
    """
    try:
        return action()
    except errors as err:
        sys.exit(f"{prog}: error: {err}")
    except (OSError, SafetensorError) as err:
        if not isinstance(err, NotWritten):
            err = not_written(getattr(err, "filename", None) or "a file", err)
        when = "once there is room" if err.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "once it can be written there"
        sys.exit(f"{prog}: error: {err}; {(intact or same_command_again(prog))(when)}")
    except KeyboardInterrupt as err:
        print(f"\n{prog}: {interrupted}", file=sys.stderr)
        sys.exit(128 + getattr(err, "signum", signal.SIGINT))


def same_command_again(prog: str) -> Callable[[str], str]:
    """What a command that writes only whole files says after a failed write."""
    return lambda when: (f"nothing was left half-written; {when}, run the same command again: "
                         f"{shlex.join([prog, *sys.argv[1:]])}")


def shell_word(key: str, value: str, quoted: bool = False) -> str:
    """The override `key=value` as one word to paste into a shell, that Hydra reads back as
    `value`: the value bare where Hydra reads it so (runs/x) unless `quoted`, else in Hydra's
    double quotes; then the word in the shell's quotes where it needs them (runs/my run)."""
    if quoted or not hydra_reads(value):
        # inside Hydra's quotes a quote is escaped, and so is a backslash before a quote or the end
        escaped = re.sub(r'(\\*)("|\Z)', lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""),
                         value)
        value = f'"{escaped}"'
    return shlex.quote(f"{key}={value}")


def hydra_reads(value: str) -> bool:
    """Whether Hydra's override grammar reads `key=value` as the string `value`: not as a
    number, a bool, a list or a sweep (a comma), nor refuses it (an apostrophe)."""
    try:
        return OverridesParser.create().parse_override(f"key={value}").value() == value
    except HydraException:
        return False


def stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a scheduler's stop) ends the command as Ctrl-C does, through its
    cleanup: temporary files and lock files are removed, not left behind."""
    def interrupt(signum: int, frame: object) -> None:
        err = KeyboardInterrupt()
        err.signum = signum
        raise err
    signal.signal(signal.SIGTERM, interrupt)


def print_what_stdout_can() -> None:
    """Print "?" for a character stdout's encoding has no code for, instead of stopping there
    (Windows encodes redirected output in its ANSI code page, which lacks √, · and U+FFFD)."""
    if hasattr(sys.stdout, "reconfigure"):  # not where a caller put another stream in its place
        sys.stdout.reconfigure(errors="replace")


# -------------------------------------------------------------------------- bad input, one line


def refuse_loose_bools(schema: type, overrides: list[str]) -> None:
    """Refuse a bool field given anything but true or false: OmegaConf reads "no", "off" or "1"
    as a bool, and a typo must never flip a setting silently."""
    for override in overrides:
        key, value = key_and_value(override)
        if field_type(schema, key) is bool and value.lower() not in ("true", "false"):
            raise ConfigError(f"{key}={value} is not allowed: must be true or false")


def refuse_schema_choice(overrides: list[str]) -> None:
    """Refuse group=schema: a group's schema is stored as its option `schema` for its files to
    extend (conf/model/*.yaml start from model/schema), but it is none of the group's choices."""
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


# ------------------------------------------------------------------------------------- --help

NOT_AN_OPTION = "?"  # a value no rule allows: what a field's check says of it is its rule
HELP_WIDTH = 100


def register_help(prog: str, config_name: str, schema: type, groups: tuple[str, ...]) -> None:
    """Give the template of conf/hydra/help/tinylm.yaml its parts, ${tinylm.help:<part>}, for
    this command; OmegaConf passes `_root_`, the config composed with the command line."""
    def part(name: str, _root_: DictConfig) -> str:
        comment = opening_comment(config_name)
        parts = {
            "prog": lambda: prog,
            "about": lambda: comment[0].strip() if comment else prog,
            "examples": lambda: "\n".join(f"  {line.strip()}" for line in comment
                                          if line.startswith("  ") and line.split()[:1] == [prog]),
            "options": lambda: options_help(schema, groups, _root_),
        }
        return parts[name]().replace("$", "$$")  # Hydra fills the template in with $NAME
    OmegaConf.register_new_resolver("tinylm.help", part, replace=True)


def opening_comment(config_name: str) -> list[str]:
    """The lines of the comment that opens conf/<config_name>.yaml, without their '#': its
    first line says what the command does; lines `#   <prog> ...` are its examples."""
    lines = (config_dir() / f"{config_name}.yaml").read_text(encoding="utf-8").splitlines()
    return [line[1:] for line in itertools.takewhile(lambda line: line.startswith("#"), lines)]


def options_help(schema: type, groups: tuple[str, ...], root: DictConfig) -> str:
    """The options of `schema` as composed in `root`: key=value, what it is (the comment beside
    its field) and what its check allows; a config group as group=choice and its choices; then
    the `groups` that have no key of their own."""
    chosen = root.hydra.runtime.choices
    values = OmegaConf.to_container(root, resolve=False)
    described = field_comments(schema)
    options, chosen_groups = [], []
    for field in dataclasses.fields(schema):
        name, kind = field.name, field_type(schema, field.name)
        if name in chosen:
            chosen_groups.append((f"{name}={chosen[name]}", f"{summary(kind)}; choices: "
                                  f"{', '.join(group_choices(name))}"))
        elif dataclasses.is_dataclass(kind):  # keys in a section of their own (bench's)
            options.append((f"{name}.<key>=<value>", summary(kind)))
        else:
            rule = allowed(schema, name)
            text = " ".join(filter(None, [described.get(name), rule and f"({rule})"]))
            options.append((f"{name}={typed(values.get(name))}", text))
    chosen_groups += [(f"{group}={chosen.get(group) or 'null'}", "a preset: values across "
                       f"the groups above; choices: {', '.join(group_choices(group))}")
                      for group in groups]
    sections = [("Options (key=value: the value in effect):", options),
                ("Config groups (group=choice; group.key=value sets one of its values):",
                 chosen_groups)]
    return "\n\n".join(table(title, rows) for title, rows in sections if rows)


def table(title: str, rows: list[tuple[str, str]]) -> str:
    """`title`, then each (key, text) row with the texts aligned and wrapped to HELP_WIDTH."""
    width = min(max(len(key) for key, _ in rows), 24)
    lines = [title]
    for key, text in rows:
        lines.append(textwrap.fill(text, HELP_WIDTH, initial_indent=f"  {key:<{width}}  ",
                                   subsequent_indent=" " * (width + 4), break_on_hyphens=False)
                     if text else f"  {key}")
    return "\n".join(lines)


def typed(value: Any) -> str:
    """`value` as an override spells it: null, true, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(map(typed, value))}]"
    return str(value) if value != "" else "''"


def summary(cls: type) -> str:
    """What dataclass `cls` holds: its docstring up to the `;` before it names its YAML files,
    lowercase as the comments beside fields ("Shape of the model" -> "shape of the model")."""
    text = " ".join((inspect.getdoc(cls) or "").split(";")[0].split()).rstrip(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def allowed(schema: type, name: str) -> str:
    """What field `name` of `schema` allows, in its own check's words (tinylm.config: `key=value
    is not allowed: <rule>`), e.g. "allowed: best, last"; "" where any value of its type goes."""
    try:
        schema(**{name: NOT_AN_OPTION})
    except Exception as err:  # a rule across fields, or a check that assumes the type: no rule
        refused = f"{name}={NOT_AN_OPTION!r} is not allowed"
        if isinstance(err, ConfigError) and str(err).startswith(refused):
            return str(err).removeprefix(refused).lstrip(":; ").removeprefix("must be ")
    return ""


def field_comments(cls: type) -> dict[str, str]:
    """The comment beside each field of dataclass `cls` in its source, or for a field with none
    there, the comment lines right above it: where each option is described, once."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # made at run time (run_schema()): no source, no comments
        return {}
    comments = {token.start[0]: token for token in
                tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}

    def text(row: int) -> str:
        return comments[row].string.lstrip("#").strip()

    def whole_line(row: int) -> bool:
        return row in comments and comments[row].line.lstrip().startswith("#")

    described = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        beside = [text(row) for row in range(node.lineno, node.end_lineno + 1)
                  if row in comments and not whole_line(row)]
        above = list(itertools.takewhile(whole_line, range(node.lineno - 1, 0, -1)))[::-1]
        described[node.target.id] = " ".join(beside or map(text, above))
    return described
