"""FSDP with dynabatch steps: on two gloo CPU ranks, FSDP2 (``fully_shard``) and FSDP1 models trained by
`step_backward` get the gradient of the whole global step's mean loss per target token (the same as
DDP), with the gradients reduced only after the last micro-batch; feedback leaves their times out
(every micro-batch all-gathers parameters, so the ranks run in lockstep) and says so; what cannot run
as asked is refused: the Trainer's FSDP on a CPU (accelerate would silently train with DDP) and a
model sharded beforehand under a non-FSDP Trainer. One launch: `tests/dp_feedback_workers.py`."""

import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers (Hugging Face Trainer)")
pytest.importorskip("accelerate", reason="needs accelerate")
fsdp = pytest.importorskip("torch.distributed.fsdp", reason="needs torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.4)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dp_feedback_workers as workers  # noqa: E402

WORKERS = str(Path(workers.__file__))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from dynabatch.pipeline import launch_local

    path = workers.write_data(str(tmp_path_factory.mktemp("fsdp") / "train.parquet"))
    res = launch_local(f"{WORKERS}:fsdp_cases", 2, args=(path,), idle_timeout_s=180)
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung:\n{r.stderr[-3000:]}"
        assert r.returncode == 0, f"rank {r.rank} failed:\n{r.stderr[-3000:]}"
    return [r.result for r in res]


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_an_fsdp_step_has_the_whole_steps_gradient(two_ranks, kind):
    a, b = (r[kind] for r in two_ranks)
    assert a["microbatches"] == b["microbatches"] >= 2
    assert sorted(a["samples"] + b["samples"]) == a["whole"] and not set(a["samples"]) & set(b["samples"])
    for r in (a, b):
        assert r["rel"] < 1e-10, r["rel"]
    assert a["metrics"]["loss"] == b["metrics"]["loss"] == pytest.approx((a["loss"] + b["loss"]) / 2)


def test_fsdp2_reduces_the_gradients_only_after_the_last_microbatch(two_ranks):
    for r in two_ranks:
        assert r["fsdp2"]["early"] == [False] * r["fsdp2"]["microbatches"]


@pytest.mark.parametrize("kind", ["fsdp2", "fsdp1"])
def test_feedback_under_fsdp_leaves_the_times_out_and_says_why(two_ranks, kind):
    for r in two_ranks:
        case = r[kind]
        assert case["recorded"] == 0
        assert any("FSDP-sharded" in w and "not fed to the FeedbackLoop" in w for w in case["warnings"])
        m = case["metrics"]
        assert m["tokens"] > 0 and m["microbatches"] == case["microbatches"] and m["measured_imbalance"] != m["measured_imbalance"]


def test_what_a_cpu_trainer_cannot_run_as_asked_is_refused(two_ranks):
    """accelerate ignores its FSDP plugin on a CPU (distributed type MULTI_CPU): the Trainer would train
    with DDP without saying so, and would wrap a model sharded beforehand in DDP again; DynabatchTrainer
    refuses both and says what works instead."""
    for r in two_ranks:
        assert "fully_shard and train it with dynabatch.integrations.step_backward" in (r["trainer_fsdp"] or "")
        assert "already FSDP-sharded" in (r["presharded"] or "")
