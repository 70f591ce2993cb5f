"""``dynabatch bench spindle --measure``: the simulator's per-component seconds against the ones the multi-task
executor (`dynabatch.pipeline.multitask.SpindleExecutor`) measures on gloo.

mtmm-tiny (`dynabatch.pipeline.models.mtmm`, the shapes of `dynabatch.core.multitask.zoo.mtmm_tiny_graph`) runs
on ``world`` local processes (gloo, CPU, one thread each) under the allocation `plan_allocation` gives the
first step's workload (`ComponentCosts` on the ``cpu`` device preset). Each step is a fresh mix of text-only,
image+text and audio+text samples (`StepSamples.pack`: one task per micro-batch), built into padded
micro-batches of exactly those token counts; every rank records each component's forward + backward seconds
on each micro-batch it ran (waits excluded; the CPU seconds of the rank's thread, so that time a rank
waited for a core of the shared machine is not counted as compute). The first ``warmup`` steps are dropped; the
rest alternate between *calibration* and *evaluation* steps (`split_steps`: interleaved, so a change of the
machine's load during the run hits both alike). The calibration steps refit each component's cost model from
their measured times (`ComponentCosts.observe` / ``refit``: the library's feedback loop, per component); the
evaluation steps are never seen by the fit, and are predicted by the refit models: per component, the simulated busy seconds of the heaviest rank of its group (the
micro-batches `route` gives each rank, priced by the refit cost model, summed) against the measured busy
seconds of the heaviest rank, summed over the evaluation steps. Compute only: the simulator's transfer and
all-reduce seconds are not in either column (on one CPU a wait is mostly other ranks' compute, not the link).
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

TASK_MIX = (("text", 1.0), ("image_text", 1.0), ("audio_text", 1.0))


@dataclasses.dataclass(frozen=True)
class SpindleMeasureConfig:
    """What the measurement runs: ``world`` gloo ranks; per step ``samples`` samples of the task mix
    (``TASK_MIX``, equal weights), text ``text`` tokens (inclusive range), ``tiles`` image tiles per image
    sample, ``frames`` audio frames per audio sample (even: 2 frames per backbone token), packed into
    micro-batches of at most ``microbatch_tokens`` backbone tokens; ``warmup`` + ``calibrate`` + ``evaluate``
    steps. ``hidden``/``vision_hidden``/``vocab``: mtmm-tiny's widths (defaults the graph's)."""

    world: int = 4
    samples: int = 36
    text: tuple[int, int] = (16, 96)
    tiles: tuple[int, int] = (1, 4)
    frames: tuple[int, int] = (16, 96)
    microbatch_tokens: int = 160
    warmup: int = 2
    calibrate: int = 5
    evaluate: int = 5
    hidden: int = 128
    vision_hidden: int = 64
    vocab: int = 512
    seed: int = 0


def split_steps(cfg: SpindleMeasureConfig) -> tuple[list[int], list[int]]:
    """(calibration steps, evaluation steps) after the warm-up: alternating, calibration first, the surplus of
    either at the end."""
    calib, evals = [], []
    for k in range(cfg.warmup, cfg.warmup + cfg.calibrate + cfg.evaluate):
        turn = (k - cfg.warmup) % 2 == 1
        (evals if (turn and len(evals) < cfg.evaluate) or len(calib) >= cfg.calibrate else calib).append(k)
    return calib, evals


def step_samples(cfg: SpindleMeasureConfig, graph, step: int):
    """Step ``step``'s `StepSamples` (deterministic in ``cfg.seed`` and ``step``): tasks cycle through the mix,
    token counts in backbone tokens (a tile is ``tile_tokens`` of them, two frames one)."""
    from ..core.multitask.workload import StepSamples
    from ..core.multitask.zoo import MTMM_TINY

    rng = np.random.default_rng([cfg.seed, step])
    tasks = [TASK_MIX[i % len(TASK_MIX)][0] for i in range(cfg.samples)]
    text = rng.integers(cfg.text[0], cfg.text[1] + 1, cfg.samples)
    tiles = rng.integers(cfg.tiles[0], cfg.tiles[1] + 1, cfg.samples)
    frames = rng.integers(cfg.frames[0] // 2, cfg.frames[1] // 2 + 1, cfg.samples) * 2
    vision = np.where([t == "image_text" for t in tasks], tiles * MTMM_TINY["tile_tokens"], 0)
    audio = np.where([t == "audio_text" for t in tasks], frames // MTMM_TINY["audio_pool"], 0)
    return StepSamples.pack(graph, tasks, text, vision, audio, microbatch_tokens=cfg.microbatch_tokens)


def microbatches(samples, tile_size: int, mel: int, vocab: int, classes: int, seed: int) -> list[dict]:
    """The padded micro-batch dicts of ``samples``: each row exactly its sample's text tokens, tiles and frames."""
    import torch

    from ..core.multitask.zoo import MTMM_TINY

    tt, pool = MTMM_TINY["tile_tokens"], MTMM_TINY["audio_pool"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for j in range(samples.num_microbatches):
        rows = np.flatnonzero(samples.microbatch == j)
        n = torch.tensor(samples.text[rows], dtype=torch.long)
        L = int(n.max())
        mask = (torch.arange(L)[None] < n[:, None]).long()
        ids = torch.randint(0, vocab, (len(rows), L), generator=gen) * mask
        b = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        task = samples.tasks[int(rows[0])]
        if task == "image_text":
            t = torch.tensor(samples.vision[rows] // tt, dtype=torch.long)
            b["image_tiles"] = t
            b["pixel_values"] = torch.randn(int(t.sum()), 3, tile_size, tile_size, generator=gen)
        if task == "audio_text":
            fr = torch.tensor(samples.audio[rows] * pool, dtype=torch.long)
            b["audio_frames"] = fr
            b["audio_values"] = torch.randn(len(rows), int(fr.max()), mel, generator=gen)
            b["class_labels"] = torch.randint(0, classes, (len(rows),), generator=gen)
        out.append(b)
    return out


def measure_rank(rank: int, world: int, port: int, payload: dict) -> list:
    """One rank: every step on the executor; per step, component -> {micro-batch: measured seconds} of this rank."""
    import torch

    from ..core.multitask.allocation import Allocation, Placement
    from ..core.multitask.zoo import mtmm_tiny_graph
    from ..pipeline.models.mtmm import mtmm_tiny
    from ..pipeline.multitask import SpindleExecutor, init_spindle
    from ..pipeline.runtime.launch import heartbeat

    cfg = SpindleMeasureConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in payload["config"].items()})
    torch.set_num_threads(1)
    graph = mtmm_tiny_graph()
    places = tuple(Placement(c, tuple(r), s, w) for c, r, s, w in payload["placements"])
    alloc = Allocation(places, tuple(tuple(w) for w in payload["waves"]), world, 0.0, {})
    model = mtmm_tiny(hidden=cfg.hidden, vision_hidden=cfg.vision_hidden, vocab=cfg.vocab, seed=cfg.seed)
    out = []
    with init_spindle(alloc, graph, rank=rank, world_size=world, master_port=port, timeout_s=300) as ctx:
        # CPU seconds of the rank's thread: the ranks share the machine's cores with each other and other work,
        # and the simulator prices compute, not the time a rank waited for a core
        ex = SpindleExecutor(model, graph, ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                             clock=time.thread_time)
        for k, step in enumerate(payload["steps"]):
            samples = step_samples(cfg, graph, k)
            batches = microbatches(samples, 56, 16, cfg.vocab, 16, cfg.seed + k)
            res = ex.step(batches, list(samples.microbatch_tasks), cost_s=step["cost_s"])
            out.append({c: {str(j): s for j, s in per.items()} for c, per in res.microbatch_s.items()})
            heartbeat()
        ctx.close()
    return out


@dataclasses.dataclass(frozen=True)
class ComponentRow:
    """One component over the evaluation steps: its group size, simulated and measured busy seconds of the
    heaviest rank (summed over the steps), their ratio, the median over the steps of each step's ratio
    (``median_ratio``: less moved by one step's outlier, e.g. a page-faulting allocation), and the calibration
    steps' MAPE per micro-batch (of the predictions before each refit); ``simulated_total_s`` /
    ``measured_total_s``: the seconds of all its micro-batches on all its ranks (`total_ratio`)."""

    component: str
    ranks: int
    simulated_s: float
    measured_s: float
    calibration_mape: float
    median_ratio: float = float("nan")
    simulated_total_s: float = float("nan")
    measured_total_s: float = float("nan")

    @property
    def total_ratio(self) -> float:
        """Simulated over measured seconds of all the component's micro-batches (every rank of its group): the
        work, without the heaviest rank's pick (a maximum over noisy ranks sits above its mean)."""
        return self.simulated_total_s / self.measured_total_s if self.measured_total_s > 0 else float("nan")

    @property
    def ratio(self) -> float:
        """Simulated over measured seconds."""
        return self.simulated_s / self.measured_s if self.measured_s > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class SpindleMeasurement:
    """The measurement: per component `ComponentRow`, the allocation run (``placements``: component, ranks,
    stages, wave), the machine's load average when it ended (``load``) and the config."""

    rows: tuple[ComponentRow, ...]
    placements: tuple[tuple, ...]
    load: tuple[float, float, float]
    config: SpindleMeasureConfig

    @property
    def within_15(self) -> bool:
        """Every component predicted within 15% of its measured seconds."""
        return all(abs(r.ratio - 1.0) <= 0.15 for r in self.rows)

    def format(self) -> str:
        """The table as text."""
        lines = [f"simulated vs measured per-component compute seconds (heaviest rank of each group, CPU seconds of "
                 f"its thread; {self.config.evaluate} evaluation steps, interleaved with {self.config.calibrate} "
                 f"calibration steps; "
                 f"{self.config.world} gloo ranks on CPU, load {self.load[0]:.1f} {self.load[1]:.1f} {self.load[2]:.1f})",
                 f"{'component':<14}{'ranks':>6}{'simulated s':>13}{'measured s':>12}{'sim/meas':>10}"
                 f"{'median step':>13}{'all ranks':>11}{'calib MAPE':>12}"]
        for r in self.rows:
            lines.append(f"{r.component:<14}{r.ranks:>6}{r.simulated_s:>13.4f}{r.measured_s:>12.4f}{r.ratio:>10.3f}"
                         f"{r.median_ratio:>13.3f}{r.total_ratio:>11.3f}{100 * r.calibration_mape:>11.1f}%")
        lines.append("sim/meas: heaviest rank's seconds summed over the evaluation steps; median step: of each step's "
                     "ratio; all ranks: every micro-batch of the component (the work); calib MAPE: per micro-batch, "
                     "before each refit")
        lines.append("placements: " + "; ".join(f"{c} ranks {list(rk)} wave {w}" for c, rk, _, w in self.placements))
        worst = max(self.rows, key=lambda r: abs(r.ratio - 1.0))
        lines.append(f"target: every component within 15% (ratio of the sums) -> {'met' if self.within_15 else 'missed'}"
                     f" (worst: {worst.component} {worst.ratio:.3f})")
        return "\n".join(lines)


def _heaviest(per_rank: dict[int, float]) -> float:
    return max(per_rank.values(), default=0.0)


def measure_spindle(config: SpindleMeasureConfig = SpindleMeasureConfig(), *,
                    idle_timeout_s: float = 300.0) -> SpindleMeasurement:
    """Run the measurement (module doc) and return its `SpindleMeasurement`. Launches ``config.world`` local
    ranks (`launch_local`); a failed rank raises RuntimeError with its stderr's end."""
    from ..core.multitask.allocation import plan_allocation
    from ..core.multitask.workload import ComponentCosts
    from ..core.multitask.zoo import mtmm_tiny_graph
    from ..pipeline.runtime.launch import first_failure, launch_local

    cfg = config
    graph = mtmm_tiny_graph()
    costs = ComponentCosts(graph, "cpu")
    steps = cfg.warmup + cfg.calibrate + cfg.evaluate
    samples = [step_samples(cfg, graph, k) for k in range(steps)]
    alloc = plan_allocation(costs, costs.workload(samples[0]), cfg.world)
    placements = tuple((p.component, p.ranks, p.stages, p.wave) for p in alloc.placements)
    # the routes balance by the prior cost model's predictions, fixed before the run (every rank the same)
    priors = [costs.workload(s) for s in samples]
    payload = {"config": dataclasses.asdict(cfg), "placements": [list(map(_jsonable, p)) for p in placements],
               "waves": [list(w) for w in alloc.waves],
               "steps": [{"cost_s": {c: w.time_s[w.row(c)].tolist() for c in graph.names}} for w in priors]}
    res = launch_local("dynabatch.bench.spindle_measure:measure_rank", cfg.world, args=(payload,),
                       idle_timeout_s=idle_timeout_s)
    bad = first_failure(res)
    if bad is not None:
        raise RuntimeError(f"bench spindle --measure: rank {bad.rank} failed:\n{bad.stderr[-4000:]}")
    measured = [[r.result[k] for r in res] for k in range(steps)]
    rows = compare(cfg, graph, costs, samples, alloc, measured, payload)
    return SpindleMeasurement(rows, placements, tuple(os.getloadavg()), cfg)


def compare(cfg: SpindleMeasureConfig, graph, costs, samples, alloc, measured, payload) -> tuple[ComponentRow, ...]:
    """The rows of the measurement: ``measured[k][rank]`` is rank's step-``k`` result (component -> {micro-batch:
    seconds}); the calibration steps of `split_steps` refit ``costs`` (in place), its evaluation steps are
    compared."""
    from ..core.multitask.routing import route

    per_step = []  # (component -> per micro-batch measured seconds, component -> rank -> busy seconds)
    for k, ranks in enumerate(measured):
        mb = {c: np.full(samples[k].num_microbatches, np.nan) for c in graph.names}
        busy = {c: {} for c in graph.names}
        for rank, got in enumerate(ranks):
            for c, per in got.items():
                for j, sec in per.items():
                    mb[c][int(j)] = sec
                busy[c][rank] = sum(per.values())
        per_step.append((mb, busy))
    calib, evals = split_steps(cfg)
    mape = {c: [] for c in graph.names}
    for k in calib:
        w = costs.workload(samples[k])
        for c, e in costs.observe(w, per_step[k][0]).items():
            mape[c].append(e)
        costs.refit()
    sim = {c: [] for c in graph.names}
    meas = {c: [] for c in graph.names}
    sim_all = {c: 0.0 for c in graph.names}
    meas_all = {c: 0.0 for c in graph.names}
    for k in evals:
        w = costs.workload(samples[k])
        routes = route(alloc, graph, samples[k].microbatch_tasks, cost_s=payload["steps"][k]["cost_s"])
        for c in graph.names:
            t = w.time_s[w.row(c)]
            sim[c].append(max((float(t[list(mbs)].sum()) for mbs in routes[c]), default=0.0))
            meas[c].append(_heaviest(per_step[k][1][c]))
            ran = np.isfinite(per_step[k][0][c])
            sim_all[c] += float(t[ran].sum())
            meas_all[c] += float(np.nansum(per_step[k][0][c]))
    return tuple(ComponentRow(c, len(alloc.placement(c).ranks), float(np.sum(sim[c])), float(np.sum(meas[c])),
                              float(np.mean(mape[c])) if mape[c] else float("nan"),
                              float(np.median(np.array(sim[c]) / np.maximum(meas[c], 1e-12))), sim_all[c], meas_all[c])
                 for c in graph.order())


def _jsonable(x):
    return list(x) if isinstance(x, tuple) else x


__all__ = ["ComponentRow", "SpindleMeasureConfig", "SpindleMeasurement", "measure_rank", "measure_spindle",
           "microbatches", "split_steps", "step_samples"]
