"""The Python examples of docs/huggingface.md ("Coming from Hugging Face") run as written, in
order in one namespace (like a notebook), and print what their comments say."""

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "huggingface.md"


def test_huggingface_page_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    # every "print(...)   # expected" comment of the page holds
    expected = [m.strip() for m in re.findall(r"print\(.*\)\s+# (.+)", "\n".join(blocks))]
    assert len(expected) >= 5
    for e in expected:
        assert e in out, e
