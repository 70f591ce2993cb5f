"""`dynabatch bench train --model hf-llama`: a tiny transformers Llama through `from_hf`, costed by a profile
of the model, ``dp`` refit per stage, ``pack`` as varlen rows. No timing assertions: the run's structure,
and that the Hugging Face model (not a tiny-model preset) was trained and costed."""

import json

import numpy as np
import pytest

from dynabatch import CostModel
from dynabatch.bench.train import TRAIN_METHODS
from dynabatch.bench.train_hf import hf_llama, load_costs, profile_costs, profile_lengths, setup
from dynabatch.bench.train_command import model_size_overrides
from dynabatch.bench.train_report import format_table
from dynabatch.datagen import write_text_shards

SIZES = dict(hidden=32, ffn=64, layers=2)  # 4 pipeline layers: embedding, 2 decoder layers, head


def _size_args():
    return [a for k, v in SIZES.items() for a in ("--size", f"{k}={v}")]


@pytest.mark.slow
def test_bench_train_hf_llama(tmp_path, run_cli):
    """(No wall clock: --timeout is the bench's liveness timeout.) The command runs in this process
    (`run_cli`); its ranks are still processes of their own."""
    paths = write_text_shards(tmp_path / "data", 300, seed=0)
    out = run_cli("bench", "train", "--model", "hf-llama", "--stages", "2", "--steps", "3", "--warmup", "1",
                  *_size_args(), "--global-batch-tokens", "2048", "--max-len", "128", "--data", *paths,
                  "--timeout", "300", "--json", "--progress", "--save-cost-model", tmp_path / "refit.json")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert "bench train (" not in out.stderr and "profiling" not in out.stderr  # --json: nothing extra
    assert res["status"] == "complete" and set(res["methods"]) == set(TRAIN_METHODS)
    cfg = res["config"]
    # the Hugging Face Llama was built: its parameter count, not a tiny model's
    model = hf_llama(**SIZES)
    assert type(model.hf_config).__name__ == "LlamaConfig" and len(model.layers) == 4
    assert cfg["model"] == "hf-llama" and cfg["parameters"] == sum(p.numel() for p in model.parameters())
    assert cfg["model_sizes"] == {"vocab": 512, "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 64}
    assert cfg["cost_source"].startswith("profiled") and cfg["profile_s"] > 0
    # dp's refit cost model is the Llama's (its class and grouped-query widths), refit per stage
    refit = CostModel.load(tmp_path / "refit.json")
    assert refit.model.name == "LlamaForCausalLM" and refit.model.hidden == 32 and refit.model.kv_dim == 16
    assert refit.stage_time_coef is not None and refit.stage_time_coef.shape[0] == 2
    per_step = {name: [r["real_tokens"] for r in m["per_step"]] for name, m in res["methods"].items()}
    assert len({tuple(v) for v in per_step.values()}) == 1, per_step  # the same global batches
    for name, m in res["methods"].items():
        assert m["steps"] == 3 and m["tokens_per_s"] > 0, name
        assert m["bounds"][0] == 0 and m["bounds"][-1] == 4 and len(m["bounds"]) == 3, name
        assert len(m["stage_mape_start"]) == 2 and len(m["stage_mape_end"]) == 2, name  # per-stage MAPE
        assert all(x >= 0 for x in m["stage_mape_end"]), name
    dp, pack = res["methods"]["dp"], res["methods"]["pack"]
    assert dp["feedback_mode"] == "per_stage" and dp["refits"] >= 1 and dp["plan_method"] == "dp"
    assert pack["plan_method"] == "pack_varlen" and pack["knobs"]["collation"] == "packed"
    assert pack["feedback_mode"] is None and pack["refits"] == 0
    table = format_table(res)
    assert table.startswith("bench train: hf-llama") and "per-stage MAPE start -> end" in table
    assert "dp vs pack:" in table


def test_profile_is_the_llamas_and_extrapolates(tmp_path):
    """The profile every method starts from times the Llama's layers; loaded back, the table
    extrapolates beyond its grid (a plan may ask for more rows than were timed)."""
    model = hf_llama(hidden=16, ffn=32, layers=2, heads=2, kv_heads=1)
    path = profile_costs(model, 2, 64, str(tmp_path / "p.json"))
    raw = CostModel.load(path)
    assert raw.model.name == "LlamaForCausalLM" and raw.table is not None and not raw.table.extrapolate
    assert list(raw.table.main_len) == [32, 64] and list(raw.table.rows) == [1, 4, 16]
    cost = load_costs(path)
    assert cost.table.extrapolate
    t, _ = cost.padded(64, 64)  # 64 rows: 4x the largest profiled row count
    assert np.isfinite(t) and t > cost.padded(16, 64)[0]


def test_profile_grid_and_method_mapping():
    assert profile_lengths(1024) == (32, 128, 512, 1024)
    assert profile_lengths(128) == (32, 128) and profile_lengths(32) == (32,) and profile_lengths(100) == (32, 100)
    assert setup("pack") == {"plan_method": "pack_varlen", "feedback": {}, "feedback_mode": None}
    assert setup("dp")["feedback"] == {"stage_reduce": "per_stage"}
    assert setup("token_budget")["plan_method"] == "token_budget"
    assert model_size_overrides("hf-llama", ["kv_heads=1", "ffn=96"]) == {"kv_heads": 1, "ffn": 96}
    with pytest.raises(ValueError, match="kv_heads"):
        model_size_overrides("hf-llama", ["vision_layers=2"])


def test_cost_model_option_errors(tmp_path, capsys):
    """``--cost-model``: a missing file names itself and how to make one; another model refuses it."""
    from dynabatch.cli import main

    missing = tmp_path / "nope.json"
    assert main(["bench", "train", "--model", "hf-llama", "--cost-model", str(missing), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert str(missing) in err and "dynabatch profile --model hf:" in err
    assert main(["bench", "train", "--model", "gpt-tiny", "--cost-model", str(missing), "--steps", "1"]) == 1
    assert "hf-llama" in capsys.readouterr().err
