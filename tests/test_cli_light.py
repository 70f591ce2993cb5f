"""`dynabatch --help` and every subcommand's --help: built without numba or torch (issue 41: help in
<= 0.5 s; measured robustly as the heavy modules a fresh interpreter imports, not as seconds), every
subcommand's help ends with examples, and the names the light parsers copy equal their originals."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import textwrap

import pytest

from dynabatch.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand parser under ``parser``, by its command path ("bench gpu"), groups included."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = sub
                out.update({f"{name} {k}": v for k, v in _subparsers(sub).items()})
    return out


COMMANDS = sorted(_subparsers(build_parser()))
LEAVES = [c for c in COMMANDS if not any(o.startswith(c + " ") for o in COMMANDS)]


def test_the_commands_are_all_there():
    assert {"demo", "datagen", "scan", "plan", "inspect", "profile", "bench", "bench plan", "bench load",
            "bench loader", "bench train", "bench multimodel", "bench gpu"} <= set(COMMANDS), COMMANDS


def test_every_help_prints_without_numba_or_torch():
    """A fresh interpreter builds the parser and prints the help of the command and of every subcommand:
    none of the modules that make `dynabatch --help` take seconds is imported."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from dynabatch.cli import main
        sizes = {{}}
        for cmd in [[]] + [c.split() for c in {COMMANDS!r}]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                try:
                    main(cmd + ["--help"])
                except SystemExit as e:
                    assert e.code == 0, (cmd, e.code)
            sizes[" ".join(cmd)] = len(buf.getvalue())
        heavy = [m for m in ("torch", "numba", "numpy", "pyarrow", "tqdm") if m in sys.modules]
        print(json.dumps({{"sizes": sizes, "heavy": heavy}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(n > 200 for n in doc["sizes"].values()), doc["sizes"]  # each printed a real help
    # torch and numba cost seconds, numpy and pyarrow ~0.1 s each of the 0.5 s a help may take
    assert doc["heavy"] == [], f"printing help imported {doc['heavy']}: import them inside the command functions"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_ends_with_examples(command):
    text = _subparsers(build_parser())[command].format_help()
    assert "\nexamples:\n" in text, f"`dynabatch {command} --help` has no examples: section"
    after = text.split("\nexamples:\n", 1)[1].splitlines()
    runnable = [line for line in after if line.startswith("  dynabatch ")]
    assert any(line.split()[1:1 + len(command.split())] == command.split() for line in runnable), \
        f"`dynabatch {command} --help`'s examples do not run `dynabatch {command}`: {runnable}"


def test_top_level_help_shows_every_command_with_an_example():
    """The README's "dynabatch --help  # every command, with examples" holds."""
    lines = build_parser().format_help().splitlines()
    for command in LEAVES:
        assert any(line.startswith(f"  dynabatch {command} ") for line in lines), \
            f"`dynabatch --help` shows no example of `dynabatch {command}`"


def test_every_command_function_resolves():
    """Each subcommand's function exists (the lazy ones name a module and function they import when run)."""
    for command in LEAVES:
        func = _subparsers(build_parser())[command].get_default("func")
        assert callable(func), command
        target = getattr(func, "target", None)
        if target:
            assert callable(getattr(importlib.import_module(target[0]), target[1])), (command, target)


def test_copied_names_equal_their_originals():
    from dynabatch.bench import loader, multimodel, train
    from dynabatch.commands import choices
    from dynabatch.datagen import TEXT_FORMATS
    from dynabatch.pipeline.measure import profile
    from dynabatch.pipeline.models import MODELS

    assert choices.TEXT_FORMATS == TEXT_FORMATS
    assert choices.TINY_MODELS == MODELS == tuple(train.MODEL_SIZES)
    assert (choices.TRAIN_METHODS, choices.VLM_METHODS) == (train.TRAIN_METHODS, train.VLM_METHODS)
    assert choices.LOADER_METHODS == loader.METHODS
    assert choices.LR_FACTORS == multimodel.LR_FACTORS
    assert (choices.PROFILE_ROWS, choices.PROFILE_LENGTHS, choices.PROFILE_TILES) == \
        (profile.DEFAULT_ROWS, profile.DEFAULT_LENGTHS, profile.DEFAULT_TILES)


def test_progress_flags_on_every_long_command():
    """datagen, scan, plan, profile and every bench take --progress / --no-progress."""
    subs = _subparsers(build_parser())
    for command in ("datagen", "scan", "plan", "profile", *(c for c in LEAVES if c.startswith("bench "))):
        flags = {s for a in subs[command]._actions for s in a.option_strings}
        assert {"--progress", "--no-progress"} <= flags, command
