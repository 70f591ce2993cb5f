"""The `dynabatch` command line: help, bench plan (table, JSON, plot, bad input) and demo."""

import gzip
import json

import pytest

from dynabatch.cli import main
from dynabatch.core.plan.planner import METHODS

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
    import re
    import warnings

    from tokenization import ChatTemplateWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["demo", "--out", str(tmp_path)]) == 0
    # the demo states how its own conversations are rendered: no warning about its own data
    assert not [w for w in caught if issubclass(w.category, ChatTemplateWarning)], [str(w.message) for w in caught]
    out = capsys.readouterr().out
    assert "rank 0's micro-batches" in out
    # what the DataLoader delivered is exactly what the planner decided for rank 0
    assert out.count("delivered samples equal the plan's rank-0 micro-batches: True") == 2
    assert "=== vlm" in out and "448-px tiles" in out
    assert "the streamed micro-batches equal dynabatch's plan of these samples from their length index: True" in out
    # the vision part says why it plans for another device than the text parts
    assert re.search(r"planned for h200, not a100-80gb as above: .* \d+ GiB per stage .*a100-80gb's 80 GiB", out)
    # every part ends on one result line against its baseline, and dynabatch wins each
    parts = out.split("\n=== ")[1:]
    assert len(parts) == 3
    for part in parts:
        last = part.strip().splitlines()[-1]
        m = re.fullmatch(r"result \((gpt|t5|vlm)\): dynabatch \d+ ms per step vs packing \d+ ms on the same \d+ "
                         r"samples: ([0-9.]+)x faster", last)
        assert m and float(m.group(2)) > 1.0, last
    assert "objective" not in out and "sum/R" not in out  # the planner's own measure only with --verbose
    assert sorted(p.name for p in (tmp_path / "text").iterdir())[0] == "shard-000000.jsonl"
    assert any(p.suffix == ".tar" for p in (tmp_path / "image_text").iterdir())


# -- the planning flags: one helper for `dynabatch plan` and `dynabatch bench plan` ---------------


def _parsed(argv):
    from dynabatch.cli import build_parser

    return build_parser().parse_args(argv)


def test_plan_flags_build_plan_options_the_same_way_for_both_commands():
    from dynabatch import PlanOptions
    from dynabatch.option_flags import plan_options_from_args

    flags = ["--global-batch-size", "96", "--max-len", "1024", "--max-target-len", "128", "--stages", "2",
             "--ranks", "3", "--schedule", "gpipe", "--memory-limit", "16GiB", "--seed", "9", "--drop-last",
             "--max-caps", "12"]
    bench = plan_options_from_args(_parsed(["bench", "plan", *flags]), max_len=2048)
    offline = plan_options_from_args(_parsed(["plan", "x.parquet", "--out", "p.parquet", *flags,
                                              "--method", "pad", "--method-option", "rows=4"]))
    expected = PlanOptions(global_batch_size=96, max_len=1024, max_target_len=128, num_stages=2, num_ranks=3,
                           schedule="gpipe", memory_limit=16 * 2**30, seed=9, drop_last=True, max_caps=12)
    assert bench == expected
    assert offline == expected.replace(method="pad", method_options={"rows": 4})
    # defaults: 64k tokens, 8 ranks x 4 stages, the caller's max_len (bench plan: the model's), no
    # target truncation (PlanOptions' default, as the DataLoader's), and the last batch kept
    d = plan_options_from_args(_parsed(["plan", "x.parquet", "--out", "p.parquet"]), max_len=8192)
    assert (d.global_batch_tokens, d.global_batch_size, d.num_ranks, d.num_stages) == (65536, None, 8, 4)
    assert (d.max_len, d.max_target_len, d.method, d.drop_last, d.seed, d.memory_limit) == \
           (8192, None, "dp", False, 0, None)
    assert d.max_target_len is PlanOptions().max_target_len
    assert d.drop_last is PlanOptions().drop_last  # one default for the CLI and the DataLoader


def test_plan_flag_values_are_checked(capsys):
    from dynabatch.option_flags import parse_bytes, plan_options_from_args

    assert parse_bytes("17e9") == 17e9 and parse_bytes("800MB") == 8e8 and parse_bytes("2 KiB") == 2048
    for argv in (["--global-batch-tokens", "1", "--global-batch-size", "2"], ["--memory-limit", "lots"],
                 ["--schedule", "zigzag"], ["--method-option", "rows"]):
        with pytest.raises(SystemExit):
            _parsed(["plan", "x.parquet", "--out", "p.parquet", *argv])
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"--method kk takes --method-option max_tokens=\.\.\., not \['rows'\]"):
        plan_options_from_args(_parsed(["plan", "x", "--out", "p", "--method", "kk", "--method-option", "rows=2"]))


def test_keep_last_is_a_deprecated_no_op(capsys):
    from dynabatch.option_flags import plan_options_from_args

    with pytest.warns(DeprecationWarning, match="--keep-last is deprecated"):
        args = _parsed(["plan", "x.parquet", "--out", "p.parquet", "--keep-last"])
    assert "--keep-last is deprecated and does nothing" in capsys.readouterr().err
    assert plan_options_from_args(args).drop_last is False


@pytest.mark.parametrize("command", [["plan", "--help"], ["bench", "plan", "--help"]])
def test_plan_flags_help_teaches(capsys, command):
    with pytest.raises(SystemExit):
        main(command)
    out = capsys.readouterr().out
    for flag in ("--global-batch-tokens", "--global-batch-size", "--max-len", "--max-target-len", "--stages",
                 "--ranks", "--schedule", "--memory-limit", "--seed", "--drop-last", "16GiB", "seed K + e",
                 "gpipe,1f1b,adaptive", "dynabatch.PlanOptions"):
        assert flag in out, (command, flag)
    if command[0] == "plan":
        assert "--method-option KEY=VALUE" in out and "max_tokens=4096" in out


def test_bench_plan_config_holds_plan_options(capsys):
    from dynabatch import PlanOptions
    from dynabatch.bench.plan import PlanBenchConfig

    assert isinstance(PlanBenchConfig().options, PlanOptions)
    assert main(["bench", "plan", "--methods", "dp", "pad", "--global-batch-size", "300", "--ranks", "2",
                 "--stages", "2", "--schedule", "gpipe", "--memory-limit", "20GB", "--drop-last", "--json",
                 *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    cfg = doc["config"]
    assert (cfg["global_batch_size"], cfg["global_batch_tokens"], cfg["num_ranks"], cfg["num_stages"]) == \
           (300, None, 2, 2)
    assert (cfg["schedule"], cfg["memory_limit"], cfg["memory_limit_bytes"], cfg["drop_last"]) == \
           ("gpipe", 20e9, 20e9, True)
    assert cfg["samples"] == 3 * 300  # three full batches of 300 samples
    assert set(doc["methods"]) == {"dp", "pad"}
