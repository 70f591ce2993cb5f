"""`dynabatch inspect`: what a run plan file predicts, as a text table and a PNG.

`summarize_plan(run)` computes the figures (JSON-able dict), `format_summary` prints them
(`dynabatch.planfile.plot` draws them). Everything is read from the plan file itself: micro-batch
shapes and predicted costs from its rows (per-stage seconds from its ``stage_time_s`` column when the plan
has per-stage predictions, else every stage costs ``time_s``), per-rank simulated times from
``dynabatch.rank_time_s``, each step's concrete schedule from ``dynabatch.step_schedule``, the task
of each placement from its ``task_id`` column and ``dynabatch.task_names``. `step_timeline`
re-simulates one rank of one step (op start/end per stage) as the planner did; `stage_busy` gives
each stage's busy and idle time. Times are seconds in the dict and milliseconds in the table;
memory is bytes in the dict, GiB in the table.
"""

from __future__ import annotations

import numpy as np

from ..core.schedule.orders import DEFAULT_FORWARD_FRACTION, plan_orders, plan_p2p_s, plan_stage_times, split_times
from ..core.schedule.search import compare_orders
from ..core.simulate.pipeline import simulate_pipeline
from .arrow import STAGE_FIELDS
from .reader import RunPlan

GiB = float(1 << 30)
_MB_FIELDS = ("step", "rank", "microbatch", "rows", "input_len", "target_len", "vision_tiles", "tokens",
              "real_tokens", "time_s", "memory_bytes")


def microbatch_columns(run: RunPlan) -> dict[str, np.ndarray]:
    """One entry per micro-batch of the run (in file order): the plan's micro-batch columns, plus
    ``samples`` (sample placements in it) and ``length`` (padded row length = input_len +
    target_len tokens; for packed collation the longest sample). ``target_tokens`` (decoder tokens)
    where the file has that column."""
    t = run.table
    fields = (*_MB_FIELDS, "target_tokens") if "target_tokens" in t.column_names else _MB_FIELDS
    step, rank, mb = (t.column(c).to_numpy() for c in ("step", "rank", "microbatch"))
    n = len(step)
    if n == 0:
        return {k: np.zeros(0) for k in (*fields, "samples", "length")}
    new = np.ones(n, bool)
    new[1:] = (np.diff(step) != 0) | (np.diff(rank) != 0) | (np.diff(mb) != 0)
    starts = np.flatnonzero(new)
    out = {k: t.column(k).to_numpy()[starts] for k in fields}
    out["samples"] = np.diff(np.append(starts, n))
    out["length"] = out["input_len"] + out["target_len"]
    return out


def _pow2_edges(top: float, first: int) -> list[int]:
    edges = [first]
    while edges[-1] < top:
        edges.append(edges[-1] * 2)
    return edges


def shape_histogram(rows: np.ndarray, length: np.ndarray) -> dict:
    """Counts of micro-batches by rows (1, 2-3, 4-7, ...) x padded length (<=128, <=256, ... tokens)."""
    row_edges = _pow2_edges(float(rows.max(initial=1)) + 1, 1)  # bucket i: [edge_i, edge_{i+1})
    len_edges = _pow2_edges(float(length.max(initial=1)), 128)  # bucket j: (edge_{j-1}, edge_j]
    ri = np.searchsorted(row_edges, rows, side="right") - 1
    li = np.searchsorted(len_edges, length, side="left")
    counts = np.zeros((len(row_edges) - 1, len(len_edges)), np.int64)
    np.add.at(counts, (np.clip(ri, 0, counts.shape[0] - 1), np.clip(li, 0, counts.shape[1] - 1)), 1)
    return {"row_edges": row_edges, "length_edges": len_edges, "counts": counts.tolist()}


def task_share(run: RunPlan, top: int = 10) -> dict:
    """Tokens of each task over the run (``sample_tokens`` summed by ``task_id``), biggest first."""
    t = run.table
    if "task_id" not in t.column_names:
        return {"num_tasks": 0, "top": [], "other": None}
    tid = t.column("task_id").to_numpy().astype(np.int64)
    tok = (t.column("sample_tokens").to_numpy() if "sample_tokens" in t.column_names
           else t.column("input_len").to_numpy() * 0 + 1).astype(np.int64)
    names = run.task_names
    known = tid >= 0
    per = np.bincount(tid[known], weights=tok[known], minlength=len(names))
    total = float(tok.sum()) or 1.0
    order = np.argsort(-per, kind="stable")
    present = order[per[order] > 0]
    rows = [{"task": names[k] if k < len(names) else str(k), "tokens": int(per[k]), "share": float(per[k] / total)}
            for k in present[:top]]
    rest = present[top:]
    unknown = float(tok[~known].sum())
    other = None
    if len(rest) or unknown:
        other = {"tasks": int(len(rest)), "tokens": int(per[rest].sum() + unknown),
                 "share": float((per[rest].sum() + unknown) / total)}
    return {"num_tasks": int(len(present)), "top": rows, "other": other}


def _stats(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0.0}
    return {"mean": float(x.mean()), "p50": float(np.percentile(x, 50)), "p95": float(np.percentile(x, 95)),
            "max": float(x.max())}


def step_detail(run: RunPlan, step: int) -> dict:
    """One step: its predicted time, each rank's simulated time and micro-batches, and the schedules ``auto``
    weighs simulated on its order (`dynabatch.core.schedule.search.compare_orders`: which runs, and why)."""
    plan = run.step(step)
    ranks = []
    length = plan.mb_input_len + plan.mb_target_len
    span = lambda x: [int(x.min()), int(x.max())] if len(x) else [0, 0]  # noqa: E731
    for r in range(plan.num_ranks):
        sel = plan.mb_rank == r
        sizes = np.diff(plan.mb_offsets)[sel]
        ranks.append({
            "rank": r, "microbatches": int(sel.sum()), "samples": int(sizes.sum()),
            "rows": span(plan.mb_rows[sel]), "length": span(length[sel]),
            "compute_s": float(plan.mb_time_s[sel].sum()),
            "simulated_s": float(plan.rank_time_s[r]),
        })
    return {"step": int(step), "epoch": run.epoch_of(step), "iteration_time_s": plan.iteration_time_s,
            "padding_efficiency": plan.padding_efficiency, "rank_imbalance": plan.rank_imbalance,
            "microbatches": plan.num_microbatches, "samples": int(len(plan.sample_ids)), "ranks": ranks,
            "schedule": plan.schedule, "schedules": compare_orders(plan, run.cost_model())}


def step_timeline(run: RunPlan, step: int, rank: int | None = None) -> dict:
    """One rank of one step re-simulated the way the planner simulated it: its micro-batches in
    execution order with their per-stage seconds (`plan_stage_times`), split forward / backward by
    the cost model's ``forward_fraction``, the op order the plan records (`dynabatch.core.schedule.orders`: the
    one the planner simulated and the runner executes), and the cost model's transfer times. ``rank`` defaults
    to the slowest. Returns ``start_s`` / ``end_s`` ``[S, k, 2]`` (index ``[s, j, 0]`` the forward of
    the rank's ``j``-th micro-batch on stage ``s``, ``1`` its backward), ``ops``, ``makespan_s``
    (equal to the plan's ``rank_time_s[rank]`` up to rounding), ``microbatches`` (their indices in the
    plan), ``stage_time_s`` ``[S, k]``, and per stage ``busy_s``, ``idle_s`` (makespan - busy) and
    ``utilization``."""
    plan = run.step(step)
    cost = run.cost_model()
    S = plan.num_stages
    if rank is None:
        rank = int(np.argmax(plan.rank_time_s)) if len(plan.rank_time_s) else 0
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} is not in the plan ({plan.num_ranks} ranks)")
    idx = plan.rank_indices(rank)
    st = plan_stage_times(plan)[:, idx]
    fwd, bwd = split_times(st, cost.forward_fraction if cost is not None else DEFAULT_FORWARD_FRACTION)
    out = {"step": int(step), "rank": int(rank), "schedule": plan.schedule, "per_stage": plan.stage_time_s is not None,
           "microbatches": idx, "stage_time_s": st, "recorded_s": float(plan.rank_time_s[rank])}
    if len(idx) == 0:
        z = np.zeros((S, 0, 2))
        return {**out, "start_s": z, "end_s": z.copy(), "ops": np.zeros((S, 0), np.int32), "makespan_s": 0.0,
                "busy_s": np.zeros(S), "idle_s": np.zeros(S), "utilization": np.zeros(S)}
    p2p = plan_p2p_s(plan, cost)[idx]
    mem = np.asarray(plan.mb_memory_bytes, np.float64)[idx]
    # the op order the planner simulated, as the plan records it (the runner executes the same)
    sim = simulate_pipeline(fwd, bwd, schedule=plan_orders(plan, rank, cost), p2p_s=p2p, mem_bytes=mem)
    busy = st.sum(axis=1)
    span = sim.makespan_s
    return {**out, "start_s": sim.start_s, "end_s": sim.end_s,
            "weight_start_s": sim.weight_start_s, "weight_end_s": sim.weight_end_s,
            "ops": sim.ops, "makespan_s": span, "busy_s": busy, "idle_s": np.maximum(span - busy, 0.0),
            "utilization": busy / span if span > 0 else np.ones(S)}


def _run_stage_times(run: RunPlan, mb: dict) -> np.ndarray:
    """``[S, N]`` seconds of every micro-batch of the run (file order) on every stage."""
    t = run.table
    if STAGE_FIELDS[0] not in t.column_names or not len(mb["time_s"]):
        return np.repeat(np.asarray(mb["time_s"], np.float64)[None, :], run.num_stages, axis=0)
    step, rank, m = (t.column(c).to_numpy() for c in ("step", "rank", "microbatch"))
    new = np.ones(len(step), bool)
    new[1:] = (np.diff(step) != 0) | (np.diff(rank) != 0) | (np.diff(m) != 0)
    col = t.column(STAGE_FIELDS[0]).combine_chunks()
    flat = np.asarray(col.flatten().to_numpy(zero_copy_only=False), np.float64).reshape(len(step), -1)
    return flat[new].T


def stage_busy(run: RunPlan, step: int, mb: dict | None = None) -> dict:
    """Per-stage busy time: for every rank of ``step``, each stage's busy seconds (the sum of its
    micro-batches' per-stage forward+backward), idle seconds (the rank's simulated time - busy) and
    utilisation (busy / simulated time); ``run``: the same per stage over the whole run, for the mean
    rank (busy summed over steps / ranks; idle = predicted run time - busy, so it includes waiting for
    the slowest rank). ``per_stage_predictions`` is False for plans whose stages all cost the same."""
    plan = run.step(step)
    st = plan_stage_times(plan)
    ranks = []
    for r in range(plan.num_ranks):
        busy = st[:, plan.mb_rank == r].sum(axis=1)
        span = float(plan.rank_time_s[r])
        ranks.append({"rank": r, "time_s": span, "busy_s": busy.tolist(),
                      "idle_s": np.maximum(span - busy, 0.0).tolist(),
                      "utilization": (busy / span if span > 0 else np.ones_like(busy)).tolist()})
    mb = microbatch_columns(run) if mb is None else mb
    run_busy = _run_stage_times(run, mb).sum(axis=1) / max(run.num_ranks, 1)
    run_time = float(run.iteration_times_s().sum())
    cost = run.cost_model()
    layout = getattr(cost, "layout", None) if cost is not None else None
    return {
        "per_stage_predictions": plan.stage_time_s is not None,
        "layout": layout.to_dict() if layout is not None else "uniform",
        "step": int(step), "schedule": plan.schedule, "ranks": ranks,
        "run": {"time_s": run_time, "busy_s": run_busy.tolist(),
                "idle_s": np.maximum(run_time - run_busy, 0.0).tolist(),
                "utilization": (run_busy / run_time if run_time > 0 else np.ones_like(run_busy)).tolist()},
    }


def summarize_plan(run: RunPlan, step: int | None = None, top_tasks: int = 10) -> dict:
    """The figures of `dynabatch inspect` (see its ``--help``); ``step`` picks the step detailed
    (default: the slowest step)."""
    mb = microbatch_columns(run)
    it = run.iteration_times_s()
    rt = run.rank_times_s()
    cost = run.cost_model()
    real, computed = int(mb["real_tokens"].sum()), int(mb["tokens"].sum())
    mean_rank = rt.mean(axis=1) if rt.size else np.zeros(0)
    imbalance = np.divide(it, mean_rank, out=np.ones_like(it), where=mean_rank > 0)
    rank_total = rt.sum(axis=0) if rt.size else np.zeros(run.num_ranks)
    try:
        limit = cost.memory_limit(run.num_stages, run.num_ranks)
    except ValueError:
        limit = float("nan")
    if step is None:
        step = int(run.steps[int(np.argmax(it))]) if len(it) else 0
    t_ms = mb["time_s"] * 1e3
    ids = run.table.column("sample_id").to_numpy()
    return {
        "file": run.path,
        "method": run.method, "collation": run.collation, "schedule": run.schedule,
        "model": cost.model.name, "device": cost.device.name, "ranks": run.num_ranks, "stages": run.num_stages,
        "dataset_fingerprint": run.dataset_fingerprint, "options": run.options_dict,
        "samples_in_index": run.index_info.get("samples"),
        "epochs": run.epochs, "steps": run.num_steps, "steps_per_epoch": run.steps_per_epoch,
        "placements": int(run.table.num_rows), "unique_samples": int(len(np.unique(ids))),
        "real_tokens": real, "computed_tokens": computed,
        # decoder (target) tokens: what an encoder-decoder's decoder computes on (None: an older file)
        "target_tokens": int(mb["target_tokens"].sum()) if "target_tokens" in mb else None,
        "target_tokens_per_microbatch_max": int(mb["target_tokens"].max(initial=0)) if "target_tokens" in mb else None,
        "padding_efficiency": real / computed if computed else 1.0,
        "iteration_time_s": _stats(it),
        "run_time_s": float(it.sum()),
        "tokens_per_s": real / float(it.sum()) if it.sum() > 0 else 0.0,
        "rank_imbalance": {"mean": float(imbalance.mean()) if len(imbalance) else 1.0,
                           "worst": float(imbalance.max(initial=1.0)),
                           "worst_step": int(run.steps[int(np.argmax(imbalance))]) if len(imbalance) else 0},
        "rank_total_s": rank_total.tolist(),
        "rank_total_max_over_min": (float(rank_total.max() / rank_total.min())
                                    if len(rank_total) and rank_total.min() > 0 else 1.0),
        "microbatches_per_step": float(len(t_ms) / max(run.num_steps, 1)),
        "microbatch_time_ms": {"mean": float(t_ms.mean()) if len(t_ms) else 0.0,
                               "cv": float(t_ms.std() / t_ms.mean()) if len(t_ms) and t_ms.mean() > 0 else 0.0,
                               "max": float(t_ms.max(initial=0.0))},
        "peak_memory_bytes": float(mb["memory_bytes"].max(initial=0.0)),
        "memory_limit_bytes": limit,
        "shape_histogram": shape_histogram(mb["rows"], mb["length"]),
        "task_share": task_share(run, top_tasks),
        "step_detail": step_detail(run, step) if run.num_steps else None,
        "stage_busy": stage_busy(run, step, mb) if run.num_steps else None,
    }


def _fmt_len(x: int) -> str:
    return f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x)


def _histogram_text(h: dict) -> list[str]:
    re_, le = h["row_edges"], h["length_edges"]
    counts = np.array(h["counts"])
    rows_lab = [f"{re_[i]}" if re_[i + 1] - re_[i] == 1 else f"{re_[i]}-{re_[i + 1] - 1}" for i in range(len(re_) - 1)]
    cols_lab = [f"<={_fmt_len(e)}" for e in le]
    keep_r = counts.sum(axis=1) > 0
    keep_c = counts.sum(axis=0) > 0
    if keep_c.any():  # show the populated range of lengths, not every empty bucket below it
        a, b = np.flatnonzero(keep_c)[[0, -1]]
        keep_c[a:b + 1] = True
    w = max(6, *(len(c) for c in cols_lab), len(str(counts.max(initial=0))) + 1)
    head = "rows \\ len".ljust(11) + "".join(c.rjust(w) for c, k in zip(cols_lab, keep_c) if k)
    lines = [head]
    for i, lab in enumerate(rows_lab):
        if keep_r[i]:
            cells = [(str(v) if v else ".").rjust(w) for v, k in zip(counts[i], keep_c) if k]
            lines.append(lab.ljust(11) + "".join(cells))
    return lines


def format_summary(s: dict) -> str:
    """The summary as aligned text (times in ms, memory in GiB)."""
    o = s["options"]
    it = s["iteration_time_s"]
    ri = s["rank_imbalance"]
    mt = s["microbatch_time_ms"]
    spe = s["steps_per_epoch"]
    per_epoch = f"{spe[0]} per epoch" if len(set(spe)) == 1 else "per epoch " + ", ".join(map(str, spe))
    limit = s["memory_limit_bytes"]
    mem = f"{s['peak_memory_bytes'] / GiB:.2f} GiB"
    if limit == limit:  # not NaN
        mem += f" of {limit / GiB:.2f} GiB limit ({100 * s['peak_memory_bytes'] / limit:.0f}%)"
    figures = [
        ("steps", f"{s['steps']} ({per_epoch}, {s['epochs']} epoch{'s' if s['epochs'] != 1 else ''})"),
        ("samples placed",
         f"{s['placements']} ({s['unique_samples']} distinct of {s['samples_in_index']} in the index)"),
        ("predicted iteration time (ms)", f"mean {it['mean'] * 1e3:.1f}  p50 {it['p50'] * 1e3:.1f}  "
                                          f"p95 {it['p95'] * 1e3:.1f}  max {it['max'] * 1e3:.1f}"),
        ("predicted run time", f"{s['run_time_s']:.1f} s ({s['run_time_s'] / 3600:.2f} h)"),
        ("predicted throughput", f"{s['tokens_per_s']:,.0f} real tokens/s"),
        ("padding efficiency", f"{s['padding_efficiency']:.3f} (real / computed tokens)"),
        *([("decoder (target) tokens",
            f"{s['target_tokens']:,} ({100 * s['target_tokens'] / max(s['real_tokens'], 1):.1f}% of the real tokens; "
            f"at most {s['target_tokens_per_microbatch_max']:,} in a micro-batch)")] if s.get("target_tokens") else []),
        ("rank balance (max/mean rank)", f"mean {ri['mean']:.3f}  worst {ri['worst']:.3f} (step {ri['worst_step']})"),
        ("rank totals over the run", f"max/min {s['rank_total_max_over_min']:.4f}"),
        ("micro-batches per step",
         f"{s['microbatches_per_step']:.1f} ({s['microbatches_per_step'] / s['ranks']:.1f} per rank)"),
        ("micro-batch time (ms)", f"mean {mt['mean']:.2f}  cv {mt['cv']:.3f}  max {mt['max']:.2f}"),
        ("peak micro-batch memory", mem),
    ]
    w = max(len(k) for k, _ in figures)
    lines = [
        f"run plan {s['file'] or ''}: {s['method']} ({s['collation']}) for {s['model']} on {s['device']}, "
        f"{s['ranks']} ranks x {s['stages']} stages, {s['schedule']}",
        f"data: fingerprint {s['dataset_fingerprint']}, {o.get('global_batch_tokens')}-token global batches, "
        f"seed {o.get('seed')}, max len {o.get('max_len')}, tokenizer {o.get('tokenizer')}",
        "",
    ]
    lines += [f"{k.ljust(w)}  {v}" for k, v in figures]
    lines += ["", "micro-batch shapes (number of micro-batches; rows x padded length in tokens)"]
    lines += _histogram_text(s["shape_histogram"])
    ts = s["task_share"]
    if ts["top"]:
        lines += ["", f"token share by task (top {len(ts['top'])} of {ts['num_tasks']} tasks)"]
        tw = max(24, *(len(r["task"]) for r in ts["top"]))
        lines.append(f"{'task'.ljust(tw)}  {'tokens':>12}  {'share':>6}")
        for r in ts["top"]:
            lines.append(f"{r['task'].ljust(tw)}  {r['tokens']:>12,}  {100 * r['share']:>5.1f}%")
        if ts["other"]:
            lab = f"other ({ts['other']['tasks']} tasks)"
            lines.append(f"{lab.ljust(tw)}  {ts['other']['tokens']:>12,}  {100 * ts['other']['share']:>5.1f}%")
    d = s["step_detail"]
    if d:
        lines += ["", f"step {d['step']} (epoch {d['epoch']}): predicted {d['iteration_time_s'] * 1e3:.1f} ms, "
                      f"{d['microbatches']} micro-batches, {d['samples']} samples, padding efficiency "
                      f"{d['padding_efficiency']:.3f}, max/mean rank {d['rank_imbalance']:.3f}"]
        lines.append("rank  micro-batches  samples  rows     padded len    compute ms  simulated ms")
        for r in d["ranks"]:
            lines.append(f"{r['rank']:>4}  {r['microbatches']:>13}  {r['samples']:>7}  "
                         f"{r['rows'][0]:>3}-{r['rows'][1]:<4} {r['length'][0]:>5}-{r['length'][1]:<6}  "
                         f"{r['compute_s'] * 1e3:>10.1f}  {r['simulated_s'] * 1e3:>12.1f}")
        lines.append(f"schedule {d['schedule']}; on this step's order: " + ", ".join(
            f"{n} {c['makespan_s'] * 1e3:.1f} ms" + ("" if c["fits"] else " (over the in-flight budget)")
            + (" (per run: a cut of its chunks for every step)" if c.get("per_run") else "")
            for n, c in d["schedules"].items()))
    if s.get("stage_busy"):
        lines += [""] + _stage_busy_text(s["stage_busy"])
    return "\n".join(lines)


def _layout_text(layout) -> str:
    if not isinstance(layout, dict):
        return str(layout)
    parts = [f"{name} {'/'.join(f'{x:g}' for x in layout[key])}" for name, key in
             (("vision", "vision_layers"), ("main", "main_layers"), ("decoder", "decoder_layers"))
             if any(layout.get(key, ()))]
    return f"{layout.get('name', 'custom')} layout, layers per stage: " + ", ".join(parts)


def _stage_busy_text(b: dict) -> list[str]:
    """Per-stage busy / idle ms (and utilisation) of every rank of the detailed step, and over the run."""
    S = len(b["run"]["busy_s"])
    if b["per_stage_predictions"]:
        cols = list(range(S))
        head = (f"per-stage busy time, step {b['step']} ({b['schedule']}; per-stage predictions, "
                f"{_layout_text(b['layout'])}): busy / idle ms of each rank's simulated time, utilisation")
    else:
        cols = [0]
        head = (f"per-stage busy time, step {b['step']} ({b['schedule']}): no per-stage predictions (uniform layout), "
                f"all {S} stages are equal: busy / idle ms of each rank's simulated time, utilisation")
    cell = lambda busy, idle, u, k: f"{busy * k:.1f} / {idle * k:.1f} {100 * u:3.0f}%"  # noqa: E731
    rows = [[f"{r['rank']}"] + [cell(r["busy_s"][c], r["idle_s"][c], r["utilization"][c], 1e3) for c in cols]
            for r in b["ranks"]]
    run = b["run"]
    rows.append(["run (s)"] + [cell(run["busy_s"][c], run["idle_s"][c], run["utilization"][c], 1.0) for c in cols])
    labels = ["rank"] + ([f"stage {c}" for c in cols] if b["per_stage_predictions"] else ["every stage"])
    w = [max(len(labels[i]), *(len(r[i]) for r in rows)) for i in range(len(labels))]
    lines = [head, "  ".join(lab.rjust(w[i]) for i, lab in enumerate(labels))]
    lines += ["  ".join(v.rjust(w[i]) for i, v in enumerate(r)) for r in rows]
    lines.append("(run: busy seconds of the mean rank over all steps / the rest of the predicted run time)")
    return lines
