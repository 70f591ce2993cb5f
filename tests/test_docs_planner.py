"""The Python examples in docs/planner.md and docs/cost_model.md run as written."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page", ["planner.md", "cost_model.md"])
def test_page_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert blocks, page
    namespace: dict = {}
    for code in blocks:  # blocks on a page build on each other, like a notebook
        exec(compile(code, str(DOCS / page), "exec"), namespace)
    assert capsys.readouterr().out.strip()


def test_options_table_lists_every_field_and_deprecated_name(capsys):
    """docs/planner.md has one row per PlanOptions field (unit, default, flag) and maps every
    deprecated name to its new one; every flag it names exists on `dynabatch plan`."""
    import dataclasses

    from dynabatch import PlanOptions
    from dynabatch.cli import main
    from dynabatch.core.options import DEPRECATED_NAMES

    text = (DOCS / "planner.md").read_text()
    section = text.split("## Planning options: `PlanOptions`", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line for line in section.splitlines()
            if line.startswith("| `")}
    for f in dataclasses.fields(PlanOptions):
        assert f.name in rows, f.name
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert f"`{default!r}`".replace("'", '"') in rows[f.name] or f"`{default}`" in rows[f.name], f.name
    for old, new in DEPRECATED_NAMES.items():
        assert any(f"`{old}`" in line and f"`{new}`" in line for line in section.splitlines()), old
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    plan_help = capsys.readouterr().out
    for flag in {w.strip("`") for line in rows.values() for w in line.split() if w.startswith("`--")}:
        assert flag in plan_help, flag
