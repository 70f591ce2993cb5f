"""scan_shapes: exact length-table schema, agreement with the formatter, batching."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

import tokenization
from tokenization import (
    ID_COLUMNS,
    IGNORE_INDEX,
    LABEL_COLUMN,
    SHAPE_SCHEMA,
    TASK_NAMES_KEY,
    ByteTokenizer,
    DynamicTiling,
    FormatConfig,
    Formatter,
    SampleError,
    concat_length_tables,
    scan_shapes,
    scan_stats,
    task_names_of,
)

CHAT = [
    {"role": "user", "content": "what is in the picture?"},
    {"role": "assistant", "content": "a red square"},
    {"role": "user", "content": "sure?"},
    {"role": "assistant", "content": "yes"},
]


# Few vision tokens per image (2 per tile, at most 3 tiles): they count towards the max lengths, so
# the limits below hold every image sample with room for text (InternVL's 256 per tile would not).
SMALL_TILES = DynamicTiling(max_num=2, tokens_per_tile=2)


def png(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def mixed_samples(n=40):
    """Plain, language-modelling, conversation and image samples over three tasks."""
    rng = np.random.default_rng(0)
    tasks = ["qa", "caption", "chat"]
    out = []
    for i in range(n):
        s = {
            "sample_id": 1000 + i,
            "key": f"shard0/{i:06d}",
            "inputs": "word " * int(rng.integers(0, 30)),
            "targets": "" if i % 5 == 0 else "answer " * int(rng.integers(0, 10)),
            "task": tasks[i % 3],
            "images": [],
            "source": "test",
            "meta": {},
        }
        if i % 7 == 3:
            s["messages"] = CHAT[: 2 + (i % 3)]
        if i % 4 == 1:
            s["images"] = [{"bytes": png(int(rng.integers(50, 1500)), int(rng.integers(50, 1500)))}]
        if i % 6 == 2:
            s["image_sizes"] = [(896, 448), (448, 448)]
            s["images"] = [{"path": "/unused/a.jpg"}, {"path": "/unused/b.jpg"}]
        out.append(s)
    return out


def test_schema_exact():
    table = scan_shapes(mixed_samples(10), ByteTokenizer())
    assert table.column_names == ["sample_id", "input_tokens", "target_tokens", "vision_tokens", "task_id"]
    assert [f.type for f in table.schema] == [pa.int64(), pa.int32(), pa.int32(), pa.int32(), pa.int32()]
    assert table.schema.equals(SHAPE_SCHEMA)  # metadata aside
    assert json.loads(table.schema.metadata[b"dynabatch.task_names"]) == ["qa", "caption", "chat"]
    assert TASK_NAMES_KEY == b"dynabatch.task_names"
    assert table.column("task_id").to_pylist() == [i % 3 for i in range(10)]
    assert table.column("sample_id").to_pylist() == list(range(1000, 1010))


def test_empty_scan_has_the_schema():
    table = scan_shapes([], "bytes", task_names=["a"])
    assert table.num_rows == 0 and table.schema.equals(SHAPE_SCHEMA)
    assert task_names_of(table) == ["a"]


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("limits", [{}, {"max_input_tokens": 40, "max_target_tokens": 20, "max_total_tokens": 50}])
def test_values_equal_per_sample_encoding(family, limits):
    samples = mixed_samples()
    kw = dict(family=family, truncation_side="left", add_bos=True, **limits)
    table = scan_shapes(samples, "bytes", vision=SMALL_TILES, batch_size=7, **kw)
    f = Formatter(ByteTokenizer(), vision=SMALL_TILES, **kw)
    enc = [f.encode(s) for s in samples]
    assert table.column("input_tokens").to_pylist() == [e.input_tokens for e in enc]
    assert table.column("target_tokens").to_pylist() == [e.target_tokens for e in enc]
    assert table.column("vision_tokens").to_pylist() == [e.vision_tokens for e in enc]
    if family == "decoder":
        assert [len(e.input_ids) for e in enc] == [e.input_tokens + e.target_tokens for e in enc]
    # the vision tokens (the model inserts them) count towards the limits, as the planner's max_len
    cap = limits.get("max_total_tokens" if family == "decoder" else "max_input_tokens")
    if cap is not None:
        assert max(e.input_tokens + e.vision_tokens + (family == "decoder") * e.target_tokens for e in enc) <= cap
    assert any(e.vision_tokens for e in enc) and any(e.target_tokens for e in enc)
    assert scan_stats(table).num_truncated == sum(e.truncated for e in enc)
    assert (scan_stats(table).num_truncated > 0) == bool(limits)


def _labels(e, family):
    """Loss labels of one EncodedSample (decoder: trained labels less the first position)."""
    if family == "encoder_decoder":
        return len(e.target_ids)
    trained = e.labels != IGNORE_INDEX
    return int(trained[1:].sum()) if len(trained) else 0


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("train", [{}, {"max_input_tokens": 12, "max_target_tokens": 6, "max_total_tokens": 15}])
def test_label_counts_and_ids_equal_the_training_formatter(family, train):
    """label_config: the one scan also counts each sample's loss labels (and keeps its ids) as the
    training formatter makes them, while the length columns keep full counts."""
    samples = mixed_samples()
    common = dict(family=family, truncation_side="left", add_bos=True)
    label_config = FormatConfig(**common, **train)
    table = scan_shapes(samples, "bytes", vision=SMALL_TILES, batch_size=7, label_config=label_config,
                        keep_ids=True, **common)
    full = [Formatter(ByteTokenizer(), vision=SMALL_TILES, **common).encode(s) for s in samples]
    trained = [Formatter(ByteTokenizer(), label_config, vision=SMALL_TILES).encode(s) for s in samples]
    assert table.column("input_tokens").to_pylist() == [e.input_tokens for e in full]
    assert table.column(LABEL_COLUMN).to_pylist() == [_labels(e, family) for e in trained]
    second = [e.target_ids if family == "encoder_decoder" else e.labels for e in trained]
    assert table.column(ID_COLUMNS[0]).to_pylist() == [e.input_ids.tolist() for e in trained]
    assert table.column(ID_COLUMNS[1]).to_pylist() == [a.tolist() for a in second]
    if train:
        assert any(e.truncated for e in trained)
    # a budget smaller than the ids drops the id columns, not the labels
    small = scan_shapes(samples, "bytes", label_config=label_config, keep_ids=True, ids_budget=100, **common)
    assert LABEL_COLUMN in small.column_names and not set(ID_COLUMNS) & set(small.column_names)
    # shards merge with their extra columns
    merged = concat_length_tables([scan_shapes(samples[:13], "bytes", vision=SMALL_TILES, label_config=label_config,
                                               keep_ids=True, **common),
                                   scan_shapes(samples[13:], "bytes", vision=SMALL_TILES, label_config=label_config,
                                               keep_ids=True, **common)])
    for col in (LABEL_COLUMN, *ID_COLUMNS):
        assert merged.column(col).to_pylist() == table.column(col).to_pylist(), col
    with pytest.raises(ValueError, match="keep_ids"):
        scan_shapes(samples, "bytes", keep_ids=True)
    with pytest.raises(ValueError, match="family"):
        scan_shapes(samples, "bytes", family=family, label_config=FormatConfig(
            family="decoder" if family == "encoder_decoder" else "encoder_decoder"))


def test_batch_size_independence():
    samples = mixed_samples(25)
    tables = [
        scan_shapes(iter(samples), "bytes", vision=SMALL_TILES, max_total_tokens=60, batch_size=bs)
        for bs in (1, 4, 1024)
    ]
    for t in tables[1:]:
        assert t.equals(tables[0], check_metadata=True)


def test_task_names_given_and_unknown():
    samples = mixed_samples(6)
    samples[1]["task"] = ""
    del samples[2]["task"]
    table = scan_shapes(samples, "bytes", task_names=["chat", "qa"])
    assert task_names_of(table) == ["chat", "qa"]
    assert table.column("task_id").to_pylist() == [1, -1, -1, 1, -1, 0]


def test_on_error_skip_counts_and_raise_names_key():
    samples = mixed_samples(8)
    samples[2] = {"sample_id": 2, "key": "broken/2", "inputs": None}
    samples[5]["images"] = [{"bytes": b"garbage"}]
    samples[5].pop("image_sizes", None)
    with pytest.raises(SampleError, match="broken/2"):
        scan_shapes(samples, "bytes")
    table = scan_shapes(samples, "bytes", vision=DynamicTiling(), on_error="skip", batch_size=3)
    stats = scan_stats(table)
    assert (stats.num_samples, stats.num_skipped) == (6, 2)
    assert [k for k, _ in stats.skipped] == ["broken/2", samples[5]["key"]]
    assert 2 not in table.column("sample_id").to_pylist()
    with pytest.raises(ValueError, match="on_error"):
        scan_shapes(samples, "bytes", on_error="ignore")


def test_progress_bar(capsys):
    scan_shapes(mixed_samples(5), "bytes", progress=True, batch_size=2)
    assert "scan_shapes" in capsys.readouterr().err


def test_reads_into_dynabatch_shapes():
    dynabatch = pytest.importorskip("dynabatch")
    table = scan_shapes(mixed_samples(12), "bytes", vision=DynamicTiling())
    shapes = dynabatch.Shapes.from_arrow(table)
    assert shapes.input_tokens.tolist() == table.column("input_tokens").to_pylist()
    assert shapes.vision_tokens.tolist() == table.column("vision_tokens").to_pylist()


def _scan_shard(shard):
    return scan_shapes(shard, "bytes", vision=DynamicTiling())


def test_shards_in_a_process_pool_merge_to_the_single_scan():
    samples = mixed_samples(30)
    shards = [samples[9:], samples[:9]]  # second shard introduces the tasks in another order
    with ProcessPoolExecutor(2) as pool:
        parts = list(pool.map(_scan_shard, shards))
    merged = concat_length_tables(parts)
    single = scan_shapes(samples[9:] + samples[:9], "bytes", vision=DynamicTiling())
    assert merged.equals(single)
    assert task_names_of(merged) == task_names_of(single)
    assert scan_stats(merged).num_samples == 30


def test_standalone_never_imports_dynabatch_or_loaders():
    code = "import sys, tokenization; bad = {'dynabatch', 'loaders'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True)
    for f in Path(tokenization.__file__).parent.glob("*.py"):
        text = f.read_text()
        assert "import dynabatch" not in text and "from dynabatch" not in text, f
        assert "import loaders" not in text and "from loaders" not in text, f
