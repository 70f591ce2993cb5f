"""`dynabatch plan` says the defaults it took for the cost model (a plan's times are its model's and
device's: planned with gpt on an A100 without a word, issue 41), suggests an ``inspect`` that writes
beside the plan (not over another plan's plan.png), and ``inspect --plot`` titles carry the model, the
device and the plan against pack."""

from __future__ import annotations

import json
import re

import pytest

from dynabatch.cli import main
from dynabatch.datagen import write_text_shards
from dynabatch.offline import load_run_plan
from dynabatch.planfile.plot import index_shapes, plot_plan


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_cli")
    write_text_shards(root / "text", 600, num_shards=2, seed=3)
    return root


FLAGS = ["--tokenizer", "bytes", "--workers", "1", "--no-progress", "--global-batch-tokens", "60000",
         "--max-len", "2048"]


def test_plan_names_the_defaults_it_took_and_a_next_step_beside_the_plan(text, tmp_path, capsys):
    out = tmp_path / "pack.parquet"
    assert main(["plan", str(text / "text"), *FLAGS, "--method", "pack", "--method-option", "rows=4",
                 "--save-index", str(tmp_path / "index.parquet"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("cost model: this command's default --model gpt --device a100-80gb (not given): the times below are "
            "gpt's on a100-80gb; give --model and --device to plan for your model and cluster") in printed
    assert f"next: dynabatch inspect {out} --plot {tmp_path / 'pack.png'}" in printed.splitlines()[-1]
    run = load_run_plan(out)
    # the title: method, model, device, world, and the plan against pack on the same global batches
    title = plot_plan(run, None, shapes=index_shapes(run, [str(tmp_path / "index.parquet")]))._suptitle.get_text()
    assert re.search(r"pack \(packed_rows\) for gpt on a100-80gb, 8 ranks x 4 stages, \d+ steps\n"
                     r"pack vs pack \(planner defaults\) on the same global batches: [0-9.]+x", title), title
    untitled = plot_plan(run, None)._suptitle.get_text()  # planned from raw data: no index file to re-plan with
    assert "for gpt on a100-80gb" in untitled and "pass the length index" in untitled


def test_stated_model_and_device_are_not_called_defaults(text, tmp_path, capsys):
    out = tmp_path / "t5.parquet"
    assert main(["plan", str(text / "text"), *FLAGS, "--model", "t5", "--device", "h100", "--json",
                 "--save-index", str(tmp_path / "index.parquet"), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "defaults_taken" not in summary and summary["device"] == "h100", summary
    run = load_run_plan(out)
    title = plot_plan(run, None, shapes=index_shapes(run, [str(tmp_path / "index.parquet")]))._suptitle.get_text()
    m = re.search(r"dp vs pack \(planner defaults\) on the same global batches: ([0-9.]+)x", title)
    speedup = float(m.group(1))
    assert speedup > 1.0 and f"on {summary['device']}" in title and summary["model"] in title, title
    assert main(["plan", str(text / "text"), *FLAGS, "--json", "--out", str(tmp_path / "gpt.parquet")]) == 0
    assert json.loads(capsys.readouterr().out)["defaults_taken"] == {"model": "gpt", "device": "a100-80gb"}
