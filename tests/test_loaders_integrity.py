"""Integrity of damaged input: a damaged compressed stream never yields a record from a member or
frame that failed its check, truncation is reported as truncation, errors name the file, and
skipped damage is counted once whatever the number of workers. Each test builds its damaged file."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import tarfile

import pyarrow.parquet as pq
import pytest
from conftest_loaders import image_bytes, write_parquet, write_tar

import loaders
from dynabatch.loader.settings import records_from_keywords

zstandard = pytest.importorskip("zstandard")


def _lines(n: int, prefix: str = "q") -> list[str]:
    return [json.dumps({"inputs": f"question {prefix}{i}: " + "w" * (20 + i % 30), "targets": f"answer {i}"})
            for i in range(n)]


def _text(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def _flip_letters(data: bytes, start: int = 0, count: int = 64) -> bytes:
    """Flip ``count`` bytes inside runs of 'w' (stored gzip blocks hold the text as is), so the
    damaged text still parses as JSON, only with other words: only the CRC can tell."""
    out = bytearray(data)
    pos, done = start, 0
    while done < count:
        pos = out.index(b"wwww", pos) + 2
        out[pos] ^= 0x01  # 'w' -> 'v'
        pos += 97
        done += 1
    return bytes(out)


def _skip(path, make=loaders.JsonlSource):
    src = make(str(path), on_error="skip")
    return list(src), src.error_counts


# -- 1. gzip with flipped bytes ------------------------------------------------------------------

def test_gzip_crc_failure_yields_nothing_of_the_member(tmp_path):
    lines = _lines(400)
    data = gzip.compress(_text(lines), compresslevel=0)
    path = tmp_path / "flip.jsonl.gz"
    path.write_bytes(_flip_letters(data, start=len(data) // 3))
    with pytest.raises(loaders.CorruptFileError) as info:
        loaders.JsonlSource(str(path))
    msg = str(info.value)
    assert msg.startswith("flip.jsonl.gz:1:") and "gzip member 1" in msg and "checksum" in msg, msg
    got, counts = _skip(path)
    # The only member failed its CRC: not one of its (altered) records is delivered.
    assert got == [] and counts == {"corrupt_file": 1}


def test_gzip_damaged_member_keeps_verified_members(tmp_path):
    lines = _lines(400)
    members = [gzip.compress(_text(lines[i:i + 100]), compresslevel=0) for i in range(0, 400, 100)]
    members[2] = _flip_letters(members[2], count=8)
    path = tmp_path / "multi.jsonl.gz"
    path.write_bytes(b"".join(members))
    with pytest.raises(loaders.CorruptFileError, match=r"multi\.jsonl\.gz:201: .*gzip member 3"):
        loaders.JsonlSource(str(path))
    got, counts = _skip(path)
    assert counts == {"corrupt_file": 1}
    assert [s["inputs"] for s in got] == [json.loads(x)["inputs"] for x in lines[:200]]
    assert [s["key"] for s in got] == [f"multi.jsonl.gz:{i + 1}" for i in range(200)]


def _gzip_with_damaged_middle_member(lines) -> bytes:
    """Three gzip members of 100 lines each; 8 bytes in the middle of the second are overwritten."""
    members = [gzip.compress(_text(lines[i:i + 100])) for i in range(0, 300, 100)]
    bad = bytearray(members[1])
    bad[len(bad) // 2: len(bad) // 2 + 8] = b"\xff" * 8
    return members[0] + bytes(bad) + members[2]


def test_gzip_deflate_error_in_later_member(tmp_path):
    lines = _lines(300)
    path = tmp_path / "z.jsonl.gz"
    path.write_bytes(_gzip_with_damaged_middle_member(lines))
    got, counts = _skip(path)
    assert counts == {"corrupt_file": 1} and len(got) == 100
    assert all(s["inputs"] == json.loads(x)["inputs"] for s, x in zip(got, lines))


def test_scan_skips_damaged_gzip_member(tmp_path):
    from dynabatch.index.scan import ScanConfig, scan_dataset

    lines = _lines(200)
    members = [gzip.compress(_text(lines[i:i + 100]), compresslevel=0) for i in range(0, 200, 100)]
    members[1] = _flip_letters(members[1], count=4)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl.gz").write_bytes(b"".join(members))
    res = scan_dataset(str(tmp_path / "d"), ScanConfig(on_error="skip"), workers=1, progress=False)
    assert res.table.num_rows == 100 and res.meta["loader_errors"] == {"corrupt_file": 1}
    with pytest.raises(loaders.CorruptFileError, match=r"a\.jsonl\.gz:101"):
        scan_dataset(str(tmp_path / "d"), ScanConfig(), workers=1, progress=False)


# -- 2. truncated / damaged zstd -------------------------------------------------------------------

def _frames(lines, per_frame, checksum=False):
    c = zstandard.ZstdCompressor(write_checksum=checksum)
    return [c.compress(_text(lines[i:i + per_frame])) for i in range(0, len(lines), per_frame)]


def test_zstd_multi_frame_cut_is_truncation(tmp_path):
    lines = _lines(2000)
    data = b"".join(_frames(lines, 100))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: int(len(data) * 0.62)])
    with pytest.raises(loaders.TruncatedFileError, match=r"cut\.jsonl\.zst:\d+: .*ends early.*zstd frame"):
        loaders.JsonlSource(str(path))
    got, counts = _skip(path)
    assert counts == {"truncated": 1} and 0 < len(got) < 2000
    assert [s["inputs"] for s in got] == [json.loads(x)["inputs"] for x in lines[: len(got)]]


@pytest.mark.parametrize("cut", [30, 60, 95])
def test_zstd_single_frame_cut_is_truncation(tmp_path, cut):
    lines = _lines(3000)
    data = zstandard.ZstdCompressor().compress(_text(lines))
    path = tmp_path / f"one{cut}.jsonl.zst"
    path.write_bytes(data[: len(data) * cut // 100])
    with pytest.raises(loaders.TruncatedFileError) as info:
        loaders.JsonlSource(str(path))
    msg = str(info.value)
    assert f"one{cut}.jsonl.zst:" in msg and "ends early" in msg and "the data ends after line" in msg, msg
    got, counts = _skip(path)
    assert counts == {"truncated": 1}
    assert [s["inputs"] for s in got] == [json.loads(x)["inputs"] for x in lines[: len(got)]]


def test_zstd_frame_checksum_failure(tmp_path):
    lines = _lines(400)
    frames = _frames(lines, 100, checksum=True)
    bad = bytearray(frames[2])
    bad[-2] ^= 0xFF  # the frame's content checksum
    frames[2] = bytes(bad)
    path = tmp_path / "ck.jsonl.zst"
    path.write_bytes(b"".join(frames))
    with pytest.raises(loaders.CorruptFileError, match=r"ck\.jsonl\.zst:201: .*zstd frame 3"):
        loaders.JsonlSource(str(path))
    got, counts = _skip(path)
    assert counts == {"corrupt_file": 1} and len(got) == 200


def test_bz2_is_read_and_checked(tmp_path):
    lines = _lines(50)
    path = tmp_path / "a.jsonl.bz2"
    path.write_bytes(bz2.compress(_text(lines)))
    assert [s["inputs"] for s in loaders.JsonlSource(str(path))] == [json.loads(x)["inputs"] for x in lines]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(loaders.TruncatedFileError, match=r"a\.jsonl\.bz2"):
        loaders.JsonlSource(str(path))


# -- 3. random access (the indexed DataLoader) on damaged compressed shards --------------------------

def _damaged_files(tmp_path):
    lines = _lines(300)
    gz = tmp_path / "m.jsonl.gz"
    gz.write_bytes(_gzip_with_damaged_middle_member(lines))
    data = b"".join(_frames(lines, 50))
    zst = tmp_path / "t.jsonl.zst"
    zst.write_bytes(data[: int(len(data) * 0.6)])
    return gz, zst


def test_random_access_reads_only_verified_data(tmp_path):
    for path in _damaged_files(tmp_path):
        src = loaders.JsonlSource(str(path), on_error="skip")
        samples = list(src)
        assert samples and sum(src.error_counts.values()) == 1
        assert src.read([s["sample_id"] for s in samples]) == samples
        again = loaders.JsonlSource(str(path), on_error="skip")
        assert loaders.open_access(again).read([samples[-1]["sample_id"]]) == [samples[-1]]


def test_random_access_damaged_parquet_group_names_file(tmp_path):
    path = _damaged_parquet(tmp_path)
    src = loaders.ParquetSource(path, on_error="skip")
    with pytest.raises(loaders.CorruptFileError, match=r"c\.parquet:2000"):
        src.read([2100])
    assert src.read([5])[0]["key"] == "c.parquet:5"


def test_indexed_dataloader_skips_damaged_compressed_shard(tmp_path):
    import dynabatch

    gz, _ = _damaged_files(tmp_path)
    opts = dict(tokenizer="bytes", mode="indexed", global_batch_tokens=4096, max_len=256, seed=0)
    loader = dynabatch.DataLoader(str(gz),
                                  **records_from_keywords(dict(on_error="skip", source_options={"on_error": "skip"},
                                                          **opts)))
    steps = list(loader.steps())
    assert steps and loader.source.error_counts == {"corrupt_file": 1}
    with pytest.raises(loaders.CorruptFileError, match=r"m\.jsonl\.gz:101"):
        dynabatch.DataLoader(str(gz), **records_from_keywords(dict(**opts)))


# -- 4. webdataset errors name the tar ---------------------------------------------------------------

def _img_samples(n):
    return [(f"s{i:04d}", {"png": image_bytes(), "txt": f"caption {i} ".encode() + b"w" * 40}) for i in range(n)]


def test_bad_image_error_names_tar(tmp_path):
    samples = _img_samples(8)
    samples[4] = ("s0004", {"png": b"\x89PNG garbage", "txt": b"broken"})
    path = write_tar(tmp_path / "shard-000.tar", samples)
    with pytest.raises(loaders.BadImageError) as info:
        list(loaders.WebDatasetSource(path))
    msg = str(info.value)
    assert msg.startswith("shard-000.tar:s0004: ") and "BytesIO" not in msg, msg
    got, counts = _skip(path, loaders.WebDatasetSource)
    assert counts == {"bad_image": 1} and [s["key"] for s in got] == [f"s{i:04d}" for i in range(8) if i != 4]


def test_truncated_tar_is_truncation_wherever_cut(tmp_path):
    good_path = write_tar(tmp_path / "good.tar", _img_samples(12))
    good = open(good_path, "rb").read()
    with tarfile.open(good_path) as tf:
        data_end = max(m.offset_data + m.size for m in tf.getmembers())
    # Cuts inside headers, member data and block padding (a cut in the zero records after the
    # end-of-archive blocks loses nothing).
    for cut in [*range(600, data_end, 733), data_end + 100]:
        path = tmp_path / "cut.tar"
        path.write_bytes(good[:cut])
        with pytest.raises(loaders.TruncatedFileError, match=r"cut\.tar"):
            loaders.WebDatasetSource(str(path))
        got, counts = _skip(path, loaders.WebDatasetSource)
        assert counts == {"truncated": 1}, (cut, counts)
        assert [s["key"] for s in got] == [f"s{i:04d}" for i in range(len(got))]


def test_tar_gz_crc_failure_yields_nothing_unverified(tmp_path):
    path = tmp_path / "flip.tar.gz"
    data = open(write_tar(tmp_path / "g.tar.gz", _img_samples(12), compresslevel=0), "rb").read()
    path.write_bytes(_flip_letters(data, start=len(data) // 2, count=4))
    with pytest.raises(loaders.CorruptFileError, match=r"flip\.tar\.gz.*gzip member 1"):
        loaders.WebDatasetSource(str(path))
    got, counts = _skip(path, loaders.WebDatasetSource)
    assert got == [] and counts == {"corrupt_file": 1}


def test_truncated_tar_gz_keeps_complete_samples(tmp_path):
    data = open(write_tar(tmp_path / "g.tar.gz", _img_samples(30)), "rb").read()
    path = tmp_path / "cut.tar.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(loaders.TruncatedFileError, match=r"cut\.tar\.gz"):
        loaders.WebDatasetSource(str(path))
    src = loaders.WebDatasetSource(str(path), on_error="skip", units_per_slot=3)
    got = list(src)
    assert src.error_counts == {"truncated": 1} and 0 < len(got) < 30
    assert [s["key"] for s in got] == [f"s{i:04d}" for i in range(len(got))]
    assert src.read([got[-1]["sample_id"]])[0]["targets"] == got[-1]["targets"]


# -- 9. files a folder holds that are not read; counts independent of the layout ----------------------

def test_folder_reports_files_it_does_not_read(tmp_path, caplog):
    lines = _lines(10)
    (tmp_path / "sub").mkdir()
    for name in ("a.jsonl", "b.JSONL", "sub/c.jsonl"):
        (tmp_path / name).write_bytes(_text(lines))
    (tmp_path / "d.jsonl.bz2").write_bytes(bz2.compress(_text(lines)))
    (tmp_path / "e.csv").write_text("a,b\n1,2\n")
    (tmp_path / "f.txt").write_text("notes\n")
    (tmp_path / ".hidden").write_text("x")
    with caplog.at_level(logging.WARNING, logger="loaders"):
        src = loaders.JsonlSource(str(tmp_path))
    assert [s.name for s in src.shards] == ["a.jsonl", "b.JSONL", "d.jsonl.bz2"]
    assert len(list(src)) == 30
    msg = caplog.text
    assert "2 file(s) of other types not read" in msg and "e.csv" in msg, msg
    assert "1 subfolder(s) not read" in msg and "sub" in msg and ".hidden" not in msg, msg
    # open_source too: upper-case suffixes are recognized.
    assert type(loaders.open_source(str(tmp_path / "b.JSONL"))).__name__ == "JsonlSource"


def _damaged_parquet(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", [{"inputs": f"q{i}", "targets": f"a{i}"} for i in range(4000)],
                         row_group_size=2000)
    col = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(open(path, "rb").read())
    data[col.data_page_offset + 20: col.data_page_offset + col.total_compressed_size - 2] = \
        b"\xff" * (col.total_compressed_size - 22)
    open(path, "wb").write(data)
    return path


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_damaged_row_group_counted_once_for_any_layout(tmp_path, world_size):
    path = _damaged_parquet(tmp_path)
    total, n = {}, 0
    for rank in range(world_size):
        src = loaders.ParquetSource(path, on_error="skip", rank=rank, world_size=world_size, units_per_slot=4)
        n += len(list(src))
        for k, v in src.error_counts.items():
            total[k] = total.get(k, 0) + v
    assert total == {"corrupt_file": 1} and n == 2000


def test_scan_counts_damaged_row_group_once_for_any_parts(tmp_path):
    from dynabatch.index.scan import ScanConfig, scan_dataset

    _damaged_parquet(tmp_path)
    counts = [scan_dataset(str(tmp_path), ScanConfig(on_error="skip"), workers=1, parts=p,
                           progress=False).meta["loader_errors"] for p in (1, 4)]
    assert counts == [{"corrupt_file": 1}, {"corrupt_file": 1}]
