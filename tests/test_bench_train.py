"""`dynabatch bench train` on tiny generated data: JSON schema, every method, same real tokens."""

import json
import subprocess
import sys
import time

import numpy as np

from dynabatch import CostModel
from dynabatch.bench.train import TRAIN_METHODS
from dynabatch.datagen import write_text_shards
from dynabatch.pipeline import batch_shapes, make_model, representative, stage_cost_model


def test_bench_train_json(tmp_path):
    paths = write_text_shards(tmp_path / "data", 300, seed=0)
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli", "bench", "train", "--model", "t5-tiny", "--stages", "2",
         "--steps", "4", "--warmup", "1", "--hidden", "64", "--global-batch-tokens", "4096",
         "--data", *map(str, paths), "--timeout", "50", "--json", "--save-cost-model", str(tmp_path / "refit.json")],
        capture_output=True, text=True, timeout=58)
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    res = json.loads(out.stdout)
    assert set(res) >= {"config", "methods"}
    assert res["config"]["model"] == "t5-tiny" and res["config"]["options"]["num_stages"] == 2
    assert set(res["methods"]) == set(TRAIN_METHODS)
    for name, m in res["methods"].items():
        assert {"tokens_per_s", "steps", "mape_start", "mape_end", "warmup_steps", "real_tokens"} <= set(m), name
        assert m["tokens_per_s"] > 0 and m["steps"] == 4 and m["warmup_steps"] == 1
        assert m["mape_start"] >= 0 and m["mape_end"] >= 0
    # the same global batches: every method processed the same real tokens, step by step
    per_step = {name: [r["real_tokens"] for r in m["per_step"]] for name, m in res["methods"].items()}
    assert len({tuple(v) for v in per_step.values()}) == 1, per_step
    assert len({m["real_tokens"] for m in res["methods"].values()}) == 1
    assert res["methods"]["dp"]["refits"] >= 1
    # the stage split was searched, and is the same kind of split every method reports
    assert all(m["bounds"][0] == 0 and m["bounds"][-1] == 6 and len(m["bounds"]) == 3 for m in res["methods"].values())
    assert res["config"]["partition"] == "searched"
    # dp's refit cost model is a file a user keeps: it loads back, moved away from the cpu preset
    refit = CostModel.load(tmp_path / "refit.json")
    prior = stage_cost_model(make_model("t5-tiny", hidden=64), 2, "cpu")
    assert refit.model == prior.model
    assert not np.allclose(refit.time_coef, prior.time_coef, rtol=0.05)
    assert res["methods"]["dp"]["cost_model_path"] == str(tmp_path / "refit.json")


def test_batch_shapes_carry_the_plans_time_and_memory():
    """The adaptive order limits in-flight activation bytes by each micro-batch's planned bytes."""
    import torch

    mb = {"input_ids": torch.zeros(3, 40, dtype=torch.long), "decoder_input_ids": torch.zeros(3, 7, dtype=torch.long),
          "predicted_time_s": 0.25, "predicted_memory_bytes": 1.5e6}
    (shape,) = batch_shapes([mb], "padded")
    assert (shape.rows, shape.input_len, shape.target_len) == (3, 40, 7)
    assert shape.time_s == 0.25 and shape.memory_bytes == 1.5e6


def test_bench_train_runs_the_adaptive_schedule(tmp_path):
    """--schedule adaptive: the planner simulates 1f1b, the runner uses the memory-bounded order."""
    paths = write_text_shards(tmp_path / "data", 120, seed=1)
    out = subprocess.run(
        [sys.executable, "-m", "dynabatch.cli", "bench", "train", "--model", "gpt-tiny", "--steps", "3",
         "--warmup", "1", "--hidden", "32", "--global-batch-tokens", "2048", "--schedule", "adaptive",
         "--methods", "dp", "pack", "--data", *map(str, paths), "--timeout", "50", "--json"],
        capture_output=True, text=True, timeout=58)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["config"]["options"]["schedule"] == "adaptive" and set(res["methods"]) == {"dp", "pack"}
    assert all(m["steps"] == 3 and m["tokens_per_s"] > 0 for m in res["methods"].values())


def test_public_microbatch_helpers():
    """batch_shapes infers the collation; representative spreads over predicted time; stage_cost_model
    divides the layers by the stages."""
    import torch

    packed = {"input_ids": torch.zeros(1, 30, dtype=torch.long), "cu_seqlens": torch.tensor([0, 10, 30]),
              "max_seqlen": 20, "predicted_time_s": 0.1}
    (shape,) = batch_shapes([packed])
    assert shape.packed and (shape.rows, shape.input_len, shape.tokens) == (2, 20, 30)
    mbs = [{"predicted_time_s": t} for t in (5.0, 1.0, 3.0, 2.0, 4.0)]
    assert [b["predicted_time_s"] for b in representative(mbs, 3)] == [1.0, 3.0, 5.0]
    assert representative([], 4) == []
    model = make_model("t5-tiny", hidden=64)
    one = stage_cost_model(model, 2, "cpu")
    assert one.model.layers == model.config.layers / 2 and one.model.decoder_layers == model.config.decoder_layers / 2
