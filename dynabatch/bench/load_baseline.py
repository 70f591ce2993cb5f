"""`dynabatch bench load`: the measured baseline paths, what a user writes today.

Text: ``datasets.load_dataset`` (or ``load_from_disk``) + a batched ``.map`` returning the two
lengths + a row loop. Webdataset: ``WebDataset().decode()`` + the same text rendering, a batched
tokenizer call and PIL image headers through ``WebLoader``. Each returns (samples, tokens).
"""

from __future__ import annotations

import contextlib
import io
import shutil
from functools import partial
from pathlib import Path

import numpy as np

from loaders import optional_module

from .load_config import BASELINE_TEXT_COLUMNS, LoadBenchError
from .load_data import Prepared, quiet_datasets


def _tokenize_text_batch(batch: dict, tok, input_col: str, target_col: str) -> dict:
    """The user's ``.map`` function: token counts of input and target (+1 EOS), as scan_shapes."""
    inputs = tok.encode_batch(batch[input_col])
    targets = tok.encode_batch([t or "" for t in batch[target_col]])
    return {"input_tokens": [len(a) for a in inputs], "target_tokens": [len(a) + 1 for a in targets]}


def _text_columns(names, where: str) -> tuple[str, str]:
    for i, t in BASELINE_TEXT_COLUMNS:
        if i in names and t in names:
            return i, t
    raise LoadBenchError(f"{where}: the datasets baseline needs one of the column pairs "
                         f"{['/'.join(p) for p in BASELINE_TEXT_COLUMNS]}; columns are {sorted(names)}")


def run_baseline_text(kind: str, prep: Prepared, tok, batch_size: int, workers: int, cache_dir: Path):
    """``load_dataset`` / ``load_from_disk`` + batched ``.map`` + row iteration. Returns (samples, tokens).

    ``cache_dir`` should be empty (a first run: nothing cached); ``load_dataset`` writes its
    Arrow copy of the data there.
    """
    datasets = optional_module("datasets", "bench load's datasets baseline")

    num_proc = workers if workers > 1 else None
    cache = str(cache_dir)
    with quiet_datasets():
        if kind == "hf":
            ds = datasets.load_from_disk(str(prep.hf_dir))
        else:
            builder = "json" if kind == "jsonl" else "parquet"
            files = prep.text_files if kind == "jsonl" else prep.parquet_files
            if kind == "parquet" or prep.same_columns:
                ds = datasets.load_dataset(builder, data_files=[str(p) for p in files], split="train",
                                           cache_dir=cache, num_proc=num_proc)
            else:
                # Files with different fields (NIv2 vs CoT's extra "answer") make one
                # load_dataset call fail with a CastError: load each, keep the text, concatenate.
                parts = []
                for p in files:
                    part = datasets.load_dataset(builder, data_files=str(p), split="train", cache_dir=cache)
                    parts.append(part.select_columns(list(_text_columns(part.column_names, p.name))))
                ds = datasets.concatenate_datasets(parts)
        cols = _text_columns(ds.column_names, kind)
        ds = ds.map(partial(_tokenize_text_batch, tok=tok, input_col=cols[0], target_col=cols[1]),
                    batched=True, batch_size=batch_size, num_proc=num_proc,
                    remove_columns=ds.column_names, load_from_cache_file=False)
        samples = tokens = 0
        for row in ds:
            samples += 1
            tokens += row["input_tokens"] + row["target_tokens"]
    return samples, tokens


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_PREFIX = {"user": "User: ", "assistant": "Assistant: ", "system": "System: "}
_IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def _wds_pieces(sample: dict) -> dict:
    """One decoded webdataset sample -> the texts to tokenize and its image bytes.

    Decoder-only rendering, as `tokenization.ChatTemplate`: masked text (``"User: " + value +
    "\\n"`` ...) up to each ``"Assistant: "`` counts as input, each answer (+ EOS) as target.
    """
    rec = sample.get("json") or {}
    inputs, targets = [], []
    if "conversations" in rec or "messages" in rec:
        pending = ""
        for turn in rec.get("conversations") or rec.get("messages"):
            role = _ROLES[turn.get("from", turn.get("role"))]
            content = turn.get("value", turn.get("content"))
            if role != "assistant":
                pending += _PREFIX[role] + content + "\n"
                continue
            inputs.append(pending + _PREFIX["assistant"])
            pending = ""
            targets.append(content)
        if pending:
            inputs.append(pending)
    images = [v for k, v in sample.items() if k.rsplit(".", 1)[-1] in _IMAGE_EXTS]
    if not inputs and not targets:
        if "json" not in sample and "txt" in sample:  # a caption (with an image) or plain text
            rec = {"inputs": "", "targets": sample["txt"]} if images else {"inputs": sample["txt"], "targets": ""}
        inputs.append(rec.get("inputs", ""))
        targets.append(rec.get("targets", "") or "")
    return {"inputs": inputs, "targets": targets, "images": images}


def _wds_count_batch(batch: list[dict], tok, policy) -> tuple[int, int]:
    """Collation: one tokenizer call for the batch's texts, PIL headers for the image sizes."""
    from PIL import Image

    texts = [t for s in batch for t in s["inputs"]] + [t for s in batch for t in s["targets"]]
    n_targets = sum(len(s["targets"]) for s in batch)
    tokens = sum(len(a) for a in tok.encode_batch(texts)) + n_targets  # + one EOS per answer
    sizes = []
    for s in batch:
        for data in s["images"]:
            with Image.open(io.BytesIO(data)) as im:
                sizes.append(im.size)
    if sizes:
        wh = np.asarray(sizes, dtype=np.int64)
        tokens += int(policy.tokens(wh[:, 0], wh[:, 1]).sum())
    return len(batch), tokens


def run_baseline_webdataset(prep: Prepared, tok, batch_size: int, workers: int):
    """``WebDataset().decode()`` + rendering + batched counting through ``WebLoader``. Returns (samples, tokens)."""
    wds = optional_module("webdataset", "bench load's webdataset baseline")

    from tokenization import DynamicTiling

    urls = [str(p) for p in prep.tar_files]
    pipeline = (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
                .decode()
                .map(_wds_pieces)
                .batched(batch_size, collation_fn=partial(_wds_count_batch, tok=tok, policy=DynamicTiling())))
    loader = wds.WebLoader(pipeline, batch_size=None, num_workers=workers if workers > 1 else 0)
    samples = tokens = 0
    for n, t in loader:
        samples += n
        tokens += t
    return samples, tokens


def drop_map_cache(hf_dir: Path | None) -> None:
    """``.map`` on a ``load_from_disk`` dataset writes its cache next to the data; remove it
    (``load_from_cache_file=False`` recomputes anyway; this keeps the temp folder small)."""
    if hf_dir is None:
        return
    for p in hf_dir.glob("cache-*.arrow"):
        with contextlib.suppress(OSError):
            p.unlink()
    for p in hf_dir.glob("tmp*"):
        shutil.rmtree(p, ignore_errors=True)
