"""dynabatch.loader.collate: padded and packed layouts on hand-made examples."""

import numpy as np
import pytest
import torch

from dynabatch.loader.collate import (IGNORE_INDEX, collate_packed, collate_padded, count_label_tokens, model_inputs,
                               placeholder_batch)
from tokenization import ByteTokenizer, EncodedSample, Formatter


def dec(ids, labels, sid=0):
    ids = np.asarray(ids, np.int32)
    return EncodedSample(sid, ids, None, np.asarray(labels, np.int32), 0, 0, 0, False)


def encdec(inp, tgt, sid=0):
    return EncodedSample(sid, np.asarray(inp, np.int32), np.asarray(tgt, np.int32), None, len(inp), len(tgt), 0, False)


X = IGNORE_INDEX


def test_packed_hand_example():
    a = dec([10, 11, 12], [X, 11, 12])
    b = dec([20, 21], [20, 21])  # language-modelling sample: every label trained
    c = dec([30, 31, 32, 33], [X, X, 32, 33])
    out = collate_packed([a, b, c])
    assert out["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 31, 32, 33]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert out["cu_seqlens"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert out["max_seqlen"] == 4
    # -100 on prompts and on the first label of every sample (DataCollatorWithFlattening)
    assert out["labels"].tolist() == [[X, 11, 12, X, 21, X, X, 32, 33]]
    assert count_label_tokens(out) == 5


def test_packed_carries_hugging_face_flash_attention_kwargs():
    """The boundaries again under DataCollatorWithFlattening's names, kept by `model_inputs`."""
    out = collate_packed([dec([10, 11, 12], [X, 11, 12]), dec([20, 21], [20, 21])])
    for k in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert out[k].dtype == torch.int32 and out[k].tolist() == out["cu_seqlens"].tolist() == [0, 3, 5]
    assert out["max_length_q"] == out["max_length_k"] == out["max_seqlen"] == 3
    assert type(out["max_length_q"]) is int
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]] and out["labels"].tolist() == [[X, 11, 12, X, 21]]
    got = model_inputs({**out, "step": 0, "sample_ids": torch.tensor([0, 1]), "real_tokens": 5})
    assert set(got) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                        "max_length_k", "use_cache"}
    assert got["use_cache"] is False  # a KV cache turns off HF's packed-sequence mask (sdpa, eager)
    ph = placeholder_batch("packed", length=8)
    assert ph["cu_seq_lens_q"].tolist() == [0, 8] and ph["max_length_k"] == 8
    # padded and encoder-decoder packed batches: no HF varlen names, no use_cache
    assert set(model_inputs(collate_padded([dec([1, 2], [1, 2])]))) == {"input_ids", "attention_mask", "labels"}
    ed = collate_packed([encdec([5, 6], [7, 2])], family="encoder_decoder")
    assert "cu_seq_lens_q" not in ed and "use_cache" not in model_inputs(ed)
    assert "cu_seq_lens_q" not in placeholder_batch("packed", family="encoder_decoder")


def test_padded_hand_example_decoder():
    a = dec([10, 11, 12], [X, 11, 12])
    b = dec([20, 21, 22, 23, 24], [X, X, 22, 23, 24])
    out = collate_padded([a, b], pad_id=0, pad_to_multiple_of=4)
    assert out["input_ids"].shape == (2, 8)
    assert out["input_ids"].tolist() == [[10, 11, 12, 0, 0, 0, 0, 0], [20, 21, 22, 23, 24, 0, 0, 0]]
    assert out["attention_mask"].sum(1).tolist() == [3, 5]
    assert out["labels"].tolist() == [[X, 11, 12, X, X, X, X, X], [X, X, 22, 23, 24, X, X, X]]
    assert "position_ids" not in out
    # the plan's padded length wins when longer
    assert collate_padded([a, b], input_len=16)["input_ids"].shape == (2, 16)


def test_padded_encoder_decoder_shift_right():
    a = encdec([5, 6, 7], [40, 41, 2])
    b = encdec([8], [50, 2])
    out = collate_padded([a, b], family="encoder_decoder", pad_id=0, decoder_start_token_id=9, pad_to_multiple_of=1)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["labels"].tolist() == [[40, 41, 2], [50, 2, X]]
    assert out["decoder_input_ids"].tolist() == [[9, 40, 41], [9, 50, 0]]
    assert out["decoder_attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    packed = collate_packed([a, b], family="encoder_decoder", decoder_start_token_id=9)
    assert packed["labels"].tolist() == [[40, 41, 2, 50, 2]]
    assert packed["decoder_input_ids"].tolist() == [[9, 40, 41, 9, 50]]
    assert packed["decoder_cu_seqlens"].tolist() == [0, 3, 5]
    assert packed["cu_seqlens"].tolist() == [0, 3, 4]


def test_packed_rows_layout():
    a, b, c = dec([1, 2], [1, 2]), dec([3, 4, 5], [3, 4, 5]), dec([6], [6])
    out = collate_padded([a, b, c], rows=[0, 1, 0], pad_to_multiple_of=1)
    assert out["input_ids"].tolist() == [[1, 2, 6], [3, 4, 5]]
    assert out["position_ids"].tolist() == [[0, 1, 0], [0, 1, 2]]
    assert out["labels"].tolist() == [[X, 2, X], [X, 4, 5]]


def test_formatter_prompt_masking_survives_collation():
    tok = ByteTokenizer()
    fmt = Formatter(tok, family="decoder")
    encs = fmt.encode_batch([{"sample_id": 0, "inputs": "2+2=", "targets": "4"},
                             {"sample_id": 1, "inputs": "hello there", "targets": "hi"}])
    out = collate_padded(encs, pad_id=tok.pad_id, pad_to_multiple_of=8)
    for row, e in enumerate(encs):
        lab = out["labels"][row]
        n = len(e.input_ids)
        assert (lab[: e.input_tokens] == X).all()  # the prompt is masked
        assert lab[e.input_tokens:n].tolist() == e.input_ids[e.input_tokens:].tolist()  # the response is trained
        assert (lab[n:] == X).all()
    packed = collate_packed(encs)
    assert count_label_tokens(packed) == count_label_tokens(out) == sum(e.target_tokens for e in encs)


@pytest.mark.parametrize("collation", ["padded", "packed", "packed_rows"])
@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_placeholder_has_no_loss(collation, family):
    out = placeholder_batch(collation, family=family, pad_id=0, length=8)
    assert count_label_tokens(out) == 0
    assert out["input_ids"].shape[1] == 8
    assert set(model_inputs({**out, "step": 3})) - {"use_cache"} <= set(out)


def test_empty_and_ragged_edge_cases():
    out = collate_padded([dec([7], [7])], pad_to_multiple_of=8)
    assert out["input_ids"].shape == (1, 8) and out["labels"].tolist()[0] == [X] * 8
    rng = np.random.default_rng(0)
    samples = [dec(rng.integers(3, 200, n), rng.integers(3, 200, n)) for n in rng.integers(1, 50, 40)]
    out = collate_padded(samples, pad_to_multiple_of=8)
    lens = [len(s.input_ids) for s in samples]
    assert out["attention_mask"].sum().item() == sum(lens)
    assert out["input_ids"].shape == (40, -(-max(lens) // 8) * 8)
    for i, s in enumerate(samples):
        assert out["input_ids"][i, : lens[i]].tolist() == s.input_ids.tolist()


from hypothesis import given, settings, strategies as st


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 8)), min_size=1, max_size=12),
       st.sampled_from([1, 4, 8]))
def test_layouts_agree_on_random_batches(shapes, multiple):
    """Padded rows, packed rows and the label counts describe the same tokens."""
    samples = []
    for k, (prompt, response) in enumerate(shapes):
        ids = np.arange(prompt + response, dtype=np.int32) + 10 * k + 3
        labels = ids.copy()
        labels[:prompt] = X
        samples.append(dec(ids, labels, sid=k))
    padded = collate_padded(samples, pad_to_multiple_of=multiple)
    packed = collate_packed(samples)
    lens = [p + r for p, r in shapes]
    assert padded["input_ids"].shape[1] % multiple == 0
    assert padded["attention_mask"].sum(1).tolist() == lens
    assert packed["cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()
    for k, s in enumerate(samples):
        a, b = packed["cu_seqlens"][k].item(), packed["cu_seqlens"][k + 1].item()
        assert packed["input_ids"][0, a:b].tolist() == padded["input_ids"][k, : lens[k]].tolist() == s.input_ids.tolist()
        assert packed["position_ids"][0, a:b].tolist() == list(range(lens[k]))
        assert packed["labels"][0, a:b].tolist() == padded["labels"][k, : lens[k]].tolist()
    want = sum(max(r - (1 if p == 0 else 0), 0) for p, r in shapes)
    assert count_label_tokens(padded) == count_label_tokens(packed) == want


def test_pad_rows_kernel_matches_numpy_reference():
    """The numba row filler equals the boolean-mask numpy path (`_dense`) on random ragged rows."""
    from dynabatch.loader.collate import _dense, _rows

    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(0, 12, rng.integers(0, 6)).astype(np.int64)
        flat = rng.integers(0, 300, int(lengths.sum())).astype(np.int64)
        L = int(lengths.max(initial=0)) + int(rng.integers(0, 4))
        mask = np.arange(L) < lengths[:, None]
        values, am = _rows(flat, lengths, L, -7, True)
        assert np.array_equal(values, _dense(flat, mask, -7))
        assert np.array_equal(am, mask.astype(np.int64))


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
def test_flat_ids_slices_collate_like_their_samples(family):
    # a loader that gathered a whole step's ids hands each micro-batch over as a FlatIds of slices
    from dynabatch.loader.collate import FlatIds, flat_ids

    if family == "decoder":
        samples = [dec([1, 2, 3], [X, 2, 3]), dec([4, 5], [4, 5]), dec([6, 7, 8, 9], [X, X, 8, 9])]
    else:
        samples = [encdec([1, 2, 3], [7, 8]), encdec([4], [9, 10, 11]), encdec([5, 6], [12])]
    step = flat_ids(samples * 2, family)  # the step: this micro-batch's samples follow another's
    n, cut = len(samples), int(step.lengths[:3].sum())
    scut = int(step.second_lengths[:3].sum())
    part = FlatIds(step.ids[cut:], step.lengths[n:], step.second[scut:], step.second_lengths[n:])
    for collate, kw in ((collate_padded, {"pad_to_multiple_of": 4}), (collate_padded, {"rows": [0, 1, 0]}),
                        (collate_packed, {})):
        want, got = collate(samples, family=family, **kw), collate(part, family=family, **kw)
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]) if torch.is_tensor(want[k]) else got[k] == want[k], k
    with pytest.raises(ValueError, match="family must be"):
        collate_padded(part, family="encoder")
