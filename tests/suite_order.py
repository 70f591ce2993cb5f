"""The order the suite hands its files to pytest-xdist's workers: the longest first.

With ``--dist loadfile`` a file is one unit of work and a worker asks for the next file when its
queue runs low, so the run ends when the last long file ends. pytest-xdist by default hands out the
files with the most tests first, which put the long multi-process files (a few tests each) at the
end: one worker ran them alone for minutes while the other sat idle. Handing out the longest files
first lets the short ones fill the gaps at the end (longest-processing-time-first).

`SECONDS` is each long file's measured time (each test's set-up to teardown, summed per file, in a fresh
clone's ``python -m pytest -n 2 --dist loadfile`` run; seconds on a 2-core machine, only their order matters). A file not named here is
short (under ~8 s) and keeps its place after the long ones. A stale figure costs only balance,
never a result.

The two workers run neighbouring files of this order side by side, so two files that leave a core idle
(`WAITING`) are kept apart: side by side they left both cores idle (machine-wide 0.4-0.6 of 2 cores busy
over their ~15 s, measured; 1.0-1.2 for a waiting file beside the one-thread S3 file), beside a file that
computes their waits cost nothing.
"""

from __future__ import annotations

import os

SECONDS: dict[str, int] = {
    "test_bench_train.py": 106,
    "test_loader_start_methods.py": 66,
    "test_pipeline_dist.py": 54,
    "test_offline.py": 45,
    "test_launch_start.py": 39,
    "test_examples_train.py": 36,
    "test_pipeline_exit.py": 36,
    "test_loader_processes.py": 33,
    "test_pipeline_flushfree.py": 30,
    "test_offline_ray.py": 30,
    "test_liveness.py": 26,
    "test_readme.py": 26,
    "test_multimodel.py": 24,
    "test_pipeline_replicas.py": 22,
    "test_feedback_stages.py": 21,
    "test_pipeline_hf_example.py": 19,
    "test_pipeline_faults.py": 18,
    "test_launch_orphans.py": 18,
    "test_trainer_feedback.py": 16,
    "test_bench_gpu.py": 16,
    "test_multitask_run.py": 14,
    "test_setup_failure.py": 13,
    "test_loaders_remote.py": 13,
    "test_pipeline_hf_dist.py": 12,
    "test_pipeline_schedules_dist.py": 11,
    "test_bench_multimodel.py": 10,
    "test_feedback.py": 10,
    "test_conformance.py": 9,
    "test_tokenization_objects.py": 9,
    "test_dataloader.py": 8,
    "test_hf_trainer.py": 8,
    "test_cli.py": 8,
}


#: files that keep at most about one core busy: deliberate waits (sleeps that follow the cost model a test
#: sets in test_trainer_feedback, a dead peer detected only after its heartbeat's silence in
#: test_setup_failure, a stalled rank's detection in test_pipeline_faults) or one thread's work (the S3
#: server and its clients in one process, test_loaders_remote: 0.9-1.1 of 2 cores beside a waiting file)
WAITING = frozenset({"test_trainer_feedback.py", "test_setup_failure.py", "test_pipeline_faults.py",
                     "test_loaders_remote.py"})


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
