"""``dynabatch bench trainer``: real training through ``transformers.Trainer`` on two gloo DDP ranks on
the CPU, dynabatch's DP with feedback against what a Hugging Face user would otherwise pick
(`dynabatch.bench.trainer_rank` runs it; parser: `dynabatch.commands.bench_trainer`).

Both tiny random models (a Llama and a T5), the same samples (the shared FLAN sample when present,
else generated FLAN-like text), the same bytes tokenization, initial weights, AdamW and number of
steps for every method; the steps hold ``global_batch_tokens`` tokens (dp: its budget; the others: a
batch size in samples, or for trl_bfd in BFD-packed rows, with that many tokens on average); methods
interleaved in rounds. trl_bfd (TRL's best-fit-decreasing packing) runs when ``trl`` is installed, on
the decoder-only model.

Reported per model and method (`format_table`): target tokens/s (real loss tokens over the wall
seconds of the timed steps, the slowest rank's), real tokens/s (all unpadded tokens), target
tokens per CPU second (each step's slowest rank's process CPU seconds: what the steps cost,
whatever else a shared machine ran; the targets are on the wall time), padding
efficiency, tokens per step, the held-out loss after the last step (the same normalization for
every method: summed token cross-entropy / target tokens), the rank spread (max/mean over ranks of
each step's forward seconds, median over the steps), the round spread (how much the method's
tokens/s moved between rounds: the run's timer and load noise), and for dp the cost model's
per-micro-batch MAPE before its first refit and over the last steps, with the timer noise floor
(median relative spread of identical micro-batch shapes) and the in-sample fit floor (`fit_floor`).
Targets: dp >= 1.2x the best other method's target tokens/s on each model; dp's MAPE after feedback
<= 10%.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict

import numpy as np

from .trainer_config import TrainerBenchConfig
from .trainer_names import family, unsupported

THROUGHPUT_TARGET = 1.2
MAPE_TARGET = 0.10


def _rows(paths) -> list[dict]:
    """``{"inputs", "targets"}`` of every sample in the JSONL / Parquet files ``paths``."""
    import loaders

    out = []
    for p in paths:
        source = loaders.ParquetSource([str(p)]) if str(p).endswith(".parquet") else loaders.JsonlSource([str(p)])
        out += [{"inputs": str(r["inputs"]), "targets": str(r["targets"])} for r in source]
    return out


def prepare_data(cfg: TrainerBenchConfig, tmp: str) -> tuple[dict, str]:
    """Draw the run's training and held-out samples (seeded) into Parquet files under ``tmp``; returns
    (the ranks' paths, a description of the data)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..datagen import write_text_shards
    from .train_data import default_data

    data = tuple(cfg.data) or default_data()
    missing = [p for p in data if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"--data {' '.join(missing)}: no such file")
    what = " ".join(os.path.basename(p) for p in data)
    if not data:
        data = tuple(str(p) for p in write_text_shards(os.path.join(tmp, "generated"), cfg.samples + cfg.eval_samples,
                                                       seed=cfg.seed))
        what = f"generated FLAN-like text ({cfg.samples + cfg.eval_samples} samples)"
    rows = _rows(data)
    need = cfg.samples + cfg.eval_samples
    if len(rows) < need:
        raise ValueError(f"the data hold {len(rows)} samples; the bench needs {need} (--samples + {cfg.eval_samples})")
    pick = np.random.default_rng(cfg.seed).permutation(len(rows))[:need]
    train, held = os.path.join(tmp, "train.parquet"), os.path.join(tmp, "eval.parquet")
    pq.write_table(pa.Table.from_pylist([rows[i] for i in pick[:cfg.samples]]), train)
    pq.write_table(pa.Table.from_pylist([rows[i] for i in pick[cfg.samples:]]), held)
    paths = {m: {"train": train, "eval": held} for m in cfg.models}
    paths["out"] = os.path.join(tmp, "runs")
    return paths, f"{what}: {cfg.samples} samples drawn (seed {cfg.seed}), {cfg.eval_samples} held out"


def batch_sizes(cfg: TrainerBenchConfig, paths: dict, world: int, trl_installed: bool) -> tuple[dict, dict]:
    """Per model, the HF methods' samples per rank and step that hold ``global_batch_tokens`` tokens on
    average (as dp's budget counts them: input + target tokens after truncation), and trl_bfd's packed
    rows per rank and step that hold as many (its rows' mean length after packing; models it runs only)."""
    from .trainer_rank import bfd_rows, tokenize

    per_step = cfg.global_batch_tokens / world
    samples_per_rank, rows_per_rank = {}, {}
    for m in cfg.models:
        samples = tokenize(paths[m]["train"], m, cfg.max_len, cfg.max_target_len)
        mean = np.mean([len(s["input_ids"]) + (len(s["labels"]) if family(m) == "encoder_decoder" else 0)
                        for s in samples])
        samples_per_rank[m] = max(1, int(round(per_step / mean)))
        if "trl_bfd" in cfg.methods and unsupported(m, "trl_bfd", trl_installed) is None:
            row = np.mean([len(r) for r in bfd_rows(samples, cfg.max_len)["input_ids"]])
            rows_per_rank[m] = max(1, int(round(per_step / row)))
    return samples_per_rank, rows_per_rank


def epoch_pools(cfg: TrainerBenchConfig, paths: dict, samples_per_rank: dict, world: int) -> dict:
    """Per model, the number of training samples every method of it trains on: the first ``steps x
    samples_per_rank x world`` of the seeded draw (all of them if fewer), written to the model's own train file
    in ``paths`` (changed in place). The HF methods' ``steps`` steps are then one epoch of that pool, as dp's are
    on average: on the whole draw, ``group_by_length``'s first steps held only its longest samples (its sampler
    sorts each mega-batch longest first; on the shared FLAN sample all 12 steps were 512-token rows, 9,216 real
    tokens a step against dp's 8,409), so the methods were timed on different tokens."""
    import pyarrow.parquet as pq

    sizes, drawn = {}, {}
    for m in cfg.models:
        src = paths[m]["train"]
        if src not in drawn:  # the models share one draw: read it once
            drawn[src] = pq.read_table(src)
        table = drawn[src]
        n = min(table.num_rows, cfg.steps * samples_per_rank[m] * world)
        pool = os.path.join(os.path.dirname(paths[m]["train"]), f"train-{m}.parquet")
        pq.write_table(table.slice(0, n), pool)
        paths[m] = {**paths[m], "train": pool}
        sizes[m] = n
    return sizes


def _summary(per_rank: list[dict], cfg: TrainerBenchConfig) -> dict:
    """One (model, method)'s figures from every rank's records (see the module docstring)."""
    from .train_report import timer_noise

    recs = [r["records"] for r in per_rank]
    n = min(len(r) for r in recs)
    timed = [i for i in range(n) if recs[0][i]["timed"]]

    def interval(rank_recs, i):
        return rank_recs[i]["end"] - rank_recs[i - 1]["end"]

    wall = np.array([max(interval(r, i) for r in recs) for i in timed])
    # the slowest rank's CPU seconds per step: the step's cost without what else the machine ran
    has_cpu = all("cpu_end" in r[i] for r in recs for i in range(n))
    cpu = np.array([max(r[i]["cpu_end"] - r[i - 1]["cpu_end"] for r in recs) for i in timed]) if has_cpu else None
    total = {k: np.array([sum(r[i][k] for r in recs) for i in range(n)]) for k in ("target", "real", "computed")}
    spread = [max(r[i]["forward_s"] for r in recs) / np.mean([r[i]["forward_s"] for r in recs]) for i in timed]
    rounds = sorted({recs[0][i]["round"] for i in timed})
    per_round = [float(sum(total["target"][i] for i in timed if recs[0][i]["round"] == k)
                       / sum(w for i, w in zip(timed, wall) if recs[0][i]["round"] == k)) for k in rounds]
    per_round_cpu = [float(sum(total["target"][i] for i in timed if recs[0][i]["round"] == k)
                           / sum(c for i, c in zip(timed, cpu) if recs[0][i]["round"] == k))
                     for k in rounds] if cpu is not None else []
    out = {
        "steps": n, "timed_steps": len(timed), "wall_s": float(wall.sum()),
        "cpu_tokens_per_s": float(total["target"][timed].sum() / cpu.sum()) if cpu is not None else float("nan"),
        "round_cpu_tokens_per_s": per_round_cpu,
        "tokens_per_s": float(total["target"][timed].sum() / wall.sum()),
        "real_tokens_per_s": float(total["real"][timed].sum() / wall.sum()),
        "padding_efficiency": float(total["real"].sum() / total["computed"].sum()),
        "tokens_per_step": float(total["real"].mean()), "target_tokens_per_step": float(total["target"].mean()),
        "microbatches_per_step": float(np.mean([r["microbatches"] for r in recs[0][:n]])),
        "rank_spread": float(np.median(spread)), "round_tokens_per_s": per_round,
        "round_spread": float((max(per_round) - min(per_round)) / np.median(per_round)) if per_round else float("nan"),
        "eval_loss": per_rank[0].get("eval_loss"), "train_loss": (per_rank[0].get("train_loss") or [None])[-1],
    }
    mapes = [r.get("mape") for r in recs[0][:n]]
    if any(m is not None for m in mapes):
        m = np.array([np.nan if x is None else x for x in mapes], np.float64)
        end = max(3, n // 4)
        obs = [r["obs"] for r in recs[0][:n] if r.get("obs")]
        phi = np.concatenate([np.asarray(o[0], np.float64).reshape(-1, 10) for o in obs]) if obs else np.zeros((0, 10))
        y = np.concatenate([np.asarray(o[1], np.float64) for o in obs]) if obs else np.zeros(0)
        mean = lambda a: float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")  # noqa: E731
        out.update(mape_start=mean(m[:cfg.refit_every]), mape_end=mean(m[-end:]),
                   mape_noise=timer_noise(phi, y) if len(y) else float("nan"), mape_fit_floor=fit_floor(phi, y))
    return out


def fit_floor(phi: np.ndarray, y: np.ndarray, iters: int = 100) -> float:
    """MAPE (fraction) of the linear price that fits every observation at once with the least MAPE, in
    sample, on the features the observations use: what the cost model's linear features could reach
    had they seen every measured time in advance (load shifts between steps and ranks, which no
    per-shape price follows, stay in it); nan with fewer observations than features. The least-MAPE
    fit is an L1 fit of relative errors, solved by reweighted least squares (``iters`` rounds)."""
    from ..core.cost.fit import mape

    cols = np.flatnonzero(np.any(phi != 0, axis=0))
    if len(y) <= len(cols):
        return float("nan")
    A = phi[:, cols] / y[:, None]
    w = np.ones(len(y))
    best = float("inf")
    for _ in range(iters):
        coef, *_ = np.linalg.lstsq(A * w[:, None], w, rcond=None)
        r = np.abs(A @ coef - 1.0)
        best = min(best, mape(phi[:, cols] @ coef, y))
        w = 1.0 / np.sqrt(np.maximum(r, 1e-9))  # squared, these weight each residual by 1 / |residual|
    return best


def assemble(cfg: TrainerBenchConfig, ranks: list[dict], data: str) -> dict:
    """The bench's JSON document from every rank's `bench_rank` result."""
    trl = cfg.trl_installed
    skipped = {f"{m}/{k}": unsupported(m, k, trl) for m in cfg.models for k in cfg.methods
               if unsupported(m, k, trl) is not None}
    methods = {key: _summary([r["results"][key] for r in ranks], cfg) for key in ranks[0]["results"]}
    ratios, targets = {}, {}
    for m in cfg.models:
        dp = methods.get(f"{m}/dp")
        others = {k: v for k, v in methods.items() if k.startswith(f"{m}/") and k != f"{m}/dp"}
        if dp is None or not others:
            continue
        best = max(others, key=lambda k: others[k]["tokens_per_s"])
        rounds = [a / b for a, b in zip(dp["round_tokens_per_s"], others[best]["round_tokens_per_s"])]
        cpu_best = max(others, key=lambda k: others[k]["cpu_tokens_per_s"])
        ratios[m] = {"best_other": best.split("/", 1)[1], "dp_vs_best": dp["tokens_per_s"] / others[best]["tokens_per_s"],
                     "cpu_best_other": cpu_best.split("/", 1)[1],
                     "cpu_dp_vs_best": dp["cpu_tokens_per_s"] / others[cpu_best]["cpu_tokens_per_s"],
                     "cpu_per_round": [a / b for a, b in zip(dp["round_cpu_tokens_per_s"],
                                                             others[cpu_best]["round_cpu_tokens_per_s"])],
                     "per_round": rounds, **{f"dp_vs_{k.split('/', 1)[1]}": dp["tokens_per_s"] / v["tokens_per_s"]
                                             for k, v in others.items()}}
        targets[m] = {"throughput": ratios[m]["dp_vs_best"] >= THROUGHPUT_TARGET,
                      "mape": dp.get("mape_end", float("inf")) <= MAPE_TARGET}
    config = dict(asdict(cfg), data=data, world_size=2, backend="gloo", rank_cpu_s=[r.get("cpu_s") for r in ranks])
    return {"config": config, "methods": methods, "skipped": skipped, "ratios": ratios, "targets": targets,
            "target_values": {"throughput_vs_best": THROUGHPUT_TARGET, "mape_after_feedback": MAPE_TARGET}}


def run_trainer_bench(cfg: TrainerBenchConfig, progress: bool = False) -> dict:
    """Run the bench on two local gloo ranks and return its JSON document (see the module docstring)."""
    import importlib.util
    from dataclasses import replace

    from ..pipeline import launch_local
    from .progress import watch_ticks

    with tempfile.TemporaryDirectory(prefix="dynabatch-bench-trainer-") as tmp:
        paths, data = prepare_data(cfg, tmp)
        trl = importlib.util.find_spec("trl") is not None
        samples_per_rank, rows_per_rank = batch_sizes(cfg, paths, 2, trl)
        pools = epoch_pools(cfg, paths, samples_per_rank, 2)
        data += "; trained on " + ", ".join(f"the first {n} ({m})" for m, n in pools.items()) + \
            " (steps x the HF batch: one epoch for every method)"
        cfg = replace(cfg, batch_size=samples_per_rank, bfd_batch_size=rows_per_rank, trl_installed=trl)
        payload = {**asdict(cfg), "steps_per_round": cfg.steps_per_round}
        runs = sum(unsupported(m, k, trl) is None for m in cfg.models for k in cfg.methods)
        with watch_ticks(os.path.join(tmp, "progress"), cfg.steps * runs, "bench trainer", "step", progress) as env:
            res = launch_local("dynabatch.bench.trainer_rank:bench_rank", 2, args=(payload, paths),
                               idle_timeout_s=cfg.timeout_s, max_wall_s=cfg.max_wall_s, env=env)
        for r in res:
            if r.timed_out or r.returncode != 0:
                why = "stopped making progress" if r.timed_out else f"failed (exit {r.returncode})"
                raise RuntimeError(f"bench trainer: rank {r.rank} {why}:\n{r.stderr[-3000:]}")
        return assemble(cfg, [json.loads(json.dumps(r.result)) for r in res], data)


def _pct(x) -> str:
    return "-" if x is None or x != x else f"{x:.1%}"


def format_table(doc: dict) -> str:
    """The bench's table (one row per model and method), the skipped methods, dp's ratios and targets."""
    c = doc["config"]
    lines = [f"dynabatch bench trainer: transformers.Trainer on {c['world_size']} {c['backend']} DDP ranks (CPU), "
             f"{c['steps']} steps in {c['rounds']} interleaved rounds, {c['global_batch_tokens']} tokens/step, "
             f"max_len {c['max_len']}; data: {c['data']}",
             f"{'model':<6} {'method':<16} {'tgt tok/s':>9} {'real tok/s':>10} {'vs dp':>6} {'cpu tok/s':>9} "
             f"{'vs dp':>6} {'pad eff':>7} "
             f"{'tok/step':>8} {'mb/step':>7} {'rank spread':>11} {'round spread':>12} {'eval loss':>9} "
             f"{'MAPE start':>10} {'MAPE end':>8} {'noise':>6} {'floor':>6}"]
    for key, v in doc["methods"].items():
        model, method = key.split("/", 1)
        dp = doc["methods"].get(f"{model}/dp")
        vs = dp["tokens_per_s"] / v["tokens_per_s"] if dp else float("nan")
        cpu = v.get("cpu_tokens_per_s", float("nan"))
        vs_cpu = dp.get("cpu_tokens_per_s", float("nan")) / cpu if dp else float("nan")
        loss = "-" if v["eval_loss"] is None else f"{v['eval_loss']:.3f}"
        lines.append(f"{model:<6} {method:<16} {v['tokens_per_s']:>9.0f} {v['real_tokens_per_s']:>10.0f} {vs:>5.2f}x "
                     f"{cpu:>9.0f} {vs_cpu:>5.2f}x {v['padding_efficiency']:>7.2f} {v['tokens_per_step']:>8.0f} {v['microbatches_per_step']:>7.1f} "
                     f"{v['rank_spread']:>11.3f} {_pct(v['round_spread']):>12} {loss:>9} "
                     f"{_pct(v.get('mape_start')):>10} {_pct(v.get('mape_end')):>8} {_pct(v.get('mape_noise')):>6} "
                     f"{_pct(v.get('mape_fit_floor')):>6}")
    for key, why in doc["skipped"].items():
        lines.append(f"skipped {key}: {why}")
    t = doc["target_values"]
    for m, r in doc["ratios"].items():
        ok = doc["targets"][m]
        per_round = ", ".join(f"{x:.2f}" for x in r["per_round"])
        lines.append(f"{m}: dp {r['dp_vs_best']:.2f}x the best other ({r['best_other']}; per round {per_round}): "
                     f"target {t['throughput_vs_best']}x {'met' if ok['throughput'] else 'MISSED'}; dp MAPE after "
                     f"feedback {_pct(doc['methods'][f'{m}/dp'].get('mape_end'))}: target "
                     f"{t['mape_after_feedback']:.0%} {'met' if ok['mape'] else 'MISSED'}")
        if r.get("cpu_per_round"):
            cpu_round = ", ".join(f"{x:.2f}" for x in r["cpu_per_round"])
            lines.append(f"{m}: per CPU second of the slowest rank, dp {r['cpu_dp_vs_best']:.2f}x the best other "
                         f"({r['cpu_best_other']}; per round {cpu_round})")
    lines.append("vs dp: dp's target tokens/s over the row's; cpu tok/s: target tokens per CPU second of each step's "
                 "slowest rank (the steps' cost without what else the machine ran: steadier than the wall time on a "
                 "shared machine; the targets stay on the wall time); rank spread: max/mean over ranks of each step's forward "
                 "seconds (median over steps); round spread: (max - min) / median of the rounds' tokens/s (timer and "
                 "load noise); MAPE: dp's planned vs measured seconds per micro-batch, before the first refit / over "
                 "the last steps; noise: the spread of identical micro-batch shapes (the floor a MAPE can reach here); "
                 "floor: the MAPE of a linear fit to every dp observation in sample (the best the features can do)")
    return "\n".join(lines)


__all__ = ["MAPE_TARGET", "THROUGHPUT_TARGET", "TrainerBenchConfig", "assemble", "batch_sizes", "epoch_pools",
           "fit_floor", "format_table", "prepare_data", "run_trainer_bench"]
