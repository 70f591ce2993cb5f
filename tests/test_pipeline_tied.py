"""Parameters shared between pipeline stages (`dynabatch.pipeline.runtime.tied`) and the interpreter's hook
points, on real gloo process groups.

The model is gpt-tiny with its LM head's weight tied to the token embedding (one `nn.Parameter` used by
the first and the last layer). Cut in two stages, each stage holds a copy; before every update the
runtime sums the copies' gradients over the two stages. Trained for a few steps with SGD (momentum) and
AdamW, flushed (`PipelineRunner.step`), as flush-free streams (`run_steps`, ``flush=False``) and as two
models of a `MultiModelRunner`, the parameters must end equal to the one-stage run, where autograd sums
the two uses of the one parameter itself:

* with one micro-batch per step, **bit for bit**: the one-stage gradient of the tied weight is
  ``head + embedding`` (two terms, added once) and the two-stage one is the all-reduce of the same two
  terms (a sum of two floats does not depend on their order); everything else is the same arithmetic;
* with 2-3 micro-batches per step, to float32 rounding (``rtol 1e-5``): one stage accumulates
  ``(h0 + e0) + (h1 + e1) + ...`` micro-batch by micro-batch, two stages ``(e0 + e1 + ...) + (h0 + h1 +
  ...)``, which round differently in the last bits.

A flush-free stream of several steps computes with stale weights (PipeDream), so it equals no one-stage
run; there the test checks that both stages' copies of the tied weight stay bit-identical (each update
applied the same summed gradient) — without the sum they drift apart at the first update.

Rank-side workers live in this file (`launch_local` runs them by path). The launches start in the
background when the module's first test begins (``tests/prelaunch.py``)."""

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the workers run this file by path
from prelaunch import Prelaunch, part  # noqa: E402
from test_pipeline_dist import ok  # noqa: E402
from test_pipeline_workers import replica_batches, synthetic_plan  # noqa: E402

from dynabatch.pipeline import launch_local  # noqa: E402
from dynabatch.pipeline.runtime import tie_stages  # noqa: E402

GPT = dict(vocab=64, hidden=16, layers=2, heads=2, max_positions=128)
TWO = [0, 2, 4]  # [embedding, block | block, head]
STEPS = 4
DATA_SEED = 1  # every run trains on the same steps (the two models of a MultiModelRunner share them)
LAUNCHES = Prelaunch(parallel=2)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def tied_model(seed: int):
    """gpt-tiny whose head's weight is the token embedding (declared in ``ties``)."""
    from dynabatch.pipeline import make_model

    model = make_model("gpt-tiny", **GPT, seed=seed)
    last = len(model.layers) - 1
    model.layers[last].lm.weight = model.layers[0].tok.weight
    model.ties = {"wte": [(0, "tok.weight"), (last, "lm.weight")]}
    return model


def _data(model, seed: int, mbs):
    """``STEPS`` steps: (micro-batch shapes, dictionaries, global real target tokens)."""
    from dynabatch.pipeline.models import plan_shapes  # noqa: E402

    rng = np.random.default_rng(seed)
    out = []
    for k in range(STEPS):
        plan = synthetic_plan(rng, collation="padded", num_ranks=1, num_stages=2, mbs=tuple(mbs), step=k)
        batches = replica_batches(model, plan, 0, seed=100 * seed + k)
        out.append((plan_shapes(plan, 0), batches, sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)))
    return out


def _optimizer(params, name):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)  # eps: see tests/test_pipeline_flushfree.py


def _weights(stage) -> dict:
    """This stage's parameters by ``global layer.name`` (a tied parameter under each layer using it)."""
    return {f"{stage.first_layer + i}.{n}": p.detach().double().flatten().tolist()
            for i, layer in enumerate(stage.layers) for n, p in layer.named_parameters()}


def _train(ctx, kind, opt, mbs, seed):
    from dynabatch.pipeline import MultiModelRunner, PipelineRunner, RunnerConfig

    S = ctx.num_stages
    bounds = TWO if S == 2 else [0, 4]
    io = ctx.stage in (0, S - 1)
    if kind.startswith("multi"):
        models = [tied_model(seed), tied_model(seed + 1)]
        multi = MultiModelRunner.from_models(models, ctx, bounds, lambda p, k: _optimizer(p, opt))
        for shapes, batches, n in _data(models[0], DATA_SEED, mbs):
            multi.step(shapes, batches if io else None, num_tokens=n if kind == "multi_early" else None)
        return [_weights(r.stage) for r in multi.runners]
    model = tied_model(seed)
    cfg = RunnerConfig(schedule="1f1b", flush=kind == "flush")
    runner = PipelineRunner.from_model(model, ctx, bounds, cfg)
    optim = _optimizer(runner.parameters(), opt)
    data = _data(model, DATA_SEED, mbs)
    window = len(data) if kind == "window" else 1
    for a in range(0, len(data), window):
        chunk = data[a:a + window]
        if kind == "flush":
            runner.step(chunk[0][0], chunk[0][1] if io else None, optimizer=optim)
        else:
            runner.run_steps([(sh, b if io else None) for sh, b, _ in chunk], optimizer=optim,
                             num_tokens=[n for *_, n in chunk])
    return [_weights(runner.stage)]


def tied_worker(rank, world, port, num_stages, configs):
    """Each ``(kind, optimizer, micro-batches per step (lo, hi), model seed)`` of ``configs`` in one process
    group; kind ``flush``, ``stream`` (flush-free, one step per stream), ``window`` (one stream of every
    step), ``multi``/``multi_early`` (two tied models, seeds ``seed`` and ``seed + 1``; early: updates
    right after each model's last backward). Returns this stage's weights per model, per config."""
    from dynabatch.pipeline import init_pipeline

    ctx = init_pipeline(num_stages, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    with ctx:
        return [_train(ctx, *c) for c in configs]


def order_worker(rank, world, port):
    """One flushed step of 3 micro-batches on 2 stages with hooks that log every call next to every
    posted operation: the log of each stage."""
    from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, make_model

    log = []

    class Logged:
        """The runner's own hooks, logging the calls the interpreter makes."""

        def __init__(self, base):
            self.base = base

        def __getattr__(self, name):
            return getattr(self.base, name)

        def before_op(self, v, forward):
            log.append(["op", v, forward])

        def after_backward(self, v):
            log.append(["after", v])

    def record(event):
        log.append(["post", event.side, event.label])

    ctx = init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=60, abort_after_s=10)
    with ctx:
        model = make_model("gpt-tiny", **GPT, seed=0)
        runner = PipelineRunner.from_model(model, ctx, TWO, RunnerConfig(schedule="1f1b", check_plan=False),
                                           recorder=record)
        data = _data(model, 0, (3, 3))
        shapes, batches, _ = data[0]
        hooks = Logged(runner.one_model(shapes, batches, 0))
        program = runner.program(shapes)
        run = runner.run(program, hooks, runner.start_program(program, hooks, 0), len(shapes))
        return {"log": log, "forward_s": run.forward_s.tolist(), "loss": run.loss.tolist()}


def _launch(num_stages, configs):
    res = ok(launch_local(f"{__file__}:tied_worker", num_stages, args=(num_stages, list(configs)),
                          idle_timeout_s=240.0))
    return [[r[i] for r in res] for i in range(len(configs))]


def launch(num_stages, configs, weight=0.0):
    run = functools.partial(_launch, num_stages)
    return [part(("tied", num_stages), c, run, weight / len(configs)) for c in configs]


EXACT, ROUNDED = (1, 1), (2, 3)
OPTS = ("sgd", "adamw")
KINDS = ("flush", "stream", "multi", "multi_early")
TWO_CONFIGS = [(k, o, m, 1) for k in KINDS for o in OPTS for m in (EXACT, ROUNDED)]
TWO_CONFIGS.append(("window", "adamw", ROUNDED, 1))
ONE_CONFIGS = [("flush", o, m, s) for o in OPTS for m in (EXACT, ROUNDED) for s in (1, 2)]
TWO_STAGE = dict(zip(TWO_CONFIGS, launch(2, TWO_CONFIGS, weight=40)))
ONE_STAGE = dict(zip(ONE_CONFIGS, launch(1, ONE_CONFIGS, weight=10)))


def _order_run(items):
    return [ok(launch_local(f"{__file__}:order_worker", 2, idle_timeout_s=240.0)) for _ in items]


ORDER = part(("order",), 0, _order_run, weight=5)


def _joined(per_rank, model=0):
    """Every stage's weights of ``model`` as one dict."""
    out = {}
    for r in per_rank:
        for key, w in r[model].items():
            out[key] = w
    return out


def _compare(got: dict, ref: dict, exact: bool):
    assert set(got) == set(ref)
    for key in sorted(ref):
        a, b = np.array(got[key]), np.array(ref[key])
        if exact:
            assert np.array_equal(a, b), (key, float(np.abs(a - b).max()))
        else:
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6), (key, float(np.abs(a - b).max()))


def test_tie_stages_from_the_cut():
    ties = {"wte": [(0, "tok.weight"), (5, "lm.weight")], "local": [(2, "a"), (3, "b")], "rel": [(1, "x"), (3, "y")]}
    assert tie_stages(ties, [0, 2, 4, 6]) == {(0, 1): ["rel"], (0, 2): ["wte"]}
    assert tie_stages(ties, [0, 3, 6]) == {(0, 1): ["local", "rel", "wte"]}
    assert tie_stages(ties, [0, 6]) == {}
    with pytest.raises(ValueError, match=r"gpt-x: tie 'wte' names layer 5 \('lm.weight'\) but the model has 3 layers"):
        tie_stages({"wte": ties["wte"]}, [0, 1, 3], "gpt-x")


@pytest.mark.parametrize("kind", ["flush", "stream", "multi", "multi_early"])
@pytest.mark.parametrize("opt", OPTS)
@pytest.mark.parametrize("mbs", [EXACT, ROUNDED], ids=["one_microbatch_exact", "several_microbatches_rounded"])
@LAUNCHES.plan(lambda kind, opt, mbs: [TWO_STAGE[(kind, opt, mbs, 1)]] + [ONE_STAGE[("flush", opt, mbs, s)]
                                                                         for s in (1, 2)])
def test_two_stages_with_a_tied_weight_end_equal_to_one_stage(kind, opt, mbs):
    got = LAUNCHES.result(TWO_STAGE[(kind, opt, mbs, 1)])
    models = 2 if kind.startswith("multi") else 1
    for k in range(models):
        ref = LAUNCHES.result(ONE_STAGE[("flush", opt, mbs, 1 + k)])[0][0]
        # the two stages' copies of the tied weight are the same bits
        assert np.array_equal(np.array(got[0][k]["0.tok.weight"]), np.array(got[1][k]["3.lm.weight"]))
        _compare(_joined(got, k), ref, exact=mbs == EXACT)


@LAUNCHES.plan(lambda: [TWO_STAGE[("window", "adamw", ROUNDED, 1)], ONE_STAGE[("flush", "adamw", ROUNDED, 1)]])
def test_a_stream_of_several_steps_keeps_the_copies_identical():
    got = LAUNCHES.result(TWO_STAGE[("window", "adamw", ROUNDED, 1)])
    first, last = np.array(got[0][0]["0.tok.weight"]), np.array(got[1][0]["3.lm.weight"])
    assert np.all(np.isfinite(first)) and np.array_equal(first, last)
    start = np.array(LAUNCHES.result(ONE_STAGE[("flush", "adamw", ROUNDED, 1)])[0][0]["0.tok.weight"])
    assert not np.array_equal(first, start)  # it trained (a stale-weight run differs from the synchronous one)


@LAUNCHES.plan(lambda: [ORDER])
def test_after_backward_runs_after_the_backward_posts_and_before_the_next_op():
    res = LAUNCHES.result(ORDER)
    for stage, out in enumerate(res):
        log = out["log"]
        ops = [e for e in log if e[0] == "op"]
        assert [e[1] for e in ops if not e[2]] == [0, 1, 2]  # 1F1B: backwards in order
        afters = [i for i, e in enumerate(log) if e[0] == "after"]
        assert [log[i][1] for i in afters] == [0, 1, 2]
        for i in afters:
            v = log[i][1]
            back = log.index(["op", v, False])
            assert all(e[0] == "post" for e in log[back + 1:i])  # only posts between the backward and its hook
            if stage == 1:  # the gradient of that backward is posted before the hook runs
                assert ["post", "send", f"grad B{v} 1->0"] in log[back + 1:i]
        assert all(t > 0 for t in out["forward_s"])
    assert res[1]["loss"][0] > 0 and res[0]["loss"] == [0.0]
