"""The Python examples in docs/dataloader.md run as written and print what the comments say."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "dataloader.md"


def test_dataloader_page_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    for code in blocks:  # blocks build on each other, like a notebook
        exec(compile(code, str(DOC), "exec"), namespace)
    out = capsys.readouterr().out
    for expected in ("streaming dp padded", "[0, 6, 11]", "indexed 9", "(2, 8) [6, 5]", "True", "200 200",
                     "world size (data-parallel ranks) is 2 in the plan but 4 here", "Step 0 1 True",
                     "['format', 'indexed', 'integrity', 'mode', 'version']"):
        assert expected in out, expected
    assert "False" not in out
