"""Tied Hugging Face models trained for real on 2 gloo stages through the adapters (`from_hf`) against one
process training the plain Hugging Face model with the same optimizer (AdamW, 3 steps, float32).

* Llama with ``tie_word_embeddings=True`` (``lm_head.weight`` is ``embed_tokens.weight``: the embedding on
  stage 0, the head on stage 1), **one micro-batch per step**: every parameter after every step and every
  loss **bit-identical** (``torch.equal``). The one-process gradient of the tied weight is the sum of its
  two uses' gradients; the runtime all-reduces each stage's part, and a sum of two floats does not depend
  on their order; the scaling by 1 / tokens is the runner's (a multiplication by the reciprocal).
* T5 (``shared`` in the encoder and decoder embeddings and the head), one micro-batch per step, **cut
  between the encoder and the decoder**: the first step's loss and every parameter but ``shared.weight``
  **bit-identical** (each stack's bias is computed once on the stage holding the stack and its blocks'
  gradients are summed in ``[1, heads, L, L]`` bias space before one table backward, as Hugging Face
  does); ``shared.weight`` sums three uses in another order than one process (not the same arithmetic by
  construction): within 1e-6 (relative, norm), as is everything after 3 steps.
* T5 **cut inside the decoder** (its bias table on both stages): after the first step everything is
  bit-identical **except the decoder's bias table**. Each stage computes that bias from its copy of the
  table (so nothing quadratic crosses a link, issue 24 item 3), and the two stages' table gradients are
  summed, where Hugging Face sums the blocks' bias gradients before one table backward: the same sum
  in another order. Bit identity would need the quadratic bias gradient sent between stages. From the
  second step on the last-bit difference reaches the other weights: within 1e-6 (relative, norm).
* **Three micro-batches per step** (both models): one process accumulates ``(h0 + e0) + (h1 + e1) + ...``
  (every use, micro-batch by micro-batch), two stages ``(e0 + e1 + ...) + (h0 + h1 + ...)`` (each stage
  over the step, then the all-reduce); matching that order would take an all-reduce per micro-batch.
  Every parameter within ``RTOL_MANY`` (relative, norm) after 3 steps, the losses within 1e-5.

One launch runs every case (process launches dominate the suite's time); the worker is in this file.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import build, decoder_config, t5_config  # noqa: E402

from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402
from dynabatch.pipeline import PipelineRunner, RunnerConfig, init_pipeline, launch_local  # noqa: E402

STEPS = 3
RTOL_MANY = 1e-5  # several micro-batches per step: relative (norm) gap of any parameter (measured 1.2e-6)
# (family, bounds, micro-batches per step): Llama = [embedding, 3 decoder layers, head]; T5 = [embedding,
# 2 encoder blocks, encoder end, 3 decoder blocks, head], cut between the stacks ([0, 4, 8]) or inside the
# decoder ([0, 5, 8]: its bias table spans both stages)
CASES = [("llama", [0, 2, 5], 1), ("t5", [0, 4, 8], 1), ("t5", [0, 5, 8], 1), ("llama", [0, 3, 5], 3),
         ("t5", [0, 4, 8], 3)]


def _reference_step(hf, optimizer, batches) -> float:
    """One process: the plain model's own forward/backward per micro-batch, gradients times 1 / tokens
    (`hf_reference_step`, scaling as the runner does), the optimizer step."""
    from dynabatch.pipeline.models.hf import hf_reference_step  # noqa: E402

    loss, _ = hf_reference_step(hf, batches)
    optimizer.step()
    return loss


def tied_worker(rank, world, port, cases):
    """Rank side: per case, train the layered model on the pipeline and a copy of the plain model in this
    process, comparing this stage's parameters after every step (`_compare`) and the losses."""
    from dynabatch.pipeline.models.hf import from_hf

    torch.set_num_threads(1)
    out = []
    with init_pipeline(world, rank=rank, world_size=world, master_port=port, timeout_s=600, abort_after_s=120) as ctx:
        for family, bounds, micro in cases:
            config = t5_config() if family == "t5" else decoder_config("llama", tie_word_embeddings=True)
            hf = build(config, seed=3, dtype=torch.float32)
            ref = copy.deepcopy(hf)
            model = from_hf(hf)
            runner = PipelineRunner.from_model(model, ctx, bounds, RunnerConfig(schedule="1f1b"))
            opt = torch.optim.AdamW(runner.parameters(), lr=1e-2, foreach=False)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
            gen = torch.Generator().manual_seed(7)
            mine = range(bounds[ctx.stage], bounds[ctx.stage + 1])
            steps = []
            for _ in range(STEPS):
                if family == "t5":
                    shapes = [MicroBatchShape("padded", 2 + k, 9 - k, 5 + k) for k in range(micro)]
                else:
                    shapes = [MicroBatchShape("padded", 2 + k, 11 - k) for k in range(micro)]
                batches = [model.random_batch(s, gen) for s in shapes]
                res = runner.step(shapes, batches, optimizer=opt)
                ref_loss = _reference_step(ref, ref_opt, batches)
                steps.append({"loss": res.loss, "ref_loss": ref_loss, **_compare(model, ref, mine)})
            out.append({"case": [family, bounds[1], micro], "stage": ctx.stage, "steps": steps,
                        "tied": sorted(t.name for t in runner.ties.ties)})
    return out


def _compare(model, ref, layers) -> dict:
    """This stage's parameters against the reference's, by state-dict name: the total, the names that are
    not bit-identical, the largest relative gap ||p - q|| / ||q|| of a parameter."""
    named = dict(ref.named_parameters())
    seen, differ, gap = set(), [], 0.0
    for i in layers:
        for path, key in model.param_keys(i).items():
            p = model.layers[i].get_parameter(path)
            if id(p) in seen:
                continue
            seen.add(id(p))
            q = named[key]
            if not torch.equal(p, q):
                differ.append(key)
                gap = max(gap, float((p - q).norm() / q.norm()))
    return {"total": len(seen), "differ": sorted(differ), "gap": gap}


@functools.lru_cache(maxsize=1)
def _results():
    res = launch_local(f"{__file__}:tied_worker", 2, args=(CASES,), idle_timeout_s=600)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [c for r in res for c in r.result]


def _of(family, cut, micro):
    return [c for c in _results() if c["case"] == [family, cut, micro]]


def test_tied_llama_one_microbatch_bit_identical_to_one_process():
    """Every parameter of both stages, after every step, and every step's loss: bit for bit."""
    _bit_identical(_of("llama", 2, 1), ["model.embed_tokens.weight"])


def test_tied_t5_cut_between_the_stacks_equal_to_one_process():
    """T5 on 2 stages, the encoder on one and the decoder on the other: the shared embedding (encoder and
    decoder embedding on stage 0, head on stage 1) and both stacks' bias tables (each computed once on its
    stage). The first step's loss and every parameter but ``shared.weight`` are bit-identical (the same ops
    in the same order). ``shared.weight``'s gradient is a sum of three uses: one process accumulates them in
    its backward order, the pipeline sums stage 0's two then all-reduces with the head's; a token in both
    the inputs and the targets makes that a three-term sum in another order, so its bits depend on the
    data and the CPU (they matched on one machine, not on another): within 1e-6 (relative, norm) after every
    step, as is every other parameter once that difference has reached it, and the losses within 1e-6."""
    cases = _of("t5", 4, 1)
    assert sorted(c["stage"] for c in cases) == [0, 1]
    for c in cases:
        assert c["tied"] == ["shared.weight"], c
        first = c["steps"][0]
        assert first["total"] > 0 and set(first["differ"]) <= {"shared.weight"}, (c["stage"], first)
        assert first["loss"] == first["ref_loss"], first
        for step in c["steps"]:
            assert step["gap"] <= 1e-6, (c["stage"], step)
            assert abs(step["loss"] - step["ref_loss"]) <= 1e-6 * abs(step["ref_loss"]), (c["stage"], step)


def _bit_identical(cases, tied):
    assert sorted(c["stage"] for c in cases) == [0, 1]
    for c in cases:
        assert c["tied"] == tied, c
        for step in c["steps"]:
            assert step["total"] > 0 and step["differ"] == [], (c["stage"], step)
            assert step["loss"] == step["ref_loss"], (c["stage"], step)


def test_tied_t5_cut_inside_a_stack_equal_to_one_process_but_that_bias_table():
    """T5 cut inside the decoder: the shared embedding and the encoder's bias table end the first step
    bit-identical, as does every other parameter but the decoder's bias table, whose gradient Hugging Face
    sums in [1, heads, L, L] bias space before one table backward while each stage computes the bias from
    its copy (nothing quadratic crosses a link) and the table gradients are summed: the same sum in
    another order. From the second step on the difference reaches the other weights; after 3 AdamW steps
    every parameter is within 1e-6 (relative, norm; measured 4e-8) and the losses within 1e-6."""
    cases = _of("t5", 5, 1)
    table = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert sorted(c["stage"] for c in cases) == [0, 1]
    for c in cases:
        assert c["tied"] == [table, "shared.weight"], c
        first = c["steps"][0]
        assert first["total"] > 0 and set(first["differ"]) <= {table}, (c["stage"], first)
        assert first["loss"] == first["ref_loss"], first
        for step in c["steps"]:
            assert step["gap"] <= 1e-6, (c["stage"], step)
            assert abs(step["loss"] - step["ref_loss"]) <= 1e-6 * abs(step["ref_loss"]), (c["stage"], step)


def test_tied_llama_and_t5_three_microbatches_close_to_one_process():
    """Three micro-batches per step: the tied gradient's sums run in another order (module doc); every
    parameter within RTOL_MANY (relative, norm) after 3 AdamW steps, the losses within 1e-5."""
    for family, cut in (("llama", 3), ("t5", 4)):
        cases = _of(family, cut, 3)
        assert sorted(c["stage"] for c in cases) == [0, 1]
        for c in cases:
            for step in c["steps"]:
                assert step["total"] > 0 and step["gap"] <= RTOL_MANY, (c["stage"], step)
                assert abs(step["loss"] - step["ref_loss"]) <= 1e-5 * abs(step["ref_loss"]), (c["stage"], step)
