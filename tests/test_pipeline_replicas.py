"""Data x pipeline parallelism on 4 gloo ranks: 2 replicas of 2 stages of a tied tiny Llama (float64).

* The runner: each replica runs its own micro-batches, the stages all-reduce their gradients over the
  replicas and the loss is normalized by the global batch's tokens, so one step equals one replica on the
  doubled batch (both replicas' micro-batches): against the same layered model run in one process on all of
  them (`sequential_step`: the same layer arithmetic), the loss within 1e-12 relative and every gradient
  within 1e-12 of the largest (only the order in which the micro-batches' sums meet differs); against the
  Hugging Face model's own forward/backward the loss within 1e-12 and the gradients within 1e-6 (its RMSNorm
  rounds through float32 differently, as in tests/test_pipeline_hf_dist.py).
* The example: ``examples/pipeline_hf.py --stages 2 --ranks 4`` trains (each replica's loader its own share:
  `loader_runtime`) and merges a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import build, decoder_config, grad_gap  # noqa: E402
from liveness import run_live  # noqa: E402

from dynabatch.pipeline.models import MicroBatchShape  # noqa: E402

BOUNDS = [0, 3, 5]  # embedding + 2 blocks | block + head (the tied embedding on both stages)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline_hf.py"


def _shapes(replica: int) -> list[MicroBatchShape]:
    dims = [[(3, 10), (2, 13), (1, 7)], [(4, 6), (1, 15), (2, 9)]][replica]
    return [MicroBatchShape("padded", r, L, time_s=1e-3 * r * L, memory_bytes=1e3 * r * L) for r, L in dims]


def _batches(model, replica: int) -> list[dict]:
    gen = torch.Generator().manual_seed(11 + replica)
    return [model.random_batch(s, gen) for s in _shapes(replica)]


def replicas_worker(rank, world, port):
    """Rank side: one step (no optimizer: the gradients stay) of this replica's micro-batches; this stage's
    largest gradient gap against the Hugging Face model on both replicas' micro-batches, and the losses."""
    from test_pipeline_hf_dist import _reference

    from dynabatch.pipeline import PipelineRunner, init_pipeline, sequential_step
    from dynabatch.pipeline.models.hf import from_hf

    torch.set_default_dtype(torch.float64)
    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=300) as ctx:
        hf = build(decoder_config("llama", tie_word_embeddings=True), seed=1)
        ref, one = copy.deepcopy(hf), from_hf(copy.deepcopy(hf))
        model = from_hf(hf)
        runner = PipelineRunner.from_model(model, ctx, BOUNDS)
        res = runner.step(_shapes(ctx.replica), _batches(model, ctx.replica))
        both = _batches(model, 0) + _batches(model, 1)
        one_loss, one_tokens = sequential_step(one.layers, both)
        ref_loss, ref_tokens = _reference(ref, both)
        mine = range(BOUNDS[ctx.stage], BOUNDS[ctx.stage + 1])
        diff, scale = grad_gap(model, ref, mine)
        one_diff = max(float((model.layers[i].get_parameter(path).grad - one.layers[i].get_parameter(path).grad)
                             .abs().max()) for i in mine for path in model.param_keys(i))
        grads = [p.grad.flatten()[:8].tolist() for p in runner.trainable()]
        return {"stage": ctx.stage, "replica": ctx.replica, "loss": res.loss, "tokens": res.num_tokens,
                "one_loss": one_loss, "one_tokens": one_tokens, "one_diff": one_diff, "ref_loss": ref_loss,
                "ref_tokens": ref_tokens, "diff": diff, "scale": scale, "grads": grads}


def test_two_replicas_of_two_stages_equal_one_replica_on_the_doubled_batch():
    from dynabatch.pipeline import launch_local

    res = launch_local(f"{__file__}:replicas_worker", 4, idle_timeout_s=300)
    for r in res:
        assert not r.timed_out and r.returncode == 0, f"rank {r.rank}:\n{r.stderr[-3000:]}"
    out = [r.result for r in res]
    assert [(o["stage"], o["replica"]) for o in out] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for o in out:
        print(f"stage {o['stage']} replica {o['replica']}: loss {o['loss']!r} one replica {o['one_loss']!r}; largest "
              f"gradient gap {o['one_diff']:.2e} against one replica, {o['diff']:.2e} against the model's own "
              f"(largest gradient {o['scale']:.3f})")
        assert o["tokens"] == o["one_tokens"] == o["ref_tokens"] > 0, o
        assert o["loss"] == pytest.approx(o["one_loss"], rel=1e-12) == pytest.approx(o["ref_loss"], rel=1e-12), o
        assert o["scale"] > 0 and o["one_diff"] <= 1e-12 * o["scale"] and o["diff"] <= 1e-6 * o["scale"], o
    for s in (0, 1):  # the all-reduce leaves both replicas' copies of a stage with the same gradients
        assert out[s]["grads"] == out[2 + s]["grads"]


@pytest.mark.slow
def test_example_trains_two_replicas_of_two_stages(tmp_path):
    import transformers
    from test_pipeline_hf_example import LIMIT, _model_folder

    from dynabatch.datagen import text_records, write_text_shards

    data = tmp_path / "data"
    write_text_shards(data, 240, num_shards=2, seed=0)
    _model_folder(tmp_path / "model", [r["inputs"] + r["targets"] for r in text_records(240, seed=0)])
    out = tmp_path / "out"
    res = run_live([sys.executable, str(EXAMPLE), str(tmp_path / "model"), str(data), "--stages", "2", "--ranks", "4",
                    "--steps", "3", "--out", str(out), "--batch-tokens", "1024", "--max-len", "128",
                    "--memory-limit", str(LIMIT)], idle_s=240)
    assert res.returncode == 0, res.stderr[-4000:]
    lines = re.findall(r"^step (\d+) loss (\S+) tokens (\d+)", res.stdout, re.M)
    assert [int(k) for k, *_ in lines] == [0, 1, 2], res.stdout
    assert all(math.isfinite(float(loss)) and float(loss) > 0 and int(n) > 0 for _, loss, n in lines), res.stdout
    print("2 replicas x 2 stages:", [(int(k), float(x), int(n)) for k, x, n in lines])
    merged = transformers.LlamaForCausalLM.from_pretrained(out)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert (out / "dynabatch-checksums.json").is_file()
