"""Issue 27 point 5: the tokenizer's content hash (not its path) is recorded with the length index,
the plan and the loader state; another tokenizer (a tokenizer.json replaced at the same path with the
same vocabulary size, or ``bytes`` vs a subword tokenizer) is refused naming both."""

from __future__ import annotations

import json
import string

import numpy as np
import pytest

from dynabatch import DataLoader, LoaderStateError, PlanMismatchError, build_index
from dynabatch.cli import main
from dynabatch.index import LengthIndexError
from tokenization import load_tokenizer, tokenizer_fingerprint

from test_dataloader_data import PLAN, records, write_jsonl
from dynabatch.loader.settings import records_from_keywords

TOKENS = 2000
CHARS = string.ascii_letters + string.digits + " "


def _char_tokenizer(path, reverse=False):
    """A character tokenizer (one token per character of ``CHARS``), ids reversed when asked: the same
    vocabulary size and token counts, other ids."""
    tk = pytest.importorskip("tokenizers")
    vocab = list(CHARS) + ["</s>", "<unk>"]
    order = vocab[::-1] if reverse else vocab
    tok = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(order)}, [], unk_token="<unk>"))
    tok.save(str(path))
    return str(path)


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", records(90, seed=12))


def test_fingerprint_is_content_not_path(tmp_path):
    a = _char_tokenizer(tmp_path / "a.json")
    b = _char_tokenizer(tmp_path / "b.json")
    c = _char_tokenizer(tmp_path / "c.json", reverse=True)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(load_tokenizer(b)) != tokenizer_fingerprint(c)
    assert load_tokenizer(a).vocab_size == load_tokenizer(c).vocab_size
    assert tokenizer_fingerprint("bytes") == tokenizer_fingerprint(load_tokenizer("bytes")) == "bytes-v1"
    assert tokenizer_fingerprint(a).startswith("sha256:") and len(tokenizer_fingerprint(a)) == 23


def test_tokenizer_replaced_at_the_same_path_is_refused_and_the_cache_rebuilt(data, tmp_path):
    path = _char_tokenizer(tmp_path / "tokenizer.json")
    index = tmp_path / "index.parquet"
    build_index(data, tokenizer=path, cache_tokens=True, path=index)  # token-cached index
    kw = dict(tokenizer=path, global_batch_tokens=TOKENS, cache_tokens=True, **PLAN)
    state = DataLoader(data, **records_from_keywords(dict(index=str(index), **kw)))
    it = iter(state)
    next(it)
    saved = json.loads(json.dumps(state.state_dict()))
    state.close()

    _char_tokenizer(tmp_path / "tokenizer.json", reverse=True)  # same path, same vocabulary size, other ids
    with pytest.raises(LengthIndexError) as e:
        DataLoader(data, **records_from_keywords(dict(index=str(index), **kw)))
    msg = str(e.value)
    assert msg.startswith(f"{index} was made with the tokenizer tokenizers:{path} (content sha256:"), msg
    assert f"but the one in use is tokenizers:{path} (content sha256:" in msg and "re-scan the data" in msg
    with pytest.raises(LoaderStateError, match=rf"the DataLoader state was made with a tokenizer of content "
                                               rf"sha256:\w+, but the one in use is tokenizers:{path}"):
        DataLoader(data, **records_from_keywords(dict(mode="indexed", **kw))).load_state_dict(saved)
    # a loader with an index cache rebuilds it, and its batches carry the new tokenizer's ids
    cache = tmp_path / "cache.parquet"
    _char_tokenizer(tmp_path / "tokenizer.json")
    list(DataLoader(data, **records_from_keywords(dict(index_cache=str(cache), **kw))))
    _char_tokenizer(tmp_path / "tokenizer.json", reverse=True)
    new = load_tokenizer(path)
    dl = DataLoader(data, **records_from_keywords(dict(index_cache=str(cache), **kw)))
    mb = next(iter(dl))[0]
    import loaders

    first = loaders.open_source(data).read([int(mb["sample_ids"][0])])[0]
    want = new.encode_batch([first["inputs"]])[0]
    row = mb["input_ids"][0].numpy()
    assert np.array_equal(row[: len(want)], want)
    dl.close()


def test_bytes_plan_replayed_with_another_tokenizer_is_refused(data, tmp_path):
    index = tmp_path / "index.parquet"
    build_index(data, path=index)  # bytes
    plan = tmp_path / "plan.parquet"
    assert main(["plan", str(index), "--out", str(plan), "--model", "gpt", "--device", "cpu", "--ranks", "1",
                 "--stages", "2", "--global-batch-tokens", str(TOKENS), "--workers", "1", "--no-progress"]) == 0
    other = _char_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(PlanMismatchError, match=rf"{plan} was made with a tokenizer of content bytes-v1, but "
                                                rf"the one in use is tokenizers:{other} \(content sha256:"):
        DataLoader(data, **records_from_keywords(dict(plan=str(plan), index=str(index), tokenizer=other, global_batch_tokens=TOKENS, **PLAN)))
    with pytest.raises(LengthIndexError, match=r"was made with the tokenizer bytes \(content bytes-v1\)"):
        DataLoader(data, **records_from_keywords(dict(index=str(index), tokenizer=other, global_batch_tokens=TOKENS, **PLAN)))
    steps = list(DataLoader(data, **records_from_keywords(dict(plan=str(plan), index=str(index), global_batch_tokens=TOKENS, **PLAN))))
    assert steps
