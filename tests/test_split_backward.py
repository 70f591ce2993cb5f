"""The runtime's split backward (`dynabatch.pipeline.runtime.split_backward`): the input part and the weight
part together give the whole backward's gradients (float64, against ``autograd.backward`` of the same graph),
and do its matrix products once between them (FLOPs counted by ``torch.utils.flop_counter``), on the first
stage of gpt-tiny (no input gradients), a middle stage, the head, a weight used twice on one stage, and with
recomputed layers (the plain split, whose weight part repeats the chain)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dynabatch.pipeline.models.partition import split_model
from dynabatch.pipeline.models.spec import MicroBatchShape
from dynabatch.pipeline.models.zoo import make_model
from dynabatch.pipeline.runtime.split_backward import input_part, weight_part

GPT = dict(vocab=64, hidden=32, layers=4, heads=2, max_positions=64)


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def _stage_case(which: str, recompute: int = 0):
    """(stage module, its outputs, output gradients, inputs that take a gradient) of one gpt-tiny stage."""
    torch.manual_seed(0)
    model = make_model("gpt-tiny", **GPT, seed=3, dtype=torch.float64)
    stages = split_model(model.layers, [0, 2, 4, 6])  # embedding+block, 2 blocks, block+head
    batch = model.random_batch(MicroBatchShape("padded", 3, 11), torch.Generator().manual_seed(1))
    x = None
    for s in stages[:{"first": 0, "middle": 1, "last": 2}[which]]:
        x = tuple(t.detach() for t in s(x, batch))
    stage = stages[{"first": 0, "middle": 1, "last": 2}[which]]
    stage.recompute = recompute
    inputs = [] if x is None else [t.requires_grad_(True) for t in x if t.is_floating_point()]
    out = stage(x, batch)
    if stage.is_last:
        return stage, [out[0]], [None], inputs
    outs = [t for t in out if t.requires_grad]
    return stage, outs, [torch.randn_like(t) for t in outs], inputs


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_split_backward_equals_the_whole_backward_and_does_its_products_once(which):
    stage, outputs, grads, inputs = _stage_case(which)
    params = [p for p in stage.parameters() if p.requires_grad]
    whole_flops = _flops(lambda: torch.autograd.backward(outputs, grads, inputs=inputs + params,
                                                         retain_graph=True))
    want_p = [p.grad.clone() for p in params]
    want_x = [x.grad.clone() for x in inputs]
    for t in params + inputs:
        t.grad = None
    res = {}
    bi = _flops(lambda: res.setdefault("bi", input_part(outputs, grads, inputs, params)))
    got_x, work = res["bi"]
    assert all(p.grad is None for p in params)  # the input part computed no weight gradient
    w = _flops(lambda: weight_part(work))
    for g, want in zip(got_x, want_x):
        torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)
    for p, want in zip(params, want_p):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14)
    assert bi + w == whole_flops  # every product once: the weight part repeats none of the chain
    assert w > 0 and bi > 0  # the first stage's input part still runs the chain, to its embedding
    if which != "first":
        assert 0.3 < w / whole_flops < 0.7  # the weight products are about half of a layer's backward


def test_a_weight_used_twice_on_one_stage_is_summed_once():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    y = lin(torch.tanh(lin(x)))  # the same weight before and after the chain
    g = torch.randn_like(y)
    (want_x,) = torch.autograd.grad([y], [x], [g], retain_graph=True)
    want = torch.autograd.grad([y], list(lin.parameters()), [g], retain_graph=True)
    (got_x,), work = input_part([y], [g], [x], list(lin.parameters()))
    weight_part(work)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-14)
    for p, w in zip(lin.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)


def test_recomputed_layers_keep_the_plain_split():
    stage, outputs, grads, inputs = _stage_case("middle", recompute=1)
    params = [p for p in stage.parameters() if p.requires_grad]
    want = torch.autograd.grad(outputs, params, grads, retain_graph=True)
    (gx,), work = input_part(outputs, grads, inputs, params, rewalk=True)
    assert work.rewalk is not None and gx is not None
    weight_part(work)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-14)


def test_a_stage_that_is_one_embedding_does_its_work_in_the_weight_part():
    emb = torch.nn.Embedding(10, 4).double()
    y = emb(torch.tensor([[1, 2, 2, 7]]))
    g = torch.randn_like(y)
    (want,) = torch.autograd.grad([y], [emb.weight], [g], retain_graph=True)
    got, work = input_part([y], [g], [], [emb.weight])
    assert got == [] and emb.weight.grad is None
    weight_part(work)
    torch.testing.assert_close(emb.weight.grad, want, rtol=0, atol=0)
