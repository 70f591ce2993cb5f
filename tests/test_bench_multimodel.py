"""`dynabatch bench multimodel` on tiny generated data: the table's figures hold together, the two arms
train the same models (bit for bit), spilling is reported, bad settings are refused."""

import json

import pytest

from dynabatch.bench.multimodel import format_multimodel, summarize_k
from dynabatch.datagen import write_text_shards


@pytest.mark.slow
def test_bench_multimodel_json_and_table(tmp_path, run_cli):
    """K = 2 interleaved and K = 3 model after model under a 1.2-shard budget (so shards spill), 2 gloo
    stages, 3 steps (1 warm-up); liveness timeouts only (``--timeout``)."""
    paths = write_text_shards(tmp_path / "data", 400, seed=0)
    common = ["--stages", "2", "--steps", "3", "--warmup", "1", "--hidden", "32", "--global-batch-tokens", "2048",
              "--max-len", "256", "--data", *paths, "--timeout", "60"]
    out = run_cli("bench", "multimodel", *common, "--k", "2", "--json", "--progress")  # in this process
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert "bench multimodel" not in out.stderr  # --json: no bar even with --progress
    (r,) = res["ks"]
    assert r["K"] == 2 and r["steps_timed"] == 2 and r["identical"] is True
    assert r["together_s"] > 0 and r["sequential_s"] > 0
    assert r["speedup"] == pytest.approx(r["sequential_s"] / r["together_s"])
    assert r["sim_plan_speedup"] >= 1.0 and r["sim_measured_speedup"] >= 1.0  # interleaving never loses in the model
    assert res["data_pass_s"] == pytest.approx(res["scan_s"] + res["loader_s"])
    assert r["data_saved_s"] == pytest.approx(res["data_pass_s"])  # (K - 1) x one pass
    assert r["budget_bytes"] is None and r["spills"] == 0
    for row in r["per_step"]:
        assert len(row["single_s"]) == 2 and row["tokens"] > 0

    out = run_cli("bench", "multimodel", *common, "--k", "3", "--budget-shards", "1.2", "--no-interleave",
                  "--progress")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bench multimodel (K=(3,))" in out.stderr and "3/3" in out.stderr  # the bar of the steps trained
    table = out.stdout
    assert "model after model" in table and "spills" in table, table
    row = [ln for ln in table.splitlines() if ln.strip().startswith("3 ")]
    assert row and " yes " in row[0], table


def test_bench_multimodel_refuses_bad_settings(capsys):
    """The command's own exit codes and messages (`dynabatch.cli.main`, what ``python -m dynabatch.cli`` exits
    with: the settings are refused before any process starts, so no fresh interpreter is needed)."""
    from dynabatch.cli import main

    assert main(["bench", "multimodel", "--k", "9", "--steps", "2"]) == 2
    assert "K must be 1..8" in capsys.readouterr().err
    assert main(["bench", "multimodel", "--steps", "2", "--warmup", "2"]) == 2
    assert "leaves none" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "multimodel", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--budget-shards" in out and "examples:" in out


def test_summary_excludes_warmup_and_measures_noise():
    rows = [{"together_s": 9.0, "single_s": [9.0, 9.0], "sim_plan_together_s": 1.0, "sim_plan_sequential_s": 1.0,
             "sim_measured_together_s": 1.0, "sim_measured_sequential_s": 1.0, "peak_resident_bytes": 5,
             "spills": 0, "loads": 0, "prefetches": 0}]
    rows += [{"together_s": 1.0, "single_s": [0.5, 0.6], "sim_plan_together_s": 1.0, "sim_plan_sequential_s": 1.1,
              "sim_measured_together_s": 2.0, "sim_measured_sequential_s": 2.4, "peak_resident_bytes": 7,
              "spills": 1, "loads": 1, "prefetches": 1} for _ in range(2)]
    s = summarize_k(rows, 1, 2, True, None)
    assert s["together_s"] == 2.0 and s["sequential_s"] == pytest.approx(2.2) and s["speedup"] == pytest.approx(1.1)
    assert s["sim_plan_speedup"] == pytest.approx(1.1) and s["sim_measured_speedup"] == pytest.approx(1.2)
    assert s["timer_noise"] == pytest.approx(0.1 / 0.55)
    assert s["peak_resident_bytes"] == 7 and s["spills"] == 2
    result = {"config": {"model": "gpt-tiny", "parameters": 10, "options": {"num_stages": 2, "global_batch_tokens": 8},
                         "bounds": [0, 1, 2], "steps": 3, "warmup": 1, "microbatches_per_step": 2.0,
                         "interleave": True, "data": ["a.jsonl"]},
              "scan_s": 1.0, "loader_s": 2.0, "data_pass_s": 3.0, "ks": [{**s, "data_saved_s": 3.0}]}
    text = format_multimodel(result)
    assert "1.100x" in text and "18.2%" in text
    spilled = {**s, "data_saved_s": 3.0, "budget_bytes": 2 ** 21, "copy_s": 0.5, "copy_bytes_per_s": 4e9,
               "sim_stall_s": 0.25}
    text = format_multimodel({**result, "ks": [spilled]})
    assert "budget 2.0 MiB" in text and "4.0 GB/s" in text and "stalls 0.25 s" in text
