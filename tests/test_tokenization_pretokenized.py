"""Pre-tokenized rows (``input_ids``, optional ``labels``, as ``datasets.map(tokenize)`` makes them) are
taken as they are: by the Formatter, the length scan and the DataLoader's collation."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from tokenization import IGNORE_INDEX, ByteTokenizer, FormatConfig, Formatter, SampleError, scan_shapes
from dynabatch import Costing, DataSource, PlanOptions
from dynabatch.loader.settings import records_from_keywords

PLAN = dict(cost_model="gpt", device="cpu", num_stages=2)


class NoTextTokenizer(ByteTokenizer):
    """Refuses to tokenize: pre-tokenized rows never reach the tokenizer."""

    def encode_batch(self, texts):
        if texts:
            raise AssertionError(f"tokenizer called with {texts!r}")
        return []

    count_batch = encode_batch


def row(i, ids, labels=None, where="top", **extra):
    cols = {"input_ids": ids, **({} if labels is None else {"labels": labels}), **extra}
    if where == "top":
        return {"sample_id": i, "key": f"r{i}", **cols}
    # as loaders yields it: empty text, the other columns in meta
    return {"sample_id": i, "key": f"r{i}", "inputs": "", "targets": "", "task": "", "images": [], "meta": cols}


# -- the Formatter -----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["top", "meta"])
def test_decoder_rows_with_labels_are_taken_as_is(where):
    fmt = Formatter(NoTextTokenizer())
    ids, labels = [5, 6, 7, 8, 9, 10], [-100, -100, 7, 8, -100, 10]
    enc = fmt.encode(row(0, ids, labels, where, attention_mask=[1] * 6, length=6))
    assert enc.input_ids.tolist() == ids and enc.labels.tolist() == labels
    assert enc.target_ids is None and enc.input_ids.dtype == np.int32
    assert (enc.input_tokens, enc.target_tokens, enc.truncated) == (3, 3, False)  # masked / trained


def test_decoder_rows_without_labels_train_every_token_and_labels_may_differ_from_ids():
    fmt = Formatter(NoTextTokenizer())
    enc = fmt.encode(row(0, [3, 4, 5]))
    assert enc.labels.tolist() == [3, 4, 5] and (enc.input_tokens, enc.target_tokens) == (0, 3)
    enc = fmt.encode(row(1, np.array([3, 4, 5]), [-100, 40, 41]))  # numpy ids; labels kept even if != ids
    assert enc.labels.tolist() == [-100, 40, 41]


def test_encoder_decoder_rows_labels_are_the_targets():
    fmt = Formatter(NoTextTokenizer(), family="encoder_decoder", add_bos=True)  # no BOS/EOS added to given ids
    enc = fmt.encode(row(0, [5, 6, 7], [8, 9]))
    assert enc.input_ids.tolist() == [5, 6, 7] and enc.target_ids.tolist() == [8, 9] and enc.labels is None
    assert (enc.input_tokens, enc.target_tokens) == (3, 2)


def test_detection_auto_forced_and_off():
    text_and_ids = {"sample_id": 0, "inputs": "ab", "targets": "c", "input_ids": [40, 41, 42, 43]}
    auto = Formatter(ByteTokenizer()).encode(text_and_ids)
    assert auto.input_ids.tolist() == [100, 101, 102, 2]  # text wins
    forced = Formatter(ByteTokenizer(), pretokenized=True).encode(text_and_ids)
    assert forced.input_ids.tolist() == [40, 41, 42, 43]
    with pytest.raises(SampleError, match="has no 'inputs' text"):
        Formatter(ByteTokenizer(), pretokenized=False).encode(row(1, [3, 4]))
    with pytest.raises(SampleError, match="sample 'x'.*has no 'input_ids'"):
        Formatter(ByteTokenizer(), pretokenized=True).encode({"sample_id": 2, "key": "x", "inputs": "ab"})
    with pytest.raises(ValueError, match="pretokenized must be"):
        FormatConfig(pretokenized="yes")


def test_truncation_decoder_by_position_and_encoder_decoder_by_part():
    ids, labels = list(range(10, 20)), [-100] * 4 + list(range(14, 20))
    right = Formatter(NoTextTokenizer(), max_total_tokens=6).encode(row(0, ids, labels))
    assert right.input_ids.tolist() == ids[:6] and right.labels.tolist() == labels[:6]
    assert (right.input_tokens, right.target_tokens, right.truncated) == (4, 2, True)
    left = Formatter(NoTextTokenizer(), max_total_tokens=6, truncation_side="left").encode(row(0, ids, labels))
    assert left.input_ids.tolist() == ids[-6:] and left.labels.tolist() == labels[-6:]
    assert (left.input_tokens, left.target_tokens) == (0, 6)
    s2s = Formatter(NoTextTokenizer(), family="encoder_decoder", max_input_tokens=4, max_target_tokens=3,
                    max_total_tokens=6, truncation_side="left")
    enc = s2s.encode(row(1, ids, [7, 8, 9, 11, 12]))
    assert enc.input_ids.tolist() == ids[-3:] and enc.target_ids.tolist() == [7, 8, 9]  # 4 + 3 > 6: input first


@pytest.mark.parametrize("family, cols, message", [
    ("decoder", {"input_ids": "5 6 7"}, "'input_ids' must be a flat list of int token ids, got str"),
    ("decoder", {"input_ids": [5, 6.5]}, "got float 6.5"),
    ("decoder", {"input_ids": [[5, 6], [7, 8]]}, "must be a flat list"),
    ("decoder", {"input_ids": [5, None]}, "got NoneType"),
    ("decoder", {"input_ids": []}, "'input_ids' is empty"),
    ("decoder", {"input_ids": [5, 6], "labels": [5]}, "'labels' has 1 entries but 'input_ids' has 2"),
    ("decoder", {"input_ids": [5, 6], "labels": [5, "x"]}, "'labels' must be a flat list"),
    ("decoder", {"input_ids": [5, 300]}, "holds 300: not an id of tokenizer 'bytes' \\(vocab_size 259\\)"),
    ("decoder", {"input_ids": [5, -100]}, "'input_ids' holds -100"),
    ("encoder_decoder", {"input_ids": [5, 6]}, "need the target ids as labels"),
    ("encoder_decoder", {"input_ids": [5], "labels": [7, -100]}, "remove the -100 padding"),
])
def test_bad_rows_name_the_sample(family, cols, message):
    fmt = Formatter(ByteTokenizer(), family=family)
    with pytest.raises(SampleError, match=f"sample 'bad7'.*{message}"):
        fmt.encode({"sample_id": 7, "key": "bad7", **cols})
    good = row(8, [5, 6], [5, 6])
    out = fmt.encode_batch([{"sample_id": 7, "key": "bad7", **cols}, good], on_error="skip")
    assert out[0] is None and out[1].input_ids.tolist() == [5, 6]


def test_scan_counts_equal_the_formatter_and_label_tokens_count_the_given_labels():
    rng = np.random.default_rng(1)
    rows = []
    for i in range(40):
        n = int(rng.integers(2, 30))
        ids = rng.integers(3, 259, n).tolist()
        trained = rng.integers(3, 259, n) if i % 5 == 1 else ids  # labels need not equal the ids
        labels = np.where(rng.random(n) < 0.4, IGNORE_INDEX, trained).tolist() if i % 3 else None
        rows.append(row(i, ids, labels, "meta" if i % 2 else "top"))
    rows.insert(5, {"sample_id": 99, "inputs": "text row", "targets": "ok"})  # mixed with text rows
    cfg = FormatConfig(max_total_tokens=17)
    table = scan_shapes(rows, ByteTokenizer(), batch_size=7, label_config=cfg, keep_ids=True)
    encs = Formatter(ByteTokenizer(), cfg).encode_batch(rows)
    full = Formatter(ByteTokenizer()).encode_batch(rows)
    assert table.column("input_tokens").to_pylist() == [e.input_tokens for e in full]
    assert table.column("target_tokens").to_pylist() == [e.target_tokens for e in full]
    assert table.column("cached_input_ids").to_pylist() == [e.input_ids.tolist() for e in encs]
    assert table.column("cached_second_ids").to_pylist() == [e.labels.tolist() for e in encs]
    # loss labels: given labels != -100 under the training max length, less the first (shifted away)
    assert table.column("label_tokens").to_pylist() == [int(np.count_nonzero(e.labels[1:] != IGNORE_INDEX))
                                                        for e in encs]


# -- end to end: the DataLoader ------------------------------------------------------------------------


def make_rows(n=60, seed=0, family="decoder"):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(3, 259, int(rng.integers(2, 40))).tolist()
        if family == "encoder_decoder":
            out.append({"input_ids": ids, "labels": rng.integers(3, 259, int(rng.integers(1, 12))).tolist()})
        elif i % 4 == 3:
            out.append({"input_ids": ids, "attention_mask": [1] * len(ids)})  # no labels: all trained
        else:
            cut = int(rng.integers(0, len(ids)))
            trained = ids if i % 4 else rng.integers(3, 259, len(ids)).tolist()  # labels need not equal the ids
            out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * cut + trained[cut:], "id": f"row{i}"})
    return out


def expected(r, family, max_len, max_target_len=None):
    """(input ids, labels or target ids) the loader must deliver for row ``r``."""
    ids = r["input_ids"][:max_len]
    if family == "encoder_decoder":
        return ids, r["labels"][:max_target_len]
    labels = list(r.get("labels", r["input_ids"]))[:max_len]
    return ids, [IGNORE_INDEX] + labels[1:]  # the collators mask each sample's first label


def unpack(b, collate, family):
    """Per sample of a micro-batch: (input ids, labels) without padding."""
    if collate == "packed":
        ids, lab, pos = (b[k][0].tolist() for k in ("input_ids", "labels", "position_ids"))
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        return [(ids[a:c], lab[a:c]) for a, c in zip(starts, starts[1:])]
    out = []
    for k in range(len(b["sample_ids"])):
        n = int(b["attention_mask"][k].sum())
        lab = b["labels"][k].tolist()
        if family == "decoder":
            assert all(v == IGNORE_INDEX for v in lab[n:])  # padding is never trained
            lab = lab[:n]
        else:
            lab = lab[:int(b["decoder_attention_mask"][k].sum())]
        out.append((b["input_ids"][k, :n].tolist(), lab))
    return out


def check_run(loader, rows, collate, family, max_len, max_target_len=None, caplog=None):
    if caplog is not None:  # a shape or label-count mismatch between the index and the batches is logged
        caplog.set_level(logging.WARNING, logger="dynabatch")
    seen = []
    for step in loader.steps():
        loss = 0
        for b in step:
            loss += int((b["labels"] != IGNORE_INDEX).sum())
            if b["is_padding"]:
                continue
            for sid, got in zip(b["sample_ids"].tolist(), unpack(b, collate, family)):
                assert got == expected(rows[sid & 0xFFFFFFFF], family, max_len, max_target_len), sid
                seen.append(sid & 0xFFFFFFFF)
        assert step.target_tokens == loss  # one rank: the step's loss tokens are this rank's labels != -100
    assert sorted(seen) == list(range(len(rows)))
    assert caplog is None or not [r for r in caplog.records if r.name.startswith("dynabatch")], caplog.text


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.mark.parametrize("mode", ["indexed", "streaming"])
@pytest.mark.parametrize("collate", ["padded", "packed"])
def test_dataloader_delivers_the_given_ids_and_labels(tmp_path, collate, mode, caplog):
    import dynabatch

    rows = make_rows()
    dl = dynabatch.DataLoader(write_jsonl(tmp_path / "tok.jsonl", rows),
                              **records_from_keywords(dict(global_batch_tokens=300, max_len=24, collate=collate, mode=mode,
                                                      **PLAN)))
    check_run(dl, rows, collate, "decoder", 24, caplog=caplog)


def test_dataloader_encoder_decoder_rows(tmp_path, caplog):
    import dynabatch

    rows = make_rows(30, seed=3, family="encoder_decoder")
    dl = dynabatch.DataLoader(write_jsonl(tmp_path / "s2s.jsonl", rows),
                              options=PlanOptions(global_batch_tokens=300, max_len=20, max_target_len=6, num_stages=2),
                              source=DataSource(mode="indexed"),
                              costing=Costing(collate="padded", cost_model="t5", device="a100-80gb"))
    assert dl.family == "encoder_decoder"
    check_run(dl, rows, "padded", "encoder_decoder", 20, 6, caplog=caplog)


def test_dataloader_hf_dataset_from_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    import dynabatch

    rows = [r for r in make_rows(40, seed=5) if "labels" in r]
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                                     "labels": [r["labels"] for r in rows]})
    dl = dynabatch.DataLoader(ds,
                              **records_from_keywords(dict(global_batch_tokens=250, collate="packed", num_workers=1,
                                                      **PLAN)))
    assert dl.mode == "indexed"
    check_run(dl, rows, "packed", "decoder", None)


def test_dataloader_pretokenized_keyword_prefers_the_ids_beside_a_text_column(tmp_path):
    """``datasets.map(tokenize)`` keeps the text column unless told otherwise: ``pretokenized=True``
    takes the ids anyway (the default would tokenize the text again)."""
    datasets = pytest.importorskip("datasets")
    import dynabatch

    rows = [r for r in make_rows(30, seed=7) if "labels" in r]
    ds = datasets.Dataset.from_dict({"text": [f"text of row {i}" for i in range(len(rows))],
                                     "input_ids": [r["input_ids"] for r in rows],
                                     "labels": [r["labels"] for r in rows]})
    dl = dynabatch.DataLoader(ds,
                              **records_from_keywords(dict(global_batch_tokens=250, collate="padded", pretokenized=True,
                                                      **PLAN)))
    check_run(dl, rows, "padded", "decoder", None)
    from_text = dynabatch.DataLoader(ds, **records_from_keywords(dict(global_batch_tokens=250, collate="padded", **PLAN)))
    with pytest.raises(AssertionError):
        check_run(from_text, rows, "padded", "decoder", None)
    with pytest.raises(TypeError, match="not both"):
        dynabatch.DataLoader(ds,
                             **records_from_keywords(dict(global_batch_tokens=250, pretokenized=True,
                                                     format_config=FormatConfig(), **PLAN)))
