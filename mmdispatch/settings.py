"""One typed configuration file for every command: tables `[serve]`, `[read]`, `[train]`, `[counting]`.

Each setting is defined once, as its command-line option (type, default, choices, help); the
file's schema (pydantic, strict) is derived from the command parsers, so a key is exactly an
option's name with underscores and the file cannot drift from the flags. Counting rules live in
`[counting]`, which `read`, `inspect` and `train` all take, so data nodes and trainers cannot
disagree on the patch size. A command validates the whole file (a typo anywhere is named), uses
its own table and `[counting]`, and flags win over the file.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import os
import tomllib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, FiniteFloat, ValidationError, create_model

from dispatcher_server.cliopts import FROM_FILE, add_logging_arguments, finite_float

#: table -> (module whose `add_arguments(parser)` defines the options, commands that use it)
TABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("mmdispatch.serve", ("serve",)),
    "read": ("pipeline.service", ("read",)),
    "train": ("trainer_client.options", ("train",)),
    "counting": ("pipeline.reader", ("read", "inspect", "train")),
}
#: options that only steer the command line itself, never a file setting
_NOT_SETTINGS = {"help", "config", "debug"}


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message is one line naming file, key and fix."""


@functools.cache
def _parser_for(table: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    module = importlib.import_module(TABLES[table][0])
    if table == "counting":
        module.add_reader_arguments(parser)
    else:
        module.add_arguments(parser)
        add_logging_arguments(parser)
    return parser


def _counting_dests() -> set[str]:
    return {a.dest for a in _parser_for("counting")._actions}


def _field_type(action: argparse.Action) -> Any:
    if action.nargs == 0:  # store_true / store_false
        return bool
    base: Any = action.type if action.type in (int, float) else str
    if action.type is finite_float:
        base = FiniteFloat
    if action.choices:
        base = Literal[tuple(action.choices)]
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        return list[base] | base  # a lone value stands for a one-element list
    return base


@functools.cache
def settings_of(table: str) -> dict[str, argparse.Action]:
    """dest -> the option defining that setting of `table` (the counting rules stay in `[counting]`)."""
    actions = {a.dest: a for a in _parser_for(table)._actions if a.dest not in _NOT_SETTINGS}
    if table != "counting":
        shared = _counting_dests()
        actions = {d: a for d, a in actions.items() if d not in shared}
    return actions


def _table_model(table: str) -> type[BaseModel]:
    fields = {dest: (_field_type(a) | None, None) for dest, a in settings_of(table).items()}
    return create_model(f"{table.title()}Settings",
                        __config__=ConfigDict(extra="forbid", strict=True), **fields)


@functools.cache
def schema() -> type[BaseModel]:
    """The pydantic model of a whole configuration file."""
    tables = {t: (_table_model(t) | None, None) for t in TABLES}
    return create_model("Settings", __config__=ConfigDict(extra="forbid", strict=True), **tables)


TOML_TYPES = {str: "a string", int: "an integer", float: "a float", bool: "a boolean",
               list: "an array", dict: "a table"}


def _describe(error: dict, path: str) -> str:
    loc = [str(p) for p in error["loc"] if not str(p).startswith(("list[", "Literal[", "function-"))]
    where = f"[{loc[0]}] {'.'.join(loc[1:])}" if len(loc) > 1 else (loc[0] if loc else "")
    if error["type"] == "extra_forbidden":
        if len(loc) == 1:
            return (f"{path}: unknown table or top-level key {loc[0]!r}: settings go in a table, "
                    f"one of {', '.join(f'[{t}]' for t in TABLES)}")
        elsewhere = [t for t in TABLES if t != loc[0] and loc[-1] in settings_of(t)]
        close = difflib.get_close_matches(loc[-1], list(settings_of(loc[0])), n=1)
        hint = (f"it is a key of [{elsewhere[0]}]" if elsewhere
                else f"did you mean {close[0]}?" if close
                else f"the keys of [{loc[0]}] are its options' names, see docs/configuration.md")
        return f"{path}: {where}: unknown setting ({hint})"
    expected = error["msg"].removeprefix("Input should be ").removeprefix("a valid ").rstrip(".")
    got = TOML_TYPES.get(type(error["input"]), type(error["input"]).__name__)
    return f"{path}: {where}: expected {expected}, got {error['input']!r} ({got})"


def read_toml(path: str, what: str, error: type[ValueError]) -> dict:
    """The contents of the TOML file `path` (a `what` file: "config", "dataset"); `error`, one
    line naming the file, when it is missing, unreadable, not UTF-8 or not TOML."""
    from pipeline.shards import is_shard_name

    # shards given where the file goes: say where they go (and where a directory's file is)
    shards = " (shards are given as --shards)"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        globbed = shards if any(c in path for c in "*?[{") else ""
        raise error(f"{what} file {path!r} does not exist{globbed}") from None
    except IsADirectoryError:
        inside = os.path.join(path, "dataset.toml")
        fix = (f"give the file in it, --{what} {inside}" if what == "dataset" and os.path.isfile(inside)
               else f"give the TOML file itself{shards if what == 'dataset' else ''}")
        raise error(f"{what} file {path!r} is a directory: {fix}") from None
    except OSError as e:
        raise error(f"{what} file {path!r} cannot be read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{path}: not valid TOML ({e})") from None
    except UnicodeDecodeError as e:
        if is_shard_name(path):
            raise error(f"{what} file {path!r} is a shard, not a TOML file{shards}") from None
        raise error(f"{what} file {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                    f"offset {e.start}): give a TOML file saved as UTF-8") from None


def load(path: str) -> dict[str, dict]:
    """The settings a file holds, per table, validated; ConfigError naming the first problem."""
    data = read_toml(path, "config", ConfigError)
    if "sources" in data and not set(data) & set(TABLES):
        raise ConfigError(f"{path} is a dataset file ([[sources]]), not a settings file: give it "
                          f"as --dataset {path}")
    try:
        settings = schema().model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e.errors()[0], path)) from None
    return {t: section.model_dump(exclude_unset=True)
            for t in TABLES if (section := getattr(settings, t)) is not None}


def for_command(path: str, command: str) -> dict[str, Any]:
    """The file's settings one command takes: its own table plus the counting rules it has."""
    return {dest: value for dest, (_, value) in _settings_of(path, command).items()}


def _settings_of(path: str, command: str) -> dict[str, tuple[str, Any]]:
    """for_command's settings with the table each came from: {dest: (table, value)}."""
    tables = load(path)
    values: dict[str, tuple[str, Any]] = {}
    for table, (_, commands) in TABLES.items():
        if command in commands:
            values.update((k, (table, v)) for k, v in tables.get(table, {}).items())
    return values


def apply_file(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> None:
    """Make the settings of `--config FILE` (if `argv` names one) the parser's defaults.

    Flags then win as ordinary argparse defaults do; an option the file provides is no longer
    required on the command line. Settings of `command`'s tables that this parser lacks are
    ignored (a `[counting]` key `train` has no flag for).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    values = _settings_of(known.config, command)
    by_dest = {a.dest: a for a in parser._actions}
    # Which settings the command line gives, for a command that weighs a flag against the
    # file's other half of a pair (serve: a typed --microbatch-token-budget replaces the file's
    # num_microbatches): past this point a file value and a flag look the same in the namespace.
    typed = frozenset(typed_dests(parser, argv))
    parser.set_defaults(**{ON_COMMAND_LINE: typed})
    origins: dict[str, str] = {}
    for dest, (table, value) in values.items():
        action = by_dest.get(dest)
        if action is None:
            continue
        if dest not in typed and action.option_strings:
            origins[max(action.option_strings, key=len)] = f"{dest} = {value!r} in [{table}]"
        if (action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)) \
                and not isinstance(value, list):
            value = [value]
        if isinstance(action, argparse._AppendAction):
            # a repeatable flag replaces the file's list, as every other flag replaces its value
            action.__class__ = _AppendOverFile
            value = _FileList(value)
        action.required = False
        parser.set_defaults(**{dest: value})
    parser.set_defaults(**{FROM_FILE: (known.config, origins)})




#: namespace attribute apply_file sets: the dests of the options typed on the command line
ON_COMMAND_LINE = "_on_command_line"


def typed_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The dests of the options `argv` names (`--flag`, `--flag=value`, or an unambiguous
    prefix of a long flag, as argparse takes it); positionals are not counted."""
    flags = {s: a.dest for a in parser._actions for s in a.option_strings}
    dests: set[str] = set()
    for token in argv:
        if token == "--":
            break
        if not token.startswith("-") or token == "-":
            continue
        name = token.split("=", 1)[0]
        if name in flags:
            dests.add(flags[name])
        elif name.startswith("--"):
            close = {d for s, d in flags.items() if s.startswith(name)}
            if len(close) == 1:
                dests |= close
    return dests


class _FileList(list):
    """A repeatable option's values taken from a --config file."""


class _AppendOverFile(argparse._AppendAction):
    """`action="append"` whose first flag starts a new list instead of extending the file's."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(getattr(namespace, self.dest, None), _FileList):
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)
