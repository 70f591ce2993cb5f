"""Online equals offline: for the same data and the same `PlanOptions`, the run plan that
``dynabatch plan`` writes holds exactly the micro-batches `dynabatch.DataLoader` yields, step by
step and rank by rank (the sample ids of every micro-batch, in order, and the micro-batch count
of every step), for every planning method, on generated FLAN-like text and image+text data.

Only public names are used: the CLI (`dynabatch.cli.main`), `dynabatch.DataLoader`,
`dynabatch.build_index` and `dynabatch.offline.load_run_plan`.
"""

from __future__ import annotations

import json
import warnings

import pytest

from dynabatch.core.options import METHODS
from dynabatch import DataLoader, build_index
from dynabatch.cli import main
from dynabatch.datagen import write_image_text_shards, write_text_shards
from dynabatch.offline import load_run_plan
from dynabatch import Costing, DataSource, PlanOptions, Runtime, Tokenization
from dynabatch.loader.settings import records_from_keywords

WORLD = 2  # DataLoader(rank=r, world_size=2) against a plan made with --ranks 2
STAGES = 2
SEED = 5

#: The data sets: generator, its size, the cost preset, and the options both sides are given.
#: The global batches are small so that each epoch has several steps and a smaller last one; the
#: vision-language model gets an explicit activation-memory limit (--memory-limit / memory_limit=).
DATA = {
    "text": dict(samples=160, model="gpt", device="a100-80gb", family="decoder", global_batch_tokens=12000,
                 max_len=1024, max_target_len=256, memory_limit=None),
    "image_text": dict(samples=24, model="vlm", device="h200", family="decoder", global_batch_tokens=12000,
                       max_len=4096, max_target_len=512, memory_limit=8 * 2**30),
}

#: Baselines get a knob through --method-option / method_options= (the others their default).
METHOD_OPTIONS = {"pad": {"rows": 2}, "token_budget": {"max_tokens": 4096}, "pack_varlen": {"rows": 2}}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_offline")
    out = {}
    for name, spec in DATA.items():
        folder = root / name
        if name == "text":
            write_text_shards(folder, spec["samples"], num_shards=2, seed=1)
            vision = None
        else:
            write_image_text_shards(folder, spec["samples"], num_shards=2, seed=1)
            from tokenization import DynamicTiling

            vision = DynamicTiling()
        index_path = root / f"{name}.index.parquet"
        # the loader's own length index, built with its tokenization settings (max_len truncates)
        table = build_index(str(folder), tokenizer="bytes", family=spec["family"], max_len=spec["max_len"],
                            max_target_len=spec["max_target_len"], vision=vision, path=index_path)
        out[name] = {"data": str(folder), "index": index_path, "table": table, "vision": vision, "dir": root,
                     **spec}
    return out


def _cli_plan(ds: dict, method: str, out, *, seed: int = SEED, drop_last: bool = False, source: str = "index"):
    """``dynabatch plan`` on the length index (or the raw data) with the options the loader gets."""
    argv = ["plan", str(ds["index"] if source == "index" else ds["data"]), "--out", str(out),
            "--model", ds["model"], "--device", ds["device"], "--ranks", str(WORLD), "--stages", str(STAGES),
            "--global-batch-tokens", str(ds["global_batch_tokens"]), "--max-len", str(ds["max_len"]),
            "--max-target-len", str(ds["max_target_len"]), "--method", method, "--seed", str(seed),
            "--tokenizer", "bytes", "--workers", "1", "--no-progress", "--json"]
    for key, value in METHOD_OPTIONS.get(method, {}).items():
        argv += ["--method-option", f"{key}={value}"]
    if ds["memory_limit"] is not None:
        argv += ["--memory-limit", "8GiB"]
        assert ds["memory_limit"] == 8 * 2**30
    if drop_last:
        argv.append("--drop-last")
    if source == "data" and ds["vision"] is not None:
        argv += ["--vision", "tiling"]
    assert main(argv) == 0
    return load_run_plan(out)


def _loader_steps(ds: dict, method: str, rank: int, *, drop_last: bool = False) -> list[list[dict]]:
    """Every step of epoch 0 as rank ``rank`` of ``WORLD`` sees it: per micro-batch its sample ids
    and whether it is a placeholder."""
    loader = DataLoader(ds["data"],
                        options=PlanOptions(num_stages=STAGES, global_batch_tokens=ds["global_batch_tokens"],
                                            max_len=ds["max_len"], max_target_len=ds["max_target_len"], method=method,
                                            method_options=METHOD_OPTIONS.get(method, {}),
                                            memory_limit=ds["memory_limit"], seed=SEED, drop_last=drop_last),
                        tokenization=Tokenization(tokenizer="bytes", vision=ds["vision"]),
                        source=DataSource(index=ds["table"], mode="indexed", cache_tokens=False),
                        costing=Costing(cost_model=ds["model"], device=ds["device"]),
                        runtime=Runtime(rank=rank, world_size=WORLD))
    try:
        return [[{"step": int(mb["step"]), "ids": mb["sample_ids"].tolist(), "padding": bool(mb["is_padding"])}
                 for mb in step] for step in loader.steps()]
    finally:
        loader.close()


def _mismatches(run, per_rank: list[list[list[dict]]]) -> list[str]:
    """What differs between the plan file and the loaders' steps (empty: they are the same)."""
    bad = []
    steps = {len(s) for s in per_rank}
    if steps != {run.num_steps}:
        bad.append(f"steps: plan {run.num_steps}, loader ranks {[len(s) for s in per_rank]}")
        return bad
    for k in range(run.num_steps):
        plan = run.step(k)
        most = int(plan.microbatches_per_rank().max())
        for rank, loader_steps in enumerate(per_rank):
            got = loader_steps[k]
            planned = [mb.sample_ids.tolist() for mb in plan.microbatches(rank)] if rank < plan.num_ranks else []
            if {mb["step"] for mb in got} != {k}:
                bad.append(f"step {k} rank {rank}: the loader labels it step {sorted({mb['step'] for mb in got})}")
            if len(got) != most:  # every rank runs as many micro-batches as the busiest rank of the plan
                bad.append(f"step {k} rank {rank}: {len(got)} micro-batches, plan {most}")
            real = [mb["ids"] for mb in got if not mb["padding"]]
            if real != planned:
                bad.append(f"step {k} rank {rank}: loader {real} != plan {planned}")
            if any(mb["ids"] for mb in got if mb["padding"]):
                bad.append(f"step {k} rank {rank}: a placeholder micro-batch carries samples")
    return bad


def _check(ds, method, tmp_path, **kw):
    run = _cli_plan(ds, method, tmp_path / f"{method}.parquet", **kw)
    assert run.method == method and run.num_ranks == WORLD
    recorded = json.loads(run.metadata["dynabatch.options"])  # the plan file records the options it was made with
    assert recorded["method_options"] == METHOD_OPTIONS.get(method, {}) and recorded["seed"] == kw.get("seed", SEED)
    per_rank = [_loader_steps(ds, method, r, drop_last=kw.get("drop_last", False)) for r in range(WORLD)]
    return run, per_rank


@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("method", METHODS)
def test_plan_file_equals_dataloader(datasets, kind, method, tmp_path):
    ds = datasets[kind]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # neither side goes through a deprecated name
        run, per_rank = _check(ds, method, tmp_path)
    assert run.num_steps >= 3
    assert _mismatches(run, per_rank) == []
    # every sample of the data is placed exactly once in the epoch (the last, smaller step is kept)
    ids = sorted(i for steps in per_rank for step in steps for mb in step for i in mb["ids"])
    assert ids == sorted(ds["table"].column("sample_id").to_pylist())


def test_raw_data_and_drop_last_agree(datasets, tmp_path):
    """Planning the raw text shards (the CLI scans them itself) with --drop-last equals the loader
    with drop_last=True, and the two plans differ in exactly the dropped last step."""
    ds = datasets["text"]
    kept = _cli_plan(ds, "dp", tmp_path / "kept.parquet")
    dropped, per_rank = _check(ds, "dp", tmp_path, drop_last=True, source="data")
    assert _mismatches(dropped, per_rank) == []
    assert dropped.num_steps == kept.num_steps - 1
    assert json.loads(dropped.metadata["dynabatch.options"])["drop_last"] is True


@pytest.mark.parametrize("kind", list(DATA))
def test_a_plan_made_differently_is_caught(datasets, kind, tmp_path):
    """The comparison is not vacuous: a plan made with another seed does not match the loader."""
    ds = datasets[kind]
    per_rank = [_loader_steps(ds, "dp", r) for r in range(WORLD)]
    assert _mismatches(_cli_plan(ds, "dp", tmp_path / "same.parquet"), per_rank) == []
    other = _cli_plan(ds, "dp", tmp_path / "other_seed.parquet", seed=SEED + 1)
    assert _mismatches(other, per_rank)


def test_a_last_step_smaller_than_the_world_is_written_and_replayed(datasets, tmp_path):
    """160 samples in steps of 53: the last step holds 1 sample for 2 ranks. `dynabatch plan` writes it
    (planned on one rank; the other holds none) and each rank replays the file as the loader plans it
    online: the same micro-batches, the same step count on both ranks, every sample once."""
    ds = datasets["text"]
    out = tmp_path / "last.parquet"
    argv = ["plan", str(ds["index"]), "--out", str(out), "--model", ds["model"], "--device", ds["device"],
            "--ranks", str(WORLD), "--stages", str(STAGES), "--global-batch-size", "53", "--max-len",
            str(ds["max_len"]), "--seed", str(SEED), "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
    assert main(argv) == 0
    run = load_run_plan(out)
    last = run.step(int(run.steps[-1]))
    assert len(last.sample_ids) == 1 and run.num_ranks == WORLD
    kw = dict(index=ds["table"], tokenizer="bytes", cost_model=ds["model"], device=ds["device"], num_stages=STAGES,
              max_len=ds["max_len"], seed=SEED, world_size=WORLD)
    seen, counts = [], []
    for r in range(WORLD):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            replay = [[(mb["step"], mb["sample_ids"].tolist(), mb["is_padding"]) for mb in step]
                      for step in DataLoader(ds["data"], **records_from_keywords(dict(plan=str(out), rank=r, **kw)))]
            online = [[(mb["step"], mb["sample_ids"].tolist(), mb["is_padding"]) for mb in step]
                      for step in DataLoader(ds["data"], **records_from_keywords(dict(global_batch_size=53, rank=r, **kw)))]
        assert replay == online
        counts.append([len(s) for s in replay])
        seen += [i for s in replay for _, ids, pad in s if not pad for i in ids]
    assert counts[0] == counts[1] and len(counts[0]) == run.num_steps
    assert sorted(seen) == sorted(set(seen)) and len(seen) == ds["samples"]
