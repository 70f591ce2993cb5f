"""The `dynabatch` command line: help, bench plan (table, JSON, plot, bad input) and demo."""

import gzip
import json

import pytest

from dynabatch.cli import main
from dynabatch.core.plan import METHODS

SMALL = ["--synthetic", "--samples", "2500", "--batches", "3", "--no-progress"]


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "dynabatch demo" in out and "bench plan" in out


def test_bench_plan_help_explains_columns(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "plan", "--help"])
    out = capsys.readouterr().out
    for word in ("obj/LB", "pad eff", "--global-batch-tokens", "vit_num"):
        assert word in out


@pytest.mark.parametrize("model", ["gpt", "t5", "vlm"])
def test_bench_plan_json_schema(capsys, model):
    assert main(["bench", "plan", "--model", model, "--json", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"config", "lower_bound_s", "methods"}
    assert set(doc["methods"]) == set(METHODS)
    keys = {"iteration_time_s", "padding_efficiency", "speedup_vs_pack", "ratio_to_lower_bound",
            "rank_imbalance", "num_microbatches", "plan_ms_median"}
    for name, m in doc["methods"].items():
        assert keys <= set(m), name
        assert m["ratio_to_lower_bound"] >= 1.0 - 1e-9, name  # the bound holds for every method
    assert doc["methods"]["pack"]["speedup_vs_pack"] == pytest.approx(1.0)
    assert doc["methods"]["dp"]["iteration_time_s"] < doc["methods"]["pack"]["iteration_time_s"]
    assert doc["config"]["model"] == model


def test_bench_plan_table_and_plot(capsys, tmp_path):
    png = tmp_path / "bench.png"
    assert main(["bench", "plan", "--methods", "dp", "pack", "--plot", str(png), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "iter ms" in out and "dp" in out and "pack" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plan_bad_data_names_file(capsys, tmp_path):
    bad = tmp_path / "broken.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"inputs": "fine", "targets": "ok"}\n{"inputs": "broken\n')
    assert main(["bench", "plan", "--data", str(bad), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.jsonl.gz" in err


def test_bench_plan_missing_file(capsys, tmp_path):
    assert main(["bench", "plan", "--data", str(tmp_path / "nope.jsonl"), "--no-progress"]) == 1
    assert "nope.jsonl" in capsys.readouterr().err


def test_demo_streams_generated_shards_through_the_loader(capsys, tmp_path):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("dp is") == 2 and "rank 0's micro-batches" in out
    # what the DataLoader delivered is exactly what the planner decided for rank 0
    assert out.count("delivered samples equal the plan's rank-0 micro-batches: True") == 2
    assert "=== vlm" in out and "448-px tiles" in out
    assert sorted(p.name for p in (tmp_path / "text").iterdir())[0] == "shard-000000.jsonl"
    assert any(p.suffix == ".tar" for p in (tmp_path / "image_text").iterdir())
