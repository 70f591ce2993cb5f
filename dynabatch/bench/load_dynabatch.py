"""`dynabatch bench load`: the measured dynabatch path.

A `loaders` source over the prepared files, built inside the timing, fed to
`tokenization.scan_shapes`; with ``workers > 1`` one slot per worker process, the length tables
concatenated. Returns (samples, tokens) as the baseline does.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .load_data import Prepared


def _open_source(kind: str, prep: Prepared):
    import loaders

    if kind == "jsonl":
        return loaders.JsonlSource([str(p) for p in prep.text_files])
    if kind == "parquet":
        return loaders.ParquetSource([str(p) for p in prep.parquet_files])
    if kind == "hf":
        return loaders.open_source(str(prep.hf_dir))
    return loaders.WebDatasetSource([str(p) for p in prep.tar_files])


def _table_counts(table) -> tuple[int, int]:
    tokens = sum(int(np.sum(table.column(c).to_numpy(), dtype=np.int64))
                 for c in ("input_tokens", "target_tokens", "vision_tokens"))
    return table.num_rows, tokens


#: How both paths render conversations: the baseline writes dynabatch's plain format by hand
#: (`load_baseline`), so this path asks for it rather than taking a tokenizer's own template (or,
#: for one without, the same plain format with a warning that it fell back).
CHAT_TEMPLATE = "plain"


def _scan_slot(source, tokenizer, vision, batch_size):
    """One worker's share: scan one slot of the source (module level: picklable)."""
    from tokenization import scan_shapes

    return scan_shapes(source, tokenizer, vision=vision, batch_size=batch_size, chat_template=CHAT_TEMPLATE)


def _pool(workers: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # fork, like datasets' num_proc: workers inherit the imports instead of re-importing torch.
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    return ProcessPoolExecutor(workers, mp_context=ctx)


def run_dynabatch(kind: str, prep: Prepared, tok, tokenizer_spec: str, batch_size: int, workers: int):
    """The dynabatch path: loaders source -> `scan_shapes` -> length table. Returns (samples, tokens)."""
    from tokenization import DynamicTiling, concat_length_tables, scan_shapes

    vision = DynamicTiling() if kind == "webdataset" else None
    source = _open_source(kind, prep)
    if workers <= 1:
        return _table_counts(scan_shapes(source, tok, vision=vision, batch_size=batch_size,
                                         chat_template=CHAT_TEMPLATE))
    parts = [source.with_layout(rank=0, world_size=1, worker_id=k, num_workers=workers) for k in range(workers)]
    with _pool(workers) as pool:
        # The spec, not the object, goes to the workers: each loads its own tokenizer.
        tables = list(pool.map(partial(_scan_slot, tokenizer=tokenizer_spec, vision=vision,
                                       batch_size=batch_size), parts))
    return _table_counts(concat_length_tables(tables))
