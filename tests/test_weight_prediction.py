"""Optimizer-dependent weight prediction, weight stashing and their memory
(`dynabatch.pipeline.runtime.weight_prediction`)."""

import copy

import pytest
import torch

from dynabatch.pipeline.runtime.weight_prediction import WeightPredictor

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}

CONFIGS = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.03, weight_decay=0.1)),
    ("sgd", dict(lr=0.05, maximize=True, weight_decay=0.02)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=0.01)),
    ("sgd", dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05)),
    ("adam", dict(lr=1e-3)),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    ("adam", dict(lr=3e-3, amsgrad=True, weight_decay=0.05)),
    ("adam", dict(lr=1e-2, maximize=True, eps=1e-6)),
    ("adamw", dict(lr=1e-3)),
    ("adamw", dict(lr=1e-2, weight_decay=0.1, betas=(0.5, 0.9))),
    ("adamw", dict(lr=5e-3, weight_decay=0.3, amsgrad=True)),
    # the multi-tensor and fused implementations (CUDA's defaults) follow the same rules
    ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=0.01, foreach=True)),
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, fused=True)),
    ("adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, foreach=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.1, fused=True)),
]


def make(kind, cfg, seed=0):
    """Two float32 parameters, their optimizer and a fixed gradient for each."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(5, 4, generator=gen).requires_grad_(), torch.randn(7, generator=gen).requires_grad_()]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    return params, OPTIMIZERS[kind](params, **cfg), grads


def step(params, opt, grads, n):
    for _ in range(n):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


def real_steps(params, opt, grads, s):
    """The parameters after ``s`` real steps of a copy of ``opt`` with ``grads``."""
    twin = [p.detach().clone().requires_grad_() for p in params]
    twin_opt = type(opt)(twin, lr=0.1)  # every group option comes back with the state dict
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(twin, twin_opt, grads, s)
    return [p.detach() for p in twin]


def rel_err(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def snapshot(opt):
    return {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for p, st in opt.state.items()}


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n]) else
                                           a[k][n] == b[k][n] for n in a[k]) for k in a)


@pytest.mark.parametrize("kind,cfg", CONFIGS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CONFIGS)])
@pytest.mark.parametrize("warm", [1, 3])
def test_constant_gradient_prediction_equals_real_steps(kind, cfg, warm):
    params, opt, grads = make(kind, cfg)
    wp = WeightPredictor(opt, "predict")
    step(params, opt, grads, warm)
    before = [p.detach().clone() for p in params]
    state = snapshot(opt)
    for s in (0, 1, 2, 5):
        with wp.predicted(s):
            w_hat = [p.detach().clone() for p in params]
        expect = real_steps(params, opt, grads, s)
        assert rel_err(w_hat, expect) <= 1e-6, (s, rel_err(w_hat, expect))
        if s > 0:  # the prediction moved the weights (a no-op predictor fails here)
            assert not all(torch.equal(a, b) for a, b in zip(w_hat, before))
        # restored bit for bit, and the optimizer's state untouched
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
        assert same_state(state, snapshot(opt))


def test_s_zero_is_the_identity_and_copies_nothing():
    params, opt, grads = make("adamw", dict(lr=1e-2, weight_decay=0.1))
    wp = WeightPredictor(opt)
    step(params, opt, grads, 2)
    held = wp.held_bytes()
    ptrs = [p.data_ptr() for p in params]
    before = [p.detach().clone() for p in params]
    with wp.predicted(0):
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
        assert wp.held_bytes() == held
    assert [p.data_ptr() for p in params] == ptrs


def test_restore_is_bitwise_for_awkward_values():
    p = torch.tensor([1e-30, -0.0, 3.0000002, -7.5e20, 1.0 / 3.0], requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.37, weight_decay=0.01)
    wp = WeightPredictor(opt)
    p.grad = torch.tensor([1e-8, 2.0, -3.0, 0.5, 1e3])
    opt.step()
    bits = p.detach().clone().view(torch.int32)
    with wp.predicted(3):
        assert not torch.equal(p.detach().view(torch.int32), bits)
    assert torch.equal(p.detach().view(torch.int32), bits)
    assert p._version == 1  # one real step bumped it; the swap did not


def test_restore_happens_when_the_forward_raises():
    params, opt, grads = make("sgd", dict(lr=0.1, momentum=0.9))
    wp = WeightPredictor(opt)
    step(params, opt, grads, 1)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ZeroDivisionError):
        with wp.predicted(2):
            1 / 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert wp.held_bytes() == wp.weight_bytes  # only the recorded gradient is left


def test_before_any_step_or_without_gradient_the_prediction_is_unchanged():
    params, opt, grads = make("sgd", dict(lr=0.1, momentum=0.9))
    wp = WeightPredictor(opt)
    before = [p.detach().clone() for p in params]
    with wp.predicted(3):
        assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    params[1].grad = None  # the optimizer skips params[1]; so does the prediction
    params[0].grad = grads[0].clone()
    opt.step()
    b1 = params[1].detach().clone()
    with wp.predicted(2):
        assert torch.equal(params[1].detach(), b1)
        assert not torch.equal(params[0].detach(), before[0])


@pytest.mark.parametrize("kind,cfg", [
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=3e-3, betas=(0.7, 0.95), amsgrad=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.2)),
    ("adam", dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1, maximize=True)),
])
def test_implied_gradient_is_exact_for_adam_after_constant_gradients(kind, cfg):
    params, opt, grads = make(kind, cfg)
    wp = WeightPredictor(opt, gradient="implied")
    step(params, opt, grads, 4)
    for s in (1, 2, 5):
        with wp.predicted(s):
            w_hat = [p.detach().clone() for p in params]
        assert rel_err(w_hat, real_steps(params, opt, grads, s)) <= 1e-6
    assert wp.held_bytes() == 0  # no gradient copy


@pytest.mark.parametrize("cfg", [dict(momentum=0.9), dict(momentum=0.8, dampening=0.3),
                                 dict(momentum=0.9, nesterov=True)])
def test_implied_gradient_for_momentum_sgd_is_the_stationary_buffer(cfg):
    params, opt, grads = make("sgd", dict(lr=1e-3, **cfg))
    wp = WeightPredictor(opt, gradient="implied")
    step(params, opt, grads, 300)  # momentum^300 < 1e-13: the buffer has converged
    for s in (1, 2, 5):
        with wp.predicted(s):
            w_hat = [p.detach().clone() for p in params]
        assert rel_err(w_hat, real_steps(params, opt, grads, s)) <= 1e-6
    # early on the buffer is not stationary and the implied gradient is not the real one
    params, opt, grads = make("sgd", dict(lr=0.1, **cfg))
    wp = WeightPredictor(opt, gradient="implied")
    step(params, opt, grads, 2)
    with wp.predicted(3):
        w_hat = [p.detach().clone() for p in params]
    assert rel_err(w_hat, real_steps(params, opt, grads, 3)) > 1e-3


def test_unsupported_optimizers_and_options_raise():
    p = torch.zeros(3, requires_grad=True)
    for opt in (torch.optim.RMSprop([p]), torch.optim.Adagrad([p]), torch.optim.LBFGS([p])):
        with pytest.raises(TypeError, match=type(opt).__name__):
            WeightPredictor(opt)

    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(TypeError, match="MySGD"):
        WeightPredictor(MySGD([p], lr=0.1))
    with pytest.raises(ValueError, match="mode"):
        WeightPredictor(torch.optim.SGD([p], lr=0.1), mode="magic")
    with pytest.raises(ValueError, match="gradient='last'"):
        WeightPredictor(torch.optim.SGD([p], lr=0.1), gradient="implied")
    with pytest.raises(ValueError, match="complex"):
        WeightPredictor(torch.optim.Adam([torch.zeros(2, dtype=torch.complex64, requires_grad=True)]))
    opt = torch.optim.SGD([p], lr=0.1)
    WeightPredictor(opt)
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    e = torch.nn.Embedding(4, 2, sparse=True)
    opt = torch.optim.SGD(e.parameters(), lr=0.1)
    WeightPredictor(opt)
    e(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    stash = WeightPredictor(torch.optim.SGD([p], lr=0.1), mode="stash")
    with pytest.raises(ValueError, match="predict"):
        with stash.predicted(1):
            pass


def test_step_inside_a_swap_is_refused():
    params, opt, grads = make("sgd", dict(lr=0.1))
    wp = WeightPredictor(opt)
    step(params, opt, grads, 1)
    with pytest.raises(RuntimeError, match="swap"):
        with wp.predicted(1):
            opt.step()


def _linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def test_forward_predicts_and_backward_after_an_update_uses_the_real_weights():
    lin = _linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    wp = WeightPredictor(opt)
    g = [torch.randn(p.shape) for p in lin.parameters()]
    step(list(lin.parameters()), opt, g, 2)
    x = torch.randn(5, 4, requires_grad=True)
    w_hat = real_steps(list(lin.parameters()), opt, g, 1)
    with wp.forward("mb0", 1):
        y = lin(x)
    assert torch.allclose(y, x @ w_hat[0].T + w_hat[1], rtol=1e-6, atol=1e-6)
    step(list(lin.parameters()), opt, g, 1)  # the update between forward and backward
    w_now = lin.weight.detach().clone()
    assert torch.allclose(w_now, w_hat[0], rtol=1e-6, atol=1e-7)  # the prediction was right
    for p in lin.parameters():
        p.grad = None
    gy = torch.randn(5, 3)
    with wp.backward("mb0"):
        y.backward(gy)  # no "modified by an inplace operation": the hooks saved version-free aliases
    assert torch.allclose(x.grad, gy @ w_now, atol=1e-6)
    assert torch.allclose(lin.weight.grad, gy.T @ x.detach(), atol=1e-6)
    assert wp.in_flight == {}


def test_without_the_hooks_an_update_between_forward_and_backward_breaks_autograd():
    lin = _linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    y = lin(torch.randn(2, 4, requires_grad=True)).sum()
    step(list(lin.parameters()), opt, [torch.ones_like(p) for p in lin.parameters()], 1)
    with pytest.raises(RuntimeError, match="inplace"):
        y.backward()


def test_stash_keeps_the_forward_version_for_the_backward():
    lin = _linear()
    opt = torch.optim.Adam(lin.parameters(), lr=0.05)
    wp = WeightPredictor(opt, "stash")
    g = [torch.randn(p.shape) for p in lin.parameters()]
    W = wp.weight_bytes
    x = torch.randn(5, 4, requires_grad=True)
    w0 = [p.detach().clone() for p in lin.parameters()]
    with wp.forward(0, 1):
        y0 = lin(x)
    assert wp.held_bytes() == 0  # nothing copied until an update comes
    step(list(lin.parameters()), opt, g, 1)  # version 0 -> 1: version 0 stashed for micro-batch 0
    assert wp.stashed_versions == [0] and wp.held_bytes() == W
    with wp.forward(1, 1):
        y1 = lin(x)
    step(list(lin.parameters()), opt, g, 1)  # version 1 -> 2: version 1 stashed too
    w1_expected = y1.detach()
    assert wp.stashed_versions == [0, 1] and wp.held_bytes() == 2 * W
    w2 = [p.detach().clone() for p in lin.parameters()]
    gy = torch.randn(5, 3)
    with wp.backward(0):
        assert all(torch.equal(p.detach(), a) for p, a in zip(lin.parameters(), w0))
        assert wp.held_bytes() == 3 * W  # two versions + the backup of the current one
        y0.backward(gy)
    assert torch.allclose(x.grad, gy @ w0[0], atol=1e-6)
    assert all(torch.equal(p.detach(), a) for p, a in zip(lin.parameters(), w2))
    assert wp.stashed_versions == [1]
    x.grad = None
    with wp.backward(1):
        assert torch.equal(lin(x.detach()), w1_expected)  # version 1 is in place
        y1.backward(gy)
    assert wp.stashed_versions == [] and wp.held_bytes() == 0
    assert all(torch.equal(p.detach(), a) for p, a in zip(lin.parameters(), w2))
    assert wp.peak_bytes == 3 * W == wp.extra_bytes(versions=2)["peak"]


def test_stash_without_an_update_copies_nothing():
    lin = _linear()
    wp = WeightPredictor(torch.optim.SGD(lin.parameters(), lr=0.1), "stash")
    x = torch.randn(2, 4)
    with wp.forward("a"):
        y = lin(x).sum()
    with wp.backward("a"):
        y.backward()
    assert wp.peak_bytes == 0
    with pytest.raises(KeyError):
        with wp.backward("a"):
            pass
    with wp.forward("b"):
        pass
    with pytest.raises(ValueError, match="in flight"):
        with wp.forward("b"):
            pass


def test_stale_mode_runs_forward_and_backward_on_the_versions_they_find():
    lin = _linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    wp = WeightPredictor(opt, "none")
    x = torch.randn(3, 4, requires_grad=True)
    w0 = lin.weight.detach().clone()
    with wp.forward(0, 1):
        y = lin(x)
    assert torch.allclose(y, x @ w0.T + lin.bias, atol=1e-6)
    step(list(lin.parameters()), opt, [torch.ones_like(p) for p in lin.parameters()], 1)
    gy = torch.randn(3, 3)
    with wp.backward(0):
        y.backward(gy)
    assert torch.allclose(x.grad, gy @ lin.weight.detach(), atol=1e-6)
    assert wp.peak_bytes == 0 and wp.extra_bytes()["peak"] == 0


@pytest.mark.parametrize("gradient", ["last", "implied"])
def test_predict_memory_matches_the_accounting(gradient):
    params, opt, grads = make("adam", dict(lr=1e-2, amsgrad=True))
    wp = WeightPredictor(opt, gradient=gradient)
    W = wp.weight_bytes
    assert W == (20 + 7) * 4
    step(params, opt, grads, 2)
    acc = wp.extra_bytes()
    persistent = W if gradient == "last" else 0
    assert wp.held_bytes() == persistent == acc["persistent"]
    with wp.predicted(2):
        assert wp.held_bytes() == persistent + W == acc["persistent"] + acc["swap"]
    assert wp.held_bytes() == persistent
    assert wp.peak_bytes == persistent + W
    assert acc["workspace"] == 7 * 20 * 4 and acc["peak"] == persistent + W + acc["workspace"]


def test_inner_pack_hooks_still_run():
    lin = _linear()
    wp = WeightPredictor(torch.optim.SGD(lin.parameters(), lr=0.1), "none")
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    with wp.forward(0, pack=pack, unpack=lambda t: t):
        y = torch.tanh(lin(torch.randn(2, 4))).sum()
    assert seen  # the meter saw what autograd saved
    with wp.backward(0):
        y.backward()
    assert lin.weight.grad is not None
