"""`count_batch` equals the lengths of `encode_batch`, and scans agree with or without it."""

import numpy as np
import pytest

from tokenization import ByteTokenizer, scan_shapes

TEXTS = ["", "hello", "héllo wörld", "日本語のテキスト", "a" * 1000]


class _NoCount:
    """The byte tokenizer without its count_batch fast path."""

    def __init__(self):
        self._t = ByteTokenizer()
        for k in ("name", "vocab_size", "eos_id", "pad_id", "bos_id"):
            setattr(self, k, getattr(self._t, k))

    def encode_batch(self, texts):
        return self._t.encode_batch(texts)

    def decode(self, ids):
        return self._t.decode(ids)


def test_byte_counts_match_ids():
    t = ByteTokenizer()
    assert t.count_batch(TEXTS).tolist() == [len(a) for a in t.encode_batch(TEXTS)]


def test_hf_counts_match_ids(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenization import HFTokenizer

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world again and again"] * 20,
                            tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>", "<pad>"]))
    hf = HFTokenizer(tok, eos_token="</s>", pad_token="<pad>")
    assert hf.count_batch(TEXTS).tolist() == [len(a) for a in hf.encode_batch(TEXTS)]


def test_scan_same_with_and_without_count_batch():
    rng = np.random.default_rng(0)
    samples = [{"sample_id": i, "key": f"k{i}", "inputs": "word " * int(rng.integers(1, 50)),
                "targets": "x" * int(rng.integers(0, 9)), "task": "t", "images": []} for i in range(200)]
    for family in ("decoder", "encoder_decoder"):
        fast = scan_shapes(samples, ByteTokenizer(), family=family, max_input_tokens=64)
        slow = scan_shapes(samples, _NoCount(), family=family, max_input_tokens=64)
        assert fast.select(["input_tokens", "target_tokens"]).equals(slow.select(["input_tokens", "target_tokens"]))
