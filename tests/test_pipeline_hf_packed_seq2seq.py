"""Packed encoder-decoder micro-batches through the T5 and BART adapters (float64).

The DataLoader's packed layout for seq2seq (`dynabatch.loader.collate.collate_packed`: every sample's
input in one row with ``cu_seqlens``/``position_ids``, its target in another with ``decoder_cu_seqlens``/
``decoder_position_ids``) gives the loss and every gradient of the same samples collated padded: no
attention across samples in the encoder, the decoder's self-attention or the cross-attention. The
masks come from the model's own mask functions with a same-sample predicate. A negative control (the
same row declared as one sample) shows the comparison would catch attention across samples.

On several stages the packed state ``(enc [1, N, H], dec [1, Nt, H], cu, dcu)`` crosses each boundary
with the shapes the plan states: N = ``tokens``, Nt = ``target_tokens`` (the plan's decoder total per
micro-batch, `BatchPlan.mb_target_tokens`). The gloo runs on 2 and 3 stages are in
`test_pipeline_hf_dist`."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, seq2seq_samples, t5_config  # noqa: E402

from dynabatch import Shapes  # noqa: E402
from dynabatch.core.cost.model import CostModel  # noqa: E402
from dynabatch.core.plan.planner import plan_microbatches  # noqa: E402
from dynabatch.loader.collate import collate_packed, collate_padded  # noqa: E402
from dynabatch.pipeline.models import MicroBatchShape, check_batch, plan_shapes  # noqa: E402
from dynabatch.pipeline import batch_shapes, from_hf, sequential_step  # noqa: E402
from dynabatch.planfile import plan_from_arrow, plans_to_arrow  # noqa: E402

DIMS = [(7, 4), (3, 6), (9, 2), (5, 5)]  # (input tokens, target tokens) of each sample


def _grads(model) -> dict:
    return {f"{i}.{n}": p.grad.clone() for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()
            if p.grad is not None}


def _collate_kw(config) -> dict:
    return dict(family="encoder_decoder", pad_id=int(config.pad_token_id),
                decoder_start_token_id=int(config.decoder_start_token_id))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_packed_equals_padded(family):
    torch.set_default_dtype(torch.float64)
    try:
        config = t5_config() if family == "t5" else bart_config()
        hf = build(config, seed=2)
        padded_model, packed_model = from_hf(copy.deepcopy(hf)), from_hf(hf)
        samples = seq2seq_samples(int(config.vocab_size), DIMS, np.random.default_rng(4))
        padded, packed = collate_padded(samples, **_collate_kw(config)), collate_packed(samples, **_collate_kw(config))
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


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_packed_state_has_the_planned_shape_after_every_layer(family):
    """After every layer the packed state a stage ending there sends (T5: without the bias its later blocks
    reuse, `stage_output`) is the boundary specs of the micro-batch's shape (as a training loop reads it,
    `batch_shapes`): its bytes are both rows' hidden states and the two cu_seqlens, nothing quadratic.
    A packed shape without a decoder total is refused naming it."""
    config = t5_config() if family == "t5" else bart_config()
    model = from_hf(build(config, seed=0, dtype=torch.float32))
    batch = collate_packed(seq2seq_samples(int(config.vocab_size), DIMS, np.random.default_rng(1)),
                           **_collate_kw(config))
    shape = batch_shapes([batch])[0]
    assert (shape.rows, shape.input_len, shape.target_len, shape.tokens, shape.target_tokens) == (4, 9, 6, 24, 17)
    check_batch(batch, shape, "the packed micro-batch")
    state = model.layers[0](batch)
    for i, layer in enumerate(model.layers[1:-1], start=1):
        state = layer(state)
        out = layer.stage_output(state) if hasattr(layer, "stage_output") else state
        specs = model.boundary(shape, i)
        assert len(specs) == len(out) and all(s.matches(t) for s, t in zip(specs, out)), i
        sent = sum(t.numel() * t.element_size() for t in out)
        assert sent == sum(s.nbytes for s in specs) == (24 + 17) * 16 * 4 + 2 * 5 * 4
    with pytest.raises(ValueError, match="target_tokens"):
        model.boundary(MicroBatchShape("packed", 4, 9, 6, 24), 1)


def test_plan_states_the_packed_decoder_total():
    """A packed (``dp_varlen``) T5 plan states each micro-batch's decoder total: the sum of its samples'
    target tokens, after the plan file's round trip too; the runner's shapes of the plan (`plan_shapes`)
    are the shapes of the micro-batches the DataLoader collates from its samples, so a stage's receive
    buffers fit what its neighbour sends."""
    rng = np.random.default_rng(3)
    n = 30
    inp, tgt = rng.integers(2, 40, n), rng.integers(1, 12, n)
    ids = rng.permutation(n) + 100
    shapes = Shapes.from_lengths(inp.astype(np.int32), tgt.astype(np.int32), None, sample_id=ids)
    plan = plan_microbatches(shapes, CostModel.preset("t5"), num_stages=2, num_ranks=2, method="dp_varlen",
                             memory_limit=2e8)
    assert plan.collation == "packed" and plan.num_microbatches > 2
    target_of = dict(zip(ids.tolist(), tgt.tolist()))
    want = [sum(target_of[int(s)] for s in mb.sample_ids) for mb in plan.microbatches()]
    assert plan.mb_target_tokens.tolist() == want
    back = plan_from_arrow(plans_to_arrow([plan]))
    np.testing.assert_array_equal(back.mb_target_tokens, plan.mb_target_tokens)
    samples = {int(i): s for i, s in zip(ids, seq2seq_samples(64, list(zip(inp.tolist(), tgt.tolist())), rng))}
    for replica in range(plan.num_ranks):
        planned = plan_shapes(back, replica)
        batches = [collate_packed([samples[int(i)] for i in mb.sample_ids], **_collate_kw(t5_config()))
                   for mb in back.microbatches(rank=replica)]
        for shape, got, b in zip(planned, batch_shapes(batches), batches):
            assert (shape.rows, shape.input_len, shape.target_len, shape.tokens, shape.target_tokens) == \
                (got.rows, got.input_len, got.target_len, got.tokens, got.target_tokens)
            check_batch(b, shape, "a planned micro-batch")


def test_packed_encoder_decoder_refusals():
    """A micro-batch whose two sides hold different sample counts is refused naming both counts; a packed
    micro-batch whose decoder row is not the plan's is refused naming both shapes."""
    model = from_hf(build(t5_config(), seed=0, dtype=torch.float32))
    samples = seq2seq_samples(64, DIMS, np.random.default_rng(1))
    kw = dict(family="encoder_decoder", pad_id=0, decoder_start_token_id=0)
    bad = dict(collate_packed(samples, **kw), decoder_cu_seqlens=torch.tensor([0, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="4 encoder and 1 decoder samples"):
        model.layers[0](bad)
    batch = collate_packed(samples, **kw)
    with pytest.raises(ValueError, match=r"decoder_input_ids has shape \[1, 17\] but the plan says \[1, 16\]"):
        check_batch(batch, MicroBatchShape("packed", 4, 9, 6, 24, target_tokens=16), "micro-batch 0")
