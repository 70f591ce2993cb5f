"""A rank that fails during set-up (before `PipelineRunner.from_model` has finished) stops every other rank
with an error naming it, on 2 gloo ranks of a tied tiny Llama saved with ``save_pretrained``: the survivor
would otherwise sit in the rendezvous of the tied embedding's process group (`Ties.of`), which gloo cannot
interrupt. Cases: rank 1 raises in `init_pipeline`'s own creation of the pipeline's process groups; rank 1
raises after loading its stage; rank 1 reads a damaged shard (the error names the
file); rank 1 is killed (SIGKILL) or leaves with ``os._exit``; rank 0, the coordination store's host, is
killed. Each survivor must stop by itself (launch_local's liveness timeout is the hang detector, no wall
clock) with an error naming the culprit and, where it raised, its exception and traceback tail:
`PipelineAborted` where it waits for the culprit (the faults are timed to land while it waits in the tie's
group), or, when it was still busy loading, the line it prints as it leaves ``abort_after_s`` later.

The seconds from the fault to each survivor's exit are printed (``-s``), not asserted. The launches run
together (``tests/prelaunch.py``): most of each is waiting for a verdict on purpose.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prelaunch import Prelaunch, job  # noqa: E402

TIMEOUT_S = 30.0  # the liveness timeout in these runs: a silent heartbeat is a death after 10 s, before a stall
IDLE_S = 120.0  # launch_local's hang detector: a rank blocked in gloo without a verdict is killed
LAUNCHES = Prelaunch(parallel=5)
SCENARIOS = [("raise", 1), ("bad_shard", 1), ("kill", 1), ("exit", 1), ("kill", 0), ("groups", 1)]


def setup_worker(rank, world, port, folder, scenario, culprit, timeout_s):
    """Load this rank's stage of ``folder``; the culprit then misbehaves before `from_model` (``raise``,
    ``kill``, ``exit``) or in `load_stage` itself (``bad_shard``: its stage's shard is damaged), printing
    ``DYNABATCH_FAULT_AT <time.time()>`` first."""
    from dynabatch.pipeline import PipelineRunner, init_pipeline, load_stage

    def mark():
        sys.stderr.write(f"DYNABATCH_FAULT_AT {time.time():.3f}\n")
        sys.stderr.flush()

    if rank == culprit and scenario == "groups":  # fails in init_pipeline's own group creation
        import torch.distributed as dist

        def refuse(*args, **kwargs):
            mark()
            raise RuntimeError(f"no process group on rank {rank}")

        dist.new_group = refuse
    with init_pipeline(2, rank=rank, world_size=world, master_port=port, timeout_s=timeout_s,
                       abort_after_s=3.0) as ctx:
        if rank == culprit and scenario == "bad_shard":
            mark()
        part = load_stage(folder, ctx)
        if rank == culprit:
            if scenario != "bad_shard":
                _until_waiting_in_the_tie(ctx, 1 - rank)
            mark()
            if scenario == "raise":
                raise ValueError(f"boom in the set-up of rank {rank}")
            if scenario == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario == "exit":
                os._exit(3)
        PipelineRunner.from_model(part.model, ctx, part.bounds)
    return {"finished": True}


def _until_waiting_in_the_tie(ctx, other: int) -> None:
    """Return once rank ``other``'s heartbeat says it waits in the creation of the tied embedding's process
    group (so the fault lands while it is blocked there; a rank that never gets there hangs this loop, which
    launch_local's liveness timeout ends)."""
    import json

    from dynabatch.pipeline.runtime.verdict import LIVE_PREFIX

    key = f"{LIVE_PREFIX}{other}"
    while True:
        info = json.loads(ctx.monitor.store.get(key)) if ctx.monitor.store.check([key]) else {}
        if info.get("k") == "wait" and "tied parameters" in info.get("t", ""):
            return
        time.sleep(0.05)


def _folder(root: Path, scenario: str) -> Path:
    """A tied tiny Llama, sharded so that stage 1's decoder layer is in a shard of its own; ``bad_shard``
    overwrites the middle of that shard's header (the same size)."""
    import json

    from hf_tiny import build, decoder_config

    folder = root / scenario
    model = build(decoder_config("llama", tie_word_embeddings=True, num_hidden_layers=2), dtype=__import__(
        "torch").float32)
    model.save_pretrained(folder, max_shard_size="6KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index["model.layers.1.mlp.down_proj.weight"]
    assert shard.name != index["model.embed_tokens.weight"]  # stage 0 never reads it
    assert not any(index[k] == shard.name for k in index if k.startswith(("model.layers.0.", "model.embed")))
    if scenario == "bad_shard":
        raw = bytearray(shard.read_bytes())
        raw[10:40] = b"\xff" * 30  # inside the JSON header
        shard.write_bytes(bytes(raw))
    return folder


def _launch(folder, scenario, culprit):
    from dynabatch.pipeline import launch_local

    t0 = time.time()
    res = launch_local(f"{__file__}:setup_worker", 2, args=(str(folder), scenario, culprit, TIMEOUT_S),
                       idle_timeout_s=IDLE_S)
    return t0, res


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The model folders, made here, one after the other (transformers' lazy imports are not thread-safe)."""
    base = tmp_path_factory.mktemp("setup_failure")
    for scenario in ("raise", "bad_shard"):
        _folder(base, scenario)
    return base


@pytest.fixture(scope="module", autouse=True)
def _launches(request, root):
    yield from LAUNCHES.started(request, root=root)


def setup_job(root, scenario, culprit):
    folder = root / ("bad_shard" if scenario == "bad_shard" else "raise")
    return job((scenario, culprit), _launch, folder, scenario, culprit, weight=1.0)


def _result(root, scenario, culprit):
    t0, res = LAUNCHES.result(setup_job(root, scenario, culprit))
    marks = re.findall(r"DYNABATCH_FAULT_AT ([0-9.]+)", res[culprit].stderr)
    assert marks, f"the fault did not happen on rank {culprit}:\n{res[culprit].stderr[-3000:]}"
    fault_at = float(marks[0])
    for r in res:
        assert not r.timed_out, f"rank {r.rank} hung ({scenario}):\n{r.stderr[-3000:]}"
        assert r.returncode != 0, f"rank {r.rank} exited 0 ({scenario}):\n{r.stderr[-3000:]}"
    survivor = res[1 - culprit]
    print(f"{scenario} culprit={culprit}: rank {survivor.rank} stopped {t0 + survivor.wall_s - fault_at:.1f} s "
          f"after the fault began, {survivor.wall_s - res[culprit].wall_s:.1f} s after rank {culprit} ended")
    err = survivor.stderr
    assert "PipelineAborted: " in err or "aborting: still blocked" in err, err[-3000:]
    # a verdict naming a rank, not a raw transport error (which it may quote)
    assert re.match(r"(PipelineAborted: |aborting: still blocked [^:]*: )rank \d \(stage", _aborted(err)), err[-3000:]
    return res, err


def _aborted(err: str) -> str:
    """The survivor's final message: its PipelineAborted, or the line it printed when, still busy in set-up
    ``abort_after_s`` after the failure, it left with ``os._exit(1)``."""
    at = max(err.rfind("PipelineAborted: "), err.rfind("aborting: still blocked"))
    return err[at:]


@LAUNCHES.plan(lambda root: [setup_job(root, "raise", 1)])
def test_rank_raising_in_set_up_stops_its_peer(root):
    res, err = _result(root, "raise", 1)
    assert "ValueError: boom in the set-up of rank 1" in res[1].stderr
    msg = _aborted(err)
    assert "rank 1 (stage 1, replica 0) failed: ValueError: boom in the set-up of rank 1" in msg, msg
    assert "its traceback" in msg and "in setup_worker" in msg and "raise ValueError" in msg, msg
    assert "tied.py" in err and "PipelineAborted: " in err, err[-3000:]  # raised where it waited: the tie's group


@LAUNCHES.plan(lambda root: [setup_job(root, "bad_shard", 1)])
def test_damaged_shard_on_one_rank_names_the_file_on_both(root):
    res, err = _result(root, "bad_shard", 1)
    msg = _aborted(err)
    assert "rank 1 (stage 1, replica 0) failed:" in msg and "model-0000" in msg and ".safetensors" in msg, msg
    assert "header" in msg, msg


@pytest.mark.parametrize("scenario", ["kill", "exit"])
@LAUNCHES.plan(lambda root, scenario: [setup_job(root, scenario, 1)])
def test_rank_dying_in_set_up_stops_its_peer(root, scenario):
    res, err = _result(root, scenario, 1)
    assert res[1].returncode == (-9 if scenario == "kill" else 3)
    msg = _aborted(err)
    assert "rank 1 (stage 1, replica 0) died" in msg and "detected by rank 0" in msg, msg
    assert "tied.py" in err and "PipelineAborted: " in err, err[-3000:]


@LAUNCHES.plan(lambda root: [setup_job(root, "kill", 0)])
def test_store_host_dying_in_set_up_stops_the_others(root):
    res, err = _result(root, "kill", 0)
    assert res[0].returncode == -9
    msg = _aborted(err)
    assert "rank 0 (stage 0, replica 0) died" in msg and "coordination store" in msg, msg
    assert "tied.py" in err and "PipelineAborted: " in err, err[-3000:]


@LAUNCHES.plan(lambda root: [setup_job(root, "groups", 1)])
def test_rank_failing_in_init_pipeline_groups_stops_its_peer(root):
    """The pipeline's own process groups (`init_pipeline`) are set-up collectives too: rank 1 failing there
    stops rank 0, which waits in its group creation, with rank 1's error."""
    res, err = _result(root, "groups", 1)
    assert "RuntimeError: no process group on rank 1" in res[1].stderr
    msg = _aborted(err)
    assert "rank 1 (stage 1, replica 0) failed: RuntimeError: no process group on rank 1" in msg, msg
