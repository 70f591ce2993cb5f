"""`dynabatch scan` / `dynabatch plan` read remote shards (fsspec URLs) like local ones: the index
of ``memory://`` shards equals the index of the same files on disk (fingerprint and token counts)."""

from __future__ import annotations

import json

import fsspec
import pyarrow.parquet as pq

from dynabatch.cli import main

from test_dataloader_data import records


def test_scan_and_plan_of_remote_shards_equal_local(tmp_path):
    fs = fsspec.filesystem("memory")
    recs = records(150, seed=9)
    for k in range(3):
        text = "".join(json.dumps(r) + "\n" for r in recs[k * 50:(k + 1) * 50])
        (tmp_path / f"part-{k}.jsonl").write_text(text)
        with fs.open(f"memory://dynabatch-offline/part-{k}.jsonl", "w") as f:
            f.write(text)
    try:
        remote, local = tmp_path / "remote.parquet", tmp_path / "local.parquet"
        assert main(["scan", "memory://dynabatch-offline/*.jsonl", "--workers", "1", "--no-progress",
                     "--out", str(remote)]) == 0
        assert main(["scan", str(tmp_path / "part-*.jsonl"), "--workers", "1", "--no-progress",
                     "--out", str(local)]) == 0
        a, b = pq.read_table(remote), pq.read_table(local)
        assert a.num_rows == 150 and a.select(["sample_id", "input_tokens", "target_tokens"]).equals(
            b.select(["sample_id", "input_tokens", "target_tokens"]))
        assert a.schema.metadata[b"dynabatch.dataset_fingerprint"] == b.schema.metadata[b"dynabatch.dataset_fingerprint"]
        # raw remote shards plan directly (scanned on the way)
        assert main(["plan", "memory://dynabatch-offline/*.jsonl", "--workers", "1", "--no-progress", "--ranks", "2",
                     "--stages", "2", "--device", "cpu", "--global-batch-tokens", "3000",
                     "--out", str(tmp_path / "plan.parquet")]) == 0
        assert pq.read_table(tmp_path / "plan.parquet").num_rows > 0
    finally:
        fs.rm("memory://dynabatch-offline", recursive=True)
