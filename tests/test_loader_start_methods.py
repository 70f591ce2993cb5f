"""DataLoader workers under every multiprocessing start method (issue 25 point 3).

Each mode (indexed over Parquet and over a ``datasets.Dataset``, replay of a plan file, streaming
over JSON lines) runs with one worker under ``fork``, ``spawn`` and ``forkserver``
(``multiprocessing_context=``), stops in the middle of a step, saves its state, and a new loader
with a worker under the same start method resumes it: what the two deliver, in order, equals an
uninterrupted run without workers (or, for streaming, whose order depends on the worker layout,
with one forked worker). Under spawn and forkserver the workers get the loader's objects pickled
(``TypeError: cannot pickle 'mappingproxy' object`` before); a forkserver worker is a child of
the fork server, so the check that its parent lives must not read ``os.getppid()`` (before, every
streaming worker killed itself at once: "DataLoader worker ... exited unexpectedly").

Small on purpose: 60 samples, 1 worker. A start of a spawned worker imports torch (seconds).
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dataloader_data import PLAN, records, write_jsonl, write_parquet  # noqa: E402

from dynabatch import DataLoader, PlanOptions  # noqa: E402
from dynabatch.loader.settings import records_from_keywords

TOKENS = 1200
METHODS = [m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()]
LIVENESS_S = 120  # torch's timeout=: a worker silent this long fails the test instead of hanging it


@pytest.fixture(scope="module", autouse=True)
def _forkserver_preload():
    """`multiprocessing`'s fork server, when this module starts it, imports torch and dynabatch once
    instead of every forkserver worker importing them itself (seconds each). A worker still gets the
    loader's objects pickled and is still a child of the server, not of the loader's process."""
    from multiprocessing import forkserver

    before = list(forkserver._forkserver._preload_modules)
    multiprocessing.set_forkserver_preload([*before, "torch", "dynabatch"])
    yield
    multiprocessing.set_forkserver_preload(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dynabatch.core.cost import CostModel
    from dynabatch.offline import RunPlanConfig, plan_run, read_index, scan_dataset
    from dynabatch.offline.scan import ScanConfig

    d = tmp_path_factory.mktemp("start_methods")
    recs = records(60, seed=11)
    parquet = write_parquet(d / "train.parquet", recs, row_group_size=16)
    jsonl = write_jsonl(d / "train.jsonl", recs)
    scan_dataset([parquet], ScanConfig(), workers=1, progress=False).write(d / "index.parquet")
    cfg = RunPlanConfig(PlanOptions(num_stages=2, global_batch_tokens=TOKENS, seed=3), epochs=1)
    run = plan_run(read_index([str(d / "index.parquet")]), CostModel.preset("gpt", "cpu", num_stages=2), cfg,
                   workers=1, progress=False)
    run.write(d / "plan.parquet")
    return {"parquet": parquet, "jsonl": jsonl, "plan": str(d / "plan.parquet"), "records": recs}


def _loader(data, mode: str, **kw):
    if mode == "indexed":
        return DataLoader(data["parquet"], **records_from_keywords(dict(global_batch_tokens=TOKENS, seed=3, **PLAN, **kw)))
    if mode == "dataset":
        import datasets

        return DataLoader(datasets.Dataset.from_list(data["records"]),
                          **records_from_keywords(dict(global_batch_tokens=TOKENS, seed=3, **PLAN, **kw)))
    if mode == "replay":
        return DataLoader(data["parquet"],
                          **records_from_keywords(dict(plan=data["plan"], cost_model="gpt", device="cpu", **kw)))
    return DataLoader(data["jsonl"],
                      **records_from_keywords(dict(mode="streaming", global_batch_tokens=TOKENS, chunk_size=8, **PLAN,
                                              **kw)))


def _ids(batches) -> list[list[int]]:
    return [b["sample_ids"].tolist() for b in batches]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["indexed", "dataset", "replay", "streaming"])
def test_workers_run_and_resume_under_every_start_method(data, mode, method):
    if mode == "dataset" and method != "spawn":
        pytest.skip("a datasets.Dataset pickled for a worker: spawn shows it (forkserver pickles the same way)")
    ref_kw = dict(num_workers=1, multiprocessing_context="fork") if mode == "streaming" else {}
    reference = _ids(_loader(data, mode, **ref_kw).microbatches())
    assert len(reference) >= 4, "the data should give several micro-batches"

    first = _loader(data, mode, num_workers=1, multiprocessing_context=method, timeout=LIVENESS_S)
    it = first.microbatches()
    cut = len(reference) // 2
    head = _ids(next(it) for _ in range(cut))
    state = first.state_dict()
    it.close()
    first.close()

    second = _loader(data, mode, num_workers=1, multiprocessing_context=multiprocessing.get_context(method),
                     timeout=LIVENESS_S)
    second.load_state_dict(state)
    tail = _ids(second.microbatches())
    second.close()
    assert head + tail == reference, f"{mode} under {method}: the resumed run differs from the uninterrupted one"
