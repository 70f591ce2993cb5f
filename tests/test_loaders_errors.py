"""One test per bad-input kind: a clear default error, and a counted skip with on_error="skip"."""

from __future__ import annotations

import gzip
import json
import logging

import pyarrow.parquet as pq
import pytest
from conftest_loaders import image_bytes, records, wds_text_samples, write_jsonl, write_parquet, write_tar

import loaders


def _skip(make, path):
    src = make(path, on_error="skip")
    return [x["key"] for x in src], src.error_counts


def _jsonl_with(tmp_path, bad_line: str, at: int = 2, n: int = 5) -> str:
    lines = [json.dumps(r) for r in records(n)]
    lines.insert(at, bad_line)
    return write_jsonl(tmp_path / "bad.jsonl", lines)


@pytest.mark.parametrize(
    "bad, err, kind, words",
    [
        ('{"inputs": "x", "targets": ', loaders.InvalidJSONError, "invalid_json", ["invalid JSON"]),
        ("[1, 2]", loaders.InvalidJSONError, "invalid_json", ["JSON object"]),
        ('{"inputs": "x"}', loaders.MissingFieldError, "missing_field", ["'targets'"]),
        ('{"inputs": "x", "targets": 5}', loaders.BadFieldError, "bad_field", ["'targets'", "int"]),
        ('{"inputs": "   ", "targets": "y"}', loaders.EmptyTextError, "empty_text", ["'inputs'", "empty"]),
        ('{"question": "x"}', loaders.MissingFieldError, "missing_field", ["no text fields"]),
    ],
)
def test_bad_jsonl_records(tmp_path, bad, err, kind, words):
    path = _jsonl_with(tmp_path, bad, at=2)
    with pytest.raises(err) as info:
        list(loaders.JsonlSource(path))
    msg = str(info.value)
    assert "bad.jsonl:3" in msg and all(w in msg for w in words), msg
    assert isinstance(info.value, loaders.LoaderError) and isinstance(info.value, ValueError)
    keys, counts = _skip(loaders.JsonlSource, path)
    assert counts == {kind: 1} and len(keys) == 5 and "bad.jsonl:3" not in keys


def test_truncated_gzip(tmp_path):
    good = write_jsonl(tmp_path / "t.jsonl.gz", records(400))
    data = open(good, "rb").read()
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(loaders.TruncatedFileError, match=r"cut\.jsonl\.gz:\d+.*ends early"):
        loaders.JsonlSource(str(path))
    keys, counts = _skip(loaders.JsonlSource, str(path))
    assert counts == {"truncated": 1} and 0 < len(keys) < 400
    assert keys == [f"cut.jsonl.gz:{i + 1}" for i in range(len(keys))]  # every complete line kept


def test_corrupt_gzip_header(tmp_path):
    path = tmp_path / "nogz.jsonl.gz"
    path.write_bytes(b"this is not gzip data at all\n")
    with pytest.raises(loaders.CorruptFileError, match="nogz.jsonl.gz"):
        loaders.JsonlSource(str(path))
    assert _skip(loaders.JsonlSource, str(path)) == ([], {"corrupt_file": 1})


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_truncated_tar(tmp_path, suffix):
    good = write_tar(tmp_path / f"good{suffix}", wds_text_samples(30, "t"))
    data = open(good, "rb").read()
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: len(data) // 2 + 100])
    with pytest.raises(loaders.TruncatedFileError, match=f"cut{suffix}"):
        loaders.WebDatasetSource(str(path))
    keys, counts = _skip(loaders.WebDatasetSource, str(path))
    assert counts == {"truncated": 1} and 0 < len(keys) < 30
    assert keys == [f"t_{i:05d}" for i in range(len(keys))]


def test_corrupt_parquet_file(tmp_path):
    write_parquet(tmp_path / "a.parquet", records(10))
    (tmp_path / "b.parquet").write_bytes(b"PAR1 but not really")
    with pytest.raises(loaders.CorruptFileError, match=r"b\.parquet.*cannot open"):
        loaders.ParquetSource(str(tmp_path))
    keys, counts = _skip(loaders.ParquetSource, str(tmp_path))
    assert counts == {"corrupt_file": 1} and len(keys) == 10


def test_corrupt_parquet_row_group(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", records(64), row_group_size=16)
    col = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(open(path, "rb").read())
    data[col.data_page_offset + 20: col.data_page_offset + col.total_compressed_size - 2] = \
        b"\xff" * (col.total_compressed_size - 22)
    open(path, "wb").write(data)
    with pytest.raises(loaders.CorruptFileError, match=r"c\.parquet:32"):
        list(loaders.ParquetSource(path))
    keys, counts = _skip(loaders.ParquetSource, path)
    assert counts == {"corrupt_file": 1} and len(keys) == 48 and "c.parquet:32" not in keys


def _llava(tmp_path, image):
    rec = {"id": "1", "image": image,
           "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]}
    ok = {**rec, "id": "0", "image": "ok.png"}
    (tmp_path / "ok.png").write_bytes(image_bytes())
    return write_jsonl(tmp_path / "llava.jsonl", [ok, rec])


def test_missing_image(tmp_path):
    path = _llava(tmp_path, "nope/missing.jpg")
    with pytest.raises(loaders.MissingImageError, match=r"llava\.jsonl:2.*missing\.jpg"):
        list(loaders.JsonlSource(path))
    assert _skip(loaders.JsonlSource, path) == (["llava.jsonl:1"], {"missing_image": 1})
    # Without the check the reference passes through (tokenization will decode it).
    assert len(list(loaders.JsonlSource(path, check_images=False))) == 2


def test_unreadable_image_file(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    path = _llava(tmp_path, "broken.jpg")
    with pytest.raises(loaders.BadImageError, match=r"llava\.jsonl:2.*broken\.jpg"):
        list(loaders.JsonlSource(path))
    assert _skip(loaders.JsonlSource, path)[1] == {"bad_image": 1}


def test_undecodable_image_member(tmp_path):
    samples = [("ok", {"jpg": image_bytes("JPEG"), "txt": b"a red square"}),
               ("bad", {"jpg": b"\xff\xd8garbage", "txt": b"broken"})]
    path = write_tar(tmp_path / "img.tar", samples)
    with pytest.raises(loaders.BadImageError, match="bad"):
        list(loaders.WebDatasetSource(path))
    assert _skip(loaders.WebDatasetSource, path) == (["ok"], {"bad_image": 1})


def test_wds_sample_without_text(tmp_path):
    path = write_tar(tmp_path / "x.tar", [("a", {"png": image_bytes()}), ("b", {"txt": b"hello"})])
    with pytest.raises(loaders.MissingFieldError, match=r"x\.tar:a.*no \.json or \.txt"):
        list(loaders.WebDatasetSource(path))
    assert _skip(loaders.WebDatasetSource, path) == (["b"], {"missing_field": 1})


def test_skip_counts_are_logged_at_epoch_end(tmp_path, caplog):
    path = _jsonl_with(tmp_path, "{oops", at=0)
    src = loaders.JsonlSource(path, on_error="skip", name="flan")
    with caplog.at_level(logging.WARNING, logger="loaders"):
        assert len(list(src)) == 5
    assert "flan" in caplog.text and "'invalid_json': 1" in caplog.text


def test_skip_counts_survive_resume(tmp_path):
    path = _jsonl_with(tmp_path, "{oops", at=1)
    src = loaders.JsonlSource(path, on_error="skip")
    it = iter(src)
    next(it), next(it)
    again = loaders.JsonlSource(path, on_error="skip")
    again.load_state_dict(src.state_dict())
    assert len(list(again)) == 3 and again.error_counts == {"invalid_json": 1}


def test_zstd_needs_module(tmp_path):
    path = tmp_path / "a.jsonl.zst"
    try:
        import zstandard
    except ImportError:
        path.write_bytes(b"\x28\xb5\x2f\xfd")
        with pytest.raises(loaders.MissingDependencyError, match="pip install zstandard"):
            loaders.JsonlSource(str(path))
    else:
        path.write_bytes(zstandard.ZstdCompressor().compress(b'{"inputs": "a", "targets": "b"}\n'))
        assert [x["inputs"] for x in loaders.JsonlSource(str(path))] == ["a"]


def test_bad_options(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", records(2))
    with pytest.raises(ValueError, match="on_error"):
        loaders.JsonlSource(path, on_error="ignore")
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        loaders.JsonlSource("/nonexistent/nothing-here-*.jsonl")


def test_gzip_bytes_roundtrip_helper(tmp_path):
    # Guard the helper itself: .gz paths really are gzip.
    path = write_jsonl(tmp_path / "h.jsonl.gz", records(2))
    assert gzip.decompress(open(path, "rb").read()).count(b"\n") == 2
