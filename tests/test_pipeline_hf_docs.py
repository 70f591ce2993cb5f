"""The examples of docs/pipeline_hf.md run as written: the python blocks in one process (like a notebook);
the training block is examples/pipeline_hf.py's, which tests/test_pipeline_hf_example.py runs."""

import re
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "pipeline_hf.md"
EXAMPLE = ROOT / "examples" / "pipeline_hf.py"


def test_python_blocks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    dtype = torch.get_default_dtype()
    try:
        for code in blocks:
            exec(compile(code, str(PAGE), "exec"), namespace)
    finally:
        torch.set_default_dtype(dtype)
    out = capsys.readouterr().out
    assert "6 layers; tied: {'model.embed_tokens.weight': [(0, 'embed.weight'), (5, 'lm_head.weight')]}" in out
    stage_bytes = [int(x) for x in re.findall(r"stage \d: (\d+) of", out)]
    whole = int(re.search(r"of (\d+) parameter bytes", out).group(1))
    assert len(stage_bytes) == 2 and all(b < whole for b in stage_bytes)
    assert "19 12 ['[1, 19, 16] float32', '[1, 12, 16] float32', '[4] int32', '[4] int32']" in out


def test_training_block_is_the_example():
    """The training block is examples/pipeline_hf.py's `train`, verbatim (tests/test_pipeline_hf_example.py
    runs the example on two processes and checks its merged checkpoint), and its command line is shown."""
    text = PAGE.read_text()
    block = re.search(r"```py\n(def train\(.*?)```", text, re.S).group(1)
    assert block.strip() in EXAMPLE.read_text()
    assert "python examples/pipeline_hf.py MODEL_DIR DATA" in text and "torchrun" in text
