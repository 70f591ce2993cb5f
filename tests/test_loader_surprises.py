"""What used to pass silently now says so (issue 25 point 4): each case is a clear error or a
one-line warning, in the DataLoader and in the offline commands alike."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dataloader_data import PLAN, records, write_jsonl  # noqa: E402

from dynabatch import DataLoader  # noqa: E402
from dynabatch.cli import main  # noqa: E402
from dynabatch import Costing, PlanOptions, Tokenization
from dynabatch.loader.settings import records_from_keywords


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("surprises")
    recs = records(40, seed=2)
    empty = d / "empty.jsonl"
    empty.write_text("")
    return {"jsonl": write_jsonl(d / "train.jsonl", recs), "empty": str(empty), "dir": d}


def test_a_global_batch_smaller_than_a_sample_is_warned_about(data, tmp_path, capsys):
    with pytest.warns(UserWarning, match=r"global_batch_tokens=8 is smaller than \d+ of 40 samples"):
        dl = DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=8, mode="indexed", **PLAN)))
    assert len(dl) == 40  # one sample per step: what the warning says
    out = tmp_path / "plan.parquet"
    assert main(["plan", data["jsonl"], "--out", str(out), "--model", "gpt-tiny", "--device", "cpu", "--ranks", "1",
                 "--stages", "1", "--global-batch-tokens", "8", "--workers", "1", "--no-progress", "--json"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning" in line]
    assert len(lines) == 1 and lines[0].startswith("dynabatch: warning: global_batch_tokens=8 is smaller than"), err


def test_plan_refuses_to_write_a_plan_for_fewer_ranks_than_asked(data, tmp_path, capsys):
    out = tmp_path / "plan.parquet"
    rc = main(["plan", data["jsonl"], "--out", str(out), "--model", "gpt-tiny", "--device", "cpu", "--ranks", "8",
               "--stages", "2", "--global-batch-tokens", "100", "--workers", "1", "--no-progress", "--json"])
    err = capsys.readouterr().err
    assert rc == 1 and not out.exists()
    assert "fewer than the 8 ranks asked for" in err and "raise --global-batch-tokens" in err, err


def test_image_text_records_without_a_vision_policy_are_warned_about(tmp_path):
    from dynabatch.datagen import write_image_text_shards

    write_image_text_shards(tmp_path / "vl", 6, num_shards=1, seed=1)
    with pytest.warns(UserWarning, match="carry images .* no vision policy: the images are dropped"):
        DataLoader(str(tmp_path / "vl"), options=PlanOptions(global_batch_tokens=4000),
                   costing=Costing(cost_model="gpt-tiny", device="cpu"))
    with warnings.catch_warnings():  # with a vision policy: nothing to say
        warnings.simplefilter("error", UserWarning)
        from tokenization import DynamicTiling

        DataLoader(str(tmp_path / "vl"), options=PlanOptions(global_batch_tokens=4000),
                   tokenization=Tokenization(vision=DynamicTiling()),
                   costing=Costing(cost_model="gpt-tiny", device="cpu"))


@pytest.mark.parametrize("mode", ["indexed", "streaming"])
def test_world_size_without_rank_is_refused_the_same_way_in_every_mode(data, mode):
    with pytest.raises(ValueError, match=r"world_size=2 without rank=: say which rank this process is \(rank=0..1\)"):
        DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=500, world_size=2, mode=mode, **PLAN)))
    with pytest.raises(ValueError, match=r"rank=2 is not a rank of world_size=2"):
        DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=500, world_size=2, rank=2, mode=mode,
                                                          **PLAN)))


def test_empty_data_is_an_error_in_the_indexed_mode_and_a_warning_when_streamed(data):
    with pytest.raises(ValueError, match="holds no samples"):
        DataLoader(data["empty"], **records_from_keywords(dict(global_batch_tokens=500, mode="indexed", **PLAN)))
    dl = DataLoader(data["empty"], **records_from_keywords(dict(global_batch_tokens=500, mode="streaming", **PLAN)))
    with pytest.warns(UserWarning, match="epoch 0 of the streaming mode gave no step: the data holds no samples"):
        assert list(dl) == []


def test_drop_last_with_less_than_one_global_batch_is_an_error(data):
    with pytest.raises(ValueError, match="less than one full global batch .* drop_last=True"):
        DataLoader(data["jsonl"], **records_from_keywords(dict(global_batch_tokens=10**7, drop_last=True, mode="indexed",
                                                          **PLAN)))


def test_scan_of_empty_data_fails(data, tmp_path, capsys):
    out = tmp_path / "index.parquet"
    assert main(["scan", data["empty"], "--out", str(out), "--workers", "1", "--no-progress"]) == 1
    assert "holds no samples" in capsys.readouterr().err and not out.exists()


def test_missing_text_fields_name_the_mapping_fix(tmp_path):
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a question", "response": "an answer"}) + "\n" for _ in range(3)))
    with pytest.raises(Exception, match=r"missing field 'instruction'.*fields \['prompt', 'response'\].*mapping="):
        list(DataLoader(str(path), **records_from_keywords(dict(global_batch_tokens=500, **PLAN))))
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(Exception, match=r"no text fields.*fields \['answer', 'question'\].*mapping="):
        list(DataLoader(str(path), **records_from_keywords(dict(global_batch_tokens=500, **PLAN))))
    # and the fix it names works
    dl = DataLoader(str(path), **records_from_keywords(dict(global_batch_tokens=500,
                                                       source_options={"mapping": {"inputs": "question",
                                                                                "targets": "answer"}},
                                                       **PLAN)))
    assert sum(len(step) for step in dl) == 1
