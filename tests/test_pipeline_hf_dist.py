"""Hugging Face models through the gloo pipeline: on 2 and 3 stages, under gpipe, 1f1b and adaptive,
padded and packed (decoders, and T5 and BART with their targets in a second packed row), the loss and
every gradient (tied ones summed over their stages with the runner's `Ties`) equal the Hugging Face
model's own forward/backward in one process with the loss written in the test (`_reference`: the plain
model's logits, `conformance_ref.summed_ce`, over the step's target tokens; float64; a packed micro-batch
against its samples one by one, or padded for an encoder-decoder), and every stage sends exactly the bytes
the plan's boundary specs predict. This is the pipeline half of the conformance matrix
(tests/test_conformance.py holds the in-process routes).

The rank-side worker (`hf_worker`) is in this file; `launch_local` runs it by path. Every case of one
stage count runs in one launch (`Prelaunch` parts), the two launches side by side.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import (bart_config, build, decoder_config, grad_gap, llava_config, seq2seq_microbatches,  # noqa: E402
                     t5_config)
from prelaunch import Prelaunch, part  # noqa: E402

from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402
from dynabatch.pipeline import PipelineRunner, RunnerConfig, batch_shapes, init_pipeline, launch_local  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "adaptive"]
SEQ2SEQ = ("t5", "bart")
PACKED_ROWS = [3, 2, 1, 4]  # samples per packed encoder-decoder micro-batch
LAUNCHES = Prelaunch(parallel=2)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


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


def _microbatches(family: str, collation: str, model):
    """(shapes, the micro-batches the pipeline runs, the Hugging Face reference's micro-batches). A packed
    encoder-decoder micro-batch is collated by the DataLoader's packed collator and its shape read off it
    (`batch_shapes`, as a training loop does); the reference runs the same samples padded (the Hugging
    Face model's own forward has no packed encoder-decoder path)."""
    if family in SEQ2SEQ and collation == "packed":
        packed, padded = seq2seq_microbatches(_config(family), PACKED_ROWS, seed=7)
        for b in packed:  # the plan's predictions, as the DataLoader attaches them
            n = b["input_ids"].shape[1]
            b["predicted_time_s"], b["predicted_memory_bytes"] = 1e-4 * n, 1e2 * n
        return batch_shapes(packed), packed, padded
    shapes = _shapes(collation, family in SEQ2SEQ, family == "llava")
    gen = torch.Generator().manual_seed(5)
    batches = [model.random_batch(s, gen) for s in shapes]
    return shapes, batches, batches


def _sent_and_predicted(model, shapes, events, bounds, stage, world) -> tuple[dict, dict]:
    """Bytes this stage sent per message (``act F3 0->1``: recorded tensors) and the bytes the plan's boundary
    specs predict for the same messages (activations after this stage's last layer, gradients of the state
    before its first)."""
    sent: dict = {}
    for e in events:
        if e.side == "send" and e.label.split()[0] in ("act", "grad"):  # not the plan check or shape headers
            n = sum(torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size()
                    for s, d in zip(e.shapes, e.dtypes))
            sent[e.label] = sent.get(e.label, 0) + n
    predicted = {}
    for j, shape in enumerate(shapes):
        if stage < world - 1:
            out = model.boundary(shape, bounds[stage + 1] - 1)
            predicted[f"act F{j} {stage}->{stage + 1}"] = sum(s.nbytes for s in out)
        if stage > 0:
            into = model.boundary(shape, bounds[stage] - 1)
            predicted[f"grad B{j} {stage}->{stage - 1}"] = sum(s.nbytes for s in into if s.requires_grad)
    return sent, predicted


def _reference(hf, batches) -> tuple[float, int]:
    """The plain model's forward on each micro-batch (as the model takes it: padded rows, a packed
    encoder-decoder's samples padded), the loss written here (`conformance_ref.summed_ce`: summed token
    cross-entropy, shifted for causal LMs) over the step's target tokens; the gradients left in ``hf``."""
    from conformance_ref import summed_ce

    seq2seq = bool(hf.config.is_encoder_decoder)
    hf.zero_grad(set_to_none=True)
    parts = []
    for b in batches:
        if "cu_seqlens" in b:  # a packed decoder micro-batch: every sample alone
            cu = b["cu_seqlens"].tolist()
            parts += [summed_ce(hf(input_ids=b["input_ids"][:, i:j], use_cache=False).logits, b["labels"][:, i:j],
                                shift=True) for i, j in zip(cu[:-1], cu[1:])]
            continue
        inputs = {k: b[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
                  if k in b}
        if "pixel_values" in b and int(b["image_tiles"].sum()):
            inputs["pixel_values"] = b["pixel_values"]
        parts.append(summed_ce(hf(**inputs, use_cache=False).logits, b["labels"], shift=not seq2seq))
    n = sum(k for _, k in parts)
    (sum(s for s, _ in parts) / n).backward()
    return float(sum(float(s.detach()) for s, _ in parts) / n), n


def hf_worker(rank, world, port, cases, schedules):
    """Rank side: every ``[family, bounds, collation, bypass]`` case under every schedule; per case this stage's
    largest gradient gap against the Hugging Face reference, the losses, the bytes sent and predicted per
    message, and (``bypass``: RunnerConfig(bypass_idle_stages=True)) each micro-batch's entry stage and this
    stage's seconds."""
    from dynabatch.pipeline.models.hf import from_hf

    torch.set_default_dtype(torch.float64)
    ctx = init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=600, abort_after_s=60)
    out = []
    with ctx:
        for family, bounds, collation, bypass in cases:
            # one model and one reference per case, shared by its schedules: a step without an optimizer leaves
            # the weights as they were, and each runner's step starts from no gradients (`start_program` sets
            # them to None), so every schedule is compared with the same fresh reference gradients; the
            # reference runs once (it does not depend on the schedule)
            hf = build(_config(family), seed=1)
            ref = copy.deepcopy(hf)
            model = from_hf(hf)
            shapes, batches, ref_batches = _microbatches(family, collation, model)
            ref_loss, ref_n = _reference(ref, ref_batches)
            for schedule in schedules:
                config = RunnerConfig(schedule=schedule, bypass_idle_stages=bypass)
                events = []
                runner = PipelineRunner.from_model(model, ctx, list(bounds), config, recorder=events.append)
                res = runner.step(shapes, batches if ctx.stage in (0, world - 1) or bypass else None)
                diff, scale = grad_gap(model, ref, range(bounds[ctx.stage], bounds[ctx.stage + 1]))
                sent, predicted = _sent_and_predicted(model, shapes, events, bounds, ctx.stage, world)
                out.append({"case": [family, collation, schedule], "loss": res.loss, "ref_loss": ref_loss,
                            "tokens": res.num_tokens, "ref_tokens": ref_n, "diff": diff, "scale": scale,
                            "tied_here": sorted(t.name for t in runner.ties.ties),
                            "entry": runner.entries(shapes).tolist(),
                            "ran": (res.timing.forward_s + res.timing.backward_s).tolist(), "stage": ctx.stage,
                            "sent": sent, "predicted": predicted})
    return out


def _launch(cases):
    """One launch of ``cases`` (all of one stage count): per case, every rank's results (one per schedule),
    checked: loss and tokens equal the reference, every gradient within 1e-6 of the largest."""
    stages = len(cases[0][1]) - 1
    res = launch_local(f"{__file__}:hf_worker", stages, args=(list(cases), SCHEDULES), idle_timeout_s=600)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    for r in res:
        assert len(r.result) == len(cases) * len(SCHEDULES)
        for c in r.result:
            assert c["tokens"] == c["ref_tokens"] > 0, c
            assert c["loss"] == pytest.approx(c["ref_loss"], rel=1e-12), c
            # the reference scales the loss before backward, the runner its gradients after; RMSNorms compute in
            # float32 even in a float64 model, so the two orders round differently there (measured <= 1e-7)
            assert c["scale"] > 0 and c["diff"] <= 1e-6 * c["scale"], c
    n = len(SCHEDULES)
    return [[r.result[k * n:(k + 1) * n] for r in res] for k in range(len(cases))]


def case(family: str, bounds, collation: str = "padded", bypass: bool = False):
    """One case of the launch of its stage count."""
    return part(("hf", len(bounds) - 1), (family, tuple(bounds), collation, bypass), _launch, weight=5.0)


TWO = [case("llama", [0, 2, 5]), case("llama", [0, 3, 5], "packed"), case("qwen3", [0, 1, 5], "packed"),
       case("t5", [0, 5, 8]), case("bart", [0, 2, 6]), case("gemma2", [0, 3, 5]), case("qwen2", [0, 2, 5], "packed")]
THREE = [case("mistral", [0, 2, 3, 5], "packed"), case("llama", [0, 1, 4, 5]), case("t5", [0, 2, 5, 8]),
         case("phi3", [0, 2, 4, 5], "packed"), case("gemma", [0, 1, 3, 5])]
PACKED_SEQ2SEQ = [case("t5", [0, 3, 8], "packed"), case("bart", [0, 3, 6], "packed"),
                  case("t5", [0, 2, 5, 8], "packed"), case("bart", [0, 2, 4, 6], "packed")]
LLAVA = case("llava", [0, 4, 8], bypass=True)


def _results(cases) -> list:
    return [LAUNCHES.result(c) for c in cases]


def _check_bytes(results) -> None:
    for per_rank in results:
        for out in per_rank:
            for c in out:
                assert c["sent"] == c["predicted"] and c["sent"], c["case"]


@LAUNCHES.plan(lambda: TWO)
def test_two_stages_equal_hugging_face_all_schedules():
    """Tied Llama padded and packed, Qwen3 packed, T5 (shared embedding and bias tables on both stages), BART,
    tied Gemma2 (eager), Qwen2 packed (sliding window) on 2 gloo stages: loss and every gradient equal the Hugging Face model's own, for each schedule; each
    stage sends the bytes its boundary specs predict."""
    results = _results(TWO)
    _check_bytes(results)
    tied = {tuple(c["case"]): c["tied_here"] for per_rank in results for c in per_rank[0]}
    assert tied[("llama", "padded", "gpipe")] == ["model.embed_tokens.weight"]
    assert tied[("t5", "padded", "1f1b")] == ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                                              "shared.weight"]


@LAUNCHES.plan(lambda: THREE)
def test_three_stages_equal_hugging_face_all_schedules():
    """Mistral (sliding window) packed, tied Llama padded, T5, Phi-3 packed and Gemma on 3 gloo stages, each
    schedule."""
    _check_bytes(_results(THREE))


@LAUNCHES.plan(lambda: PACKED_SEQ2SEQ)
def test_packed_t5_and_bart_on_two_and_three_stages_equal_hugging_face():
    """T5 and BART packed micro-batches (the DataLoader's packed collation: inputs in one row, targets in
    another) on 2 and 3 gloo stages, each schedule: loss and every gradient equal the Hugging Face model's
    own on the same samples padded; every transfer is the packed state's planned bytes, the hidden states of
    both rows ([1, N, H] and [1, Nt, H] float64) and the two cu_seqlens ([rows + 1] int32): nothing quadratic."""
    results = _results(PACKED_SEQ2SEQ)
    _check_bytes(results)
    for case_results in results:
        for out in case_results:
            for c in out:
                _, packed, _ = _microbatches(c["case"][0], "packed", None)
                for j, b in enumerate(packed):
                    n, nt, rows = b["input_ids"].shape[1], b["decoder_input_ids"].shape[1], len(b["cu_seqlens"]) - 1
                    want = (n + nt) * 16 * 8 + 2 * (rows + 1) * 4
                    for label, got in c["sent"].items():
                        if label.startswith(f"act F{j} "):
                            assert got == want, (c["case"], label, got, want)
                        elif label.startswith(f"grad B{j} "):
                            assert got == (n + nt) * 16 * 8, (c["case"], label, got)


@LAUNCHES.plan(lambda: [LLAVA])
def test_llava_text_only_microbatches_bypass_the_vision_stage():
    """LLaVA on 2 stages cut after the projector, RunnerConfig(bypass_idle_stages=True): a text-only
    micro-batch enters at stage 1 and runs nothing on the vision stage (0 s measured there); loss and every
    gradient equal the Hugging Face model's own, for every schedule."""
    for out in LAUNCHES.result(LLAVA):
        for c in out:
            assert c["entry"] == [0, 1, 0, 1], c
            skipped = [e > c["stage"] for e in c["entry"]]
            assert all((t == 0) == s for t, s in zip(c["ran"], skipped)), c
