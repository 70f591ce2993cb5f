"""The pipelined training examples train for real: the loss goes down, no hang (liveness: the run is
killed only after 120 s without progress, however slow the machine).

The three runs start together in the background when the module's first test begins
(``tests/prelaunch.py``: the pipeline examples' one-thread ranks leave the 2 cores partly idle); each
test checks its own run exactly as when it runs alone. The Hugging Face example trains in its own
process with one torch thread (``OMP_NUM_THREADS=1``, as every pipeline rank): with torch's default of
a thread per core its threads spin against any other busy process on a 2-core machine (9 s alone, but
110-125 s next to one CPU hog; one thread: 13 s alone, 22 s next to the hog)."""

import os
import re
import sys
from pathlib import Path

import pytest
from liveness import run_live, tiny_models_env
from prelaunch import Prelaunch, job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LAUNCHES = Prelaunch(parallel=3)


@pytest.fixture(scope="module", autouse=True)
def _launches(request):
    yield from LAUNCHES.started(request)


def example_job(script):
    # --timeout is launch_local's liveness timeout (no rank printed a step for that long); the example's ranks
    # build dynabatch's tiny models only, so its fork server preloads no transformers (`tiny_models_env`)
    return job(script, run_live, [sys.executable, str(EXAMPLES / script), "--steps", "8", "--samples", "400",
                                  "--hidden", "64", "--batch-tokens", "4096", "--lr", "3e-3", "--seed", "0",
                                  "--timeout", "60"], idle_s=120, env=tiny_models_env(), weight=9)


# 200 samples: 5 steps of ~16k tokens, two logged losses (logging_steps=2) to compare
HF_TRAINER = job("hf_trainer.py", run_live, [sys.executable, str(EXAMPLES / "hf_trainer.py"), "", "200"], idle_s=120,
                 env={**os.environ, "OMP_NUM_THREADS": "1"}, weight=13)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["train_t5_pipeline.py", "train_gpt_pipeline.py"])
@LAUNCHES.plan(lambda script: [example_job(script)])
def test_example_trains(script):
    out = LAUNCHES.result(example_job(script))
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", out.stdout, re.M)]
    assert len(losses) == 8, out.stdout
    assert sum(losses[-2:]) / 2 < 0.9 * sum(losses[:2]) / 2, losses
    assert "MAPE" in out.stdout and "predicted" in out.stdout and "real tokens" in out.stdout


def test_examples_and_pipeline_docs_use_public_names_only():
    """No benchmark internals, no private names, no hand-built feature rows: the examples and the
    pipeline guide show the first-class loop (DataLoader(feedback=...) + loader.feedback(result))."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    texts = {p.name: p.read_text() for p in EXAMPLES.glob("*.py")}
    texts["pipeline.md"] = (docs / "pipeline.md").read_text()
    for name, text in texts.items():
        assert "dynabatch.bench" not in text, name
        imports = re.findall(r"import\s+\(([^)]*)\)", text) + \
            re.findall(r"^\s*(?:from\s+\S+\s+)?import\s+([^(\n]+)$", text, re.M)
        assert not re.search(r"\b_\w+", " ".join(imports)), (name, imports)
        assert not re.search(r"^\s*from\s+[\w.]*\._", text, re.M), name
        assert "padded_features(" not in text and "packed_features(" not in text, name
    for name in ("train_t5_pipeline.py", "pipeline.md"):
        assert "feedback=FeedbackLoop(" in texts[name].replace("feedback=feedback", "feedback=FeedbackLoop(") \
            and "loader.feedback(result)" in texts[name], name


@pytest.mark.slow
@LAUNCHES.plan(lambda: [HF_TRAINER])
def test_hf_trainer_example_trains_one_epoch():
    """The Hugging Face-style script: Trainer counts the loader's steps, one epoch, the loss falls (200 samples: 5
    steps, so the first and the last of the losses logged every 2 steps are two different ones)."""
    out = LAUNCHES.result(HF_TRAINER)
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"200 samples -> (\d+) steps", out.stdout)
    g = re.search(r"global_step (\d+), epoch ([0-9.]+), loss ([0-9.]+) -> ([0-9.]+)", out.stdout)
    assert m and g, out.stdout
    assert int(g.group(1)) == int(m.group(1)) > 1 and float(g.group(2)) == 1.0
    assert float(g.group(4)) < float(g.group(3))
