"""``dynabatch bench spindle``: per-component device allocation in waves (Spindle, `dynabatch.core.multitask`)
against one pipeline over the whole model, simulated, on a three-task mix.

The model is the full-size multi-task graph ``mtmm`` (`dynabatch.core.multitask.mtmm_graph`: InternViT-6B,
a Whisper-large-sized audio encoder, a projector, InternLM2-20B, two heads). Each step draws samples from the
task pools by the mix's weights until it holds ``step_tokens`` backbone tokens: ``text`` (FLAN CoT and NIv2
rows of the shared data, token counts estimated from their characters), ``image_text`` (the InternVL SFT
shape records of OmniBal, COCO 2017 val captions with each image's InternVL tiling, LLaVA's COCO QA), and
``audio_text`` (generated: the shared data holds no audio). Without the shared data every pool is generated
(`dynabatch.shape_sources.synthetic_shapes`), which the output says.

For every step and device count the same micro-batches (`StepSamples.pack`, one task each) are priced by the
same per-component cost models and simulated four ways plus the allocation (its step as the multi-task
executor runs it, micro-batches streaming between component groups: `simulate_stream`): one pipeline cut
uniformly or by the partition search (`dynabatch.pipeline.balanced_partition`), each with and without the
bypass of idle leading stages (`dynabatch.core.multitask.baselines`), interleaved step by step; the
allocation is planned twice, with a ViT's tiles split over its replicas where that is shorter (`SPLIT`,
simulated only) and with whole micro-batches (what the executor runs). Both sides
overlap their gradient all-reduces with the backward the same way (`OVERLAP`). Two lower bounds of any plan
of these micro-batches: all the work over all devices, and the heaviest micro-batch's path through its
components (`chain_bound`). ``plan ms`` is the wall time of pricing the step and searching the allocation
(`plan_allocation`, numba kernels, compiled before timing).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MIX = (("text", 0.4), ("image_text", 0.4), ("audio_text", 0.2))
BASELINES = ("uniform", "uniform+bypass", "searched", "searched+bypass")
AUDIO_TOKENS_PER_S = 25  # 50 encoder frames per second (Whisper), pooled 2:1 into backbone tokens
DEFAULT_SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@dataclass(frozen=True)
class TaskPool:
    """Samples one task draws from: per sample text / vision / audio token counts (backbone tokens)."""

    task: str
    text: np.ndarray
    vision: np.ndarray
    audio: np.ndarray
    origin: str


def _tokens(text: str) -> int:
    from ..shape_sources import CHARS_PER_TOKEN

    return max(1, math.ceil(len(text.encode()) / CHARS_PER_TOKEN))


def _audio_pool(rng, n: int, text_median: float = 40.0) -> TaskPool:
    seconds = rng.uniform(2.0, 30.0, n)
    text = np.ceil(text_median * np.exp(0.6 * rng.standard_normal(n))).astype(np.int64)
    return TaskPool("audio_text", np.maximum(text, 1), np.zeros(n, np.int64),
                    np.round(seconds * AUDIO_TOKENS_PER_S).astype(np.int64),
                    f"generated ({n} clips of 2-30 s, {AUDIO_TOKENS_PER_S} backbone tokens/s)")


def shared_pools(root: Path, max_len: int, seed: int) -> list[TaskPool] | None:
    """The task pools from the shared data folder ``root`` (None when its files are missing)."""
    from tokenization import DynamicTiling

    from ..shape_sources import TOKENS_PER_TILE, read_shapes

    root = Path(root)
    text_files = [root / "text" / "flan_cot_sample.jsonl.gz", root / "text" / "niv2_sample.jsonl.gz"]
    mm = root / "multimodal"
    need = text_files + [mm / "omnibal_internvl_sft_lengths.csv.gz", mm / "coco_val2017_images.jsonl",
                         mm / "llava_coco2014_val_gpt4_qa_30x3.jsonl"]
    if not all(p.exists() for p in need):
        return None
    ts, _ = read_shapes([str(p) for p in text_files])
    text = np.minimum(ts.input_tokens + ts.target_tokens, max_len).astype(np.int64)
    pools = [TaskPool("text", text, np.zeros(len(text), np.int64), np.zeros(len(text), np.int64),
                      f"FLAN CoT + NIv2 ({len(text)} rows, tokens ~ bytes / 4)")]
    om, _ = read_shapes([str(mm / "omnibal_internvl_sft_lengths.csv.gz")])
    keep = om.vision_tokens > 0
    vis, txt = [om.vision_tokens[keep]], [om.input_tokens[keep]]
    tiling = DynamicTiling()
    rows = [json.loads(line) for line in open(mm / "coco_val2017_images.jsonl")]
    tiles = tiling.num_tiles(np.array([r["width"] for r in rows]), np.array([r["height"] for r in rows]))
    vis.append(np.asarray(tiles, np.int64) * TOKENS_PER_TILE)
    txt.append(np.array([_tokens(r["captions"][0]) + 8 for r in rows], np.int64))  # caption + a short prompt
    qa = [json.loads(line) for line in open(mm / "llava_coco2014_val_gpt4_qa_30x3.jsonl")]
    coco_tiles = int(np.asarray(tiling.num_tiles(np.array([640]), np.array([480])))[0])  # a typical COCO image
    vis.append(np.full(len(qa), coco_tiles * TOKENS_PER_TILE, np.int64))
    txt.append(np.array([_tokens(r["instruction"]) + _tokens(r["output"]) for r in qa], np.int64))
    vision = np.concatenate(vis)
    text = np.minimum(np.concatenate(txt), np.maximum(max_len - vision, 1))
    pools.append(TaskPool("image_text", text, vision, np.zeros(len(vision), np.int64),
                          f"InternVL SFT shapes ({int(keep.sum())}) + COCO val2017 captions ({len(rows)}) + "
                          f"LLaVA COCO QA ({len(qa)})"))
    pools.append(_audio_pool(np.random.default_rng(seed + 17), 20000))
    return pools


def generated_pools(seed: int, n: int = 20000) -> list[TaskPool]:
    """Task pools without the shared data: the project's synthetic text and vision shapes, generated audio."""
    from ..shape_sources import synthetic_shapes

    ts, _ = synthetic_shapes("text", n, seed)
    vs, _ = synthetic_shapes("vision", n, seed + 1)
    keep = vs.vision_tokens > 0
    z = np.zeros(n, np.int64)
    return [TaskPool("text", (ts.input_tokens + ts.target_tokens).astype(np.int64), z, z, f"synthetic text ({n})"),
            TaskPool("image_text", vs.input_tokens[keep].astype(np.int64), vs.vision_tokens[keep].astype(np.int64),
                     np.zeros(int(keep.sum()), np.int64), f"synthetic image+text ({int(keep.sum())})"),
            _audio_pool(np.random.default_rng(seed + 17), n)]


def draw_step(pools: list[TaskPool], weights: dict[str, float], step_tokens: int, rng):
    """(tasks, text, vision, audio) of one step: samples drawn by task weight until ``step_tokens`` backbone
    tokens."""
    names = [p.task for p in pools]
    w = np.array([weights[n] for n in names], np.float64)
    tasks, text, vision, audio, total = [], [], [], [], 0
    while total < step_tokens:
        k = int(rng.choice(len(pools), p=w / w.sum()))
        p = pools[k]
        i = int(rng.integers(len(p.text)))
        tasks.append(p.task)
        text.append(int(p.text[i]))
        vision.append(int(p.vision[i]))
        audio.append(int(p.audio[i]))
        total += text[-1] + vision[-1] + audio[-1]
    return tasks, text, vision, audio


@dataclass(frozen=True)
class SpindleRow:
    """One device count, means over the steps: the allocation's simulated step seconds (a ViT's tiles split
    over its replicas where that is shorter: `plan_allocation(split_sequences=True)`), the allocation's with
    whole micro-batches (``whole_s``, what the executor runs), each baseline's (NaN: no layout fits), the best
    baseline, speed-up (best baseline over the allocation), the lower bound (all the work over all devices,
    `lower_bound`), the chain bound (the heaviest micro-batch's path, `chain_bound`; it does not depend on the
    device count), planning ms (median, the split search included), and the first step's allocation
    (component: devices x stages @ wave, / pieces)."""

    devices: int
    allocation_s: float
    whole_s: float
    baselines_s: dict
    best_baseline: str
    speedup: float
    lower_bound_s: float
    chain_bound_s: float
    plan_ms: float
    layout: str

    @property
    def bound_s(self) -> float:
        """The tighter of the two lower bounds (seconds, mean over the steps of each)."""
        return max(self.lower_bound_s, self.chain_bound_s)

    def to_dict(self) -> dict:
        """JSON-able (NaN: None)."""
        def clean(v):
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return None if isinstance(v, float) and math.isnan(v) else v

        return {k: clean(v) for k, v in asdict(self).items()}


def _partition(forward_s, backward_s, num_stages):
    from ..pipeline.models.partition import LayerCosts, balanced_partition

    return balanced_partition(LayerCosts(forward_s, backward_s), num_stages).bounds


def _memo_partition():
    """`_partition` remembering its answers by the per-layer seconds (a deterministic search): the
    ``searched`` and ``searched+bypass`` baselines cut the same layer table of a step, so the second asks
    for what the first found (half the bench's search time)."""
    seen: dict = {}

    def partition(forward_s, backward_s, num_stages):
        key = (np.asarray(forward_s).tobytes(), np.asarray(backward_s).tobytes(), np.shape(forward_s), int(num_stages))
        if key not in seen:
            seen[key] = _partition(forward_s, backward_s, num_stages)
        return seen[key]

    return partition


def run_spindle_bench(pools: list[TaskPool], weights: dict[str, float], devices: tuple[int, ...], steps: int,
                      step_tokens: int, microbatch_tokens: int, device: str, seed: int, *,
                      progress: bool = False) -> list[SpindleRow]:
    """The bench (module doc): one `SpindleRow` per device count; ``progress``: a bar (`progress_bar`) over the
    (step, device count) pairs."""
    from ..progress import progress_bar
    from ..core.multitask import ComponentCosts, StepSamples, mtmm_graph, plan_allocation
    from ..core.multitask.baselines import chain_bound, lower_bound, one_pipeline

    graph = mtmm_graph()
    costs = ComponentCosts(graph, device)
    rng = np.random.default_rng(seed)
    drawn = [draw_step(pools, weights, step_tokens, rng) for _ in range(steps)]
    # compile the kernels before anything is timed
    first = StepSamples.pack(graph, *drawn[0], microbatch_tokens=microbatch_tokens)
    plan_allocation(costs, costs.workload(first), max(devices))
    acc = {N: {"alloc": [], "whole": [], "lb": [], "chain": [], "ms": [], "layout": "",
               **{b: [] for b in BASELINES}} for N in devices}
    with progress_bar(steps * len(devices), "bench spindle", "plan", progress) as bar:
        for tasks, text, vision, audio in drawn:
            for N in devices:
                a = acc[N]
                t0 = time.perf_counter()
                samples = StepSamples.pack(graph, tasks, text, vision, audio, microbatch_tokens=microbatch_tokens)
                w = costs.workload(samples)
                try:
                    alloc = plan_allocation(costs, w, N, split_sequences=True)
                    a["alloc"].append(alloc.step_seconds)
                    a["layout"] = a["layout"] or ", ".join(
                        f"{p.component} {len(p.ranks)}x{p.stages}@{p.wave}" + (f"/{p.pieces}" if p.pieces > 1 else "")
                        + (f" on {p.ranks[0]}..{p.ranks[-1]}" if p.ranks[0] else "") for p in alloc.placements)
                except ValueError:
                    a["alloc"].append(math.nan)
                a["ms"].append(1e3 * (time.perf_counter() - t0))
                try:  # whole micro-batches (what the executor runs), not timed
                    a["whole"].append(plan_allocation(costs, w, N).step_seconds)
                except ValueError:
                    a["whole"].append(math.nan)
                a["lb"].append(lower_bound(w, N))
                a["chain"].append(chain_bound(graph, w))
                partition = _memo_partition()  # this step's layer table: shared by both searched baselines
                for name in BASELINES:
                    try:
                        bl = one_pipeline(costs, w, N, bypass=name.endswith("+bypass"),
                                          partition=partition if name.startswith("searched") else None)
                        a[name].append(bl.step_seconds)
                    except ValueError:
                        a[name].append(math.nan)
                bar.update(1)
    rows = []
    for N in devices:
        a = acc[N]
        base = {b: float(np.mean(a[b])) for b in BASELINES}
        fits = {b: v for b, v in base.items() if not math.isnan(v)}
        best = min(fits, key=fits.get) if fits else "-"
        alloc_s = float(np.mean(a["alloc"]))
        rows.append(SpindleRow(N, alloc_s, float(np.mean(a["whole"])), base, best, fits[best] / alloc_s if fits else math.nan,
                               float(np.mean(a["lb"])), float(np.mean(a["chain"])), float(np.median(a["ms"])),
                               a["layout"]))
    return rows


def format_spindle(rows: list[SpindleRow]) -> str:
    """The table as text."""
    head = (f"{'devices':>7} {'allocation s':>12} {'whole-mb s':>10} " + " ".join(f"{b:>15}" for b in BASELINES)
            + f" {'best/alloc':>10} {'best/whole':>10} {'lower bound':>11} {'chain bound':>11} {'alloc/bound':>11}"
              f" {'plan ms':>8}")
    lines = [head]
    for r in rows:
        cells = " ".join(f"{r.baselines_s[b]:>15.3f}" if not math.isnan(r.baselines_s[b]) else f"{'(no fit)':>15}"
                         for b in BASELINES)
        ratio = f"{'-':>10}" if math.isnan(r.speedup) else f"{r.speedup:>9.2f}x"
        whole = f"{'-':>10}" if math.isnan(r.speedup) else f"{r.speedup * r.allocation_s / r.whole_s:>9.2f}x"
        lines.append(f"{r.devices:>7} {r.allocation_s:>12.3f} {r.whole_s:>10.3f} {cells} {ratio} {whole} "
                     f"{r.lower_bound_s:>11.3f} "
                     f"{r.chain_bound_s:>11.3f} {r.allocation_s / r.bound_s:>10.2f}x {r.plan_ms:>8.1f}")
    lines.append("")
    lines += [f"allocation at {r.devices}: {r.layout}  (component devices x pipeline stages @ wave [/ pieces each "
              f"micro-batch's tiles are split into] [on its ranks, replica 0's first, when not from rank 0])"
              for r in rows]
    return "\n".join(lines)


#: what each side of the comparison overlaps (printed under the table and in the JSON)
OVERLAP = ("gradient all-reduce, both sides overlapped the same way: the allocation posts each component group's "
           "all-reduce when that component's last backward on the rank ends (SpindleExecutor does), while the "
           "rank goes on with the other components' backward; one pipeline posts each stage's all-reduce when that "
           "stage's last backward ends (Megatron's overlap-grad-reduce), while the earlier stages go on. An "
           "all-reduce takes no compute; a device's link carries one at a time. Neither side splits a stage's or "
           "a component's all-reduce into buckets overlapping its own last backward.")


#: what the allocation column may do that the whole-micro-batch column and the executor do not
SPLIT = ("allocation s splits a micro-batch's image tiles over the vit group's replicas where that shortens the step "
         "(/pieces in the layout; plan_allocation(split_sequences=True)): simulated only, like the pipeline stages "
         "inside a group; the executor (SpindleExecutor) runs whole micro-batches on one stage per group. "
         "whole-mb s: the same search with whole micro-batches. One pipeline runs whole micro-batches.")


def describe(pools: list[TaskPool], weights: dict[str, float], shared: bool) -> str:
    """Where the pools came from, one line per task."""
    src = "shared data" if shared else "GENERATED data (the shared data folder was not found)"
    return "\n".join([f"data: {src}"] + [f"  {p.task} (weight {weights[p.task]:g}): {p.origin}" for p in pools])


def jsonable(x):
    """A dataclass tree (e.g. `dynabatch.bench.spindle_measure.SpindleMeasurement`) as JSON-able values."""
    import dataclasses

    if dataclasses.is_dataclass(x):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def load_text() -> str:
    """The machine's load average, for the timing's context."""
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} {b:.1f} {c:.1f} on {os.cpu_count()} cores"


__all__ = ["MIX", "BASELINES", "OVERLAP", "SPLIT", "DEFAULT_SHARED", "TaskPool", "SpindleRow", "shared_pools", "generated_pools", "draw_step",
           "run_spindle_bench", "format_spindle", "describe", "jsonable", "load_text"]
