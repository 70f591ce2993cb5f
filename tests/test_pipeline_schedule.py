"""Op orders and communication programs: NCCL-safe by construction, checked under strict semantics."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynabatch.pipeline.runtime import (CommRecorder, Message, Post, ProgramError, build_programs,
                                        check_peer_sequences, check_programs, stage_orders)
from dynabatch.pipeline.runtime.comm import CommEvent
from dynabatch.pipeline.runtime.schedule import naive_programs, peer_sequences, quantize_times
from dynabatch.core.simulate import pipeline_schedule, simulate_pipeline


@settings(max_examples=60, deadline=None)
@given(S=st.integers(1, 6), M=st.integers(1, 8), kind=st.sampled_from(["gpipe", "1f1b", "adaptive"]),
       seed=st.integers(0, 10_000))
def test_programs_pair_and_never_deadlock(S, M, kind, seed):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.01, 1.0, M)
    mem = rng.uniform(1.0, 4.0, M)
    orders = stage_orders(kind, S, M, time_s=t, memory_bytes=mem, memory_limit=float(rng.uniform(1.0, 12.0)))
    progs = build_programs(orders, quantize_times(t))
    codes = orders.codes()
    check_programs(progs)  # strict: one FIFO per rank, blocking computes
    # both ends of every link post the same message sequence, opposite sides
    for s in range(S - 1):
        a = peer_sequences(progs[s], s)[s + 1]
        b = peer_sequences(progs[s + 1], s + 1)[s]
        assert [m for _, m in a] == [m for _, m in b]
        assert all(x != y for (x, _), (y, _) in zip(a, b))
    # computes appear in exactly the stage's op order
    for s in range(S):
        assert [i.op for i in progs[s] if not isinstance(i, Post)] == list(orders.rank(s))
        assert len(orders.rank(s)) == len(codes[s])


@given(S=st.integers(2, 6), M=st.integers(1, 8), kind=st.sampled_from(["gpipe", "1f1b", "adaptive"]),
       seed=st.integers(0, 10_000))
def test_programs_with_bypassed_stages_pair_and_never_deadlock(S, M, kind, seed):
    """Micro-batches entering at a later stage (their first stages idle): those stages hold no op and
    no message for them, every link still pairs, and the programs run under NCCL semantics."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.01, 1.0, M)
    entry = rng.integers(0, S, M) * (rng.random(M) < 0.6)
    orders = stage_orders(kind, S, M, time_s=t, memory_bytes=rng.uniform(1.0, 4.0, M), memory_limit=8.0)
    progs = build_programs(orders, quantize_times(t), entry)
    check_programs(progs, entry)
    for s in range(S):
        ran = [i.op for i in progs[s] if not isinstance(i, Post)]
        assert ran == [op for op in orders.rank(s) if s >= entry[op.microbatch]]  # the order, less the bypassed
        for p in (i for i in progs[s] if isinstance(i, Post)):
            j, link = p.message.microbatch, min(p.message.src, p.message.dst)
            assert link >= entry[j]  # nothing crosses a link into (or before) the entry stage
    for s in range(S - 1):
        a, b = peer_sequences(progs[s], s).get(s + 1, []), peer_sequences(progs[s + 1], s + 1).get(s, [])
        assert [m for _, m in a] == [m for _, m in b]
    if (entry > 0).any():  # without the entries the checker sees forwards waiting for activations never sent
        with pytest.raises(ProgramError, match="deadlock"):
            check_programs(progs)


def test_naive_posting_deadlocks_1f1b_under_nccl_semantics():
    """Posting each receive just before its compute is fine for GPipe but not for 1F1B: the checker
    must catch it (this is the bug `build_programs` avoids)."""
    check_programs(naive_programs(pipeline_schedule(3, 4, "gpipe")))
    with pytest.raises(ProgramError, match="deadlock"):
        check_programs(naive_programs(pipeline_schedule(3, 4, "1f1b")))


def test_checker_rejects_mismatched_and_premature_posts():
    orders = pipeline_schedule(2, 2, "1f1b")
    progs = build_programs(orders)
    bad = [list(p) for p in progs]
    posts = [k for k, i in enumerate(bad[1]) if isinstance(i, Post)]
    bad[1][posts[0]], bad[1][posts[1]] = bad[1][posts[1]], bad[1][posts[0]]  # swap two posts on one side
    with pytest.raises(ProgramError):
        check_programs(bad)
    early = [list(p) for p in progs]
    k = next(k for k, i in enumerate(early[0]) if isinstance(i, Post))
    early[0].insert(0, early[0].pop(k))  # send before computing
    with pytest.raises(ProgramError, match="before computing"):
        check_programs(early)


def test_adaptive_respects_memory_limit_and_is_deterministic():
    rng = np.random.default_rng(3)
    for _ in range(50):
        S, M = int(rng.integers(2, 6)), int(rng.integers(2, 12))
        mem = rng.uniform(1, 10, M)
        limit = float(rng.uniform(mem.max(), 4 * mem.max()))
        units = quantize_times(rng.uniform(0.1, 1, M))
        a = stage_orders("adaptive", S, M, time_s=units, memory_bytes=mem, memory_limit=limit).codes()
        assert np.array_equal(a, stage_orders("adaptive", S, M, time_s=units, memory_bytes=mem,
                                              memory_limit=limit).codes())
        sim = simulate_pipeline(units.astype(float), 2 * units.astype(float), schedule=a, mem_bytes=mem)
        assert np.all(sim.peak_inflight_bytes <= limit + 1e-9)


def test_adaptive_depth_follows_micro_batch_size():
    """Small micro-batches: more in flight than 1F1B; one oversize micro-batch still runs (alone)."""
    S, M = 3, 8
    units = np.ones(M, np.int64)
    small = stage_orders("adaptive", S, M, time_s=units, memory_bytes=np.full(M, 1.0), memory_limit=6.0).codes()
    peak = simulate_pipeline(np.ones(M), 2 * np.ones(M), schedule=small, mem_bytes=np.ones(M)).peak_inflight
    assert peak[0] > S
    big = stage_orders("adaptive", S, M, time_s=units, memory_bytes=np.array([1, 1, 10, 1, 1, 1, 1, 1.0]),
                       memory_limit=3.0).codes()
    sim = simulate_pipeline(np.ones(M), 2 * np.ones(M), schedule=big, mem_bytes=np.array([1, 1, 10, 1, 1, 1, 1, 1.0]))
    assert sim.peak_inflight_bytes[0] == 10.0  # the big one ran with nothing else in flight
    # without memory figures it holds at most S micro-batches (1F1B's depth)
    plain = stage_orders("adaptive", S, M, time_s=units).codes()
    assert simulate_pipeline(np.ones(M), np.ones(M), schedule=plain).peak_inflight.max() <= S


def test_peer_sequence_checker_catches_disorder():
    def rec(rank, peer, ops):
        r = CommRecorder()
        for side, label in ops:
            r(CommEvent(rank, peer, side, label, ((2, 3),), ("float32",)))
        return r.per_peer()

    good = {0: rec(0, 1, [("send", "a"), ("recv", "b")]), 1: rec(1, 0, [("recv", "a"), ("send", "b")])}
    check_peer_sequences(good)
    bad = {0: rec(0, 1, [("send", "a"), ("recv", "b")]), 1: rec(1, 0, [("send", "b"), ("recv", "a")])}
    with pytest.raises(AssertionError, match="does not pair"):
        check_peer_sequences(bad)


def test_message_order_is_the_same_key_on_both_ends():
    progs = build_programs(pipeline_schedule(4, 5, "1f1b"))
    sent = [i.message for i in progs[1] if isinstance(i, Post) and i.message.src == 1 and i.message.dst == 2]
    got = [i.message for i in progs[2] if isinstance(i, Post) and i.message.src == 1]
    assert sent == got and sent[0] == Message(0, "act", 1, 2)
