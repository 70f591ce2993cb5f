"""Small generated datasets and multi-rank runners shared by the tests/test_dataloader*.py files
(plain helpers, no tests here)."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

# Cheap planning settings for tests: GPT stage costs on the CPU device preset, 2 stages.
PLAN = dict(cost_model="gpt", device="cpu", num_stages=2)


def records(n: int, seed: int = 0, prefix: str = "q", long: bool = False, lm_every: int = 7) -> list[dict]:
    """FLAN-like records with heavy-tailed lengths; every ``lm_every``-th is plain text (all trained)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(min(rng.lognormal(3.6 if long else 2.8, 0.7), 400)) + 1
        t = int(rng.integers(1, 40))
        body = "".join(rng.choice(list("abcdefgh "), p))
        if lm_every and i % lm_every == lm_every - 1:
            # empty targets: language-modelling text, every token trained
            out.append({"inputs": f"{prefix}{i} {body}", "targets": "", "task": "lm"})
        else:
            out.append({"inputs": f"{prefix}{i} {body}", "targets": "y" * t, "task": f"t{i % 3}"})
    return out


def write_jsonl(path, recs) -> str:
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def write_parquet(path, recs, row_group_size: int = 32) -> str:
    pq.write_table(pa.Table.from_pylist(recs), str(path), row_group_size=row_group_size)
    return str(path)


def uneven_jsonl(folder) -> str:
    """Three files of very different sizes and lengths: ranks' slots get uneven token loads."""
    write_jsonl(os.path.join(folder, "a.jsonl"), records(160, 1, "a"))
    write_jsonl(os.path.join(folder, "b.jsonl"), records(50, 2, "b", long=True))
    write_jsonl(os.path.join(folder, "c.jsonl"), records(12, 3, "c"))
    return os.path.join(folder, "*.jsonl")


def run_ranks(world_size: int, fn, timeout: float = 120.0):
    """Run ``fn(rank, collective)`` for every rank in its own thread with a `ThreadCollective`;
    returns the results by rank and re-raises the first error."""
    from dynabatch.loader.collective import ThreadCollective

    colls = ThreadCollective.create(world_size, timeout=timeout)
    out: list = [None] * world_size
    errors: list = []

    def go(r):
        try:
            out[r] = fn(r, colls[r])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            colls[r].abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    if errors:
        raise errors[0]
    return out


def flat(items) -> list[dict]:
    """Micro-batch dicts of yielded items: steps (lists of micro-batches, what iterating a
    DataLoader yields) are flattened; micro-batch dicts are kept."""
    return [b for x in items for b in (x if isinstance(x, list) else [x])]


def structure(batches) -> list[tuple[int, int, int]]:
    """(step, microbatch, num_microbatches) of each yielded micro-batch."""
    return [(b["step"], b["microbatch"], b["num_microbatches"]) for b in flat(batches)]


def ids_of(batches) -> list[int]:
    return [i for b in flat(batches) for i in b["sample_ids"].tolist()]


def assert_exactly_once(delivered: list[int], expected) -> None:
    counts = Counter(delivered)
    repeated = [i for i, c in counts.items() if c > 1]
    missing = set(int(i) for i in expected) - set(counts)
    extra = set(counts) - set(int(i) for i in expected)
    assert not repeated and not missing and not extra, (
        f"{len(repeated)} repeated, {len(missing)} missing, {len(extra)} unexpected samples")
