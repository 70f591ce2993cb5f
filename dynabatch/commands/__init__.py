"""The argument parsers of the ``dynabatch`` command (`dynabatch.cli` assembles them).

Building a parser imports nothing heavier than argparse and small modules of names: ``dynabatch
--help`` and every subcommand's ``--help`` print without importing numpy, numba or torch. Each
subcommand's function imports its work when the command runs (`lazy_handler`). One module per
command group: `datagen`, `bench` (the group, and `bench_plan`, `bench_load`: load + loader,
`bench_train`: train + multimodel; ``bench gpu`` registers itself from `dynabatch.bench.gpu`),
`profile`; ``scan`` / ``plan`` / ``inspect`` are `dynabatch.offline.commands`. `choices` holds the
names the parsers offer whose defining modules are heavy. Every subcommand's help ends with an
``examples:`` section.
"""

from __future__ import annotations

import argparse
import importlib
import textwrap


def lazy_handler(module: str, name: str):
    """The function of a subcommand (``set_defaults(func=...)``) that imports ``module`` and calls its
    ``name(args)`` only when the command runs."""

    def run(args):
        return getattr(importlib.import_module(module), name)(args)

    run.__qualname__ = f"lazy_handler({module}:{name})"
    run.target = (module, name)  # what it will call (tests resolve it without running the command)
    return run


def add_subcommand(sub, name: str, help: str, description: str, epilog: str) -> argparse.ArgumentParser:
    """Register ``name`` on the subparsers ``sub``. The epilog (and a description with line breaks)
    keeps its lines; a one-paragraph description is wrapped at 100 columns, as the epilogs are."""
    if "\n" not in description:
        description = textwrap.fill(description, 100)
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
