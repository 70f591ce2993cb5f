"""The examples in docs/pipeline.md, docs/feedback.md, docs/memory.md and docs/multimodel.md run as written (the training script on two
local gloo processes)."""

import re
from pathlib import Path

import pytest
import torch

from dynabatch.pipeline import launch_local

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page", ["pipeline.md", "feedback.md", "memory.md", "multimodel.md"])
def test_python_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert blocks, page
    namespace: dict = {}
    threads = torch.get_num_threads()  # an example may pin threads; give pytest its setting back
    try:
        for code in blocks:  # blocks build on each other, like a notebook
            exec(compile(code, str(DOCS / page), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.strip()
    if page == "feedback.md":
        last = float(re.findall(r"before, ([\d.]+)% after", out)[-1])
        assert last < 10.0


def test_training_script_runs_on_two_processes(tmp_path):
    script = re.search(r"```py\n(# train_pipeline\.py.*?)```", (DOCS / "pipeline.md").read_text(), re.S).group(1)
    path = tmp_path / "train_pipeline.py"
    path.write_text(script)
    res = launch_local(f"{path}:main", 2, timeout_s=120)
    for r in res:
        assert r.returncode == 0 and not r.timed_out, r.stderr[-3000:]
    assert "step 5: loss" in res[0].stdout
