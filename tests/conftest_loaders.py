"""Small data generators shared by the tests/test_loaders*.py files (plain helpers, no fixtures)."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq


def records(n: int, prefix: str = "r", task: str | None = None) -> list[dict]:
    """FLAN-style records with unique inputs ``{prefix}-{i}``."""
    return [
        {"inputs": f"question {prefix}-{i}", "targets": f"answer {i}",
         "task": task or f"task{i % 3}", "idx": i}
        for i in range(n)
    ]


def write_jsonl(path, recs, blank_every: int = 0) -> str:
    """Write records as JSON Lines (gzip when the name ends with .gz); optional blank lines."""
    lines = []
    for i, r in enumerate(recs):
        lines.append(json.dumps(r) if isinstance(r, dict) else r)
        if blank_every and i % blank_every == blank_every - 1:
            lines.append("")
    data = ("\n".join(lines) + "\n").encode()
    path = str(path)
    if path.endswith(".gz"):
        data = gzip.compress(data)
    with open(path, "wb") as f:
        f.write(data)
    return path


def write_parquet(path, recs, row_group_size: int = 16, compression: str = "snappy") -> str:
    """Write records as Parquet with small row groups."""
    pq.write_table(pa.Table.from_pylist(recs), str(path), row_group_size=row_group_size,
                   compression=compression)
    return str(path)


def write_tar(path, samples: list[tuple[str, dict[str, bytes]]], compresslevel: int | None = None) -> str:
    """Write a webdataset shard: ``samples`` = [(key, {ext: bytes})] (``.gz``: gzipped, at ``compresslevel``)."""
    kw = {"compresslevel": compresslevel} if compresslevel is not None else {}
    with tarfile.open(str(path), "w:gz" if str(path).endswith(".gz") else "w", **kw) as tf:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return str(path)


def wds_text_samples(n: int, prefix: str) -> list[tuple[str, dict[str, bytes]]]:
    return [(f"{prefix}_{i:05d}", {"json": json.dumps(r).encode()}) for i, r in enumerate(records(n, prefix))]


def image_bytes(fmt: str = "PNG", size=(8, 6)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format=fmt)
    return buf.getvalue()


def slot_ids(source, world_size: int, num_workers: int) -> list[list[int]]:
    """sample_ids read by every slot of a layout, slot-major."""
    out = []
    for rank in range(world_size):
        for worker in range(max(1, num_workers)):
            s = source.with_layout(rank=rank, world_size=world_size, worker_id=worker, num_workers=num_workers)
            out.append([x["sample_id"] for x in s])
    return out


def ensure_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    return str(path)


def build_formats(root) -> dict:
    """One small dataset per format: ``{format: (make_source(**options), expected_ids)}``.

    Shards have different sizes (and JSONL has blank lines) so units are uneven.
    """
    import datasets

    import loaders

    root = ensure_dir(root)
    sizes = [37, 5, 61]
    out = {}

    jdir = ensure_dir(os.path.join(root, "jsonl"))
    for i, n in enumerate(sizes):
        write_jsonl(os.path.join(jdir, f"train-{i:05d}.jsonl"), records(n, f"j{i}"), blank_every=7)
    jsonl_ids = []
    for i, n in enumerate(sizes):
        lines = [p for p in range(n + n // 7) if (p + 1) % 8 != 0]  # blank line after every 7th record
        jsonl_ids += [(i << 32) | p for p in lines]
    out["jsonl"] = (lambda **kw: loaders.JsonlSource(os.path.join(jdir, "*.jsonl"), **kw), jsonl_ids)

    pdir = ensure_dir(os.path.join(root, "parquet"))
    for i, n in enumerate(sizes):
        write_parquet(os.path.join(pdir, f"part-{i}.parquet"), records(n, f"p{i}"), row_group_size=8)
    ids = [(i << 32) | p for i, n in enumerate(sizes) for p in range(n)]
    out["parquet"] = (lambda **kw: loaders.ParquetSource(pdir, **kw), ids)

    wdir = ensure_dir(os.path.join(root, "wds"))
    for i, n in enumerate(sizes):
        write_tar(os.path.join(wdir, f"shard-{i:03d}.tar"), wds_text_samples(n, f"w{i}"))
    out["webdataset"] = (lambda **kw: loaders.WebDatasetSource(os.path.join(wdir, "shard-{000..002}.tar"), **kw), ids)

    ds = datasets.Dataset.from_list(records(sum(sizes), "hf"))
    out["hf"] = (lambda **kw: loaders.HFSource(ds, **kw), list(range(sum(sizes))))
    return out
