"""One default per option (issue 25 point 5): ``dynabatch plan`` and the `DataLoader` take every
planning option's default from `PlanOptions` (no truncation unless ``max_len``/``max_target_len``
are given), so the offline plan and the online loader form the same micro-batches from the same
stated options; where the command's defaults must differ (the cost model's device, the world
layout, the global batch), its summary and the plan file say so."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynabatch import DataLoader
from dynabatch.cli import main
from dynabatch.offline import load_run_plan
from dynabatch import Costing, PlanOptions

TOKENS = 12000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Encoder-decoder records whose inputs pass 2048 and targets pass 512 bytes (the command's old
    truncation defaults), so any hidden truncation changes the micro-batches."""
    rng = np.random.default_rng(4)
    recs = [{"inputs": "q" * int(rng.integers(50, 3000)), "targets": "a" * int(rng.integers(20, 1200))}
            for _ in range(48)]
    path = tmp_path_factory.mktemp("defaults") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(recs), str(path))
    return str(path)


def _plan(data, out, *flags):
    rc = main(["plan", data, "--out", str(out), "--model", "t5-tiny", "--tokenizer", "bytes", "--workers", "1",
               "--no-progress", *flags])
    assert rc == 0
    return load_run_plan(out)


def test_offline_plan_equals_the_online_loader_for_the_same_stated_options(data, tmp_path, capsys):
    run = _plan(data, tmp_path / "plan.parquet", "--device", "cpu", "--ranks", "1", "--stages", "1",
                "--global-batch-tokens", str(TOKENS))
    assert run.options.max_len is None and run.options.max_target_len is None
    online = DataLoader(data, options=PlanOptions(global_batch_tokens=TOKENS),
                        costing=Costing(cost_model="t5-tiny", device="cpu"))
    assert (online.max_len, online.max_target_len) == (None, None)
    got = [b["sample_ids"].tolist() for b in online.microbatches() if not b["is_padding"]]
    want = [mb.sample_ids.tolist() for k in range(run.num_steps) for mb in run.step(k).microbatches(0)]
    assert got == want
    assert "differ from the DataLoader's" not in capsys.readouterr().out  # every default stated: none differ


def test_defaults_that_differ_from_the_loaders_are_stated(data, tmp_path, capsys):
    run = _plan(data, tmp_path / "plan.parquet", "--json")
    summary = json.loads(capsys.readouterr().out)
    differ = summary["loader_default_differences"]
    assert sorted(differ) == ["device", "global_batch_tokens", "num_ranks", "num_stages"]  # not the stated model
    assert differ["device"].startswith("'a100-80gb' (DataLoader: 'auto'")
    assert run.option("loader_default_differences") == differ
    _plan(data, tmp_path / "plan2.parquet", "--device", "h100", "--ranks", "2")
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "differ from the DataLoader's" in line)
    assert "num_stages=4 (DataLoader: 1)" in line and "device=" not in line and "num_ranks=" not in line
