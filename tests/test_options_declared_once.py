"""Issue 42: every planning option is declared once (`PlanOptions`' fields: name, type, default, meaning, flag);
the command line's flags, the epilog that teaches them, docs/planner.md's table and the DataLoader's own
keywords are checked against that declaration, so none can drift from it."""

import dataclasses
import inspect
import re
from pathlib import Path

from dynabatch.core.options import PlanOptions, option_default, option_flag, option_help
from dynabatch.loader.settings import DIRECT
from dynabatch.option_flags import PLAN_OPTIONS_HELP

FIELDS = [f.name for f in dataclasses.fields(PlanOptions)]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "planner.md"


def _plan_parser_actions():
    from dynabatch.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")  # argparse's own
    return {s: a for a in sub.choices["plan"]._actions for s in a.option_strings}


def test_every_field_declares_a_meaning_and_its_flag_is_on_the_command_line_with_its_default():
    actions = _plan_parser_actions()
    for name in FIELDS:
        assert option_help(name).strip(), name
        flag = option_flag(name)
        if flag is None:  # equal_microbatches: steps always ask for equal counts
            continue
        assert flag in actions, (name, flag)
        assert option_help(name) in actions[flag].help, (name, flag)
    # a flag whose default is the field's own (the command's own defaults: tokens, stages, ranks)
    for name in ("schedule", "recompute", "max_caps", "seed", "max_len", "memory_limit"):
        assert actions[option_flag(name)].default == option_default(name), name
    assert actions["--no-flush"].default is option_default("flush") and actions["--drop-last"].default is False


def test_the_epilog_names_declared_flags_only():
    declared = {option_flag(n) for n in FIELDS} - {None}
    named = set(re.findall(r"^  (--[a-z-]+)", PLAN_OPTIONS_HELP, re.M))
    assert named and named <= declared | {"--keep-last"}, named - declared


def test_the_docs_table_lists_every_field_with_its_declared_flag_and_default():
    rows = re.findall(r"^\| `(\w+)` \| [^|]* \| ([^|]*) \| ([^|]*) \|", DOCS.read_text(), re.M)
    table = {name: (default, flag) for name, default, flag in rows if name in FIELDS}
    assert list(table) == FIELDS
    for name, (default, flag) in table.items():
        want = option_flag(name)
        assert (want is None and "always on" in flag) or (want is not None and want in flag), (name, flag)
        assert repr(option_default(name)).replace("'", '"') in default or \
            (name == "method_options" and "{}" in default), (name, default)


def test_the_data_loader_takes_the_direct_keywords_and_the_records_and_nothing_else():
    from dynabatch.loader.dataloader import DataLoader

    params = set(inspect.signature(DataLoader.__init__).parameters) - {"self", "data"}
    assert params == set(DIRECT)
    assert not (set(FIELDS) - {"num_ranks", "shuffle", "drop_last"}) & params  # planning options go in options=
