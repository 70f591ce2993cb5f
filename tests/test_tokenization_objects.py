"""Tokenizer objects as specs: tokenizers.Tokenizer, transformers tokenizers and tiktoken.Encoding
are wrapped in their adapters by load_tokenizer, and so work in the DataLoader, build_index and the
index scan (all built in-process: no network)."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tokenization import HFTokenizer, TiktokenTokenizer, TransformersTokenizer, load_tokenizer
from dynabatch.loader.settings import records_from_keywords

tk = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer turns text into token ids",
    "dynabatch plans micro batches for variable length data",
    "hello world, hello tokens, hello batches",
] * 5
TEXTS = ["the lazy fox", "hello batches of data", "ünïcode text ✓ and unseen words"]
PLAN = dict(cost_model="gpt", device="cpu", num_stages=2)


def train_bpe(corpus=SENTENCES, vocab_size=300):
    """A tiny byte-level BPE trained here (special tokens <pad> <s> </s> <unk> are ids 0-3)."""
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def raw():
    return train_bpe()


@pytest.fixture(scope="module")
def fast(raw):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>",
                                                bos_token="<s>")


@pytest.fixture(scope="module")
def encoding():
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    ranks = {bytes([i]): i for i in range(256)}
    for k, merge in enumerate([b"th", b"he", b"the", b"ll", b"llo", b" t"]):
        ranks[merge] = 256 + k
    return tiktoken.Encoding(name="tiny-test", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 262})


def own_ids(kind, obj, text):
    """The object's own encoding of ``text`` (no special tokens)."""
    if kind == "tokenizers":
        return obj.encode(text, add_special_tokens=False).ids
    if kind == "transformers":
        return obj(text, add_special_tokens=False)["input_ids"]
    return obj.encode_ordinary(text)


KINDS = {  # kind -> (adapter, (pad, bos, eos))
    "tokenizers": (HFTokenizer, (0, 1, 2)),
    "transformers": (TransformersTokenizer, (0, 1, 2)),
    "tiktoken": (TiktokenTokenizer, (262, None, 262)),
}


@pytest.fixture(params=list(KINDS))
def kind_obj(request):
    return request.param, request.getfixturevalue({"tokenizers": "raw", "transformers": "fast",
                                                   "tiktoken": "encoding"}[request.param])


def test_load_tokenizer_wraps_each_kind_and_encodes_like_the_object(kind_obj):
    kind, obj = kind_obj
    adapter, specials = KINDS[kind]
    tok = load_tokenizer(obj)
    assert type(tok) is adapter
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == specials
    assert [a.tolist() for a in tok.encode_batch(TEXTS)] == [own_ids(kind, obj, t) for t in TEXTS]
    assert all(a.dtype == np.int32 for a in tok.encode_batch(TEXTS))
    assert tok.decode(tok.encode_batch(["the lazy fox"])[0]) == "the lazy fox"


def test_adapters_of_objects_pickle(kind_obj):
    kind, obj = kind_obj
    tok = load_tokenizer(obj)
    back = pickle.loads(pickle.dumps(tok))
    assert (back.name, back.vocab_size, back.pad_id, back.bos_id, back.eos_id) == \
        (tok.name, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    assert [a.tolist() for a in back.encode_batch(TEXTS)] == [own_ids(kind, obj, t) for t in TEXTS]


def test_tokenizers_object_specials_by_name_and_caller_object_untouched():
    raw = train_bpe()
    raw.enable_truncation(max_length=2)
    tok = load_tokenizer(raw, eos_token="<unk>", pad_token="<s>")
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (3, 1, 1)
    assert len(tok.encode_batch([SENTENCES[0]])[0]) > 2  # the object's truncation does not cap counts
    assert raw.truncation is not None and raw.truncation["max_length"] == 2  # ... and is still the caller's
    with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
        load_tokenizer(raw, eos_token="<nope>")


def test_transformers_object_special_ids_and_missing_eos(raw):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    no_eos = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>")
    with pytest.raises(ValueError, match="no EOS token.*eos_token is not set.*eos_token="):
        load_tokenizer(no_eos)
    tok = load_tokenizer(no_eos, eos_token="</s>")
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 0, None)
    no_pad = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    assert load_tokenizer(no_pad).pad_id == 2  # no PAD: pad with EOS
    with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
        load_tokenizer(no_pad, pad_token="<nope>")


def test_object_names_follow_content(raw, fast):
    other = train_bpe(["completely different words here"] * 10, vocab_size=280)
    assert load_tokenizer(raw).name == load_tokenizer(train_bpe()).name  # same content, same name
    assert load_tokenizer(raw).name != load_tokenizer(other).name  # an index cache never mixes them up
    assert load_tokenizer(fast).name.startswith("transformers:")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    other_fast = transformers.PreTrainedTokenizerFast(tokenizer_object=other, pad_token="<pad>", eos_token="</s>")
    assert load_tokenizer(fast).name != load_tokenizer(other_fast).name


def test_unknown_object_is_refused_without_importing_optional_libraries():
    code = (
        "import sys\n"
        "from tokenization import load_tokenizer\n"
        "try:\n"
        "    load_tokenizer(object())\n"
        "except TypeError as e:\n"
        "    msg = str(e)\n"
        "assert 'transformers tokenizer' in msg and 'tiktoken.Encoding' in msg and 'object' in msg, msg\n"
        "assert not {'transformers', 'tiktoken', 'tokenizers'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


# -- through the DataLoader, build_index and the index scan ------------------------------------------


def write_records(path, n=24):
    rng = np.random.default_rng(0)
    words = " ".join(SENTENCES).split()
    recs = [{"inputs": " ".join(rng.choice(words, int(rng.integers(2, 12)))),
             "targets": " ".join(rng.choice(words, int(rng.integers(1, 6))))} for _ in range(n)]
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return recs


def packed_rows(batch):
    """Per-sample input ids of a packed micro-batch (positions restart at 0 at each sample)."""
    ids, pos = batch["input_ids"][0].tolist(), batch["position_ids"][0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
    return [ids[a:b] for a, b in zip(starts, starts[1:])]


def check_loader_tokens(loader, recs, kind, obj, eos):
    seen = []
    for step in loader.steps():
        for b in step:
            if b["is_padding"]:
                continue
            for sid, got in zip(b["sample_ids"].tolist(), packed_rows(b)):
                r = recs[sid & 0xFFFFFFFF]
                assert got == own_ids(kind, obj, r["inputs"]) + own_ids(kind, obj, r["targets"]) + [eos]
                seen.append(sid)
    assert sorted(seen) == list(range(len(recs)))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_dataloader_with_tokenizer_object(kind_obj, num_workers, tmp_path):
    import dynabatch

    kind, obj = kind_obj
    recs = write_records(tmp_path / "d.jsonl")
    dl = dynabatch.DataLoader(str(tmp_path / "d.jsonl"),
                              **records_from_keywords(dict(tokenizer=obj, global_batch_tokens=160, collate="packed",
                                                      mode="indexed", num_workers=num_workers, **PLAN)))
    assert type(dl.tokenizer) is KINDS[kind][0]
    check_loader_tokens(dl, recs, kind, obj, KINDS[kind][1][2])


def test_dataloader_spawned_worker_gets_a_transformers_object(fast, tmp_path):
    import dynabatch

    recs = write_records(tmp_path / "d.jsonl", n=10)
    dl = dynabatch.DataLoader(str(tmp_path / "d.jsonl"),
                              **records_from_keywords(dict(tokenizer=fast, global_batch_tokens=400, collate="packed",
                                                      mode="streaming", num_workers=1,
                                                      multiprocessing_context="spawn", **PLAN)))
    check_loader_tokens(dl, recs, "transformers", fast, 2)


def test_build_index_and_scan_with_an_object_equal_the_saved_file(raw, tmp_path):
    import dynabatch
    from dynabatch.index import ScanConfig, scan_dataset

    write_records(tmp_path / "d.jsonl")
    raw.save(str(tmp_path / "tokenizer.json"))
    data = str(tmp_path / "d.jsonl")
    by_object = dynabatch.build_index(data, tokenizer=raw, max_len=12)
    by_file = dynabatch.build_index(data, tokenizer=str(tmp_path / "tokenizer.json"), max_len=12)
    for col in ("sample_id", "input_tokens", "target_tokens", "label_tokens"):
        assert by_object.column(col).to_pylist() == by_file.column(col).to_pylist()
    # the index scan over two worker processes: the object travels as its (pickled) adapter
    scanned = scan_dataset(data, ScanConfig(tokenizer=raw), workers=2, progress=False)
    ref = scan_dataset(data, ScanConfig(tokenizer=str(tmp_path / "tokenizer.json")), workers=1, progress=False)
    assert scanned.parts == 4
    assert scanned.table.column("input_tokens").to_pylist() == ref.table.column("input_tokens").to_pylist()
    assert scanned.meta["tokenizer"] == load_tokenizer(raw).name
