"""Tokenizer protocol, adapters (on tiny locally built tokenizers) and load_tokenizer."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from tokenization import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    TransformersTokenizer,
    load_tokenizer,
    scan_shapes,
)

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a tokenizer turns text into token ids",
    "dynabatch plans micro batches for variable length data",
    "hello world, hello tokens, hello batches",
    "encoder decoder models read inputs and write targets",
] * 4


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
    """A tiny byte-level BPE trained here, saved as tokenizer.json (no download)."""
    tk = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A tiny sentencepiece BPE model trained here from a temp text file."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece is not installed (pip install sentencepiece)")
    d = tmp_path_factory.mktemp("spm")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(SENTENCES), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(d / "tiny"),
        vocab_size=80,
        model_type="bpe",
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return d / "tiny.model"


# --- byte tokenizer -------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_special_ids():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 259)
    texts = ["hello", "", "héllo wörld ✓", "日本語"]
    ids = tok.encode_batch(texts)
    assert all(a.dtype == np.int32 for a in ids)
    assert [len(a) for a in ids] == [len(t.encode("utf-8")) for t in texts]
    assert ids[0].tolist() == [ord(c) + 3 for c in "hello"]
    assert all(a.min(initial=3) >= 3 for a in ids)  # bytes never collide with special ids
    assert [tok.decode(a) for a in ids] == texts
    # special ids are dropped on decode
    assert tok.decode([tok.bos_id, *ids[0], tok.eos_id, tok.pad_id]) == "hello"


# --- Hugging Face tokenizers -----------------------------------------------------------


def test_hf_tokenizer_json(bpe_json):
    import tokenizers

    tok = load_tokenizer(str(bpe_json))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    raw = tokenizers.Tokenizer.from_file(str(bpe_json))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    ids = tok.encode_batch(SENTENCES[:3] + ["unseen words, zebra!"])
    for text, a in zip(SENTENCES[:3] + ["unseen words, zebra!"], ids):
        assert a.dtype == np.int32
        assert a.tolist() == raw.encode(text, add_special_tokens=False).ids
        assert tok.decode(a) == text
    # the subword tokenizer is shorter than bytes on text it was trained on
    assert len(ids[0]) < len(SENTENCES[0].encode())
    assert "tokenizer.json" in tok.name


def test_hf_tokenizer_ignores_saved_truncation_padding_and_post_processor(bpe_json, tmp_path):
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(str(bpe_json))
    raw.enable_truncation(max_length=3)
    raw.enable_padding(length=64, pad_id=0, pad_token="<pad>")
    raw.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    plain = load_tokenizer(str(bpe_json)).encode_batch([SENTENCES[0]])[0]
    assert load_tokenizer(str(path)).encode_batch([SENTENCES[0]])[0].tolist() == plain.tolist()
    # the caller's object is not modified either
    HFTokenizer(raw)
    assert raw.truncation is not None


def test_hf_special_tokens_from_config_and_explicit(bpe_json, tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(bpe_json.read_bytes())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert load_tokenizer(str(d / "tokenizer.json")).eos_id == 0
    assert HFTokenizer(str(bpe_json), eos_token="<unk>").eos_id == 3
    with pytest.raises(ValueError, match="'<nope>' is not in the vocabulary"):
        HFTokenizer(str(bpe_json), eos_token="<nope>")


def test_hf_without_eos_says_how_to_fix(tmp_path):
    tk = pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install tokenizers)")
    tok = tk.Tokenizer(tk.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with pytest.raises(ValueError, match="no EOS token.*eos_token="):
        load_tokenizer(str(path))
    t = load_tokenizer(str(path), eos_token="[UNK]")
    assert t.eos_id == 2 and t.pad_id == 2 and t.bos_id is None
    assert [a.tolist() for a in t.encode_batch(["a b", "b"])] == [[0, 1], [1]]


def test_scan_with_subword_tokenizer_matches_direct_encoding(bpe_json):
    tok = load_tokenizer(str(bpe_json))
    samples = [{"sample_id": i, "inputs": s, "targets": SENTENCES[i + 1]} for i, s in enumerate(SENTENCES[:4])]
    table = scan_shapes(samples, str(bpe_json), family="encoder_decoder", batch_size=3)
    assert table.column("input_tokens").to_pylist() == [len(tok.encode_batch([s["inputs"]])[0]) for s in samples]
    assert table.column("target_tokens").to_pylist() == [len(tok.encode_batch([s["targets"]])[0]) + 1 for s in samples]


# --- sentencepiece ---------------------------------------------------------------------


def test_sentencepiece_model(spm_model):
    import sentencepiece as spm

    tok = load_tokenizer(str(spm_model))
    assert isinstance(tok, SentencePieceTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 2, 3)
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    assert tok.vocab_size == sp.vocab_size()
    ids = tok.encode_batch(SENTENCES[:3])
    for text, a in zip(SENTENCES[:3], ids):
        assert a.dtype == np.int32
        assert a.tolist() == sp.encode(text)
        assert tok.decode(a) == text
    assert 3 not in ids[0].tolist()  # no EOS added by encode_batch


# --- transformers ----------------------------------------------------------------------


def test_transformers_adapter_real(bpe_json, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional adapter)")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(bpe_json), eos_token="</s>", pad_token="<pad>", bos_token="<s>"
    )
    fast.save_pretrained(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, TransformersTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    ref = load_tokenizer(str(bpe_json))
    assert [a.tolist() for a in tok.encode_batch(SENTENCES[:2])] == [a.tolist() for a in ref.encode_batch(SENTENCES[:2])]


def test_transformers_adapter_glue_with_fake_module(monkeypatch, tmp_path):
    """The adapter's use of AutoTokenizer, checked without transformers installed."""
    seen = {}

    class FakeTok:
        eos_token_id, pad_token_id, bos_token_id = 2, None, None

        def __len__(self):
            return 259

        def __call__(self, texts, **kw):
            seen["call"] = kw
            return {"input_ids": [[ord(c) for c in t] for t in texts]}

        def decode(self, ids, skip_special_tokens):
            return "".join(chr(i) for i in ids)

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path, **kw):
            seen["load"] = (path, kw)
            return FakeTok()

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoTokenizer=AutoTokenizer))
    tok = load_tokenizer(str(tmp_path))
    assert seen["load"] == (str(tmp_path), {"trust_remote_code": False, "local_files_only": True})
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (2, 2, None, 259)
    assert [a.tolist() for a in tok.encode_batch(["ab"])] == [[97, 98]]
    assert seen["call"]["add_special_tokens"] is False
    assert tok.decode(np.array([97, 98])) == "ab"


def test_transformers_refuses_non_local_paths():
    with pytest.raises(FileNotFoundError, match="only loads tokenizers from local files"):
        TransformersTokenizer("meta-llama/Llama-2-7b-hf")


# --- tiktoken --------------------------------------------------------------------------


def test_tiktoken_adapter_on_local_encoding():
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    ranks = {bytes([i]): i for i in range(256)}
    ranks[b"th"] = 256
    enc = tiktoken.Encoding(
        name="tiny", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 257}
    )
    tok = TiktokenTokenizer(enc)
    assert (tok.eos_id, tok.pad_id, tok.bos_id, tok.vocab_size) == (257, 257, None, 258)
    ids = tok.encode_batch(["the", "x<|endoftext|>"])
    assert ids[0].tolist() == [256, ord("e")]
    assert 257 not in ids[1].tolist()  # special-token text in data is plain text
    assert tok.decode(ids[0]) == "the"
    assert tok.name == "tiktoken:tiny"


def test_tiktoken_never_downloads(monkeypatch, tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    import tiktoken.registry

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "r50k_base", raising=False)
    with pytest.raises(OSError, match="not cached locally.*never downloads"):
        load_tokenizer("tiktoken:r50k_base")


def test_tiktoken_named_encoding_if_cached():
    pytest.importorskip("tiktoken", reason="tiktoken is not installed (pip install tiktoken)")
    try:
        tok = load_tokenizer("tiktoken:cl100k_base")
    except OSError as exc:
        pytest.skip(f"cl100k_base is not in the local tiktoken cache: {exc}")
    assert tok.eos_id == 100257
    assert tok.decode(tok.encode_batch(["hello world"])[0]) == "hello world"


# --- missing packages and bad specs ----------------------------------------------------


@pytest.mark.parametrize(
    "module, build",
    [
        ("tokenizers", lambda p: HFTokenizer(p / "tokenizer.json")),
        ("sentencepiece", lambda p: SentencePieceTokenizer(p / "tokenizer.json")),
        ("tiktoken", lambda p: TiktokenTokenizer("cl100k_base")),
        ("transformers", lambda p: TransformersTokenizer(p)),
    ],
)
def test_missing_package_says_what_to_install(module, build, monkeypatch, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(ImportError, match=f"pip install {module}"):
        build(tmp_path)


@pytest.mark.parametrize("spec", ["gpt2", "/no/such/tokenizer.json", "tiktoken-cl100k", ""])
def test_bad_spec_names_it(spec):
    with pytest.raises(ValueError, match="tokenizer spec") as info:
        load_tokenizer(spec)
    assert repr(spec) in str(info.value)
    assert "nothing is downloaded" in str(info.value)


def test_spec_file_with_unknown_suffix_and_non_string(tmp_path):
    f = tmp_path / "vocab.txt"
    f.write_text("a\n")
    with pytest.raises(ValueError, match="vocab.txt"):
        load_tokenizer(str(f))
    with pytest.raises(TypeError, match="tokenizer spec"):
        load_tokenizer(42)
    tok = ByteTokenizer()
    assert load_tokenizer(tok) is tok
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
