"""`dynabatch bench train` on tiny generated data: JSON schema, every method, same real tokens.

Each completed run goes through the console script's own entry point in this process (the `run_cli`
fixture, conftest.py); its ranks are still separate processes (`launch_local`, forked from this process's
fork server, shared by every run here). The SIGTERM test keeps a bench process of its own: its point is a
signal to that process and its session.
"""

import json
import sys

import numpy as np
import pytest
from liveness import tiny_models_env

from dynabatch import CostModel
from dynabatch.bench.train import TRAIN_METHODS
from dynabatch.datagen import write_text_shards
from dynabatch.pipeline import batch_shapes, make_model, stage_cost_model
from dynabatch.pipeline.measure import representative


@pytest.mark.slow
def test_bench_train_json(tmp_path, run_cli):
    """(No wall clock: --timeout is the bench's liveness timeout.) 2048-token global batches under caps
    of 256 tokens keep each step cheap (the default caps spend the run in attention; 4096/512 cost
    twice the ranks' CPU for the same checks): dp plans 1-2 micro-batches a step, pack 3, so the methods
    still group each global batch differently, and 4 steps give dp two refits to move its cost model."""
    paths = write_text_shards(tmp_path / "data", 300, seed=0)
    out = run_cli("bench", "train", "--model", "t5-tiny", "--stages", "2", "--steps", "4", "--warmup", "1", "--hidden", "64",
                      "--global-batch-tokens", "2048", "--max-len", "256", "--data", *paths, "--timeout", "60",
                      "--json", "--save-cost-model", tmp_path / "refit.json", "--out", tmp_path / "result.json",
                      "--progress")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert "bench train (" not in out.stderr  # --json: no bar even with --progress
    assert res["partial"] is False and res["status"] == "complete" and res["stopped_by"] is None
    assert json.loads((tmp_path / "result.json").read_text()) == res  # --out holds the same document
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


@pytest.mark.slow
def test_bench_train_runs_the_adaptive_schedule(tmp_path, run_cli):
    """--schedule adaptive: the planner orders and simulates the memory-bounded order the runner runs."""
    paths = write_text_shards(tmp_path / "data", 120, seed=1)
    out = run_cli("bench", "train", "--model", "gpt-tiny", "--steps", "3", "--warmup", "1", "--hidden", "32",
                      "--global-batch-tokens", "2048", "--max-len", "512", "--schedule", "adaptive", "--methods", "dp",
                      "pack", "--data", *paths, "--timeout", "60", "--progress", "--out", tmp_path / "adaptive.json")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "adaptive.json").read_text())
    # --progress: a bar of the 3 steps (each: both methods) on stderr, the table on stdout
    assert "bench train (gpt-tiny, 2 methods)" in out.stderr and "3/3" in out.stderr and "dp" in out.stdout
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


@pytest.mark.slow
def test_bench_train_stopped_by_sigterm_leaves_a_partial_json(tmp_path):
    """A run asked for far more steps than it gets: SIGTERM after a few rounds still prints (--json)
    and writes (--out) the per-method results of the steps done, marked partial; the ranks are gone.
    A bench process of its own (the signal goes to it; its session is checked). ``--partition uniform``:
    the stop does not depend on the split, and searching it profiled every layer for each method."""
    import os
    import signal
    import subprocess
    import time

    paths = write_text_shards(tmp_path / "data", 1000, seed=2)
    out_file = tmp_path / "result.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynabatch.cli", "bench", "train", "--model", "gpt-tiny", "--steps", "100000",
         "--warmup", "1", "--hidden", "32", "--global-batch-tokens", "2048", "--max-len", "512", "--methods", "dp",
         "pack", "--partition", "uniform", "--data", *map(str, paths), "--timeout", "60", "--json", "--out",
         str(out_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=tiny_models_env())
    try:
        # --out is rewritten after a round, once a second (partial, "running"): wait for two rounds, with a
        # liveness check of our own (the file must keep changing, the process must keep running)
        last_change, seen, running = time.monotonic(), None, None
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            stat = out_file.stat().st_mtime_ns if out_file.exists() else None
            if stat != seen:
                seen, last_change = stat, time.monotonic()
                try:
                    running = json.loads(out_file.read_text())
                except (OSError, ValueError):
                    running = None
                if running and min(running["steps_done"].values()) >= 2:
                    break
            assert time.monotonic() - last_change < 180, "bench train made no progress for 180 s"
            time.sleep(0.2)
        assert running["partial"] is True and running["status"] == "running"
        os.kill(proc.pid, signal.SIGTERM)  # the bench process only, as `kill PID` would
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "stopped by SIGTERM" in stderr and "steps done: dp" in stderr
    res = json.loads(stdout)
    assert res["partial"] is True and res["status"] == "stopped" and res["stopped_by"] == "stopped by SIGTERM"
    assert json.loads(out_file.read_text()) == res
    assert set(res["methods"]) == {"dp", "pack"} and res["config"]["steps"] == 100000
    for name, m in res["methods"].items():
        assert 2 <= m["steps"] == res["steps_done"][name] == len(m["per_step"]) < 100000
        assert m["tokens_per_s"] > 0 and m["mape_start"] >= 0
    # interleaved rounds: the methods are at most one step apart, on the same global batches
    n = min(m["steps"] for m in res["methods"].values())
    assert max(m["steps"] for m in res["methods"].values()) <= n + 1
    assert [r["real_tokens"] for r in res["methods"]["dp"]["per_step"][:n]] == \
        [r["real_tokens"] for r in res["methods"]["pack"]["per_step"][:n]]
    # no rank outlived the stop (they are in the bench process's session; the fork server they came from
    # leaves once it sees its launcher gone): wait for that, under a liveness bound, not a fixed sleep
    gone_by = time.monotonic() + 60
    while _session_members(proc.pid) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert _session_members(proc.pid) == []


def _session_members(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``, from /proc (Linux; [] elsewhere)."""
    import os

    found = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:
                found.append(int(d))
    return found


def test_bench_train_liveness_timeout_reports_the_partial_result(tmp_path, monkeypatch):
    """When the ranks stop making progress, launch_local kills them (timed_out, "idle"): the
    command still hands back what rank 0 wrote after its last round, marked partial."""
    import dynabatch.pipeline as pipeline
    from dynabatch.bench import train
    from dynabatch.pipeline.runtime.launch import ProcResult

    seen = {}

    def stalled_launch(target, nprocs, *, args, idle_timeout_s, max_wall_s, threads_per_proc, env=None):
        (payload,) = args
        seen.update(idle=idle_timeout_s, max_wall=max_wall_s)
        row = {"steps": 3, "tokens_per_s": 1000.0, "per_step": [{"step": k} for k in range(3)]}
        train.write_json(payload["_partial"], train.assemble_result(payload["_config"], {"dp": row}, status="running"))
        return [ProcResult(r, None, "", f"rank {r} silent", 40.0, True, None, "idle") for r in range(nprocs)]

    monkeypatch.setattr(pipeline, "launch_local", stalled_launch)
    cfg = train.TrainBenchConfig(model="gpt-tiny", data=tuple(map(str, write_text_shards(tmp_path / "d", 60, seed=3))),
                                 steps=50, methods=("dp", "pack"), timeout_s=40.0, model_sizes={"hidden": 32})
    out = tmp_path / "partial.json"
    with pytest.raises(train.TrainBenchStopped) as e:
        train.run_train_bench(cfg, out=str(out))
    assert seen == {"idle": 40.0, "max_wall": None}
    res = e.value.result
    assert e.value.exit_code == 1 and "liveness timeout: no rank made progress for 40 s" in str(e.value)
    assert "rank 1 silent" in str(e.value)
    assert res["partial"] is True and res["status"] == "stopped" and res["stopped_by"].startswith("liveness timeout")
    assert res["steps_done"] == {"dp": 3, "pack": 0} and res["methods"]["dp"]["steps"] == 3
    assert json.loads(out.read_text()) == res
    assert train.format_table({**res, "methods": {}}).startswith("PARTIAL RESULT (liveness timeout")


# -- vlm-tiny: image+text and text-only records, stage-aware dp vs stage-blind dp vs pack/token_budget -------

@pytest.mark.slow
def test_bench_train_vlm_tiny_json(tmp_path, run_cli):
    """A tiny vlm-tiny run on generated image+text and text records (no shared data): every method, the
    per-stage MAPE fields, the modality split, the same samples per method step by step."""
    from dynabatch.bench.train_vlm import VLM_METHODS, build_vlm_data

    (data,) = build_vlm_data(str(tmp_path), 48, text_fraction=0.5, seed=0, use_shared=False)
    out = run_cli("bench", "train", "--model", "vlm-tiny", "--stages", "2", "--steps", "3", "--warmup", "1",
                      "--global-batch-tokens", "2048", "--max-len", "512", "--refit-every", "1", "--data", data,
                      "--timeout", "90", "--json")
    rows = [json.loads(line) for line in open(data)]
    assert sum(bool(r.get("image")) for r in rows) == 24 and len(rows) == 48
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    assert res["status"] == "complete" and res["config"]["partition"] == "modality"
    assert set(res["methods"]) == set(VLM_METHODS) == {"dp", "dp-blind", "pack", "token_budget"}
    for name, m in res["methods"].items():
        assert m["steps"] == 3 and m["tokens_per_s"] > 0, name
        assert m["bounds"] == [0, 6, 10]  # patch embedding, 4 ViT blocks, projector | merge, 2 GPT blocks, head
        for key in ("stage_mape_start", "stage_mape_end", "stage_mape_all", "stage_step_mape_start",
                    "stage_step_mape_end"):
            assert len(m[key]) == 2 and all(v >= 0 for v in m[key]), (name, key)
    dp, blind = res["methods"]["dp"], res["methods"]["dp-blind"]
    assert dp["stage_aware"] and not blind["stage_aware"] and dp["refits"] >= 1
    # vlm-tiny's default: text-only micro-batches bypass the vision stage (no op there, no observation)
    assert res["config"]["bypass_idle_stages"] is True
    # stage 0 (vision) never ran exactly the timed micro-batches without vision tiles; stage 1 ran all. Which
    # micro-batches are text-only is the plan's (dp's follows its refits of measured times), so the share is
    # checked against each run's own micro-batches, and the data must give some text-only ones
    text_only = 0
    for name, m in res["methods"].items():
        timed = m["per_step"][m["warmup_steps"]:]
        share = sum(r["text_only_microbatches"] for r in timed) / sum(r["microbatches"] for r in timed)
        assert m["stage_bypassed_share"][0] == pytest.approx(share, abs=1e-12), name
        assert m["stage_bypassed_share"][1] == 0, name
        text_only += sum(r["text_only_microbatches"] for r in timed)
    assert text_only > 0
    assert dp["feedback_mode"] in ("per_stage", "max") and blind["feedback_mode"] == "max"
    assert res["methods"]["pack"]["knobs"]["collation"] == "packed_rows"
    # every method saw the same samples, step by step
    seen = {name: [r["sample_ids"] for r in m["per_step"]] for name, m in res["methods"].items()}
    assert all(v == seen["dp"] for v in seen.values()) and all(seen["dp"])
    assert {"dp_vs_dp_blind", "dp_vs_pack", "dp_vs_token_budget"} <= set(res["ratios"])


def test_vlm_stage_layout_follows_the_runners_split():
    """modality_bounds puts the vision layers on stage 0; layout_of reads the ViT and GPT blocks per stage."""
    from dynabatch.bench.train_vlm import VLM_SIZES, layout_of, modality_bounds

    model = make_model("vlm-tiny", **{**VLM_SIZES, "hidden": 32, "vision_hidden": 16})
    assert modality_bounds(model, 2) == [0, 6, 10] and modality_bounds(model, 3) == [0, 6, 8, 10]
    lay = layout_of(model, [0, 6, 10])
    assert lay.vision_layers == (4.0, 0.0) and lay.main_layers == (0.0, 2.0)
    cost = stage_cost_model(model, 2, "cpu").set_layout(lay)
    phi = cost.padded_features([4, 4], [64, 64], [0, 0], [0, 3])
    st = cost.stage_times(phi)
    assert st[0, 1] > st[0, 0] and st[1, 0] > st[0, 0]  # tiles cost on stage 0 only; text on stage 1


def test_packed_rows_become_one_sequence_per_row():
    """pack's rows reach vlm-tiny as one sequence per row: the row's tiles summed, position_ids dropped."""
    import torch

    from dynabatch.bench.train_vlm import rows_as_sequences

    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]])
    mb = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
          "position_ids": pos, "image_tiles": torch.tensor([2, 0, 1, 3])}
    (out,) = rows_as_sequences([mb])
    assert "position_ids" not in out and out["image_tiles"].tolist() == [2, 4]
    assert rows_as_sequences([{"input_ids": 1}]) == [{"input_ids": 1}]


def test_bench_train_compares_recompute_policies(tmp_path, run_cli):
    """--device-memory-limit: dp+none, dp+full and dp+adaptive at a level below the peak without
    recomputation; the measured bytes of full and adaptive stay within the limit, none's do not, and
    every variant trains the same real tokens."""
    paths = write_text_shards(tmp_path / "data", 160, seed=2)
    out = run_cli("bench", "train", "--model", "gpt-tiny", "--steps", "3", "--warmup", "1", "--hidden", "32",
                      "--global-batch-tokens", "4096", "--max-len", "512", "--device-memory-limit", "0.5x", "--data",
                      *paths, "--timeout", "60", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    (level,) = doc["levels"]
    limit = level["device_memory_limit"]
    assert limit == pytest.approx(0.5 * doc["predicted_peak_without_recompute_bytes"])
    m = level["methods"]
    assert set(m) == {"dp+none", "dp+full", "dp+adaptive"}
    assert len({v["real_tokens"] for v in m.values()}) == 1
    for name in ("dp+full", "dp+adaptive"):
        mem = m[name]["memory"]
        assert mem["fits_measured"] and mem["fits_planned"] and max(mem["measured_peak_bytes"]) <= limit, name
        assert mem["measured_over_planned"] <= 1.0 + 1e-9
    assert not m["dp+none"]["memory"]["fits_measured"]
    assert m["dp+full"]["memory"]["mean_recompute_layers"] == [2.0, 2.0]  # gpt-tiny: 4 blocks, 2 per stage
    assert sum(m["dp+adaptive"]["memory"]["mean_recompute_layers"]) < 4.0
    assert m["dp+full"]["step_time_vs_full"] == pytest.approx(1.0)


def test_bench_train_flush_free_variants(tmp_path, run_cli):
    """--flush-free: dp/sync against the three flush-free streams; the same global batches and real
    tokens, every variant trains, the weight memory is reported (stash and predict hold copies). Two
    windows of 3 steps, 2 micro-batches a step (4096-token batches, 512-token caps). ``--partition
    uniform``: the split is not what this test is about (test_bench_train_json checks the searched one),
    and searching it profiled every layer once per variant, half the ranks' CPU."""
    paths = write_text_shards(tmp_path / "data", 160, seed=4)
    out = run_cli("bench", "train", "--model", "gpt-tiny", "--steps", "6", "--warmup", "1", "--hidden", "32",
                      "--global-batch-tokens", "4096", "--max-len", "512", "--flush-free", "--flush-window", "3",
                      "--partition", "uniform", "--data", *paths, "--timeout", "60", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    m = res["methods"]
    assert set(m) == {"dp/sync", "dp/stale", "dp/stash", "dp/predict"}
    per_step = {name: [r["real_tokens"] for r in v["per_step"]] for name, v in m.items()}
    assert len({tuple(v) for v in per_step.values()}) == 1 and all(v["steps"] == 6 for v in m.values())
    # the first step of a stream runs with the initial weights everywhere: the same loss as sync
    first = {name: v["per_step"][0]["loss"] for name, v in m.items()}
    assert max(first.values()) - min(first.values()) < 1e-5
    assert m["dp/sync"]["weight_extra_bytes"] == 0 and m["dp/stale"]["weight_extra_bytes"] == 0
    assert m["dp/stash"]["weight_extra_bytes"] > 0 and m["dp/predict"]["weight_extra_bytes"] > 0
    from dynabatch.bench.train_flushfree import summarize

    conv = summarize(m)
    assert all(abs(c["mean_vs_sync"] - 1) < 0.05 for c in conv.values())


def test_flush_free_plans_keep_the_cuts_and_record_the_steady_state():
    from dynabatch import Shapes, plan_microbatches
    from dynabatch.core.simulate.flushfree import flushfree_report

    rng = np.random.default_rng(0)
    shapes = Shapes.from_lengths(rng.integers(64, 2000, 300))
    cost = CostModel.preset("gpt", num_stages=4)
    flushed = plan_microbatches(shapes, cost, num_stages=4, num_ranks=4)
    free = plan_microbatches(shapes, cost, num_stages=4, num_ranks=4, flush=False)
    assert np.array_equal(flushed.sample_ids, free.sample_ids) and free.options["flush"] is False
    ss = free.options["flushfree_step_s"]
    assert ss == pytest.approx(flushfree_report([flushed], cost).flushfree_s[0]) and ss < flushed.iteration_time_s
