"""The Python example in docs/offline_plans.md runs as written, and the page documents every
column the plan file has."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "offline_plans.md"


def test_doc_example_runs(tmp_path, monkeypatch, capsys):
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "offline_docs"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    assert "2000 ['t0', 't1', 't2']" in out
    assert "world size (data-parallel ranks) is 8 in the plan but 4 here" in out


def test_doc_lists_every_plan_column():
    from dynabatch.offline.commands import PLAN_EPILOG

    text = DOC.read_text(encoding="utf-8")
    columns = ("step", "rank", "microbatch", "row", "sample_id", "rows", "input_len", "target_len", "vision_tiles",
               "tokens", "real_tokens", "target_tokens", "time_s", "memory_bytes", "epoch", "task_id", "sample_tokens")
    for col in columns:
        assert f"| `{col}` |" in text, col
        assert f"  {col} " in PLAN_EPILOG, col
