"""`dynabatch bench load`: JSON schema, both paths count the same samples and tokens, bad input."""

import gzip
import json
import os

import pytest

from dynabatch import datagen
from dynabatch.bench import load as bl
from dynabatch.cli import main

RATE_KEYS = {"samples", "tokens", "seconds", "cpu_s", "samples_per_s", "tokens_per_s"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_load")
    text = datagen.write_text_shards(root / "text", 300, 2, seed=0, format="jsonl.gz")
    datagen.write_image_text_shards(root / "image_text", 24, 2, seed=0)
    return {"text": [str(p) for p in text], "image_text": str(root / "image_text")}


def _run_json(capsys, *args) -> dict:
    assert main(["bench", "load", "--json", "--repeat", "1", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _assert_agree(doc):
    for name, src in doc["sources"].items():
        d, b = src["methods"]["dynabatch"], src["methods"]["baseline"]
        assert (d["samples"], d["tokens"]) == (b["samples"], b["tokens"]), name
        assert src["counts_agree"], name


def test_json_schema_and_equal_counts(capsys, data):
    doc = _run_json(capsys, "--data", *data["text"], "--image-text", data["image_text"], "--limit", "200")
    assert list(doc["sources"]) == list(bl.SOURCES)
    for name, src in doc["sources"].items():
        assert set(src["methods"]) == {"dynabatch", "baseline"}
        for m in src["methods"].values():
            assert RATE_KEYS <= set(m) and m["samples_per_s"] > 0 and m["tokens_per_s"] > 0
        assert set(src["ratio"]) == {"samples_per_s", "tokens_per_s"}
    _assert_agree(doc)
    # --limit takes the first 200 samples of the text and of the image+text data (24 < 200: all).
    assert doc["sources"]["jsonl"]["methods"]["dynabatch"]["samples"] == 200
    assert doc["sources"]["webdataset"]["methods"]["baseline"]["samples"] == 24
    assert doc["sources"]["webdataset"]["methods"]["dynabatch"]["tokens"] > 24 * 256  # vision tokens counted
    # The documented top-level shape: methods aggregated over the text sources.
    assert doc["aggregate_over"] == ["jsonl", "parquet", "hf"]
    assert doc["methods"]["dynabatch"]["samples"] == 600
    assert set(doc["methods"]) == {"dynabatch", "baseline"} and RATE_KEYS <= set(doc["methods"]["baseline"])
    assert doc["ratio"]["samples_per_s"] == pytest.approx(
        doc["methods"]["dynabatch"]["samples_per_s"] / doc["methods"]["baseline"]["samples_per_s"])
    assert doc["config"]["workers"] == 1 and doc["config"]["tokenizer"] == "bytes"


def test_table_output(capsys, data):
    assert main(["bench", "load", "--data", data["text"][0], "--sources", "jsonl", "--limit", "50",
                 "--repeat", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for word in ("samples/s", "tokens/s", "x baseline", "dynabatch", "baseline", "counts agree", "median of 2"):
        assert word in out


def test_workers_and_a_subword_tokenizer_agree(capsys, data, tmp_path, monkeypatch):
    """Two workers, a BPE tokenizer: the counts agree, and the TOKENIZERS_PARALLELISM the bench sets for its
    forked workers is gone afterwards (the caller's later launches and subprocesses see its own environment)."""
    tokenizers = pytest.importorskip("tokenizers")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator([r["inputs"] for r in datagen.text_records(200, seed=5)], trainer)
    raw.save(str(tmp_path / "tokenizer.json"))
    doc = _run_json(capsys, "--data", *data["text"], "--image-text", data["image_text"], "--limit", "120",
                    "--sources", "jsonl", "hf", "webdataset", "--workers", "2",
                    "--tokenizer", str(tmp_path / "tokenizer.json"))
    _assert_agree(doc)
    assert doc["config"]["workers"] == 2 and doc["config"]["tokenizer_name"].startswith("tokenizers:")
    assert doc["sources"]["hf"]["methods"]["dynabatch"]["samples"] == 120
    assert "TOKENIZERS_PARALLELISM" not in os.environ


def test_files_with_different_fields(capsys, tmp_path):
    # As NIv2 and CoT: CoT rows carry an extra "answer"; one load_dataset call would fail.
    a, b = tmp_path / "niv2.jsonl", tmp_path / "cot.jsonl"
    a.write_text("".join(json.dumps({"task": "t1", "inputs": f"question {i}", "targets": f"a{i}"}) + "\n"
                         for i in range(30)))
    b.write_text("".join(json.dumps({"task": "cot", "inputs": f"why {i}?", "targets": "because", "answer": "(A)"})
                         + "\n" for i in range(20)))
    doc = _run_json(capsys, "--data", str(a), str(b), "--sources", "jsonl", "parquet")
    _assert_agree(doc)
    assert doc["sources"]["jsonl"]["methods"]["baseline"]["samples"] == 50


@pytest.mark.parametrize("sources", [["jsonl"], ["parquet", "hf"]])
def test_bad_line_names_file_and_position(capsys, tmp_path, sources):
    bad = tmp_path / "broken.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"inputs": "a", "targets": "b"}\n{"inputs": "c", "targets": "d"}\n{"inputs": "e", "targets": \n')
    assert main(["bench", "load", "--data", str(bad), "--sources", *sources, "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "broken.jsonl.gz" in err and ":3" in err


def test_missing_file_and_bad_options(capsys, tmp_path):
    assert main(["bench", "load", "--data", str(tmp_path / "nope.jsonl"), "--no-progress"]) == 1
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["bench", "load", "--repeat", "0", "--no-progress"]) == 1
    assert "repeat" in capsys.readouterr().err


def test_quotas_split_a_limit_by_file_size():
    assert bl.file_quotas([100, 300], 40) == [10, 30]
    assert sum(bl.file_quotas([7, 5, 3], 10)) == 10
    assert bl.file_quotas([5, 5], 50) == [5, 5]


def test_default_data_is_the_shared_flan_sample():
    found = bl.default_text_data()
    if not found:
        pytest.skip("shared FLAN sample not present")
    assert {p.name for p in found} <= {"niv2_sample.jsonl.gz", "flan_cot_sample.jsonl.gz"}


def test_help_explains_columns_and_caveats(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "load", "--help"])
    out = capsys.readouterr().out
    for word in ("x baseline", "tokens/s", "cpu s", "cache", "--workers", "num_proc", "--limit", "load_dataset"):
        assert word in out


def test_limit_cuts_webdataset_shards(capsys, data):
    doc = _run_json(capsys, "--sources", "webdataset", "--image-text", data["image_text"], "--limit", "10")
    _assert_agree(doc)
    assert doc["sources"]["webdataset"]["methods"]["dynabatch"]["samples"] == 10
    assert doc["methods"]["baseline"]["samples"] == 10  # no text source: aggregated over webdataset
