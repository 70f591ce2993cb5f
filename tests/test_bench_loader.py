"""`dynabatch bench loader`: JSON schema, every method delivers every sample once, bad input."""

import json

import pytest
import torch

from dynabatch import datagen
from dynabatch.bench import loader as bl
from dynabatch.cli import main

RUN_KEYS = {"method", "workers", "microbatches", "samples", "real_tokens", "tensor_tokens", "seconds", "setup_s",
            "microbatches_per_s", "samples_per_s", "real_tokens_per_s", "padding_efficiency",
            "samples_per_s_vs_torch_pad"}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_loader")
    return [str(p) for p in datagen.write_text_shards(root / "text", 240, 2, seed=0, format="jsonl.gz")]


def _run_json(capsys, *args) -> dict:
    assert main(["bench", "loader", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_schema_and_equal_counts(capsys, text):
    doc = _run_json(capsys, "--data", *text, "--limit", "150", "--workers", "0", "--global-batch-tokens", "4096",
                    "--max-len", "512")
    assert set(doc) == {"config", "runs", "ratios"}
    assert [(r["method"], r["workers"]) for r in doc["runs"]] == [(m, 0) for m in bl.METHODS]
    for r in doc["runs"]:
        assert RUN_KEYS <= set(r)
        assert r["samples"] == 150  # --limit; every method delivers every sample exactly once
        assert r["microbatches_per_s"] > 0 and r["samples_per_s"] > 0 and r["real_tokens_per_s"] > 0
        assert 0 < r["padding_efficiency"] <= 1
    # Every method counts the same real tokens (same tokenizer, same truncation).
    assert len({r["real_tokens"] for r in doc["runs"]}) == 1
    by = {r["method"]: r for r in doc["runs"]}
    assert by["dynabatch_packed"]["padding_efficiency"] == 1.0  # one unpadded row per micro-batch
    assert by["torch_pad"]["samples_per_s_vs_torch_pad"] == 1.0
    assert doc["ratios"]["dynabatch_padded@0"] == pytest.approx(
        by["dynabatch_padded"]["samples_per_s"] / by["torch_pad"]["samples_per_s"])
    c = doc["config"]
    assert c["samples"] == 150 and c["world_size"] == 1 and c["tokenizer_name"]
    assert c["baseline_batch_size"] == max(1, round(4096 / c["mean_sample_tokens"]))


def test_table_and_methods_subset(capsys, text):
    assert main(["bench", "loader", "--data", text[0], "--limit", "40", "--workers", "0", "--no-progress",
                 "--methods", "torch_pad", "dynabatch_packed"]) == 0
    out = capsys.readouterr().out
    for word in ("samples/s", "real tok/s", "pad eff", "x torch_pad", "torch_pad", "dynabatch_packed",
                 "world_size 1", "exactly once"):
        assert word in out


def test_collators():
    batch = [(7, torch.tensor([1, 2, 3]), torch.tensor([-100, 2, 3])), (9, torch.tensor([4]), torch.tensor([4]))]
    p = bl.pad_collate(batch)
    assert p["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert p["attention_mask"].sum().item() == 4 and p["labels"][1].tolist() == [4, -100, -100]
    k = bl.PackCollate(max_len=4)(batch)
    assert k["input_ids"].tolist() == [[1, 2, 3, 4]] and k["position_ids"].tolist() == [[0, 1, 2, 0]]
    k = bl.PackCollate(max_len=3)(batch)
    assert k["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]] and k["sample_ids"].tolist() == [7, 9]


def test_bad_input(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"inputs": "a", "targets": "b"}\n{"inputs": oops\n')
    assert main(["bench", "loader", "--data", str(bad), "--workers", "0", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynabatch: error:") and "bad.jsonl:2" in err and "\n" not in err
    assert main(["bench", "loader", "--data", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["bench", "loader", "--data", str(bad), "--workers", "-1", "--no-progress"]) == 1
    assert "--workers" in capsys.readouterr().err
