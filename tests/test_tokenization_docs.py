"""The Python examples in docs/tokenization.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "tokenization.md"


def test_doc_examples_run(tmp_path, monkeypatch, capsys):
    try:
        import tokenizers  # noqa: F401

        have_tokenizers = True
    except ImportError:
        have_tokenizers = False
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "tokenization_docs"}
    for i, code in enumerate(blocks):
        if "from tokenizers" in code and not have_tokenizers:
            continue  # the tokenizer.json example needs `pip install tokenizers`; the others do not
        exec(compile(code, f"{DOC.name}[block {i}]", "exec"), namespace)
    out = capsys.readouterr().out
    # spot-check the outputs the page quotes in comments
    for quoted in (
        "[[107, 108], [107, 198, 172, 111, 111, 114]]",
        "[-100, -100, -100, -100, 55, 2]",
        "efxyz True",
        "[1, 3, 4]",
        "'input_tokens': [9, 18, 27, 36, 45, 25]",  # vision tokens count towards max_total_tokens
        "[9, 18, 27, 33, 33] 1",  # an image that alone passes it is skipped
        "12 'a c' True",
        "[259, 259, 259, 259, 259, 259, 259, 259, 259, 259, 259, 259, 100, 35, 102, 2]",
        # a chat template: assistant turns only are trained, on both mask paths
        "tokenizer chat template sha256:2f0fa6056c853e65 (assistant tokens from generation masks)",
        "[-100, -100, -100, -100, -100, 6, 4, -100, -100, -100, -100, -100, -100, 10, 4]\nTrue",
    ):
        assert quoted in out
