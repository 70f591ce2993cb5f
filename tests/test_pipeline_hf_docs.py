"""The examples of docs/pipeline_hf.md run as written: the python blocks in one process (like a notebook),
the training script on two local gloo processes, whose merged checkpoint from_pretrained loads."""

import re
from pathlib import Path

import torch

from dynabatch.pipeline import launch_local

PAGE = Path(__file__).resolve().parent.parent / "docs" / "pipeline_hf.md"


def test_python_blocks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 2
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


def test_training_script_runs_on_two_processes(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    script = re.search(r"```py\n(# train_pipeline_hf\.py.*?)```", PAGE.read_text(), re.S).group(1)
    path = tmp_path / "train_pipeline_hf.py"
    path.write_text(script)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    res = launch_local(f"{path}:main", 2, args=(str(tmp_path / "model"), str(tmp_path / "out")), timeout_s=300)
    for r in res:
        assert r.returncode == 0 and not r.timed_out, r.stderr[-3000:]
    assert "step 2: loss" in res[0].stdout and "merged into" in res[0].stdout
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
