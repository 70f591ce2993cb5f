"""The Python examples of docs/multitask.md up to its "Running it" section run as written (graph, mixture,
workload, plan); that section's own examples are the executor's (tests/test_multitask_run*.py)."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_multitask_page_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "multitask.md").read_text()
    planning = text.split("\n## Running it", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", planning, re.S)
    assert len(blocks) >= 5
    namespace: dict = {}
    for code in blocks:  # the blocks build on each other, like a notebook
        exec(compile(code, str(DOCS / "multitask.md"), "exec"), namespace)
    out = capsys.readouterr().out
    assert "wave" in out and "one pipeline" in out
    assert namespace["alloc"].num_devices == 4
