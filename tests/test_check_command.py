"""`dynabatch check MODEL_DIR DATA` (docs/pipeline_hf.md's first section) on a tiny save_pretrained folder of each
family: the report, and every route agreeing with the plain model (exit 0); exit 1, with the reason, on a folder
whose config was edited to fewer layers, more stages than layers, and a tokenizer the model cannot embed."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, decoder_config, llava_config, t5_config  # noqa: E402

from dynabatch.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
V = 260


def _config(family):
    if family == "llava":
        cfg = llava_config(image_token_id=V - 1)
        cfg.text_config.vocab_size = V
        return cfg
    return {"t5": lambda: t5_config(vocab_size=V), "bart": lambda: bart_config(vocab_size=V),
            "gemma2": lambda: decoder_config("gemma2", vocab_size=V, tie_word_embeddings=True)}.get(
        family, lambda: decoder_config(family, vocab_size=V))()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Text records and, for LLaVA, image+text records (images as files) mixed with text-only ones."""
    from dynabatch import datagen

    d = tmp_path_factory.mktemp("data")
    rows = [{"inputs": f"question {i} " + "ab " * (i % 7), "targets": "yes " * (1 + i % 3)} for i in range(30)]
    (d / "text.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    vlm = []
    for i, (_, _, img, _) in enumerate(datagen.image_text_samples(4, seed=0)):
        (d / f"img{i}.jpg").write_bytes(img)
        vlm.append({"inputs": f"describe {i}", "targets": "shapes " * (1 + i % 3), "image": str(d / f"img{i}.jpg")})
    vlm += [{"inputs": f"say {i}", "targets": "w " * (i + 1)} for i in range(3)]
    (d / "vlm.jsonl").write_text("\n".join(json.dumps(r) for r in vlm))
    return d


def _folder(tmp_path, family, **edit):
    out = tmp_path / family
    build(_config(family), seed=1, dtype=torch.float32).save_pretrained(out)
    if edit:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(edit)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma", "gemma2", "phi3", "t5", "bart", "llava"])
def test_check_agrees_on_each_family(tmp_path, data, family, capsys):
    folder = _folder(tmp_path, family)
    records = data / ("vlm.jsonl" if family == "llava" else "text.jsonl")
    assert main(["check", str(folder), str(records), "--stages", "2", "--batch-tokens", "600"]) == 0
    out = capsys.readouterr().out
    assert "check: everything agrees" in out, out
    assert re.search(r"^step_backward .*: agrees$", out, re.M) and re.search(r"^pipeline x2 .*: agrees$", out, re.M)
    assert re.search(r"stage 1  layers \d+\.\.\d+: [\d.]+ MiB", out)
    if family == "bart":
        assert "decoder    starts with id 2 (config.decoder_start_token_id)" in out
    if family == "llava":
        assert "28 px images of 14 px patches, 4 tokens per image, image token id 259" in out


def test_check_packed_float64(tmp_path, data, capsys):
    folder = _folder(tmp_path, "llama")
    argv = ["check", str(folder), str(data / "text.jsonl"), "--stages", "3", "--collate", "packed", "--dtype",
            "float64", "--batch-tokens", "600", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["route"] for r in report["routes"]] == ["step_backward", "pipeline x3"]
    assert all(r["ok"] and r["grad_gap"] < 1e-5 for r in report["routes"]), report


def test_check_refuses_what_would_train_wrong(tmp_path, data, capsys):
    """A config edited to fewer layers than its weights, more stages than layers, a tokenizer too large."""
    text = str(data / "text.jsonl")
    cut = _folder(tmp_path, "llama", num_hidden_layers=2)
    assert main(["check", str(cut), text]) == 1
    err = capsys.readouterr().err
    assert "stored tensor(s) no layer of the config takes, e.g. ['model.layers.2." in err, err
    full = _folder(tmp_path / "ok", "llama")
    assert main(["check", str(full), text, "--stages", "6"]) == 1
    assert "6 pipeline stages asked, but LlamaForCausalLM has 5 layers" in capsys.readouterr().err
    small = tmp_path / "small"
    build(decoder_config("llama", vocab_size=64), seed=1, dtype=torch.float32).save_pretrained(small)
    assert main(["check", str(small), text]) == 1
    assert "the tokenizer has 259 ids but the model embeds 64" in capsys.readouterr().err


def test_docs_start_with_check():
    page = (ROOT / "docs" / "pipeline_hf.md").read_text()
    first = page.split("\n## ", 2)[1]
    assert first.startswith("First: `dynabatch check` your folder and data")
    assert "dynabatch check MODEL_DIR DATA --num-stages 2" in first
