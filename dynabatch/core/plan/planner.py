"""`plan_microbatches`: cut one global batch into micro-batches, spread them over ranks, order them.

``method="dp"`` (padded collation) and ``method="dp_varlen"`` (packed varlen collation) run the
numba dynamic program of `dynabatch.core.kernels.dp` on an ordering of the samples that keeps similar shapes
adjacent, then balance ranks and order each rank's micro-batches by simulating the schedule
(`dynabatch.core.kernels.assign`). The baselines of `dynabatch.core.plan.baselines` go through the same costing and
simulation so every comparison is one ``method=`` flag.

Planning only groups and orders *within* a global batch; `split_global_batches` forms the global
batches as random samples of the stream so no step is all-short or all-long.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

from typing import Any, Mapping

import numpy as np

from . import baselines as _bl
from ..kernels.assign import BALANCE_ROUNDS, BALANCE_TOP, assign_ranks, balance_simulated
from ..kernels.global_batches import greedy_cuts
from ..kernels.dp import INFEASIBLE_SAMPLE, NO_EQUAL_SPLIT, TOO_FEW_SAMPLES, DPSearch, dp_kernel, segment_cost
from ..batchplan import BatchPlan
from ..cost.features import main_padding
from ..cost.model import CostModel
from ..options import METHODS, UNSET, PlanOptions, given, renamed
from ..schedule.orders import record_orders
from ..schedule.registry import AUTO_PREFERENCE
from ..schedule.search import ops_by_count, order_step
from .recompute import apply_recompute, dp_candidates
from .stage_plan import assign_and_order_stages, assign_ranks_stages, refine_orders
from ..shapes import Shapes
from ..simulate.flushfree import flushfree_report



class PlanningError(ValueError):
    """A global batch cannot be planned (a sample too large for memory, too few samples...)."""


class NoEqualSplitError(PlanningError):
    """The global batch cannot be cut into a multiple of the rank count under the memory limit."""


def split_global_batches(shapes: Shapes, global_batch_tokens: int | None = None, *, seed: int = 0, tokens=None,
                         drop_last: bool = False, shuffle: bool = True, batch_tokens: int | None = None,
                         tokens_per_batch: int | None = None) -> list[np.ndarray]:
    """Positions of each global batch: a seeded random permutation of the samples (the samples in
    order when not ``shuffle``), cut each time a
    batch's own token count reaches ``global_batch_tokens`` (so every batch but the last holds at
    least that many tokens). ``tokens`` overrides the per-sample token count (default
    ``shapes.total_tokens``; ones count samples). The last, smaller batch is kept unless
    ``drop_last``. `dynabatch.core.plan.steps.global_batches` calls this with a `PlanOptions`.
    ``batch_tokens`` and ``tokens_per_batch``: deprecated names of ``global_batch_tokens`` (a warning)."""
    deprecated = {k: v for k, v in (("batch_tokens", batch_tokens), ("tokens_per_batch", tokens_per_batch))
                  if v is not None}
    if deprecated:
        global_batch_tokens = renamed(deprecated, where="split_global_batches").pop("global_batch_tokens",
                                                                                     global_batch_tokens)
    if global_batch_tokens is None or global_batch_tokens <= 0:
        raise ValueError(f"global_batch_tokens must be positive, got {global_batch_tokens!r}")
    tok = shapes.total_tokens if tokens is None else np.asarray(tokens, np.int64)
    if len(tok) != len(shapes):
        raise ValueError(f"tokens has {len(tok)} entries for {len(shapes)} samples")
    perm = np.random.default_rng(seed).permutation(len(shapes)) if shuffle else np.arange(len(shapes))
    if len(perm) == 0:
        return []
    ends = greedy_cuts(tok[perm].astype(np.int64), int(global_batch_tokens))
    parts = np.split(perm, ends[:-1])
    if drop_last and tok[parts[-1]].sum() < global_batch_tokens:
        parts = parts[:-1]
    return parts


def _decoder_classes(dec, pad_multiple: int) -> np.ndarray:
    """Geometric classes of the decoder length: 0 up to ``base = 2 * max(pad_multiple, 8)`` tokens,
    then one class per doubling (``(base, 2 base]``, ``(2 base, 4 base]``...), so a micro-batch
    drawn from one class pads its decoder dimension by less than 2x (int64 per sample)."""
    base = 2 * max(int(pad_multiple), 8)
    d = np.maximum(np.asarray(dec, np.int64), 1)
    # the smallest c with d <= base * 2**c, exactly in integers
    return np.maximum(np.ceil(np.log2(d / base) - 1e-12), 0).astype(np.int64)


def sample_order(cost: CostModel, main, dec, tiles, padded: bool = True) -> np.ndarray:
    """Sample order that keeps similar shapes adjacent: by length for decoder-only models, else by
    the sample's own cost (ties by main then decoder length). For padded 2-D (encoder-decoder)
    shapes a 1-D sort cannot keep both lengths close, so samples are first grouped by geometric
    class of decoder length (`_decoder_classes`): a contiguous segment of the order then pads
    little in either dimension (by own cost alone the DP ended 12% above the objective bound on
    FLAN-like T5 batches, with the classes 8%). Packed (``padded=False``) micro-batches pay no
    padding, so they keep the plain order."""
    if cost.kind == "decoder":
        return np.argsort(main, kind="stable")
    own, _ = cost.padded(1, main, dec, tiles)
    if not padded or not np.any(dec):
        return np.lexsort((dec, main, own))
    return np.lexsort((dec, main, own, _decoder_classes(dec, cost.pad_multiple)))


def plan_microbatches(shapes: Shapes, cost_model: CostModel, options: PlanOptions | None = None, *, step: int = 0,
                      global_batch_tokens: int | None = UNSET, global_batch_size: int | None = UNSET,
                      max_len: int | None = UNSET, max_target_len: int | None = UNSET, method: str = UNSET,
                      method_options: Mapping[str, Any] = UNSET, num_stages: int = UNSET, num_ranks: int = UNSET,
                      schedule: str = UNSET, memory_limit: float | None = UNSET, recompute: str = UNSET,
                      device_memory_limit: float | None = UNSET, flush: bool = UNSET, seed: int = UNSET,
                      shuffle: bool = UNSET, drop_last: bool = UNSET, equal_microbatches: bool = UNSET,
                      max_caps: int = UNSET, batch_tokens: int = UNSET, tokens_per_batch: int = UNSET,
                      batch_size: int = UNSET, samples_per_batch: int = UNSET, ranks: int = UNSET, stages: int = UNSET,
                      rows: int = UNSET, max_tokens: int = UNSET, microbatches_per_rank: int = UNSET) -> BatchPlan:
    """Plan one global batch: which samples form each micro-batch, on which rank, in which order.

    ``shapes`` are the samples of the global batch; ``options`` a `PlanOptions`, or give its fields
    as keywords (``num_stages=4, num_ranks=8, method="dp", max_len=2048``...; each keyword is the
    `PlanOptions` field of its name and overrides ``options``; one not given (`UNSET`) keeps the
    value of ``options``). Deprecated, with a DeprecationWarning: the old option names
    (``batch_tokens``, ``tokens_per_batch``, ``batch_size``, ``samples_per_batch``, ``ranks``,
    ``stages``: `DEPRECATED_NAMES`) and a baseline's knob as a bare keyword (``rows``, ``max_tokens``,
    ``microbatches_per_rank``: give it in ``method_options``). ``memory_limit`` (bytes of activations per micro-batch per stage) defaults to
    ``cost_model.memory_limit(num_stages, num_ranks)``; ``max_len``/``max_target_len`` truncate
    sample lengths in tokens; baselines take their knob from ``method_options`` (see
    `dynabatch.core.plan.baselines.BASELINE_KNOBS`). ``step`` numbers the plan. Raises `PlanningError`
    when a sample cannot fit in memory even alone, naming its sample id.

    ``recompute`` / ``device_memory_limit`` (`dynabatch.core.plan.recompute`): ``full`` sizes micro-batches
    by their fully recomputed memory and prices every stage recomputing all its layers; ``adaptive``
    cuts the step at each of `dp_candidates` (the micro-batch cuts), orders it for the schedule (with
    ``schedule="auto"``: for each of gpipe, 1f1b and adaptive), picks per stage the fewest recomputed layers whose simulated peak fits the device limit,
    and returns the candidate with the shortest simulated iteration. The choice is in
    ``plan.options`` (``recompute_layers``, ``stage_peak_bytes``); a baseline method is cut as
    ``full`` cuts and priced under the policy.
    """
    # every keyword given but the four above is a planning option (or a deprecated name of one)
    fields = given({k: v for k, v in locals().items() if k not in ("shapes", "cost_model", "options", "step")})
    options = _options(options, fields)
    if options.recompute == "none":
        plan = _plan(shapes, cost_model, options, step)
        if options.device_memory_limit is None:
            return plan
        return apply_recompute(plan, cost_model, "none", options.device_memory_limit, shapes=shapes)
    limit = cost_model.memory_limit(options.num_stages, options.num_ranks) if options.memory_limit is None \
        else float(options.memory_limit)
    dp = options.method in ("dp", "dp_varlen")
    cands = dp_candidates(cost_model, limit, options.recompute if dp else "full", options.device_memory_limit,
                          options.num_stages)
    # schedule "auto" under adaptive recomputation: every concrete order is tried with every cut, since
    # an order that holds fewer micro-batches needs less recomputation (each candidate's own "auto" pick
    # only sees the per-micro-batch limit)
    scheds = AUTO_PREFERENCE if options.schedule == "auto" and options.recompute == "adaptive" and dp \
        else (options.schedule,)
    best, error = None, None
    for (cost, cap), sched in itertools.product(cands, scheds):
        try:
            plan = _plan(shapes, cost, options.replace(memory_limit=cap, schedule=sched), step)
            plan = apply_recompute(plan, cost_model, options.recompute, options.device_memory_limit, shapes=shapes)
        except (PlanningError, ValueError) as e:  # cuts too fine for a sample, or no recompute fits
            error = error or e
            continue
        if best is None or plan.iteration_time_s < best.iteration_time_s:
            best = plan
    if best is None:
        raise error
    return best


def _plan(shapes: Shapes, cost_model: CostModel, options: PlanOptions, step: int) -> BatchPlan:
    """`plan_microbatches` without recomputation. Flush-free (``flush=False``) the cuts, ranks and order
    are the same (the flushed objective's ``(S-1) x max`` term still stands for the 1F1B round trip a
    large micro-batch stalls in steady state: planning on ``sum/R`` alone gave 4x larger micro-batches
    and a 31% slower steady state on FLAN-like gpt steps), and the plan records its simulated
    steady-state step time in a stream of itself (``options["flushfree_step_s"]``,
    `dynabatch.core.simulate.flushfree.flushfree_report`)."""
    plan = _plan_flushed(shapes, cost_model, options, step)
    if options.flush:
        return plan
    rep = flushfree_report([plan], cost_model)  # a stream of this plan: its steady state
    return dataclasses.replace(plan, options={**plan.options, "flush": False,
                                              "flushfree_step_s": float(rep.flushfree_s[0])})


def _plan_flushed(shapes: Shapes, cost_model: CostModel, options: PlanOptions, step: int) -> BatchPlan:
    method, num_ranks, num_stages = options.method, options.num_ranks, options.num_stages
    max_len, max_target_len = options.max_len, options.max_target_len
    method_options = dict(options.method_options)
    if len(shapes) < num_ranks:
        raise PlanningError(f"a global batch of {len(shapes)} samples cannot feed {num_ranks} ranks")
    limit = cost_model.memory_limit(num_stages, num_ranks) if options.memory_limit is None \
        else float(options.memory_limit)
    main, dec, tiles = cost_model.sample_dims(shapes, max_len, max_target_len)
    if cost_model.stage_aware and cost_model.layout.num_stages != num_stages:
        raise ValueError(f"the cost model's layout has {cost_model.layout.num_stages} stages; num_stages={num_stages}")

    collation = options.collation
    _check_samples_fit(cost_model, shapes.sample_id, main, dec, tiles, collation, limit)
    dp = method in ("dp", "dp_varlen")
    if dp:
        unknown = set(method_options) - {"order"}
        if unknown:
            raise TypeError(f"method {method!r} takes no options {sorted(unknown)}")
        if cost_model.stage_aware:  # per-stage path: the better of the DP's stage surrogates, by simulation
            return _plan_stage_candidates(shapes, cost_model, options, main, dec, tiles, limit, step, method_options)
        grouping = _dp_grouping(cost_model, shapes.sample_id, main, dec, tiles, collation, limit, num_ranks,
                                num_stages,
                                options.max_caps, method_options.get("order"), options.equal_microbatches)
    else:
        grouping = _baseline_grouping(method, cost_model, main, dec, tiles, num_ranks, max_len, max_target_len,
                                      method_options)
    return _assemble(shapes, cost_model, main, dec, tiles, grouping, collation, method, num_ranks, num_stages,
                     options.schedule, limit, step, rebalance=dp, equal=options.equal_microbatches and dp,
                     options={"max_len": max_len, "max_target_len": max_target_len, **method_options})


def _plan_stage_candidates(shapes, cost, options, main, dec, tiles, limit, step, method_options) -> BatchPlan:
    """DP plans on the per-stage path: the DP prices a micro-batch additively, so it runs once with the
    stage-mean coefficients (``time_coef``: exact total work, tight when stages balance) and once with
    those of the stage the samples load most (the bottleneck's own total, which the makespan is at
    least); both are assembled with per-stage assignment and ordering and the faster plan is kept."""
    ranks, stages, collation = options.num_ranks, options.num_stages, options.collation
    phi = cost.packed_features(main, dec, tiles, np.arange(len(main)))  # each sample alone
    own = cost.stage_times(phi).sum(axis=1)
    candidates = [None, cost.stage_time_rows(stages)[int(np.argmax(own))]]
    # memory: the per-feature largest stage coefficients bound every stage's memory; where a sample
    # does not fit alone under that bound, the stage-mean coefficients (as the stage-blind DP uses)
    mcoef = cost.planning_mem_coef()
    if (phi @ mcoef).max(initial=0.0) > limit:
        mcoef = cost.mem_coef
    best = None
    for tcoef in candidates:
        g = _dp_grouping(cost, shapes.sample_id, main, dec, tiles, collation, limit, ranks, stages, options.max_caps,
                         method_options.get("order"), options.equal_microbatches, tcoef, mcoef)
        plan = _assemble(shapes, cost, main, dec, tiles, g, collation, options.method, ranks, stages,
                         options.schedule, limit, step, rebalance=True, equal=options.equal_microbatches,
                         options={"max_len": options.max_len, "max_target_len": options.max_target_len,
                                  **method_options})
        if best is None or plan.iteration_time_s < best.iteration_time_s:
            best = plan
    return refine_orders(best, cost, shapes)


def _options(options: PlanOptions | None, fields: dict) -> PlanOptions:
    """``options`` with keyword ``fields`` applied; a method knob given as a bare keyword (the form
    of earlier releases) moves into ``method_options`` with a DeprecationWarning."""
    names = {f.name for f in dataclasses.fields(PlanOptions)}
    fields = renamed(fields, where="plan_microbatches", stacklevel=4)
    knobs = {k: fields.pop(k) for k in list(fields) if k not in names}
    if knobs:
        warnings.warn(f"plan_microbatches: pass method knobs as method_options={knobs!r}, not as keywords",
                      DeprecationWarning, stacklevel=3)
        fields["method_options"] = {**dict(fields.get("method_options") or (options.method_options if options
                                                                             else {})), **knobs}
    if options is None:
        return PlanOptions(**fields)
    return dataclasses.replace(options, **fields) if fields else options


def _check_samples_fit(cost, sample_ids, main, dec, tiles, collation, limit) -> None:
    """Raise `PlanningError` naming the first sample that cannot fit in memory even alone."""
    # Alone means a batch of one in its own length; a fixed-length packed row that overflows the
    # limit is a setting of that baseline (flagged over_memory_limit), not a sample that cannot fit.
    if collation == "packed":
        t, m = cost.packed(main, dec, tiles, np.arange(len(main)))
    else:
        t, m = cost.padded(1, main, dec, tiles)
    bad = np.flatnonzero((m > limit) | ~np.isfinite(t) | ~np.isfinite(m))
    if not len(bad):
        return
    k = int(bad[0])
    what = (f"sample_id {int(sample_ids[k])} ({int(main[k])} main tokens, {int(dec[k])} decoder tokens, "
            f"{int(tiles[k])} tiles)")
    if not np.isfinite(t[k]) or not np.isfinite(m[k]):
        tab = cost.table
        raise PlanningError(
            f"{what} lies outside the profiled cost table (rows {tab.rows[0]:g}-{tab.rows[-1]:g}, main length "
            f"{tab.main_len[0]:g}-{tab.main_len[-1]:g}, decoder length {tab.dec_len[0]:g}-{tab.dec_len[-1]:g}); "
            f"profile larger shapes, truncate with max_len, or build the table with extrapolate=True")
    raise PlanningError(
        f"{what} needs {float(m[k]):.4g} bytes of activations alone ({collation} collation), over the memory "
        f"limit of {limit:.4g} bytes per micro-batch; raise the limit, truncate it (max_len) or use more stages")


def _dp_grouping(cost, sample_ids, main, dec, tiles, collation, limit, ranks, stages, max_caps,
                 order, equal, tcoef=None, mcoef=None) -> _bl.Grouping:
    varlen = collation == "packed"
    perm = sample_order(cost, main, dec, tiles, not varlen) if order is None else np.asarray(order, np.int64)
    seg = segment_cost(varlen, cost.pad_multiple, cost.model.tile_patches, cost.time_coef if tcoef is None else tcoef,
                       cost.mem_coef if mcoef is None else mcoef, limit, cost.table,
                       dense=cost.packed_attention == "dense")
    starts, status = dp_kernel(main[perm], dec[perm], tiles[perm], seg,
                               DPSearch(int(ranks), int(stages), int(max_caps), bool(equal)))
    if status == INFEASIBLE_SAMPLE:  # _check_samples_fit runs first; kept for direct kernel callers
        p = int(perm[starts[0]])
        raise PlanningError(f"sample_id {int(sample_ids[p])} cannot fit in memory alone")
    if status == TOO_FEW_SAMPLES:
        raise PlanningError(f"a global batch of {len(main)} samples cannot feed {ranks} ranks")
    if status == NO_EQUAL_SPLIT:
        raise NoEqualSplitError(
            f"the {len(main)} samples of this global batch cannot be cut into a multiple of {ranks} micro-batches "
            f"under the memory limit ({limit:.4g} bytes), so ranks cannot get equal micro-batch counts; use a larger "
            f"global batch, raise the memory limit, or pass equal_microbatches=False")
    offsets = np.append(starts, len(perm)).astype(np.int64)
    return _bl.Grouping(perm, offsets, np.zeros(len(starts), np.int32), np.zeros(len(perm), np.int32))


def _baseline_grouping(method, cost, main, dec, tiles, ranks, max_len, max_target_len, opts) -> _bl.Grouping:
    knob, _ = _bl.BASELINE_KNOBS[method]
    unknown = set(opts) - {knob}
    if unknown:
        raise TypeError(f"method {method!r} takes the option {knob!r}, not {sorted(unknown)}")
    tokens = main + dec
    kw = {knob: int(opts[knob])} if knob in opts else {}
    if method == "pad":
        return _bl.pad(tokens, ranks, **kw)
    if method == "group_by_length":
        return _bl.group_by_length(tokens, ranks, **kw)
    if method == "token_budget":
        return _bl.token_budget(tokens, ranks, pad_multiple=cost.pad_multiple, **kw)
    if method in ("pack", "pack_varlen"):
        L = int(max_len) if max_len is not None else int(main.max(initial=1))
        T = int(max_target_len) if max_target_len is not None else int(dec.max(initial=0))
        fn = _bl.pack if method == "pack" else _bl.pack_varlen
        return fn(main, dec, ranks, max_len=L, max_target_len=T, **kw)
    if method == "rebalance":
        own, _ = cost.padded(1, main, dec, tiles)
        return _bl.rebalance(tokens, own, ranks, **kw)
    return _bl.kk(tokens, ranks, **kw)


def _balance_simulated(schedule, time_s, p2p, rank_of, ranks, stages, fwd_fraction) -> np.ndarray:
    """`assign_ranks` balances ``sum + (S-1) * max`` per rank, which leaves the simulated makespans
    2-3% apart; finish with swaps judged by simulating the plain order the schedule registers as its
    ``balance`` (`dynabatch.core.schedule.registry.ScheduleInfo`: GPipe's own for ``gpipe``, 1F1B's for the
    others, whose orders the swap kernel cannot price; the final order and rank times are the schedule's
    own), keeping every rank's count. An unknown schedule raises."""
    ops = ops_by_count(stages, np.bincount(rank_of, minlength=ranks), schedule)
    if ranks < 2 or stages < 2 or not len(time_s) or not np.all(np.isfinite(time_s)):
        return rank_of
    return balance_simulated(np.ascontiguousarray(time_s, np.float64), np.ascontiguousarray(p2p, np.float64),
                             np.ascontiguousarray(rank_of, np.int32), ranks, fwd_fraction, stages, ops,
                             BALANCE_ROUNDS, BALANCE_TOP)


def _assemble(shapes, cost, main, dec, tiles, g: _bl.Grouping, collation, method, ranks, stages, schedule, limit,
              step, rebalance, equal, options) -> BatchPlan:
    pos, off = g.positions, g.offsets
    starts = off[:-1]
    sizes = np.diff(off)
    m_main, m_dec, m_tiles = main[pos], dec[pos], tiles[pos]
    n_tiles = np.add.reduceat(m_tiles, starts) if len(pos) else np.zeros(0, np.int64)
    L = np.maximum.reduceat(m_main, starts) if len(pos) else np.zeros(0, np.int64)
    T = np.maximum.reduceat(m_dec, starts) if len(pos) else np.zeros(0, np.int64)
    real = np.add.reduceat(m_main + m_dec, starts) if len(pos) else np.zeros(0, np.int64)
    # the decoder tokens (packed: the decoder row a stage boundary carries), from the same per-sample lengths
    target = np.add.reduceat(m_dec, starts) if len(pos) else np.zeros(0, np.int64)
    if collation == "packed":
        group = np.repeat(np.arange(len(sizes)), sizes)
        phi = cost.packed_features(m_main, m_dec, m_tiles, group)
        rows = sizes.astype(np.int64)
        time_s, mem = cost.time(phi), cost.memory(phi)
        computed = real
    else:
        if collation == "packed_rows":
            rows = np.maximum.reduceat(g.row.astype(np.int64), starts) + 1
            L = np.full(len(sizes), int(options.get("max_len") or main.max(initial=1)), np.int64)
            T = np.full(len(sizes), int(options.get("max_target_len") or dec.max(initial=0)) if dec.any() else 0, np.int64)
        else:
            rows = sizes.astype(np.int64)
        p = cost.pad_multiple
        L = -(-L // p) * p
        T = -(-T // p) * p
        padding = main_padding(real - target, rows, L)
        phi = cost.padded_features(rows, L, T, n_tiles, padding)
        time_s, mem = cost.padded(rows, L, T, n_tiles, padding)
        computed = rows * (L + T)
    stage_t = stage_m = None
    if cost.stage_aware:  # per-stage path: a micro-batch's time is its slowest stage's, memory its largest
        stage_t, stage_m = cost.stage_times(phi), cost.stage_memory(phi)
        time_s, mem = stage_t.max(axis=0), stage_m.max(axis=0)
        options = {**options, "layout": cost.layout.to_dict()}
    if len(sizes) and mem.max() > limit:
        k = int(np.argmax(mem))
        options = {**options, "over_memory_limit": True}
        if method in ("dp", "dp_varlen"):
            raise PlanningError(f"micro-batch {k} needs {mem[k]:.3g} bytes > limit {limit:.3g}")
    p2p = cost.p2p_time(phi)
    if stage_t is not None:  # the better of the per-stage assignment and the stage-blind one (stage means)
        eq = equal and len(sizes) % ranks == 0
        blind = _balance_simulated(schedule, stage_t.mean(axis=0), p2p,
                                   assign_ranks(stage_t.mean(axis=0), ranks, stages, eq), ranks, stages,
                                   cost.forward_fraction) if rebalance else g.rank
        cands = [assign_ranks_stages(stage_t, ranks, eq), blind] if rebalance else [g.rank]
        rank_of, perm, rank_time, schedule = assign_and_order_stages(
            schedule, stage_t, p2p, mem, cands, ranks, cost.forward_fraction, stages * limit, rebalance)
    elif rebalance:
        rank_of = assign_ranks(time_s, ranks, stages, equal and len(sizes) % ranks == 0)
        rank_of = _balance_simulated(schedule, time_s, p2p, rank_of, ranks, stages, cost.forward_fraction)
    else:
        rank_of = g.rank
    counts = np.bincount(rank_of, minlength=ranks)
    if not np.all(np.isfinite(time_s)):
        # Shapes outside a profiled table: the plan cannot run as measured.
        options = {**options, "over_memory_limit": True, "outside_profile": True}
    # schedule "auto" resolves to the concrete order it chose; adaptive keeps stages * limit in flight
    if stage_t is None:
        st = np.broadcast_to(time_s, (stages, len(time_s)))
        perm, rank_time, schedule = order_step(schedule, st, p2p, mem, rank_of, ranks, cost.forward_fraction,
                                               stages * limit, rebalance, per_stage=False)
    if schedule == "adaptive":
        options = {**options, "stage_memory_bytes": float(stages * limit)}
    # micro-batches in execution order, rank by rank
    mb_rank = rank_of[perm].astype(np.int32)
    mb_order = (np.arange(len(perm)) - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.int32)
    new_sizes = sizes[perm]
    new_off = np.concatenate(([0], np.cumsum(new_sizes))).astype(np.int64)
    # the samples' positions in execution order: micro-batch perm[j]'s slice of the grouping, vectorized
    take = np.repeat(off[perm] - new_off[:-1], new_sizes) + np.arange(new_off[-1], dtype=np.int64)
    plan = BatchPlan(
        method=method, collation=collation, num_ranks=ranks, num_stages=stages, schedule=schedule,
        sample_ids=shapes.sample_id[pos[take]], sample_row=g.row[take].astype(np.int32), mb_offsets=new_off,
        mb_rank=mb_rank, mb_order=mb_order, mb_rows=rows[perm], mb_input_len=L[perm].astype(np.int64),
        mb_target_len=T[perm].astype(np.int64), mb_vision_tiles=n_tiles[perm].astype(np.int64),
        mb_tokens=computed[perm].astype(np.int64), mb_real_tokens=real[perm].astype(np.int64),
        mb_target_tokens=target[perm].astype(np.int64),
        mb_time_s=time_s[perm], mb_memory_bytes=mem[perm], rank_time_s=rank_time, step=step,
        options={k: v for k, v in options.items() if v is not None},
        stage_time_s=None if stage_t is None else stage_t[:, perm],
        stage_memory_bytes=None if stage_m is None else stage_m[:, perm],
    )
    return record_orders(plan, p2p[perm], cost.forward_fraction)
