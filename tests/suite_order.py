"""The order the suite hands its files to pytest-xdist's workers: the longest first.

With ``--dist loadfile`` a file is one unit of work and a worker asks for the next file when its
queue runs low, so the run ends when the last long file ends. pytest-xdist by default hands out the
files with the most tests first, which put the long multi-process files (a few tests each) at the
end: one worker ran them alone for minutes while the other sat idle. Handing out the longest files
first lets the short ones fill the gaps at the end (longest-processing-time-first).

`SECONDS` is each long file's measured time (``python -m pytest -n 2 --dist loadfile --durations=0``,
summed per file; seconds on a 2-core machine, only their order matters). A file not named here is
short (under ~8 s) and keeps its place after the long ones. A stale figure costs only balance,
never a result.

The two workers run neighbouring files of this order side by side, so two files that mostly wait on
purpose (`WAITING`) are kept apart: side by side they left both cores idle (machine-wide 0.4-0.6 of 2
cores busy over their ~15 s, measured), beside a file that computes their waits cost nothing.
"""

from __future__ import annotations

import os

SECONDS: dict[str, int] = {
    "test_loader_start_methods.py": 158,
    "test_bench_train.py": 106,
    "test_pipeline_dist.py": 74,
    "test_hf_trainer.py": 57,
    "test_conformance.py": 52,
    "test_schedule_ops.py": 43,
    "test_bench_load.py": 40,
    "test_pipeline_vlm.py": 39,
    "test_multitask_run.py": 39,
    "test_pipeline_flushfree.py": 37,
    "test_multimodel.py": 37,
    "test_liveness.py": 37,
    "test_feedback_stages.py": 34,
    "test_launch_start.py": 33,
    "test_loader_processes.py": 30,
    "test_bench_train_hf.py": 26,
    "test_examples_train.py": 25,
    "test_pipeline_hf_techniques.py": 24,
    "test_offline_ray.py": 23,
    "test_inspect_plan.py": 21,
    "test_bench_multimodel.py": 18,
    "test_multitask_run_docs.py": 18,
    "test_trainer_feedback.py": 18,
    "test_setup_failure.py": 18,
    "test_loaders_remote.py": 16,
    "test_pipeline_hf.py": 15,
    "test_pipeline_schedule.py": 15,
    "test_trainer_fsdp.py": 15,
    "test_pipeline_replicas.py": 14,
    "test_pipeline_exit.py": 13,
    "test_recompute.py": 13,
    "test_kernels_reference.py": 12,
    "test_pipeline_hf_dist.py": 11,
    "test_pipeline_docs.py": 11,
    "test_bounds.py": 10,
    "test_readme.py": 10,
    "test_pipeline_tied.py": 10,
    "test_pipeline_hf_example.py": 9,
    "test_vlm_placeholders.py": 9,
    "test_plan.py": 9,
    "test_launch_orphans.py": 8,
    "test_offline.py": 8,
}


#: files whose time is mostly deliberate waiting: sleeps that follow the cost model a test sets
#: (test_trainer_feedback), a dead peer detected only after its heartbeat's silence (test_setup_failure)
WAITING = frozenset({"test_trainer_feedback.py", "test_setup_failure.py"})


def file_seconds(path: str) -> int:
    """The measured seconds of the test file at ``path`` (0: a short file)."""
    return SECONDS.get(os.path.basename(path), 0)


def longest_first(items: list) -> list:
    """``items`` (pytest items) with the long files' items first, longest file first (a stable sort, so
    the tests of a file and the short files keep their collection order), except that a `WAITING` file
    that would follow another waits for the next file that is not one."""
    by_file: dict[str, list] = {}
    for item in sorted(items, key=lambda item: -file_seconds(str(item.fspath))):
        by_file.setdefault(str(item.fspath), []).append(item)
    order, held = [], []
    for path in by_file:
        waiting = os.path.basename(path) in WAITING
        if waiting and order and os.path.basename(order[-1]) in WAITING:
            held.append(path)
            continue
        order.append(path)
        if not waiting and held:
            order.append(held.pop(0))
    return [item for path in order + held for item in by_file[path]]
