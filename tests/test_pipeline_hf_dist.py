"""Hugging Face models through the gloo pipeline: on 2 and 3 stages, under gpipe, 1f1b and adaptive,
padded and packed, the loss and every gradient (tied ones summed over their stages with
the runner's `Ties`) equal the Hugging Face model's own forward/backward in one process (float64).

The rank-side worker (`hf_worker`) is in this file; `launch_local` runs it by path.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import bart_config, build, decoder_config, grad_gap, llava_config, t5_config  # noqa: E402

from dynabatch.pipeline import MicroBatchShape, PipelineRunner, RunnerConfig, init_pipeline, launch_local  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "adaptive"]


def _shapes(collation: str, seq2seq: bool, vision: bool = False) -> list[MicroBatchShape]:
    if vision:  # image+text and text-only
        dims = [(3, 20, 4), (2, 9, 0), (1, 12, 2), (4, 7, 0)]
        return [MicroBatchShape("padded", r, L, tiles=t, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L)
                for r, L, t in dims]
    if collation == "packed":
        dims = [(3, 9, 0, 17), (2, 8, 0, 11), (1, 6, 0, 6), (4, 5, 0, 14)]
    else:
        dims = [(3, 10, 6 * seq2seq, 0), (2, 13, 9 * seq2seq, 0), (1, 7, 4 * seq2seq, 0), (4, 6, 3 * seq2seq, 0)]
    return [MicroBatchShape(collation, r, L, T, tok, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L)
            for r, L, T, tok in dims]


def _config(family: str):
    if family == "llava":
        return llava_config()
    if family == "bart":
        return bart_config()
    return t5_config() if family == "t5" else decoder_config(family, tie_word_embeddings=True)


def hf_worker(rank, world, port, cases, schedules, bypass=False):
    """Rank side: every ``[family, bounds, collation]`` case under every schedule; per case this stage's
    largest gradient gap against the Hugging Face reference and the losses (``bypass``:
    RunnerConfig(bypass_idle_stages=True), each micro-batch's entry stage and this stage's seconds)."""
    from dynabatch.pipeline.models.hf import from_hf, hf_reference_step

    torch.set_default_dtype(torch.float64)
    ctx = init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=600, abort_after_s=60)
    out = []
    with ctx:
        for family, bounds, collation in cases:
            for schedule in schedules:
                hf = build(_config(family), seed=1)
                ref = copy.deepcopy(hf)
                model = from_hf(hf)
                config = RunnerConfig(schedule=schedule, bypass_idle_stages=bypass)
                runner = PipelineRunner.from_model(model, ctx, bounds, config)
                shapes = _shapes(collation, family in ("t5", "bart"), family == "llava")
                gen = torch.Generator().manual_seed(5)
                batches = [model.random_batch(s, gen) for s in shapes]
                res = runner.step(shapes, batches if ctx.stage in (0, world - 1) or bypass else None)
                ref_loss, ref_n = hf_reference_step(ref, batches)
                diff, scale = grad_gap(model, ref, range(bounds[ctx.stage], bounds[ctx.stage + 1]))
                out.append({"case": [family, collation, schedule], "loss": res.loss, "ref_loss": ref_loss,
                            "tokens": res.num_tokens, "ref_tokens": ref_n, "diff": diff, "scale": scale,
                            "tied_here": sorted(t.name for t in runner.ties.ties), "entry": runner.entries(shapes).tolist(),
                            "ran": (res.timing.forward_s + res.timing.backward_s).tolist(), "stage": ctx.stage})
    return out


def _run(stages, cases, bypass=False):
    res = launch_local(f"{__file__}:hf_worker", stages, args=(cases, SCHEDULES, bypass), idle_timeout_s=600)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    for r in res:
        assert len(r.result) == len(cases) * len(SCHEDULES)
        for c in r.result:
            assert c["tokens"] == c["ref_tokens"] > 0, c
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12), c
            assert c["scale"] > 0 and c["diff"] <= 1e-8 * c["scale"], c
    return [r.result for r in res]


def test_two_stages_equal_hugging_face_all_schedules():
    """Tied Llama padded and packed, Qwen3 packed, T5 (shared embedding and bias tables on both stages), BART
    on 2 gloo stages: loss and every gradient equal the Hugging Face model's own, for each schedule."""
    results = _run(2, [["llama", [0, 2, 5], "padded"], ["llama", [0, 3, 5], "packed"], ["qwen3", [0, 1, 5], "packed"],
                       ["t5", [0, 5, 8], "padded"], ["bart", [0, 2, 6], "padded"]])
    tied = {tuple(c["case"]): c["tied_here"] for c in results[0]}
    assert tied[("llama", "padded", "gpipe")] == ["model.embed_tokens.weight"]
    assert tied[("t5", "padded", "1f1b")] == ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                              "shared.weight"]


def test_three_stages_equal_hugging_face_all_schedules():
    """Mistral (sliding window) packed, tied Llama padded and T5 on 3 gloo stages, each schedule."""
    _run(3, [["mistral", [0, 2, 3, 5], "packed"], ["llama", [0, 1, 4, 5], "padded"], ["t5", [0, 2, 5, 8], "padded"]])


def test_llava_text_only_microbatches_bypass_the_vision_stage():
    """LLaVA on 2 stages cut after the projector, RunnerConfig(bypass_idle_stages=True): a text-only
    micro-batch enters at stage 1 and runs nothing on the vision stage (0 s measured there); loss and every
    gradient equal the Hugging Face model's own, for every schedule."""
    results = _run(2, [["llava", [0, 4, 8], "padded"]], bypass=True)
    for out in results:
        for c in out:
            assert c["entry"] == [0, 1, 0, 1], c
            skipped = [e > c["stage"] for e in c["entry"]]
            assert all((t == 0) == s for t, s in zip(c["ran"], skipped)), c
