"""``dynabatch bench train --model vlm-tiny``: what the vision-language run adds to `dynabatch.bench.train`.

* Data (`build_vlm_data`): one shuffled JSONL of image+text records and FLAN text-only records
  (``text_fraction`` of them text-only, 0.5 by default). With the shared data present
  (``../shared/data``, see its README): the 50 real COCO photos of ``images/`` with their captions,
  then the LLaVA GPT-4 instruction/answer pairs and the COCO val2017 captions, whose photos are not
  in the collection, each on a generated image (`dynabatch.datagen`) of the photo's real size
  (LLaVA's COCO 2014 sizes are unknown: a COCO val2017 size each), and FLAN text rows from the NIv2
  and CoT samples. Without it, `dynabatch.datagen` image+text and text records. Byte tokens, 56 px
  tiles of 14 px patches (`VISION`, 4 language tokens per tile), pixels loaded by the `DataLoader`.
* Stages (`modality_bounds`): the patch embedding, ViT blocks and projector on stage 0, the merge
  embedding, GPT blocks and head on the others (``--partition modality``, the default; ``uniform``
  cuts by layer count). `layout_of` reads the `StageLayout` of the bounds the runner runs.
* Methods (`VLM_METHODS`): ``dp`` plans with that layout (stage-aware) and is refit per stage
  (``FeedbackLoop(stage_reduce="per_stage")`` when the feedback loop has it, else the scalar
  ``"max"`` refit; the result's ``feedback_mode`` says which); ``dp-blind`` is the same DP on the
  uniform layout of the same model (every stage priced as the average stage), refit from the slowest
  stage (``"max"``); ``pack`` and ``token_budget`` are the baselines with their default knobs.
  vlm-tiny takes one sample per row, so ``pack``'s packed rows are handed to it as one sequence per
  row (`rows_as_sequences`: the row's images first, its text tokens after, no block-diagonal mask):
  the same tensor shapes and compute, the attention between packed samples not masked.
* Per-stage MAPE (`stage_observation`): each micro-batch's planned forward+backward seconds on each
  stage (``cost.stage_times`` before the step's refit) against the measured seconds of that stage,
  pooled over every micro-batch (``stage_mape_*``) and split (`stage_split`) into the micro-batches
  the stage runs layers on (``stage_compute_mape_*``) and those it passes through
  (``stage_passthrough_mape_*``, `stage_computes`): on the vision stage a text-only micro-batch skips
  every layer, and its measured "forward+backward" is the dispatch of the skipped layers plus the
  language-side index bookkeeping, 0.1-1 ms whose spread between identical micro-batches is 15-25%
  (even in CPU time). What ran before it on the core sets it, not its shape: the same pass-through
  takes 0.12 ms after another one and 0.33 ms right after a vision micro-batch's forward and
  backward (cold CPU caches; 0.015 ms vs 0.10 ms with no bookkeeping at all), so no per-micro-batch
  model can predict it. Pooled by count (about half the data is text-only), those sub-millisecond
  times would set the vision stage's MAPE while being about 5% of its seconds. Both figures are
  reported, with each stage's share of pass-through micro-batches and of its measured seconds, and
  the noise floor of each (`stage_mape_floor`: the MAPE of predicting every repeated identical
  micro-batch by its median measured time, in sample, which no model of the features can beat),
  and each stage's per-step sums (`stage_step_mape`: its planned vs measured busy seconds per step).
  By default the bench's runners bypass idle stages (``RunnerConfig(bypass_idle_stages=True)``): a
  text-only micro-batch never visits the vision stage, which measures 0 s for it, no observation
  (left out of every figure, counted in ``stage_bypassed_share``); ``--no-bypass-idle-stages`` runs
  the pass-throughs described above.
  On a shared CPU machine the vision stage also takes the brunt of other processes' load: it
  computes only while the language stage (the bottleneck, busy all step) computes too, so a third
  runnable process slows every vision call (1.3-1.6x with one busy core elsewhere, measured) while the
  language stage, alone on a core most of the step, barely moves; the floor shows it.
* ``dp``'s per-stage refit fits the vision stage's token-dependent bookkeeping and the language
  stage's vision-token merge too (``FeedbackLoop(fit_layout_zeros=True)``): the layout prices
  neither, and the prior's zeros would otherwise stay 0.

Times are seconds, lengths tokens, sizes pixels.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np

VLM_MODEL = "vlm-tiny"
VLM_METHODS = ("dp", "dp-blind", "pack", "token_budget")
VLM_SIZES = dict(vocab=512, hidden=128, layers=2, heads=4, vision_hidden=64, vision_layers=4, vision_heads=2,
                 max_positions=4096)
TILE = dict(tile_size=56, patch_size=14)
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
PROMPTS = ("Describe the image.", "What is in this picture?", "Write a caption for the image.")


def vision_policy():
    """The tiling the loader plans and decodes pixels with (vlm-tiny reads its tile size from it)."""
    import tokenization

    return tokenization.DynamicTiling(**TILE)


# -- data ------------------------------------------------------------------------------------------

def _jsonl(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _shared_image_records(n: int, tmp: Path, seed: int) -> list[dict]:
    from ..datagen import image_bytes

    rng, pick = np.random.default_rng([seed, 13]), random.Random(seed)
    out = []
    for r in _jsonl(SHARED / "images" / "manifest.jsonl"):  # real photos, real captions
        out += [{"image": str((SHARED / "images" / r["file"]).resolve()), "inputs": pick.choice(PROMPTS),
                 "targets": c, "source": "coco-photo"} for c in r["captions"]]
    coco = list(_jsonl(SHARED / "multimodal" / "coco_val2017_images.jsonl"))
    made: dict = {}

    def generated(w: int, h: int) -> str:  # one generated image per size: the tiling depends on the size only
        if (w, h) not in made:
            p = tmp / f"gen-{w}x{h}.jpg"
            p.write_bytes(image_bytes(rng, w, h, "jpg"))
            made[w, h] = str(p)
        return made[w, h]

    for r in _jsonl(SHARED / "multimodal" / "llava_coco2014_val_gpt4_qa_30x3.jsonl"):
        c = coco[pick.randrange(len(coco))]
        out.append({"image": generated(c["width"], c["height"]), "inputs": r["instruction"], "targets": r["output"],
                    "source": "llava-instruct"})
    k = 0
    while len(out) < n and k < 5 * len(coco):
        c = coco[k % len(coco)]
        out.append({"image": generated(c["width"], c["height"]), "inputs": pick.choice(PROMPTS),
                    "targets": c["captions"][k // len(coco) % len(c["captions"])], "source": "coco-caption"})
        k += 1
    pick.shuffle(out)
    return out[:n]


def _shared_text_records(n: int, seed: int) -> list[dict]:
    rows = [r for name in ("niv2_sample.jsonl.gz", "flan_cot_sample.jsonl.gz")
            for r in _jsonl(SHARED / "text" / name)]
    return [{"inputs": r["inputs"], "targets": r["targets"], "source": "flan"}
            for r in random.Random(seed).sample(rows, min(n, len(rows)))]


def _generated_records(n_img: int, n_text: int, tmp: Path, seed: int) -> list[dict]:
    from ..datagen import image_text_samples, text_records

    out = []
    for key, ext, data, rec in image_text_samples(n_img, seed=seed):
        p = tmp / f"{key}.{ext}"
        p.write_bytes(data)
        out.append({"image": str(p), "conversations": rec["conversations"], "source": "generated"})
    return out + [{"inputs": r["inputs"], "targets": r["targets"], "source": "generated"}
                  for r in text_records(n_text, seed=seed)]


def shared_present() -> bool:
    need = ("images/manifest.jsonl", "multimodal/coco_val2017_images.jsonl",
            "multimodal/llava_coco2014_val_gpt4_qa_30x3.jsonl", "text/niv2_sample.jsonl.gz",
            "text/flan_cot_sample.jsonl.gz")
    return all((SHARED / p).exists() for p in need)


def build_vlm_data(tmp: str, samples: int, text_fraction: float = 0.5, seed: int = 0,
                   use_shared: bool | None = None) -> tuple[str, ...]:
    """Write ``samples`` records (``text_fraction`` of them FLAN text-only, the rest image+text) as one
    shuffled JSONL in ``tmp``; returns its path as the data tuple."""
    if not 0.0 <= text_fraction <= 1.0:
        raise ValueError("text_fraction must be in [0, 1]")
    d = Path(tmp) / "vlm-data"
    d.mkdir(parents=True, exist_ok=True)
    n_text = int(round(samples * text_fraction))
    n_img = samples - n_text
    shared = shared_present() if use_shared is None else use_shared
    if shared:
        rows = _shared_image_records(n_img, d, seed) + _shared_text_records(n_text, seed)
    else:
        rows = _generated_records(n_img, n_text, d, seed)
    random.Random(seed + 1).shuffle(rows)
    path = d / "mix.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return (str(path),)


# -- stages, cost models, feedback ------------------------------------------------------------------

def modality_bounds(model, stages: int) -> list[int]:
    """Vision layers (patch embedding, ViT, projector) on stage 0, the language layers spread over the
    rest by block count (merge embedding on the first of them, head on the last)."""
    n, nv = len(model.layers), model.vision_layers
    if stages == 1:
        return [0, n]
    blocks = n - nv - 2
    if stages - 1 > blocks:
        raise ValueError(f"vlm-tiny has {blocks} GPT blocks: at most {blocks + 1} stages")
    return [0, nv, *(nv + 1 + round(blocks * k / (stages - 1)) for k in range(1, stages - 1)), n]


def layout_of(model, bounds) -> "object":
    """The `StageLayout` (ViT blocks and GPT blocks per stage) of the runner's split ``bounds``."""
    from ..core.cost.stages import StageLayout
    from ..pipeline.models.tiny import GPTBlock
    from ..pipeline.models.vlm import ViTBlock

    S = len(bounds) - 1
    main = [sum(isinstance(m, GPTBlock) for m in model.layers[bounds[s]:bounds[s + 1]]) for s in range(S)]
    vis = [sum(isinstance(m, ViTBlock) for m in model.layers[bounds[s]:bounds[s + 1]]) for s in range(S)]
    return StageLayout(tuple(main), (0,) * S, tuple(vis), name="runner")


def feedback_kwargs(method: str) -> tuple[dict, str]:
    """(`FeedbackLoop` keywords, feedback mode) of a method: per-stage refits for ``dp`` (with the
    layout's zero coefficients fitted too, ``fit_layout_zeros``) when the loop supports
    ``stage_reduce="per_stage"``, the slowest stage otherwise."""
    if method == "dp":
        from ..core.cost.model import CostModel
        from ..core.plan.feedback import FeedbackLoop

        cost = CostModel.preset("gpt-tiny", "cpu", num_stages=2)
        for kw in ({"stage_reduce": "per_stage", "fit_layout_zeros": True}, {"stage_reduce": "per_stage"}):
            try:
                FeedbackLoop(cost, **kw)
                return kw, "per_stage"
            except (ValueError, TypeError):
                pass
    return {"stage_reduce": "max"}, "max"


def setup(model, cost, num_stages: int, cfg, method: str) -> dict:
    """What a vlm-tiny method run needs: its planning method, stage bounds, `Tokenization` and feedback keywords
    (``dp``: ``cost`` gets the runner's layout in place)."""
    bounds = uniform_vlm_bounds(model, num_stages) if cfg.partition == "uniform" else modality_bounds(model, num_stages)
    if method == "dp":
        cost.set_layout(layout_of(model, bounds))
    fb, mode = feedback_kwargs(method)
    return {"plan_method": "dp" if method == "dp-blind" else method, "bounds": bounds, "feedback": fb,
            "feedback_mode": mode if method in ("dp", "dp-blind") else None,
            "tokenization": {"vision": vision_policy(), "load_pixels": True}}


def uniform_vlm_bounds(model, stages: int) -> list[int]:
    """About equal layer counts per stage (vision and language layers alike)."""
    n = len(model.layers)
    return [0, *(round(n * k / stages) for k in range(1, stages)), n]


# -- micro-batches and per-stage observations ------------------------------------------------------

def rows_as_sequences(mbs) -> list[dict]:
    """``pack``'s packed-row micro-batches as vlm-tiny takes them: one sequence per row (see the module
    docstring); ``image_tiles`` summed over each row's samples (in sample order, as ``pixel_values``)."""
    import torch

    out = []
    for b in mbs:
        if "position_ids" not in b:
            out.append(b)
            continue
        pos, mask = b["position_ids"], b["attention_mask"].bool()
        starts = ((pos == 0) & mask).sum(1)  # samples per row
        tiles = b["image_tiles"].reshape(-1)
        row_of = torch.repeat_interleave(torch.arange(len(starts)), starts)
        per_row = torch.zeros(len(starts), dtype=tiles.dtype).index_add_(0, row_of[:len(tiles)], tiles[:len(row_of)])
        out.append({**{k: v for k, v in b.items() if k != "position_ids"}, "image_tiles": per_row})
    return out


def stage_observation(cost, step, result) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features ``[m, F]``, predicted, measured forward+backward seconds ``[S, m]``) of this replica's
    micro-batches on every stage, in plan order; predicted by ``cost`` as it is now (call before the
    step's refit)."""
    from ..core.cost.features import plan_features

    plan = step.plan
    replica = int(getattr(step, "rank", 0) or 0) if plan.num_ranks > 1 else 0
    sel = np.flatnonzero(plan.mb_rank == replica)
    phi = plan_features(cost, plan, step.shapes)[sel]
    timings = [t for t in result.all_timings if int(t.replica) == int(result.timing.replica)]
    meas = np.array([np.asarray(t.compute_s, np.float64)[:len(sel)] for t in sorted(timings, key=lambda t: t.stage)])
    return phi, cost.stage_times(phi, len(meas)), meas


def stage_mape(preds: list, meas: list) -> list[float]:
    """Per-stage MAPE (fractions) pooled over the given steps' ``[S, m]`` arrays, over the micro-batches
    each stage ran: a measured 0 s is one it never ran (bypassed, ``--bypass-idle-stages``), with
    nothing to predict."""
    from ..core.cost.fit import mape

    if not preds:
        return []
    p, y = np.concatenate(preds, axis=1), np.concatenate(meas, axis=1)
    return [float(mape(p[s][y[s] > 0], y[s][y[s] > 0])) for s in range(len(p))]


def stage_step_mape(preds: list, meas: list) -> list[float]:
    """Per-stage MAPE (fractions) of each step's summed seconds: stage ``s``'s planned busy time in a
    step (the sum over its micro-batches, what the pipeline simulation adds up) against its measured
    one, over the given steps' ``[S, m]`` arrays."""
    from ..core.cost.fit import mape

    if not preds:
        return []
    p = np.array([np.where(y > 0, a, 0.0).sum(axis=1) for a, y in zip(preds, meas)])  # the ops each stage ran
    y = np.array([a.sum(axis=1) for a in meas])
    return [float(mape(p[:, s], y[:, s])) for s in range(p.shape[1])]


def stage_computes(model, bounds, phi) -> np.ndarray:
    """``[S, m]`` bool: whether stage ``s`` of ``model`` split at ``bounds`` runs layers on micro-batch
    ``j`` (features ``phi[j]``): it holds a language-side layer (merge embedding, GPT block, head:
    every micro-batch runs them), or vision layers (patch embedding, ViT blocks, projector) and the
    micro-batch has image tiles. Otherwise the stage passes the micro-batch through: a vision-only
    stage on a text-only micro-batch, whose vision layers return without computing (the patch
    embedding still lays out the language-side index tensors)."""
    from ..core.kernels.cost import FEATURES
    from ..pipeline.models.vlm import VISION_LAYER_TYPES

    phi = np.atleast_2d(np.asarray(phi, np.float64))
    rows, tiles = phi[:, FEATURES.index("one")] > 0, phi[:, FEATURES.index("has_vis")] > 0
    out = np.zeros((len(bounds) - 1, len(phi)), bool)
    for s in range(len(out)):
        layers = model.layers[bounds[s]:bounds[s + 1]]
        lang = any(not isinstance(m, VISION_LAYER_TYPES) for m in layers)
        vis = any(isinstance(m, VISION_LAYER_TYPES) for m in layers)
        out[s] = (rows & lang) | (tiles & vis)
    return out


def stage_split(preds: list, meas: list, computes: list) -> dict:
    """Per-stage MAPE (fractions; nan where a stage has none) over the steps' micro-batches the stage
    runs layers on (``compute``) and those it passes through (``passthrough``), with the pass-through
    micro-batches' share of the stage's micro-batches (``passthrough_share``) and of its measured
    seconds (``passthrough_time_share``) and the share it never ran (``bypassed_share``: measured 0 s,
    left out of the others); each argument a list of ``[S, m]`` arrays, one per step."""
    from ..core.cost.fit import mape

    if not preds:
        return {k: [] for k in ("compute", "passthrough", "passthrough_share", "passthrough_time_share",
                                "bypassed_share")}
    p, y, c = (np.concatenate(a, axis=1) for a in (preds, meas, computes))
    S = len(p)
    ran = y > 0  # 0 s: a micro-batch the stage never ran (bypassed)
    c, t = c & ran, ~c & ran
    return {"compute": [mape(p[s][c[s]], y[s][c[s]]) for s in range(S)],
            "passthrough": [mape(p[s][t[s]], y[s][t[s]]) for s in range(S)],
            "passthrough_share": [float(t[s].mean()) for s in range(S)],
            "bypassed_share": [float((~ran[s]).mean()) for s in range(S)],
            "passthrough_time_share": [float(y[s][~c[s]].sum() / y[s].sum()) if y[s].sum() > 0 else float("nan")
                                       for s in range(S)]}


def stage_mape_floor(phis: list, meas: list, computes: list, min_repeats: int = 3) -> dict:
    """The timing-noise floor of each stage's MAPE (fractions; nan without repeats): the MAPE of
    predicting every micro-batch whose feature row occurs at least ``min_repeats`` times by the
    median measured time of its identical micro-batches (in sample: no model of the features does
    better on them), for the micro-batches the stage computes on (``compute``) and passes through
    (``passthrough``). ``phis``: the steps' ``[m, F]`` features; ``meas``/``computes``: ``[S, m]``."""
    if not phis:
        return {"compute": [], "passthrough": []}
    phi, y, c = np.vstack(phis), np.concatenate(meas, axis=1), np.concatenate(computes, axis=1)
    _, group = np.unique(np.round(phi, 6), axis=0, return_inverse=True)
    group = group.ravel()
    out = {"compute": [], "passthrough": []}
    for s in range(len(y)):
        for key, sel in (("compute", c[s] & (y[s] > 0)), ("passthrough", ~c[s] & (y[s] > 0))):
            g, v = group[sel], y[s][sel]
            order = np.argsort(g, kind="stable")
            g, v = g[order], v[order]
            starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if len(g) else np.zeros(0, np.int64)
            ends = np.r_[starts[1:], len(g)]
            errs = [np.abs(np.median(v[a:b]) - v[a:b]) / np.maximum(v[a:b], 1e-12)
                    for a, b in zip(starts, ends) if b - a >= min_repeats]
            out[key].append(float(np.concatenate(errs).mean()) if errs else float("nan"))
    return out


def vlm_stats(preds: list, meas: list, computes: list, phis: list, first: int, last: int, warmup: int) -> dict:
    """The per-stage fields of a vlm method's result from its steps' ``[S, m]`` planned and measured
    seconds, compute masks and ``[m, F]`` features: per micro-batch (pooled, and split into computing
    and pass-through micro-batches, each with its noise floor) and per step, over the first ``first``
    steps (start), the last ``last`` (end) and all; shares and floors over the steps after ``warmup``."""
    sp, sm, sc, w = preds, meas, computes, warmup
    a, b = stage_split(sp[:first], sm[:first], sc[:first]), stage_split(sp[-last:], sm[-last:], sc[-last:])
    timed = stage_split(sp[w:], sm[w:], sc[w:])
    floor = stage_mape_floor(phis[w:], sm[w:], sc[w:])
    return dict(stage_mape_start=stage_mape(sp[:first], sm[:first]), stage_mape_end=stage_mape(sp[-last:], sm[-last:]),
                stage_mape_all=stage_mape(sp, sm),
                stage_step_mape_start=stage_step_mape(sp[:first], sm[:first]),
                stage_step_mape_end=stage_step_mape(sp[-last:], sm[-last:]),
                stage_compute_mape_start=a["compute"], stage_compute_mape_end=b["compute"],
                stage_passthrough_mape_start=a["passthrough"], stage_passthrough_mape_end=b["passthrough"],
                stage_passthrough_share=timed["passthrough_share"],
                stage_passthrough_time_share=timed["passthrough_time_share"],
                stage_bypassed_share=timed["bypassed_share"],
                stage_compute_mape_floor=floor["compute"], stage_passthrough_mape_floor=floor["passthrough"],
                stage_measured_s=[float(x) for x in np.concatenate(sm, axis=1).sum(axis=1)])


def data_description(paths) -> dict:
    """Counts of the data's records by source and kind (image+text or text-only)."""
    counts: dict = {}
    for p in paths:
        for r in _jsonl(p):
            key = f"{r.get('source', 'given')}:{'image' if r.get('image') else 'text'}"
            counts[key] = counts.get(key, 0) + 1
    return counts


__all__ = ["VLM_METHODS", "VLM_SIZES", "build_vlm_data", "modality_bounds", "layout_of", "setup",
           "rows_as_sequences", "stage_observation", "stage_mape", "stage_step_mape", "stage_computes",
           "stage_split", "stage_mape_floor", "vlm_stats"]
