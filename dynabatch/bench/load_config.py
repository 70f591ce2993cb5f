"""`dynabatch bench load`: what it measures (`LoadBenchConfig`), its constants and its error.

The sources it times, the two paths per source (`DYNABATCH_PATHS`, `BASELINE_PATHS`), the
default and generated data sizes, and `LoadBenchError`, the one-line error of bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("jsonl", "parquet", "hf", "webdataset")
TEXT_SOURCES = ("jsonl", "parquet", "hf")
METHODS = ("dynabatch", "baseline")
#: The shared FLAN sample, relative to the repository root.
DEFAULT_TEXT_DATA = ("../shared/data/text/niv2_sample.jsonl.gz", "../shared/data/text/flan_cot_sample.jsonl.gz")
#: Generated data when the shared sample is absent / for ``--image-text generate``.
GENERATED_TEXT_SAMPLES = 20000
GENERATED_IMAGE_TEXT_SAMPLES = 512
GENERATED_SHARDS = 4
#: (inputs, targets) column pairs the text baseline understands (the loaders map more).
BASELINE_TEXT_COLUMNS = (("inputs", "targets"), ("input", "output"), ("prompt", "completion"), ("source", "target"))
BASELINE_PATHS = {
    "jsonl": "datasets.load_dataset('json') + .map(tokenize, batched=True) + for row in ds",
    "parquet": "datasets.load_dataset('parquet') + .map(tokenize, batched=True) + for row in ds",
    "hf": "datasets.load_from_disk + .map(tokenize, batched=True) + for row in ds",
    "webdataset": "webdataset.WebDataset().decode() + PIL header + batched tokenize via WebLoader",
}
DYNABATCH_PATHS = {
    "jsonl": "loaders.JsonlSource + tokenization.scan_shapes",
    "parquet": "loaders.ParquetSource + tokenization.scan_shapes",
    "hf": "loaders.open_source(save_to_disk dir) + tokenization.scan_shapes",
    "webdataset": "loaders.WebDatasetSource + tokenization.scan_shapes(vision=DynamicTiling())",
}


class LoadBenchError(ValueError):
    """Bad benchmark input (missing file, unusable columns, a path that failed); one-line message."""


@dataclass(frozen=True)
class LoadBenchConfig:
    """What `run_load_bench` measures.

    ``data``: text files (JSONL, ``.jsonl.gz``); empty = the shared FLAN sample if present,
    else generated shards. ``image_text``: a folder (or one file) of webdataset ``.tar``
    shards, or ``"generate"`` / None for generated shards. ``limit``: samples per data set (None = all).
    ``repeat``: runs per path (the median is reported). ``workers``: processes for both
    paths. ``tokenizer``: a `tokenization.load_tokenizer` spec. ``batch_size``: samples per
    tokenizer call on both paths.
    """

    data: tuple[str, ...] = ()
    image_text: str | None = "generate"
    sources: tuple[str, ...] = SOURCES
    limit: int | None = None
    repeat: int = 3
    workers: int = 1
    tokenizer: str = "bytes"
    batch_size: int = 1024
    seed: int = 0

    def __post_init__(self):
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise LoadBenchError(f"--sources must be among {list(SOURCES)}, got {list(self.sources)}")
        for name, least in (("repeat", 1), ("workers", 1), ("batch_size", 1)):
            if getattr(self, name) < least:
                raise LoadBenchError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise LoadBenchError(f"limit must be >= 1 samples, got {self.limit}")
