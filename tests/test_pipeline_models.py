"""Tiny models: boundary specs predict every state, masks make padding and packing invisible."""

import numpy as np
import pytest
import torch

from dynabatch.pipeline.models import MicroBatchShape, PlanMismatch, check_batch, count_parameters, gpt_tiny, t5_tiny
from dynabatch.pipeline.models import segment_ids
from dynabatch.pipeline.runtime.reference import sequential_step

SMALL = dict(vocab=97, hidden=32, heads=4, max_positions=64, seed=0)


def states(model, batch):
    x = model.layers[0](batch)
    out = [x]
    for layer in model.layers[1:-1]:
        x = layer(x)
        out.append(x)
    return out


@pytest.mark.parametrize("make,shape", [
    (lambda: gpt_tiny(layers=2, **SMALL), MicroBatchShape("padded", 3, 16)),
    (lambda: gpt_tiny(layers=2, **SMALL), MicroBatchShape("packed", 4, 9, tokens=23)),
    (lambda: t5_tiny(encoder_layers=1, decoder_layers=2, **SMALL), MicroBatchShape("padded", 2, 12, 7)),
    (lambda: t5_tiny(encoder_layers=1, decoder_layers=2, **SMALL),
     MicroBatchShape("packed", 3, 9, 4, 20, target_tokens=11)),
])
def test_boundary_spec_predicts_every_state(make, shape):
    model = make()
    batch = model.random_batch(shape, torch.Generator().manual_seed(1))
    check_batch(batch, shape, "test")
    for i, st in enumerate(states(model, batch)):
        spec = model.boundary(shape, i)
        assert len(spec) == len(st)
        for sp, t in zip(spec, st):
            assert sp.matches(t), (i, sp, t.shape, t.dtype)
            assert sp.requires_grad == t.is_floating_point()


def loss_sum(model, batch):
    x = model.layers[0](batch)
    for layer in model.layers[1:-1]:
        x = layer(x)
    loss, n = model.layers[-1](x, batch)
    return float(loss.detach()), int(n)


def test_gpt_padding_and_packing_are_invisible():
    """Two sequences: padded together, packed together, and run alone give the same summed loss."""
    model = gpt_tiny(layers=2, **SMALL)
    a = torch.randint(0, 97, (5,))
    b = torch.randint(0, 97, (8,))
    alone = [loss_sum(model, {"input_ids": s[None], "labels": s[None]}) for s in (a, b)]
    ids = torch.zeros(2, 8, dtype=torch.long)
    ids[0, :5], ids[1] = a, b
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    padded = loss_sum(model, {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    cat = torch.cat([a, b])[None]
    pos = torch.cat([torch.arange(5), torch.arange(8)])[None]
    packed = loss_sum(model, {"input_ids": cat, "position_ids": pos, "cu_seqlens": torch.tensor([0, 5, 13], dtype=torch.int32),
                              "max_seqlen": 8, "labels": cat.masked_fill(pos == 0, -100)})
    total = sum(x[0] for x in alone)
    assert padded[1] == packed[1] == 4 + 7
    assert padded[0] == pytest.approx(total, rel=1e-5)
    assert packed[0] == pytest.approx(total, rel=1e-5)


def test_t5_padding_is_invisible():
    model = t5_tiny(encoder_layers=1, decoder_layers=1, **SMALL)
    gen = torch.Generator().manual_seed(3)
    batch = model.random_batch(MicroBatchShape("padded", 3, 10, 6), gen)
    whole = loss_sum(model, batch)
    parts = []
    for r in range(3):
        li, lt = int(batch["attention_mask"][r].sum()), int((batch["labels"][r] != -100).sum())
        one = {"input_ids": batch["input_ids"][r:r + 1, :li], "decoder_input_ids": batch["decoder_input_ids"][r:r + 1, :lt],
               "labels": batch["labels"][r:r + 1, :lt]}
        parts.append(loss_sum(model, one))
    assert whole[1] == sum(p[1] for p in parts)
    assert whole[0] == pytest.approx(sum(p[0] for p in parts), rel=1e-5)


def _encoded(rng, n, family):
    from tokenization import EncodedSample

    out = []
    for i in range(n):
        inp = rng.integers(1, 97, int(rng.integers(1, 9))).astype(np.int32)
        if family == "decoder":
            out.append(EncodedSample(i, inp, None, inp.copy(), len(inp), 0, 0, False))
        else:
            tgt = rng.integers(1, 97, int(rng.integers(1, 6))).astype(np.int32)
            out.append(EncodedSample(i, inp, tgt, None, len(inp), len(tgt), 0, False))
    return out


@pytest.mark.parametrize("family,layout", [("decoder", "rows"), ("encoder_decoder", "rows"),
                                           ("encoder_decoder", "packed")])
def test_packed_rows_train_the_same_function_as_one_sample_per_row(family, layout):
    """The ``pack`` baseline's rows (several samples per row, collated by the library) and t5-tiny's packed
    (varlen) micro-batches (inputs in one row, targets in another) give the same summed loss and gradients
    as one sample per row: no attention crosses a sample boundary, and positions restart at every sample."""
    from dynabatch.loader.collate import collate_packed, collate_padded

    model = (gpt_tiny(layers=2, **SMALL) if family == "decoder"
             else t5_tiny(encoder_layers=1, decoder_layers=2, **SMALL))
    samples = _encoded(np.random.default_rng(5), 7, family)
    rows = np.array([0, 0, 1, 0, 1, 2, 2])
    if layout == "rows":
        packed = collate_padded(samples, family=family, rows=rows)
        assert packed["input_ids"].shape[0] == 3
    else:
        packed = collate_packed(samples, family=family)
        assert packed["input_ids"].shape[0] == 1 and len(packed["decoder_cu_seqlens"]) == 8
    per_row = collate_padded(samples, family=family)

    def loss_and_grads(batch):
        for p in model.parameters():
            p.grad = None
        x = model.layers[0](batch)
        for layer in model.layers[1:-1]:
            x = layer(x)
        loss, n = model.layers[-1](x, batch)
        loss.backward()
        return float(loss.detach()), int(n), [p.grad.clone() for p in model.parameters()]

    lp, n_p, gp = loss_and_grads(packed)
    lr, n_r, gr = loss_and_grads(per_row)
    assert n_p == n_r
    assert lp == pytest.approx(lr, rel=1e-5)
    for a, b in zip(gp, gr):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_segment_ids_number_the_samples_of_a_row():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]])
    assert segment_ids(mask, pos).tolist() == [[1, 1, 2, 3, 0], [1, 1, 0, 0, 0]]
    assert segment_ids(mask).tolist() == mask.tolist()


def test_default_sizes_are_a_few_million_parameters():
    assert 2e6 < count_parameters(gpt_tiny()) < 6e6
    assert 2e6 < count_parameters(t5_tiny()) < 6e6


def test_check_batch_names_the_mismatch():
    model = gpt_tiny(layers=1, **SMALL)
    batch = model.random_batch(MicroBatchShape("padded", 2, 16))
    with pytest.raises(PlanMismatch, match=r"input_ids has shape \[2, 16\] but the plan says \[2, 24\]"):
        check_batch(batch, MicroBatchShape("padded", 2, 24), "micro-batch 0")


def test_sequential_step_normalizes_per_token_over_all_micro_batches():
    """Two micro-batches of very different sizes: the loss is the token-weighted mean, not the mean of means."""
    model = gpt_tiny(layers=1, **SMALL)
    gen = torch.Generator().manual_seed(0)
    small = model.random_batch(MicroBatchShape("padded", 1, 4), gen)
    big = model.random_batch(MicroBatchShape("padded", 4, 32), gen)
    loss, n = sequential_step(model.layers, [small, big])
    (ls, ns), (lb, nb) = loss_sum(model, small), loss_sum(model, big)
    assert n == ns + nb
    assert loss == pytest.approx((ls + lb) / (ns + nb), rel=1e-6)
    assert abs(loss - 0.5 * (ls / ns + lb / nb)) > 1e-4
