"""The token cache on disk (issue 27.8 and 27.5): memory-mapped, not held in the process; checked
against its integrity record and the tokenizer's content hash, and refused naming the file when
the file, the tokenizer or the data changed."""

from __future__ import annotations

import gc
import os
import pickle

import numpy as np
import pytest

from dynabatch import DataLoader
from dynabatch.index import TokenFileError, TokenFileWriter
from tokenization import tokenizer_fingerprint
from dynabatch.index.token_file import read_token_file

from test_dataloader_data import records, write_parquet
from dynabatch.loader.settings import records_from_keywords


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_parquet(tmp_path_factory.mktemp("tokfile") / "train.parquet", records(120, seed=5), row_group_size=40)


def word_tokenizer(path, shift: int = 0) -> str:
    """A tokenizer.json: one id per character of a fixed alphabet (ids rotated by ``shift``: the same
    vocabulary size and file name, other ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = [*"abcdefghijklmnopqrstuvwxyz0123456789 "]
    words = ["<pad>", "</s>", "<unk>", *chars]
    vocab = {w: (i if i < 3 else 3 + (i - 3 + shift) % len(chars)) for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(path))
    return str(path)


def test_the_cache_is_memory_mapped_and_its_private_file_goes_with_the_loader(path, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))
    dl = DataLoader(path, **records_from_keywords(dict(global_batch_tokens=1500, cache_tokens=True)))
    tc = dl.token_cache
    assert isinstance(tc.input_ids, np.memmap) and isinstance(tc.second, np.memmap)
    assert os.path.dirname(tc.path) == str(tmp_path / "cache") and os.path.exists(tc.path)
    ref = list(DataLoader(path, **records_from_keywords(dict(global_batch_tokens=1500, cache_tokens=False))).microbatches())
    got = list(dl.microbatches())
    assert [m["input_ids"].tolist() for m in got] == [m["input_ids"].tolist() for m in ref]
    clone = pickle.loads(pickle.dumps(tc))  # spawned workers: the path travels, not the ids
    assert len(pickle.dumps(tc)) < tc.nbytes / 4 and isinstance(clone.input_ids, np.memmap)
    ids = dl.index.shapes.sample_id[:7]
    assert all(np.array_equal(a, b) for a, b in zip(tc.gather(ids), clone.gather(ids)))
    file = tc.path
    del dl, tc, clone
    gc.collect()
    assert not os.path.exists(file)


def test_an_edited_or_truncated_file_is_refused(path, tmp_path):
    cache = tmp_path / "index.parquet"
    first = DataLoader(path, **records_from_keywords(dict(index_cache=cache, global_batch_tokens=1500)))
    tokens = f"{cache}.tokens"
    assert first.token_cache.path == tokens
    del first
    with open(tokens, "r+b") as f:  # one id changed
        f.seek(40)
        b = f.read(1)
        f.seek(40)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(TokenFileError, match=f"token cache {tokens}: its content does not match"):
        DataLoader(path, **records_from_keywords(dict(index_cache=cache, global_batch_tokens=1500)))
    with open(tokens, "r+b") as f:
        f.truncate(os.path.getsize(tokens) - 3)
    with pytest.raises(TokenFileError, match=f"token cache {tokens}: not a dynabatch token-cache file"):
        DataLoader(path, **records_from_keywords(dict(index_cache=cache, global_batch_tokens=1500)))


def test_a_replaced_tokenizer_is_not_reused(path, tmp_path):
    """tokenizer.json replaced at the same path with the same vocabulary size (main reused the old
    ids): the index cache records the tokenizer's content hash, so both caches are made again and the
    batches carry the new tokenizer's ids (the token file alone refuses another tokenizer: below)."""
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    cache = tmp_path / "index.parquet"
    kw = dict(tokenizer=tok, index_cache=cache, global_batch_tokens=1500)
    old = [m["input_ids"].tolist() for m in DataLoader(path, **records_from_keywords(dict(**kw))).microbatches()]
    word_tokenizer(tmp_path / "tokenizer.json", shift=5)
    new = [m["input_ids"].tolist() for m in DataLoader(path, **records_from_keywords(dict(**kw))).microbatches()]
    assert len(new) == len(old) and new != old
    again = [m["input_ids"].tolist() for m in DataLoader(path, **records_from_keywords(dict(**kw))).microbatches()]
    assert again == new


def test_tokenizer_fingerprint_is_the_content_not_the_path(tmp_path):
    from tokenization import load_tokenizer

    a = word_tokenizer(tmp_path / "a.json")
    os.makedirs(tmp_path / "b")
    b = word_tokenizer(tmp_path / "b" / "a.json")
    c = word_tokenizer(tmp_path / "c.json", shift=1)
    fa, fb, fc = (tokenizer_fingerprint(load_tokenizer(p)) for p in (a, b, c))
    assert fa == fb != fc
    assert tokenizer_fingerprint(load_tokenizer("bytes")) not in (fa, fc)


def test_other_settings_and_missing_footer_are_refused(tmp_path):
    path = str(tmp_path / "t.bin")
    w = TokenFileWriter(path)
    w.add([3, 1], np.array([5, 6, 7], np.int32), [2, 1], np.array([-100, 6, 7], np.int32), [2, 1])
    w.finish({"settings": {"max_total_tokens": 64, "source_fingerprint": "abc"}, "tokenizer": "t" * 64})
    ids, inp, off, second, soff = read_token_file(path, settings={"max_total_tokens": 64, "source_fingerprint": "abc"},
                                                  tokenizer="t" * 64)
    assert ids.tolist() == [3, 1] and inp.tolist() == [5, 6, 7] and off.tolist() == [0, 2, 3]
    assert second.tolist() == [-100, 6, 7] and soff.tolist() == [0, 2, 3]
    with pytest.raises(TokenFileError, match=f"token cache {path} was made with source_fingerprint='abc'.*'xyz'"):
        read_token_file(path, settings={"max_total_tokens": 64, "source_fingerprint": "xyz"}, tokenizer="t" * 64)
    with pytest.raises(TokenFileError, match="another tokenizer"):
        read_token_file(path, settings={"max_total_tokens": 64, "source_fingerprint": "abc"}, tokenizer="u" * 64)
    w = TokenFileWriter(str(tmp_path / "never.bin"))  # a scan that fails leaves no file
    w.add([0], np.array([1], np.int32), [1], np.array([1], np.int32), [1])
    w.discard()
    assert os.listdir(tmp_path) == ["t.bin"]


def _mapped_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                inside = len(head) > 5 and head[5] == path
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_the_caches_file_pages_never_count_in_the_process_over_an_epoch(tmp_path, monkeypatch):
    """Issue 27.8: an epoch reads every sample of a token file in random order. Read through the
    memory map, each read mapped a large folio (up to 2 MiB) into the process, so its resident memory
    grew to the whole file; read with pread, none of the file's pages is mapped into the process, and
    every batch equals the in-memory cache's."""
    from test_dataloader_data import write_jsonl

    rng = np.random.default_rng(11)
    recs = [{"inputs": "".join(rng.choice(list("abcdefgh "), int(rng.integers(1000, 3000)))), "targets": "yes"}
            for _ in range(1500)]
    data = write_jsonl(tmp_path / "long.jsonl", recs)
    monkeypatch.setenv("DYNABATCH_CACHE_DIR", str(tmp_path / "cache"))
    kw = dict(global_batch_tokens=65536, max_len=4096, mode="indexed")
    dl = DataLoader(data, **records_from_keywords(dict(**kw, cache_tokens=True)))
    tc = dl.token_cache
    assert os.path.getsize(tc.path) > 20 << 20
    peak, seen, batches = 0, 0, []
    for step in dl.steps():  # a step's micro-batches come from one read of the cache
        seen += sum(len(mb["sample_ids"]) for mb in step)
        batches += [mb["input_ids"].numpy().tobytes() for mb in step]
        peak = max(peak, _mapped_bytes(tc.path))
    assert seen == len(recs) and peak == 0, peak
    in_memory = DataLoader(data, **records_from_keywords(dict(**kw, cache_tokens=False)))
    assert batches == [mb["input_ids"].numpy().tobytes() for step in in_memory.steps() for mb in step]
    assert int(tc.input_ids[: 1 << 20].sum()) and _mapped_bytes(tc.path) >= 1 << 20  # what reads map is seen
