"""Packed encoder-decoder micro-batches through the T5 and BART adapters (one process, float64).

The DataLoader's packed layout for seq2seq (`dynabatch.loader.collate.collate_packed`: every sample's
input in one row with ``cu_seqlens``/``position_ids``, its target in another with ``decoder_cu_seqlens``/
``decoder_position_ids``) gives the loss and every gradient of the same samples collated padded: no
attention across samples in the encoder, the decoder's self-attention or the cross-attention. The
masks come from the model's own mask functions with a same-sample predicate. A negative control (the
same row declared as one sample) shows the comparison would catch attention across samples. On several
stages packed encoder-decoder micro-batches are refused (the plan carries no decoder token total)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, t5_config  # noqa: E402

from dynabatch.loader.collate import collate_packed, collate_padded  # noqa: E402
from dynabatch.pipeline import MicroBatchShape, from_hf, sequential_step  # noqa: E402
from tokenization import EncodedSample  # noqa: E402


def _samples(vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, t) in enumerate([(7, 4), (3, 6), (9, 2), (5, 5)]):
        inp = rng.integers(3, vocab, n).astype(np.int32)
        tgt = rng.integers(3, vocab, t).astype(np.int32)
        out.append(EncodedSample(i, inp, tgt, None, n, t, 0, False))
    return out


def _grads(model) -> dict:
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_packed_equals_padded(family):
    torch.set_default_dtype(torch.float64)
    try:
        config = t5_config() if family == "t5" else bart_config()
        hf = build(config, seed=2)
        padded_model, packed_model = from_hf(copy.deepcopy(hf)), from_hf(hf)
        samples = _samples(int(config.vocab_size), seed=4)
        kw = dict(family="encoder_decoder", pad_id=int(config.pad_token_id),
                  decoder_start_token_id=int(config.decoder_start_token_id))
        padded, packed = collate_padded(samples, **kw), collate_packed(samples, **kw)
        assert packed["input_ids"].shape == (1, 24) and packed["decoder_input_ids"].shape == (1, 17)
        loss_pad, n_pad = sequential_step(padded_model.layers, [padded])
        loss_pack, n_pack = sequential_step(packed_model.layers, [packed])
        assert n_pad == n_pack == 17
        assert loss_pack == pytest.approx(loss_pad, rel=1e-12)
        g_pad, g_pack = _grads(padded_model), _grads(packed_model)
        assert g_pad.keys() == g_pack.keys() and len(g_pad) > 10
        scale = max(float(g.abs().max()) for g in g_pad.values())  # a key bias's gradient is 0 up to rounding
        for k in g_pad:
            assert float((g_pad[k] - g_pack[k]).abs().max()) <= 1e-10 * scale, k

        # negative control: the same row as one sample attends across the samples, and the loss moves
        merged = dict(packed, cu_seqlens=torch.tensor([0, 24], dtype=torch.int32),
                      decoder_cu_seqlens=torch.tensor([0, 17], dtype=torch.int32))
        loss_one, _ = sequential_step(packed_model.layers, [merged])
        assert abs(loss_one - loss_pad) > 1e-6 * loss_pad
    finally:
        torch.set_default_dtype(torch.float32)


def test_packed_encoder_decoder_refusals():
    """Several stages: the boundary of a packed shape is refused naming why; a micro-batch whose two sides
    hold different sample counts is refused naming both counts."""
    model = from_hf(build(t5_config(), seed=0, dtype=torch.float32))
    with pytest.raises(ValueError, match="decoder token total"):
        model.boundary(MicroBatchShape("packed", 4, 9, 6, 24), 1)
    samples = _samples(64, seed=1)
    kw = dict(family="encoder_decoder", pad_id=0, decoder_start_token_id=0)
    bad = dict(collate_packed(samples, **kw), decoder_cu_seqlens=torch.tensor([0, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="4 encoder and 1 decoder samples"):
        model.layers[0](bad)
