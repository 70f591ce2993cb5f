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
