"""dynabatch.DataLoader across real torch.distributed (gloo) processes on CPU: the streaming mode
with DataLoader workers on 4 ranks, a mid-epoch checkpoint, and the rest of the epoch on 2 ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import loaders
from dynabatch import DataLoader

from test_dataloader_data import PLAN, assert_exactly_once, uneven_jsonl
from dynabatch.loader.settings import records_from_keywords

STOP_STEP = 3


def _source(pattern):
    return loaders.JsonlSource(pattern, shuffle=True, shuffle_buffer=8, seed=7)


def _rank_main(rank, world, phase, tmp, pattern):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store{phase}", rank=rank, world_size=world)
    try:
        # rank and world size come from torch.distributed; the collective is a gloo all_reduce
        dl = DataLoader(_source(pattern),
                        **records_from_keywords(dict(global_batch_tokens=2000, num_workers=2, chunk_size=16, **PLAN)))
        assert (dl.rank, dl.world_size) == (rank, world) and dl.mode == "streaming"
        out = {"ids": [], "structure": []}
        if phase == 2:
            with open(os.path.join(tmp, "states.json")) as f:
                dl.load_state_dict(json.load(f))
        for b in dl.microbatches():
            out["ids"] += b["sample_ids"].tolist()
            out["structure"].append([b["step"], b["microbatch"], b["num_microbatches"]])
            if phase == 1 and b["step"] == STOP_STEP and b["microbatch"] == min(1, b["num_microbatches"] - 1):
                break
        if phase == 1:
            out["state"] = dl.state_dict()
        dl.close()
        with open(os.path.join(tmp, f"phase{phase}_rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world, phase, tmp, pattern):
    mp.start_processes(_rank_main, args=(world, phase, str(tmp), pattern), nprocs=world, join=True,
                       start_method="fork")
    out = []
    for r in range(world):
        with open(tmp / f"phase{phase}_rank{r}.json") as f:
            out.append(json.load(f))
    return out


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs the gloo backend")
def test_gloo_streaming_four_ranks_resume_on_two(tmp_path):
    pattern = uneven_jsonl(str(tmp_path))
    first = _run(4, 1, tmp_path, pattern)
    assert all(r["structure"] == first[0]["structure"] for r in first)  # same steps, same micro-batch counts
    assert first[0]["structure"][-1][0] == STOP_STEP
    with open(tmp_path / "states.json", "w") as f:
        json.dump([r["state"] for r in first], f)  # every rank's state: loadable on any world size
    second = _run(2, 2, tmp_path, pattern)
    assert second[0]["structure"] == second[1]["structure"]
    delivered = [i for r in first + second for i in r["ids"]]
    assert_exactly_once(delivered, [s["sample_id"] for s in loaders.open_source(pattern)])
