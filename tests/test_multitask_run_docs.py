"""The "Running it" examples of docs/multitask.md run as written: the training script (its ``py`` block,
saved as ``train_multitask.py``) on 4 local gloo processes through the page's ``python`` block."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_running_it_examples_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    section = (DOCS / "multitask.md").read_text().split("\n## Running it", 1)[1]
    script = re.search(r"```py\n(# train_multitask\.py.*?)```", section, re.S).group(1)
    (tmp_path / "train_multitask.py").write_text(script)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(DOCS / "multitask.md"), "exec"), namespace)
    results = namespace["results"]
    for r in results:
        assert r.returncode == 0 and not r.timed_out, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", results[0].stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], results[0].stdout
