"""Spindle planning (issue 39): the component graph, per-step workload, the allocation kernels against their
plain-Python references on random graphs and workloads, the planner against a brute force written here, the
routing rule, and the one-pipeline baselines."""

import itertools
import math

import numpy as np
import pytest

from dynabatch.core.cost.model import CostModel
from dynabatch.core.cost.presets import ModelConfig, device_preset, model_preset
from dynabatch.core.kernels import allocation as K
from dynabatch.core.kernels import allocation_stream as KS
from dynabatch.core.kernels.cost import FEATURES
from dynabatch.core.kernels.simulate import makespan_kernel
from dynabatch.core.multitask import (Allocation, Component, ComponentCosts, ComponentGraph, Placement, StepSamples,
                                      Task, graph_from_configs, mtmm_graph, mtmm_tiny_graph, plan_allocation, route,
                                      vision_language_graph)
from dynabatch.core.multitask.allocation import StreamModel, component_options, simulate_stream
from dynabatch.core.multitask.baselines import (LayerTable, chain_bound, lower_bound, one_pipeline, pipeline_time,
                                               uniform_bounds)

DEV = device_preset("a100-80gb")


def _cfg(name, hidden, layers, ffn=None):
    return ModelConfig(name, "decoder", hidden=hidden, attn_dim=hidden, kv_dim=hidden, ffn=ffn or 4 * hidden,
                       layers=layers)


def _random_graph(rng, encoders=2, seq_len=None):
    """Encoders e0.. -> projector -> backbone -> heads h0, h1; random widths and layer counts; ``seq_len``:
    e0 attends its tokens in independent sequences of this many (a ViT's tiles)."""
    configs, kinds, inputs, tokens, tasks = {}, {}, {}, {}, {}
    enc = [f"e{k}" for k in range(encoders)]
    for k, e in enumerate(enc):
        configs[e] = _cfg(e, int(rng.choice([512, 1024, 2048])), int(rng.integers(1, 5)))
        kinds[e], tokens[e] = "encoder", ("vision", "audio")[k % 2]
    configs["proj"] = _cfg("proj", 1024, 1)
    kinds["proj"], inputs["proj"], tokens["proj"] = "projector", tuple(enc), "encoded"
    configs["bb"] = _cfg("bb", int(rng.choice([2048, 4096])), int(rng.integers(2, 7)))
    kinds["bb"], inputs["bb"], tokens["bb"] = "backbone", ("proj",), "merged"
    for h in ("h0", "h1"):
        configs[h] = _cfg(h, 1024, 1)
        kinds[h], inputs[h], tokens[h] = "head", ("bb",), "merged"
    tasks["text"] = ("bb", "h0")
    for k, e in enumerate(enc):
        tasks[f"t{k}"] = (e, "proj", "bb", ("h0", "h1")[k % 2])
    return graph_from_configs(configs, kinds, inputs, tasks, tokens=tokens,
                              seq_len={"e0": seq_len} if seq_len else None)


def _random_step(rng, graph, n=12, microbatch_tokens=2048):
    tasks = [str(t) for t in rng.choice(graph.task_names, n)]
    text = rng.integers(50, 1500, n)
    vision = np.array([256 * int(rng.integers(1, 4)) if t == "t0" else 0 for t in tasks])
    audio = np.array([int(rng.integers(100, 800)) if t.startswith("t") and t != "t0" and t != "text" else 0
                      for t in tasks])
    return StepSamples.pack(graph, tasks, text, vision, audio, microbatch_tokens=microbatch_tokens)


# ----------------------------------------------------------------------------------------------- graph


def test_graph_order_reaches_and_checks():
    g = mtmm_tiny_graph()
    assert g.order() == ("vit", "audio", "projector", "backbone", "head_caption", "head_cls")
    assert g.reaches("image_text") == ("vit", "projector", "backbone", "head_caption")
    assert g.tasks_through("projector") == ("image_text", "audio_text")
    assert g.consumers("backbone") == ("head_caption", "head_cls")
    m = _cfg("x", 64, 1)
    with pytest.raises(ValueError, match="cycle"):
        ComponentGraph((Component("a", "encoder", 1, m, inputs=("b",)), Component("b", "backbone", 1, m, ("a",))), ())
    with pytest.raises(ValueError, match="not a component"):
        ComponentGraph((Component("a", "encoder", 1, m, inputs=("zz",)),), ())
    with pytest.raises(ValueError, match="dependency order"):
        ComponentGraph((Component("a", "encoder", 1, m), Component("b", "backbone", 1, m, ("a",))),
                       (Task("t", ("b", "a")),))
    with pytest.raises(ValueError, match="none of which is earlier"):
        ComponentGraph((Component("a", "encoder", 1, m), Component("c", "encoder", 1, m),
                        Component("b", "backbone", 1, m, ("a",))), (Task("t", ("c", "b")),))
    with pytest.raises(KeyError, match="tasks: text"):
        g.reaches("video")
    with pytest.raises(ValueError, match="decoder-kind"):
        Component("a", "encoder", 3, m)


def test_vision_language_graph_keeps_the_preset_shapes():
    cfg = model_preset("vlm", 4)
    g = vision_language_graph(cfg, num_stages=4)
    assert g.names == ("vit", "backbone") and g.reaches("text") == ("backbone",)
    vit, lm = g.component("vit"), g.component("backbone")
    assert (vit.layers, lm.layers) == (45, 48)
    # the two components hold the preset's parameters (4 stages of it)
    assert math.isclose(vit.param_count + lm.param_count, 4 * cfg.params_per_stage, rel_tol=1e-12)


# ----------------------------------------------------------------------------------------------- workload


def test_workload_features_and_times_match_the_cost_model():
    g = mtmm_tiny_graph()
    s = StepSamples(("image_text", "image_text", "text", "audio_text"), text=[10, 20, 30, 5], vision=[8, 4, 0, 0],
                    audio=[0, 0, 0, 7], microbatch=[0, 0, 1, 2])
    costs = ComponentCosts(g, "cpu")
    w = costs.workload(s)
    n, q, one = (FEATURES.index(k) for k in ("n_main", "q_main", "one"))
    vit = w.features[w.row("vit")]
    # 8 and 4 backbone tokens are 2 and 1 tiles of 16 patches: 48 patches, attention per tile
    assert vit[0, n] == 48 and vit[0, q] == 3 * 16 ** 2 and vit[0, one] == 1
    assert not vit[1:].any()
    audio = w.features[w.row("audio")]
    assert audio[2, n] == 14 and audio[2, q] == 14 ** 2  # 7 tokens pooled 2:1 from 14 frames
    bb = w.features[w.row("backbone")]
    assert list(bb[:, n]) == [42, 30, 12] and list(bb[:, q]) == [18 ** 2 + 24 ** 2, 30 ** 2, 12 ** 2]
    assert list(w.reaches[w.row("head_cls")]) == [False, False, True]
    cm = CostModel.analytic(g.component("backbone").model, device_preset("cpu"))
    np.testing.assert_allclose(w.time_s[w.row("backbone")], cm.time(bb), rtol=1e-12)
    assert w.send_bytes[w.row("vit"), 0] == 12 * 64 * 4  # 12 backbone tokens, 64 wide, fp32
    with pytest.raises(ValueError, match="mixes tasks"):
        StepSamples(("text", "image_text"), [1, 1], [0, 4], [0, 0], [0, 0])


def test_pack_is_deterministic_and_names_unknown_tasks():
    g = mtmm_tiny_graph()
    tasks = ["text", "image_text", "text", "audio_text", "text"]
    a = StepSamples.pack(g, tasks, [100, 50, 300, 20, 200], [0, 8, 0, 0, 0], [0, 0, 0, 6, 0], microbatch_tokens=400)
    b = StepSamples.pack(g, tasks, [100, 50, 300, 20, 200], [0, 8, 0, 0, 0], [0, 0, 0, 6, 0], microbatch_tokens=400)
    assert list(a.microbatch) == list(b.microbatch) and a.microbatch_tasks == ("text", "text", "image_text",
                                                                               "audio_text")
    with pytest.raises(ValueError, match="tasks: text, image_text, audio_text"):
        StepSamples.pack(g, ["video"], [1], [0], [0], microbatch_tokens=10)


def test_refit_from_measured_component_times_goes_through_the_feedback_loop():
    rng = np.random.default_rng(3)
    g = _tiny_tasks(mtmm_tiny_graph())
    costs, truth = ComponentCosts(g, "cpu"), ComponentCosts(g, "cpu")
    before = costs.models["backbone"].time_coef.copy()
    errs = []
    for step in range(4):
        samples = _random_step(rng, g, n=10, microbatch_tokens=64)
        w, true = costs.workload(samples), truth.workload(samples)
        measured = {name: 1.5 * true.time_s[true.row(name)] for name in g.names}  # a machine 1.5x slower
        errs.append(costs.observe(w, measured)["backbone"])
        costs.refit()
    assert errs[0] == pytest.approx(1 / 3, rel=1e-9)  # |1 - 1.5| / 1.5
    assert errs[-1] < 0.05 and costs.models["backbone"].version > 0
    assert not np.allclose(before, costs.models["backbone"].time_coef)


def _tiny_tasks(g):
    """The tiny graph renamed like `_random_graph`'s tasks, for `_random_step`."""
    return ComponentGraph(g.components, (Task("text", g.reaches("text")), Task("t0", g.reaches("image_text")),
                                         Task("t1", g.reaches("audio_text"))))


# ----------------------------------------------------------------------------------------------- kernels


def test_lpt_kernel_matches_reference():
    rng = np.random.default_rng(0)
    for _ in range(30):
        c = np.round(rng.random(int(rng.integers(1, 20))) * 5, 1) - (rng.random() < 0.3)  # ties and skips
        d = int(rng.integers(1, 6))
        assign = np.empty(len(c), np.int64)
        loads = K.lpt_kernel(c, d, assign)
        ra, rl = K.lpt_reference(c, d)
        assert list(assign) == list(ra)
        np.testing.assert_allclose(loads, rl)


def test_gpipe_recurrence_is_the_simulator():
    rng = np.random.default_rng(1)
    for _ in range(30):
        s, m = int(rng.integers(2, 6)), int(rng.integers(1, 7))
        st, p2p, ff = rng.random(m), rng.random(m) * 0.1, float(rng.uniform(0.2, 0.5))
        sel = np.arange(m)
        got = K.gpipe_makespan_kernel(st, ff, p2p, sel, m, s, np.empty(m), np.empty(m))
        want = makespan_kernel(np.tile(st * ff, (s, 1)), np.tile(st * (1 - ff), (s, 1)), p2p, K.gpipe_codes(s, m))
        assert got == pytest.approx(want, rel=1e-12)


def _check_options(a, b):
    assert list(a[0]) == list(b[0]) and list(a[1]) == list(b[1])
    np.testing.assert_allclose(a[2], b[2], rtol=1e-9)
    np.testing.assert_allclose(a[3], b[3], rtol=1e-9)


def test_options_kernel_matches_reference_on_random_components():
    rng = np.random.default_rng(2)
    for _ in range(12):
        M = int(rng.integers(1, 9))
        t = np.where(rng.random(M) < 0.25, -1.0, rng.random(M))
        mem, p2p, recv = rng.random(M) * 4e9, rng.random(M) * 1e-3, rng.random(M) * 1e-2
        N, layers = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        state = np.array([0.0] + [2e10 * (1 + 3.0 / d) for d in range(1, N + 1)])
        args = (t, mem, p2p, recv, 4e-4, 1 / 3, layers, N, state, 1e10, 25e9, 2e-5, float(rng.uniform(2e10, 9e10)))
        _check_options(K.options_kernel(*args), K.options_reference(*args))


def test_frontier_and_pareto_sum_kernels_match_references():
    rng = np.random.default_rng(4)
    for _ in range(20):
        K_, N = int(rng.integers(1, 4)), int(rng.integers(2, 9))
        sizes = rng.integers(1, 5, K_)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n = rng.integers(1, N + 1, starts[-1]).astype(np.int64)
        t, m = np.round(rng.random(starts[-1]), 2), np.round(rng.random(starts[-1]), 2)
        got, want = K.block_frontier_kernel(n, t, m, starts, N), K.block_frontier_reference(n, t, m, starts, N)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
        n1, n2 = int(rng.integers(0, 6)), int(rng.integers(1, 6))
        t1, m1, t2, m2 = (np.round(rng.random(k), 2) for k in (n1, n1, n2, n2))
        for x, y in zip(K.pareto_sum_kernel(t1, m1, t2, m2, 1.2), K.pareto_sum_reference(t1, m1, t2, m2, 1.2)):
            np.testing.assert_array_equal(x, y)
        assert tuple(K.min_sum_kernel(t1, m1, t2, m2, 1.2)) == tuple(K.min_sum_reference(t1, m1, t2, m2, 1.2))


def test_plan_allocation_kernel_matches_reference_on_random_graphs():
    rng = np.random.default_rng(5)
    for trial in range(6):
        g = _random_graph(rng, encoders=2 + trial % 2)
        costs = ComponentCosts(g, DEV)
        w = costs.workload(_random_step(rng, g, n=int(rng.integers(4, 10))))
        N = int(rng.integers(2, 7))
        a = plan_allocation(costs, w, N)
        r = plan_allocation(costs, w, N, method="reference")
        assert a.step_seconds == pytest.approx(r.step_seconds, rel=1e-9)
        assert a.placements == r.placements and a.waves == r.waves


def _random_allocation(rng, g, N):
    """A random valid allocation of ``g`` on ``N`` devices: each dependency level a wave, components of a wave
    on disjoint contiguous ranks from a random first rank (waves may share devices or not; ranks ascending or
    descending), random stages."""
    depth = {}
    for c in g.order():
        depth[c] = 1 + max((depth[i] for i in g.component(c).inputs), default=-1)
    placements, waves = [], []
    for lv in range(max(depth.values()) + 1):
        names = [c for c in g.order() if depth[c] == lv]
        at = int(rng.integers(0, N - len(names) + 1))
        for c in names:
            room = N - at - (len(names) - 1 - names.index(c))
            n = int(rng.integers(1, room + 1))
            divs = [x for x in range(1, min(n, g.component(c).layers) + 1) if n % x == 0]
            ranks = tuple(range(at, at + n))[::int(rng.choice([1, -1]))]  # replica 0 first or last
            placements.append(Placement(c, ranks, int(rng.choice(divs)), lv))
            at += n
        waves.append(tuple(names))
    return Allocation(tuple(placements), tuple(waves), N, 0.0, {})


def test_stream_kernel_matches_reference_on_random_allocations():
    rng = np.random.default_rng(9)
    for trial in range(10):
        g = _random_graph(rng, encoders=2 + trial % 2)
        costs = ComponentCosts(g, DEV)
        w = costs.workload(_random_step(rng, g, n=int(rng.integers(3, 12))))
        N = int(rng.integers(4, 9))
        model = StreamModel(costs, w)
        for _ in range(3):
            a = _random_allocation(rng, g, N)
            got, want = model.run(a), model.run(a, "reference")
            assert got[0] == pytest.approx(want[0], rel=1e-12)
            assert got[1] == pytest.approx(want[1], rel=1e-12)
            np.testing.assert_allclose(got[2], want[2], rtol=1e-12)


def _mtmm_step(rng, tiles, text, n=40):
    """The full-size mtmm graph, its costs and the workload of ``n`` random samples (image samples of
    ``tiles`` 256-token tiles, audio samples of 750 tokens, ``text`` token counts), micro-batches of 4096."""
    g = mtmm_graph()
    costs = ComponentCosts(g, DEV)
    tasks = [str(t) for t in rng.choice(g.task_names, n)]
    vision = [256 * int(rng.integers(*tiles)) if t == "image_text" else 0 for t in tasks]
    audio = [750 if t == "audio_text" else 0 for t in tasks]
    return g, costs, costs.workload(StepSamples.pack(g, tasks, rng.integers(*text, n), vision, audio,
                                                     microbatch_tokens=4096))


def _pieced(rng, a):
    """``a`` with random pieces on its e0 (which attends independent sequences)."""
    import dataclasses

    return Allocation(tuple(dataclasses.replace(p, pieces=int(rng.integers(1, 5))) if p.component == "e0" else p
                            for p in a.placements), a.waves, a.num_devices, 0.0, {})


def test_stream_kernel_matches_reference_with_split_microbatches():
    """e0 attends sequences of 256 tokens: its micro-batches split into pieces (columns of one micro-batch),
    the consumer waiting for every piece and each piece's backward for the consumer: kernel = reference."""
    rng = np.random.default_rng(13)
    split = 0
    for trial in range(8):
        g = _random_graph(rng, encoders=2, seq_len=256)
        costs = ComponentCosts(g, DEV)
        w = costs.workload(_random_step(rng, g, n=int(rng.integers(4, 12))))
        model = StreamModel(costs, w)
        for _ in range(3):
            a = _pieced(rng, _random_allocation(rng, g, int(rng.integers(4, 9))))
            got, want = model.run(a), model.run(a, "reference")
            split += model.columns(tuple(a.placement(n).pieces for n in model.names))[0].shape[1] > w.num_microbatches
            assert got[0] == pytest.approx(want[0], rel=1e-12)
            assert got[1] == pytest.approx(want[1], rel=1e-12)
            np.testing.assert_allclose(got[2], want[2], rtol=1e-12)
    assert split >= 5  # most cases did split some micro-batch


def test_stream_split_microbatch_on_a_hand_example():
    """Producer a splits the one micro-batch into two pieces on its two replicas (ranks 0, 1), consumer b on
    rank 0 waits for both; each piece's backward waits for b's. Worked out by hand."""
    t = np.array([[2.0, 2.0], [6.0, -1.0]])  # a's pieces: F 1, B 1 each; b: F 3, B 3 (column 0 only)
    z = np.zeros((2, 2))
    xfer = np.array([[0.5, 0.5], [0.0, 0.0]])
    prod = np.array([[False, False], [True, False]])
    args = (t, z, z, xfer, prod, np.array([2, 1], np.int64), np.ones(2, np.int64), np.array([0, 1, 0], np.int64),
            np.array([0, 2], np.int64), np.array([0.5, 0.5]), 0.0, np.zeros(2), np.zeros(2), 2,
            np.array([0, 0], np.int64))
    # a piece 0 on r0 0-1, piece 1 on r1 0-1; b F on r0 after piece 1 arrives (1.5) 1.5-4.5, B 4.5-7.5;
    # a piece 0 B on r0 7.5-8.5, piece 1 B on r1 after b's gradient arrives (8) 8-9
    for fn in (KS.stream_kernel, KS.stream_reference):
        step, busy, _ = fn(*args)
        assert step == 9.0 and list(busy) == [2.0, 6.0]
    # whole (one column of 4 s on rank 0): a F 0-2, b F 2-5, b B 5-8, a B 8-10
    whole = (np.array([[4.0], [6.0]]), np.zeros((2, 1)), np.zeros((2, 1)), np.array([[0.5], [0.0]]), prod,
             np.array([1, 1], np.int64), np.ones(2, np.int64), np.array([0, 0], np.int64), np.array([0, 1], np.int64),
             np.array([0.5, 0.5]), 0.0, np.zeros(2), np.zeros(2), 2, np.array([0], np.int64))
    for fn in (KS.stream_kernel, KS.stream_reference):
        assert fn(*whole)[0] == 10.0


def test_split_sequences_splits_only_sequence_components_and_is_refused_by_route():
    """`plan_allocation(split_sequences=True)` is never slower than whole micro-batches, splits only a
    component of independent sequences (the full-size ViT here), and such a plan is simulated only: `route`
    refuses it by name."""
    g, costs, w = _mtmm_step(np.random.default_rng(14), tiles=(4, 14), text=(100, 800))
    whole = plan_allocation(costs, w, 32)
    split = plan_allocation(costs, w, 32, split_sequences=True)
    assert all(p.pieces == 1 for p in whole.placements)
    assert split.step_seconds < whole.step_seconds
    assert {p.component for p in split.placements if p.pieces > 1} == {"vit"}
    assert split.step_seconds == simulate_stream(costs, w, split)[0]
    assert split.step_seconds >= chain_bound(g, w)
    with pytest.raises(ValueError, match="'vit' splits each micro-batch"):
        route(split, g, w.microbatch_tasks)


def test_stream_follows_the_executors_order_on_a_hand_example():
    """Producer a (rank 0) feeds consumer b (rank 1), two micro-batches, one stage each, no transfers: every
    forward/backward end worked out by hand."""
    t = np.array([[4.0, 2.0], [6.0, 6.0]])       # forward share 1/2: a's F 2, 1; b's F 3, 3
    z = np.zeros((2, 2))
    prod = np.array([[False, False], [True, False]])
    one = np.ones(2, np.int64)
    args = (t, z, z, z, prod, one, one, np.array([0, 1], np.int64), np.array([0, 1], np.int64),
            np.array([0.5, 0.5]), 0.0, np.zeros(2), np.zeros(2), 2, np.arange(2))
    # a: F0 0-2, F1 2-3; b: F0 2-5, F1 5-8, then backward last first: B1 8-11, B0 11-14;
    # a's backward waits for b's: B1 (needs b's B1, ends 11) 11-12, B0 (b's B0 ends 14) 14-16
    for fn in (KS.stream_kernel, KS.stream_reference):
        step, busy, mem = fn(*args)
        assert step == 16.0 and list(busy) == [6.0, 12.0] and list(mem) == [0.0, 0.0]
    # on one rank the same work runs back to back: all forwards (a, then b), then all backwards (b, then a)
    same = args[:7] + (np.array([0, 0], np.int64),) + args[8:]
    for fn in (KS.stream_kernel, KS.stream_reference):
        assert fn(*same)[0] == 18.0
    # a barrier between the waves (the waves model) would take a's F+B then b's F+B on rank 1: longer than streamed
    ar = np.array([0.0, 1.5])  # b's group all-reduce, after its rank's last backward (11 + 3 = 14)
    for fn in (KS.stream_kernel, KS.stream_reference):
        assert fn(*(args[:12] + (ar, 2, np.arange(2))))[0] == 16.0
        assert fn(*(args[:12] + (np.array([0.0, 2.5]), 2, np.arange(2))))[0] == 16.5


def test_stream_allreduce_overlaps_the_other_components_backward():
    """Producer a and consumer b on the same rank 0: a rank posts b's all-reduce when its backward of b is done
    and goes on with a's backward, the all-reduce on the link meanwhile; two all-reduces on one device's link
    run one after the other, in the order they became ready. Worked out by hand."""
    t = np.array([[4.0, 2.0], [6.0, 6.0]])
    z = np.zeros((2, 2))
    prod = np.array([[False, False], [True, False]])
    one = np.ones(2, np.int64)

    def run(fn, ar):
        return fn(t, z, z, z, prod, one, one, np.array([0, 0], np.int64), np.array([0, 1], np.int64),
                  np.array([0.5, 0.5]), 0.0, np.zeros(2), np.asarray(ar, np.float64), 2, np.arange(2))[0]

    # rank 0: a F0 0-2, F1 2-3, b F0 3-6, F1 6-9, b B1 9-12, B0 12-15, a B1 15-16, B0 16-18
    for fn in (KS.stream_kernel, KS.stream_reference):
        assert run(fn, [0.0, 0.0]) == 18.0
        assert run(fn, [0.0, 2.5]) == 18.0   # b's all-reduce 15-17.5, hidden behind a's backward
        assert run(fn, [1.0, 2.5]) == 19.0   # a's posted at 18: 18-19 (after the rank's whole loop: 20.5)
        assert run(fn, [1.0, 4.0]) == 20.0   # b's holds the link 15-19, so a's waits: 19-20
        assert run(fn, [4.0, 1.0]) == 22.0   # b's 15-16, a's 18-22


def test_stream_allreduce_per_pipeline_stage():
    """Inside a group of two stages each stage's all-reduce starts when that stage's backward is done (as the
    baselines' stages do): b on 2 stages (stage 0 on rank 0, stage 1 on rank 1), its producer a on rank 1; one
    micro-batch, worked out by hand."""
    t = np.array([[2.0], [8.0]])  # a: F 1, B 1; b: per stage F 2, B 2
    z = np.zeros((2, 1))
    prod = np.array([[False, False], [True, False]])
    # a F 0-1 (r1), b F stage 0 1-3 (r0), stage 1 3-5 (r1), b B stage 1 5-7 (r1), stage 0 7-9 (r0), a B 9-10 (r1)
    for fn in (KS.stream_kernel, KS.stream_reference):
        def run(ar):
            return fn(t, z, z, z, prod, np.ones(2, np.int64), np.array([1, 2], np.int64),
                      np.array([1, 0, 1], np.int64), np.array([0, 1], np.int64), np.array([0.5, 0.5]), 0.0,
                      np.zeros(2), np.array(ar), 2, np.arange(1))[0]
        assert run([0.0, 0.0]) == 10.0
        # b's stage 1 all-reduce 7-10 on rank 1's link, stage 0's 9-12 on rank 0's; a's 10-11 on rank 1's
        # (one all-reduce over the whole group, 9-12 on both links, would push a's to 12-13)
        assert run([1.0, 3.0]) == 12.0
        assert run([1.0, 1.5]) == 11.0  # b's 7-8.5 and 9-10.5, a's 10-11


def test_stream_pipeline_inside_a_group_is_gpipe():
    """One component on s stages of one replica, micro-batches streamed stage to stage: the simulator's GPipe
    with the executor's reversed backward order, checked against the pipeline simulator's makespan."""
    rng = np.random.default_rng(10)
    for _ in range(10):
        s, m = int(rng.integers(2, 5)), int(rng.integers(1, 6))
        t = rng.random((1, m)) + 0.1
        p2p = rng.random((1, m)) * 0.05
        ff = float(rng.uniform(0.2, 0.5))
        args = (t, np.zeros((1, m)), p2p, np.zeros((1, m)), np.zeros((1, 1), np.bool_), np.ones(1, np.int64),
                np.array([s], np.int64), np.arange(s, dtype=np.int64), np.zeros(1, np.int64), np.array([ff]), 0.0,
                np.zeros(1), np.zeros(1), s, np.arange(m))
        st = t[0] / s
        codes = np.array([list(range(1, m + 1)) + [-k for k in range(m, 0, -1)]] * s, np.int32)
        want = makespan_kernel(np.tile(st * ff, (s, 1)), np.tile(st * (1 - ff), (s, 1)), p2p[0], codes)
        for fn in (KS.stream_kernel, KS.stream_reference):
            assert fn(*args)[0] == pytest.approx(want, rel=1e-12)


# ----------------------------------------------------------------------------------------------- planner


def _brute_force(costs, w, N, limit):
    """Least step time over every wave order written independently: each component in its own wave or
    side by side with others of the same dependency level, every (n, s) option on every component."""
    g = costs.graph
    opts = {c: component_options(costs, w, c, N, limit) for c in g.order()}
    depth = {}
    for c in g.order():
        depth[c] = 1 + max((depth[i] for i in g.component(c).inputs), default=-1)
    best = math.inf
    names = list(g.order())
    # a wave id per component: components of one level share a wave or not (ids 0..len-1 within the level)
    for waves in itertools.product(*[range(len(names)) for _ in names]):
        groups = {}
        for c, k in zip(names, waves):
            groups.setdefault((depth[c], k), []).append(c)
        if len(set(groups)) != len(set((depth[c], k) for c, k in zip(names, waves))):
            continue
        for choice in itertools.product(*[range(len(opts[c].n)) for c in names]):
            pick = dict(zip(names, choice))
            total, mem, ok = 0.0, 0.0, True
            for members in groups.values():
                if sum(opts[c].n[pick[c]] for c in members) > N:
                    ok = False
                    break
                total += max(opts[c].seconds[pick[c]] for c in members)
                mem += max(opts[c].bytes[pick[c]] for c in members)
            if ok and mem <= limit:
                best = min(best, total)
    return best


def test_plan_allocation_is_optimal_against_brute_force():
    rng = np.random.default_rng(6)
    configs = {"e0": _cfg("e0", 1024, 2), "e1": _cfg("e1", 512, 1), "bb": _cfg("bb", 2048, 2)}
    g = graph_from_configs(configs, {"e0": "encoder", "e1": "encoder", "bb": "backbone"}, {"bb": ("e0", "e1")},
                           {"text": ("bb",), "t0": ("e0", "bb"), "t1": ("e1", "bb")},
                           tokens={"e0": "vision", "e1": "audio", "bb": "merged"})
    for limit in (80e9, 3.0e9):
        costs = ComponentCosts(g, DEV)
        w = costs.workload(_random_step(rng, g, n=8))
        a = plan_allocation(costs, w, 4, memory_limit=limit, model="waves")
        assert a.step_seconds == pytest.approx(_brute_force(costs, w, 4, limit), rel=1e-12)
        assert max(a.memory_bytes) <= limit
        # the streamed search scores that same one-block allocation too, so it is never slower than its stream
        streamed = plan_allocation(costs, w, 4, memory_limit=limit)
        assert streamed.step_seconds <= simulate_stream(costs, w, a)[0] + 1e-12
        assert max(streamed.memory_bytes) <= limit


def test_allocation_respects_dependencies_memory_and_devices():
    g, costs, w = _mtmm_step(np.random.default_rng(7), tiles=(1, 7), text=(100, 1500))
    limit = DEV.memory_bytes * DEV.usable_memory_fraction
    waves = plan_allocation(costs, w, 16, model="waves")
    assert waves.step_seconds == pytest.approx(sum(max(waves.component_seconds[c] for c in wave)
                                                   for wave in waves.waves))
    a = plan_allocation(costs, w, 16)
    assert len(a.memory_bytes) == 16 and max(a.memory_bytes) <= limit
    for p in a.placements:
        for i in g.component(p.component).inputs:
            assert a.placement(i).wave < p.wave
    step, busy, mem = simulate_stream(costs, w, a)
    assert a.step_seconds == step and dict(a.component_seconds) == busy and a.memory_bytes == mem
    assert a.step_seconds <= simulate_stream(costs, w, waves)[0] + 1e-12
    assert a.step_seconds >= lower_bound(w, 16)
    with pytest.raises(ValueError, match="model="):
        plan_allocation(costs, w, 16, model="barrier")
    with pytest.raises(ValueError, match="fits on none"):
        plan_allocation(costs, w, 2)


# ----------------------------------------------------------------------------------------------- routing


def test_route_balances_reaching_microbatches_like_the_planner():
    g = mtmm_tiny_graph()
    tasks = ["text", "image_text", "audio_text", "text", "image_text", "text"]
    placements = [Placement(n, (0, 1, 2, 3), 2 if n == "backbone" else 1, w) for w, n in enumerate(g.order())]
    a = Allocation(tuple(placements), tuple((n,) for n in g.order()), 4, 1.0, {})
    cost = {"backbone": [5.0, 1.0, 2.0, 4.0, 3.0, 0.5]}
    r = route(a, g, tasks, cost_s=cost)
    assert r == route(a, g, tasks, cost_s=cost)  # deterministic
    # backbone: 2 replicas of 2 stages; longest first to the least loaded (ties to replica 0):
    # 0 -> r0 (5), 3 -> r1 (4), 4 -> r1 (7), 2 -> r0 (7), 1 -> r0 (8), 5 -> r1 (7.5)
    assert r["backbone"] == ((0, 1, 2), (0, 1, 2), (3, 4, 5), (3, 4, 5))
    assert r["vit"] == ((1,), (4,), (), ())  # equal costs: round-robin over the image micro-batches
    assert sorted(j for rank in r["head_caption"] for j in rank) == [0, 1, 3, 4, 5]
    with pytest.raises(ValueError, match="tasks: text, image_text, audio_text"):
        route(a, g, ["text", "speech"])


# ----------------------------------------------------------------------------------------------- baselines


def test_one_pipeline_on_one_stage_is_the_summed_work():
    rng = np.random.default_rng(8)
    g = _random_graph(rng)
    costs = ComponentCosts(g, DEV)
    w = costs.workload(_random_step(rng, g, n=6))
    table = LayerTable(costs, w)
    t, _ = pipeline_time(table, uniform_bounds(table.num_layers, 1), 1, bypass=False)
    # one stage, one device: every micro-batch's work on every component plus one launch overhead each
    assert t == pytest.approx(w.time_s.sum() - (w.time_s > 0).sum() * DEV.overhead_s
                              + w.num_microbatches * DEV.overhead_s, rel=1e-9)
    full = one_pipeline(costs, w, 4, bypass=False)
    by = one_pipeline(costs, w, 4, bypass=True)
    assert by.step_seconds <= full.step_seconds + 1e-12 and full.replicas * full.num_stages == 4
    work = w.time_s.sum() - (w.time_s > 0).sum() * DEV.overhead_s
    assert lower_bound(w, 4) == pytest.approx(work / 4, rel=1e-9)
    assert full.step_seconds >= lower_bound(w, 4)


def test_one_pipeline_overlaps_each_stage_allreduce_with_the_earlier_stages_backward():
    """The one-pipeline baseline posts each stage's gradient all-reduce when that stage's last backward (over
    the copies) ends (Megatron's overlap-grad-reduce): recomputed here from the pipeline simulator's 1F1B ends
    per copy and the ring all-reduce of each stage's parameter bytes over the copies."""
    from dynabatch.core.simulate.pipeline import simulate_pipeline

    rng = np.random.default_rng(11)
    g = _random_graph(rng)
    costs = ComponentCosts(g, DEV)
    w = costs.workload(_random_step(rng, g, n=10))
    table = LayerTable(costs, w)
    S, N, bw_link = 2, 4, 5e9
    D = N // S
    bounds = uniform_bounds(table.num_layers, S)
    got, _ = pipeline_time(table, bounds, N, bypass=False, allreduce_bandwidth=bw_link)
    o = DEV.overhead_s
    f = np.array([table.forward_s[a:b].sum(0) for a, b in zip(bounds, bounds[1:])]) + o / 3
    bwd = np.array([table.backward_s[a:b].sum(0) for a, b in zip(bounds, bounds[1:])]) + 2 * o / 3
    assign, _ = K.lpt_reference((f + bwd).sum(0), D)
    done = np.zeros(S)
    for d in range(D):
        sel = [j for j in range(w.num_microbatches) if assign[j] == d]
        sim = simulate_pipeline(f[:, sel], bwd[:, sel], schedule="1f1b", p2p_s=table.p2p_s[sel])
        done = np.maximum(done, sim.end_s[:, :, 1].max(axis=1))
    params = [sum(table.share[i] * w.params[table.component[i]] * w.dtype_bytes[table.component[i]]
                  for i in range(a, b)) for a, b in zip(bounds, bounds[1:])]
    ar = [2 * (D - 1) / D * p / bw_link + 2 * (D - 1) * DEV.p2p_latency_s for p in params]
    assert got == pytest.approx(max(d + a for d, a in zip(done, ar)), rel=1e-12)
    # stage 0's backward ends last: a later stage's all-reduce overlaps it, so the step is shorter than
    # adding the largest all-reduce after the whole pipeline
    assert done[0] == done.max() and got < done.max() + max(ar)


def test_chain_bound_is_the_heaviest_path_and_bounds_every_layout():
    """`chain_bound`: per micro-batch, the heaviest path through the components its task reaches (summed
    one-device seconds less the launch overhead), written here as a sum over the task's path (each task of
    `_random_graph` is one chain); the allocation and every one-pipeline layout take at least that long."""
    rng = np.random.default_rng(12)
    for _ in range(4):
        g = _random_graph(rng)
        costs = ComponentCosts(g, DEV)
        w = costs.workload(_random_step(rng, g, n=int(rng.integers(3, 9))))
        want = 0.0
        for j, task in enumerate(w.microbatch_tasks):
            path = sum(max(0.0, float(w.time_s[w.row(c), j]) - DEV.overhead_s) for c in g.reaches(task))
            want = max(want, path)
        assert chain_bound(g, w) == pytest.approx(want, rel=1e-12)
        for N in (4, 8):
            assert plan_allocation(costs, w, N).step_seconds >= want
            assert one_pipeline(costs, w, N, bypass=True).step_seconds >= want
    # a component of independent sequences counts one sequence's share: its sequences may be split
    g = _random_graph(rng, seq_len=128)
    costs = ComponentCosts(g, DEV)
    w = costs.workload(_random_step(rng, g, n=8))
    want = 0.0
    for j, task in enumerate(w.microbatch_tasks):
        path = 0.0
        for c in g.reaches(task):
            x = max(0.0, float(w.time_s[w.row(c), j]) - DEV.overhead_s)
            if c == "e0":
                x /= max(1, round(w.features[w.row(c)][j, FEATURES.index("n_main")] / 128))
            path += x
        want = max(want, path)
    assert chain_bound(g, w) == pytest.approx(want, rel=1e-12)
    assert plan_allocation(costs, w, 8, split_sequences=True).step_seconds >= want
