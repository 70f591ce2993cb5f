"""Remote shards through fsspec, against a real S3-compatible server (moto's, on 127.0.0.1 only):
``s3://`` JSONL.gz, Parquet and webdataset tars (text, image + text) read record for record like
the same files on local disk; globs, brace patterns and folders list through the bucket; slots
split the data exactly once; a resume mid-shard continues exactly; a changed remote file refuses a
saved state; damage and missing URLs raise the same errors as locally; the dynabatch DataLoader
reads s3:// data in the streaming and indexed modes. The other formats (plain/zst/bz2 JSONL, JSON
arrays, Arrow IPC, .tar.gz, save_to_disk folders) are read from fsspec's ``memory://`` file system
at the end of this file (no server)."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import socket
import sys
from collections import Counter

import pytest
from conftest_loaders import (image_bytes, records, slot_ids, wds_text_samples, write_jsonl, write_parquet,
                              write_tar)

import loaders
from dynabatch import Costing, DataSource, PlanOptions

BUCKET = "dynabatch-test"
SIZES = [37, 5, 61]


def _wait_for_port(host: str, port: int, tries: int = 200) -> None:
    """Liveness: the server accepts a connection (bounded number of tries, no clock)."""
    for _ in range(tries):
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError:
            continue
    raise RuntimeError(f"S3 test server on {host}:{port} does not accept connections")


class S3:
    """The running server: ``url(key)``, ``opts`` (storage_options), ``put(key, bytes)``, ``local`` dir."""

    def __init__(self, endpoint: str, local: str):
        import boto3

        self.endpoint, self.local = endpoint, local
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}

    def url(self, key: str) -> str:
        return f"s3://{BUCKET}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=data)

    def upload(self, key: str, path: str) -> str:
        with open(path, "rb") as f:
            self.put(key, f.read())
        return self.url(key)


@contextlib.contextmanager
def moto_s3(scratch: str):
    """A moto S3 server on 127.0.0.1 (AWS settings of this process pointed at it only, an empty bucket
    ``BUCKET``; ``scratch``: a folder for the absent AWS config files and ``S3.local``), stopped and the
    environment restored on exit. Needs moto, s3fs and boto3."""
    from moto import server as moto_server

    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "HTTP_PROXY", "HTTPS_PROXY",
                     "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            mp.delenv(name, raising=False)
        missing = os.path.join(scratch, "no-aws-config")
        mp.setenv("AWS_CONFIG_FILE", missing)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
        werkzeug = logging.getLogger("werkzeug")  # one INFO line per request otherwise
        level = werkzeug.level
        werkzeug.setLevel(logging.ERROR)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            _wait_for_port(host, port)
            local = os.path.join(scratch, "s3-local")
            os.makedirs(local, exist_ok=True)
            s = S3(f"http://{host}:{port}", local)
            s.client.create_bucket(Bucket=BUCKET)
            yield s
        finally:
            server.stop()
            werkzeug.setLevel(level)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("s3fs")
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    with moto_s3(str(tmp_path_factory.mktemp("s3"))) as s:
        _fill(s)
        yield s


def _fill(s: S3) -> None:
    """The same shards on local disk (``s.local/<key>``) and in the bucket (``<key>``)."""
    def both(key, write, *args, **kw):
        path = os.path.join(s.local, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path, *args, **kw)
        s.upload(key, path)

    for i, n in enumerate(SIZES):
        both(f"jsonl/train-{i:05d}.jsonl.gz", write_jsonl, records(n, f"j{i}"), blank_every=7)
        both(f"parquet/part-{i}.parquet", write_parquet, records(n, f"p{i}"), row_group_size=8)
        both(f"wds/shard-{i:03d}.tar", write_tar, wds_text_samples(n, f"w{i}"))
    png = image_bytes()
    both("wds-img/shard-000.tar", write_tar,
         [(f"img_{i:04d}", {"png": png, "txt": f"caption {i}".encode()}) for i in range(9)])
    both("jsonl/notes.txt", lambda p: open(p, "w").write("not data\n"))


def _local(s: S3, key_pattern: str) -> str:
    return os.path.join(s.local, key_pattern)


CASES = {  # remote pattern (relative to the bucket) and the same files locally
    "jsonl": ("jsonl/*.jsonl.gz", "jsonl/*.jsonl.gz"),
    "parquet": ("parquet/part-{0..2}.parquet", "parquet/part-{0..2}.parquet"),
    "wds": ("wds/", "wds/"),
    "wds-img": ("wds-img/shard-000.tar", "wds-img/shard-000.tar"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_s3_shards_equal_local_record_for_record(s3, case):
    remote_key, local_key = CASES[case]
    remote = loaders.open_source(s3.url(remote_key), storage_options=s3.opts)
    local = loaders.open_source(_local(s3, local_key))
    assert type(remote) is type(local) and remote.num_rows == local.num_rows
    assert [x.name for x in remote.shards] == [x.name for x in local.shards]
    assert all(x.path.startswith(f"s3://{BUCKET}/") for x in remote.shards)
    got, want = list(remote), list(local)
    assert got == want and len(got) > 0
    ids = [x["sample_id"] for x in want]
    assert remote.read(ids[::-3]) == local.read(ids[::-3])  # random access by sample_id
    if case == "wds-img":
        assert got[0]["images"][0]["bytes"] == image_bytes() and got[0]["image_sizes"] == [(8, 6)]


def test_glob_brace_folder_and_missing_urls(s3, caplog):
    names = ["train-00000.jsonl.gz", "train-00001.jsonl.gz", "train-00002.jsonl.gz"]
    glob_src = loaders.JsonlSource(s3.url("jsonl/*.jsonl.gz"), storage_options=s3.opts)
    brace = loaders.JsonlSource(s3.url("jsonl/train-{00000..00002}.jsonl.gz"), storage_options=s3.opts)
    with caplog.at_level(logging.WARNING, logger="loaders"):
        folder = loaders.JsonlSource(s3.url("jsonl"), storage_options=s3.opts)
    assert [x.name for x in glob_src.shards] == [x.name for x in brace.shards] == names
    assert [x.name for x in folder.shards] == names
    assert "1 file(s) of other types not read" in caplog.text and "notes.txt" in caplog.text
    assert glob_src.fingerprint() == brace.fingerprint() == folder.fingerprint()
    missing = s3.url("jsonl/nope-0.jsonl.gz")
    with pytest.raises(FileNotFoundError, match="nope-0.jsonl.gz") as info:
        loaders.open_source(missing, storage_options=s3.opts)
    assert missing in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"no files match 's3://dynabatch-test/nothing/\*\.jsonl'"):
        loaders.open_source(s3.url("nothing/*.jsonl"), storage_options=s3.opts)


@pytest.mark.parametrize("case", ["jsonl", "parquet", "wds"])
def test_slots_split_remote_data_exactly_once(s3, case):
    remote = loaders.open_source(s3.url(CASES[case][0]), storage_options=s3.opts)
    local = loaders.open_source(_local(s3, CASES[case][1]))
    slots = slot_ids(remote, world_size=2, num_workers=3)
    assert slots == slot_ids(local, world_size=2, num_workers=3)
    flat = [i for slot in slots for i in slot]
    assert sorted(flat) == sorted(x["sample_id"] for x in local) and len(flat) == len(set(flat))
    assert sum(1 for slot in slots if slot) >= 4  # the work is spread, not all in one slot


def test_remote_source_in_torch_dataloader_workers(s3):
    from torch.utils.data import DataLoader

    src = loaders.open_source(s3.url("parquet/"), storage_options=s3.opts)
    got = [x["sample_id"] for x in DataLoader(src, batch_size=None, num_workers=2)]
    assert Counter(got) == Counter(x["sample_id"] for x in loaders.open_source(_local(s3, "parquet/")))


@pytest.mark.parametrize("case", ["jsonl", "parquet", "wds"])
@pytest.mark.parametrize("buffer", [0, 8])
def test_resume_mid_shard_continues_exactly(s3, case, buffer):
    def make():
        return loaders.open_source(s3.url(CASES[case][0]), storage_options=s3.opts, shuffle_buffer=buffer, seed=5)

    full = [x["sample_id"] for x in make()]
    src = make()
    it = iter(src)
    head = [next(it)["sample_id"] for _ in range(20)]
    state = json.loads(json.dumps(src.state_dict()))
    unit, pos = state["cursor"]
    shard = state["units"][unit][0]
    assert 0 < pos < src.shards[shard].num_rows  # mid-shard
    again = make()
    again.load_state_dict(state)
    rest = [x["sample_id"] for x in again]
    assert head + rest == full and len(set(full)) == len(full)


def test_changed_remote_file_refuses_saved_state(s3, tmp_path):
    url = s3.url("changing/a.jsonl")
    local = os.path.join(tmp_path, "a.jsonl")

    def write(recs):
        write_jsonl(local, recs)
        s3.upload("changing/a.jsonl", local)

    def state_after_5(path, **kw):
        src = loaders.JsonlSource(path, **kw)
        it = iter(src)
        for _ in range(5):
            next(it)
        return src.state_dict()

    write(records(30, "a"))
    remote_state, local_state = state_after_5(url, storage_options=s3.opts), state_after_5(local)
    write(records(31, "a"))  # rows and size change: refused remotely as locally
    for path, state, kw in ((url, remote_state, {"storage_options": s3.opts}), (local, local_state, {})):
        with pytest.raises(loaders.StateError, match="different file list"):
            loaders.JsonlSource(path, **kw).load_state_dict(state)
    write(records(30, "a"))
    remote_state = state_after_5(url, storage_options=s3.opts)
    write(records(30, "b"))  # same size and rows, other content: the remote ETag tells
    assert os.path.getsize(local) == loaders.JsonlSource(url, storage_options=s3.opts).shards[0].size_bytes
    with pytest.raises(loaders.StateError, match="different file list"):
        loaders.JsonlSource(url, storage_options=s3.opts).load_state_dict(remote_state)


def _lines(n: int) -> bytes:
    return "".join(json.dumps({"inputs": f"question {i}: " + "w" * (20 + i % 30), "targets": f"a{i}"}) + "\n"
                   for i in range(n)).encode()


def _flip(data: bytes, start: int, count: int = 8) -> bytes:
    out, pos = bytearray(data), start
    for _ in range(count):
        pos = out.index(b"wwww", pos) + 2
        out[pos] ^= 0x01
        pos += 97
    return bytes(out)


@pytest.mark.parametrize("damage", ["crc", "truncated"])
def test_damaged_remote_gzip_raises_like_local(s3, tmp_path, damage):
    members = [gzip.compress(_lines(300)[i * 9000:(i + 1) * 9000], compresslevel=0) for i in range(3)]
    data = b"".join(members)
    if damage == "crc":
        data = data[:len(members[0])] + _flip(data[len(members[0]):], 0) + b""
    else:
        data = data[: len(members[0]) + len(members[1]) // 2]
    local = tmp_path / f"{damage}.jsonl.gz"
    local.write_bytes(data)
    url = s3.upload(f"damaged/{damage}.jsonl.gz", str(local))
    error = loaders.CorruptFileError if damage == "crc" else loaders.TruncatedFileError
    with pytest.raises(error) as remote_info:
        loaders.open_source(url, storage_options=s3.opts)
    with pytest.raises(error) as local_info:
        loaders.open_source(str(local))
    assert str(remote_info.value) == str(local_info.value)
    assert ("gzip member 2" in str(remote_info.value)) and f"{damage}.jsonl.gz" in str(remote_info.value)
    remote = loaders.open_source(url, storage_options=s3.opts, on_error="skip")
    skipping = loaders.open_source(str(local), on_error="skip")
    assert list(remote) == list(skipping) and remote.error_counts == skipping.error_counts == {error.kind: 1}


def test_cache_dir_keeps_local_copies_and_follows_changes(s3, tmp_path):
    cache = tmp_path / "cache"
    local = str(tmp_path / "c.parquet")
    url = s3.upload("cached/c.parquet", write_parquet(local, records(30, "v1"), row_group_size=8))
    src = loaders.open_source(url, storage_options=s3.opts, cache_dir=str(cache))
    assert [x["inputs"] for x in src] == [r["inputs"] for r in records(30, "v1")]
    copy = src._reader.storage.local_path(url)
    assert copy.startswith(str(cache)) and open(copy, "rb").read() == open(local, "rb").read()
    s3.upload("cached/c.parquet", write_parquet(local, records(40, "v2"), row_group_size=8))
    again = loaders.open_source(url, storage_options=s3.opts, cache_dir=str(cache))
    assert [x["inputs"] for x in again] == [r["inputs"] for r in records(40, "v2")]  # not the stale copy
    assert again.read([(0 << 32) | 33])[0]["inputs"] == "question v2-33"


def test_missing_backend_names_url_and_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if gcsfs were not installed
    with pytest.raises(loaders.MissingDependencyError) as info:
        loaders.open_source("gs://some-bucket/data/*.jsonl.gz")
    assert "gs://some-bucket/data/*.jsonl.gz" in str(info.value) and "pip install gcsfs" in str(info.value)


# -- dynabatch.DataLoader end to end ---------------------------------------------------------------

def _delivered(loader) -> list[int]:
    return [i for step in loader.steps() for mb in step for i in mb["sample_ids"].tolist()]


def test_dataloader_streams_s3_jsonl_exactly_once(s3):
    import dynabatch

    loader = dynabatch.DataLoader(s3.url("jsonl/*.jsonl.gz"), options=PlanOptions(global_batch_tokens=4096),
                                  source=DataSource(source_options={"storage_options": s3.opts}, mode="streaming"),
                                  costing=Costing(device="cpu"))
    assert loader.mode == "streaming"
    want = [x["sample_id"] for x in loaders.open_source(_local(s3, "jsonl/*.jsonl.gz"))]
    got = _delivered(loader)
    assert sorted(got) == sorted(want) and len(got) == len(want)


def test_dataloader_indexed_mode_on_s3_parquet(s3):
    import dynabatch

    loader = dynabatch.DataLoader(s3.url("parquet/*.parquet"), options=PlanOptions(global_batch_size=8),
                                  source=DataSource(source_options={"storage_options": s3.opts}),
                                  costing=Costing(device="cpu"))
    assert loader.mode == "indexed" and len(loader) == -(-sum(SIZES) // 8)
    got = _delivered(loader)
    want = [x["sample_id"] for x in loaders.open_source(_local(s3, "parquet/*.parquet"))]
    assert sorted(got) == sorted(want) and len(got) == len(want)


# -- memory:// (fsspec's in-process file system): the formats the S3 tests do not cover -------------

@pytest.fixture
def mem(tmp_path, request):
    """(memory file system, root URL, local folder): ``put(name, path)`` copies a local file there."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = "/loaders-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)

    def put(name: str, path: str) -> None:
        with open(path, "rb") as f:
            fs.pipe(f"{root}/{name}", f.read())

    yield fs, f"memory://{root}", str(tmp_path), put
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _write_compressed_jsonl(path: str, recs, codec) -> str:
    data = ("\n".join(json.dumps(r) for r in recs) + "\n").encode()
    with open(path, "wb") as f:
        f.write(codec(data))
    return path


def _formats(local: str, put) -> dict:
    """{format: (remote pattern under the root, local pattern)} of files made here and copied."""
    import bz2

    import pyarrow as pa
    from PIL import Image

    out = {}
    for i, n in enumerate((9, 14)):
        put(f"plain/p-{i}.jsonl", write_jsonl(os.path.join(local, f"p-{i}.jsonl"), records(n, f"p{i}"), blank_every=4))
    out["jsonl"] = ("plain/*.jsonl", "p-*.jsonl")
    put("c/b.jsonl.bz2", _write_compressed_jsonl(os.path.join(local, "b.jsonl.bz2"), records(12, "b"), bz2.compress))
    out["bz2"] = ("c/b.jsonl.bz2", "b.jsonl.bz2")
    zstandard = pytest.importorskip("zstandard")
    zst = zstandard.ZstdCompressor(write_checksum=True).compress
    put("c/z.jsonl.zst", _write_compressed_jsonl(os.path.join(local, "z.jsonl.zst"), records(12, "z"), zst))
    out["zst"] = ("c/z.jsonl.zst", "z.jsonl.zst")
    table = pa.Table.from_pylist(records(20, "a"))
    with pa.ipc.new_file(os.path.join(local, "a.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=6):
            w.write_batch(batch)
    with pa.ipc.new_stream(os.path.join(local, "s.arrow"), table.schema) as w:
        for batch in table.to_batches(max_chunksize=7):
            w.write_batch(batch)
    put("arrow/a.arrow", os.path.join(local, "a.arrow"))
    out["arrow"] = ("arrow/a.arrow", "a.arrow")
    put("arrow-stream/s.arrow", os.path.join(local, "s.arrow"))
    out["arrow-stream"] = ("arrow-stream/s.arrow", "s.arrow")
    png = image_bytes()
    put("tgz/t-000.tar.gz", write_tar(os.path.join(local, "t-000.tar.gz"),
                                      [(f"k{i:03d}", {"png": png, "txt": f"cap {i}".encode()}) for i in range(6)]))
    out["tar.gz"] = ("tgz/t-{000..000}.tar.gz", "t-000.tar.gz")
    Image.new("RGB", (4, 3)).save(os.path.join(local, "cat.png"))
    put("llava/cat.png", os.path.join(local, "cat.png"))
    convo = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "A cat."}]
    with open(os.path.join(local, "llava.json"), "w") as f:
        json.dump([{"id": str(i), "image": "cat.png", "conversations": convo} for i in range(3)], f)
    put("llava/llava.json", os.path.join(local, "llava.json"))
    out["json"] = ("llava/llava.json", "llava.json")
    return out


MEMORY_FORMATS = ["jsonl", "bz2", "zst", "arrow", "arrow-stream", "tar.gz", "json"]


@pytest.mark.parametrize("fmt", MEMORY_FORMATS)
def test_memory_url_formats_equal_local(mem, fmt):
    _, root, local, put = mem
    remote_pattern, local_pattern = _formats(local, put)[fmt]
    remote = loaders.open_source(f"{root}/{remote_pattern}")
    here = loaders.open_source(os.path.join(local, local_pattern))
    got, want = list(remote), list(here)
    assert len(got) == len(want) > 0 and remote.fingerprint() != here.fingerprint()
    if fmt == "json":  # image paths resolve next to the data file: a URL there, a local path here
        assert [x["images"] for x in got] == [[{"path": f"{root}/llava/cat.png"}]] * 3
        assert [x["image_sizes"] for x in got] == [[(4, 3)]] * 3
        got = [{**x, "images": None} for x in got]
        want = [{**x, "images": None} for x in want]
    assert got == want
    ids = [x["sample_id"] for x in want][::-2]
    assert [x["key"] for x in remote.read(ids)] == [x["key"] for x in here.read(ids)]


def test_memory_arrow_with_cache_dir_reads_the_local_copy(mem, tmp_path):
    _, root, local, put = mem
    remote_pattern, local_pattern = _formats(local, put)["arrow"]
    src = loaders.open_source(f"{root}/{remote_pattern}", cache_dir=str(tmp_path / "cache"))
    assert list(src) == list(loaders.open_source(os.path.join(local, local_pattern)))
    copy = src._reader.storage.local_path(src.shards[0].path)
    assert copy.startswith(str(tmp_path / "cache")) and os.path.getsize(copy) == src.shards[0].size_bytes


def test_memory_save_to_disk_folder(mem):
    import datasets

    fs, root, _, _ = mem
    rows = records(12, "s")
    datasets.Dataset.from_list(rows).save_to_disk(f"{root}/saved")
    src = loaders.open_source(f"{root}/saved")
    assert isinstance(src, loaders.HFSource) and src.name == "saved"
    assert [x["inputs"] for x in src] == [r["inputs"] for r in rows]


def test_memory_truncated_bz2_raises_like_local(mem):
    import bz2

    _, root, local, put = mem
    data = b"".join(bz2.compress(_lines(100)) for _ in range(3))
    path = os.path.join(local, "cut.jsonl.bz2")
    with open(path, "wb") as f:
        f.write(data[: len(data) - 200])
    put("cut.jsonl.bz2", path)
    with pytest.raises(loaders.TruncatedFileError) as remote_info:
        loaders.open_source(f"{root}/cut.jsonl.bz2")
    with pytest.raises(loaders.TruncatedFileError) as local_info:
        loaders.open_source(path)
    assert str(remote_info.value) == str(local_info.value) and "bz2 stream 3" in str(remote_info.value)
