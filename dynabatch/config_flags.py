"""Command-line flags declared on a config dataclass's own fields, so that a bench's option has one
place (its name, type, default, meaning and flag) and its parser is built from it: `flag_field`
declares a field, `add_config_flags` adds its flags to an ``argparse`` parser, `config_from_args`
reads them back. Standard library only: a command's ``--help`` builds the parser without torch.
(`dynabatch.PlanOptions` declares its fields the same way; `dynabatch.option_flags` parses them.)"""

from __future__ import annotations

import argparse
import dataclasses
from types import MappingProxyType


def flag_field(default, flag: str, help: str, *, metavar: str | None = None, choices: tuple | None = None,
               kind: type | None = None):
    """A dataclass field set by command-line ``flag``: its ``default``, what it means (``help``, with
    units), and how the flag parses. A tuple default takes one or more values (``nargs="+"``, each of
    ``choices`` when given); otherwise ``kind`` (default: the default's type; give it when the default is
    None) converts the text."""
    meta = MappingProxyType({"flag": flag, "help": help, "metavar": metavar, "choices": choices, "kind": kind})
    return dataclasses.field(default=default, metadata=meta)


def _flagged(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("flag")]


def add_config_flags(parser: argparse.ArgumentParser, cls) -> None:
    """Add one flag per `flag_field` of the dataclass ``cls`` to ``parser``; the help ends with the default."""
    for f in _flagged(cls):
        m = f.metadata
        shown = f" (default {' '.join(map(str, f.default)) or 'none'})" if isinstance(f.default, tuple) else (
            f" (default {f.default})" if f.default is not None else "")
        kw = dict(dest=f.name, default=f.default, help=m["help"] + shown, metavar=m["metavar"])
        if isinstance(f.default, tuple):
            kw.update(nargs="+", choices=m["choices"], type=m["kind"] or str)
        elif isinstance(f.default, bool):
            raise TypeError(f"{cls.__name__}.{f.name}: a bool flag_field is not supported; use an action flag")
        else:
            kw.update(type=m["kind"] or type(f.default), choices=m["choices"])
        parser.add_argument(m["flag"], **kw)


def config_from_args(cls, args: argparse.Namespace):
    """The ``cls`` instance of the flags `add_config_flags` added, as ``args`` parsed them (tuples for
    the many-valued ones); the fields without a flag keep their defaults."""
    values = {}
    for f in _flagged(cls):
        v = getattr(args, f.name)
        values[f.name] = tuple(v) if isinstance(f.default, tuple) else v
    return cls(**values)


__all__ = ["add_config_flags", "config_from_args", "flag_field"]
