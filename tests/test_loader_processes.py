"""The loader's child processes (DataLoader workers, plan processes): never forked while numba
compiles, and never left behind when the training process is SIGKILLed.

Each test runs the loaders in a subprocess (this file run as a script) and watches it from the
outside with liveness timeouts: a hang fails the test (and kills the subprocess) instead of
hanging the suite. A run is mostly one busy core, so two run at a time: the restarts of the stress
test pairwise, and the SIGKILL runs in the background from the module's first test on
(``tests/prelaunch.py``; each test checks its own run exactly as when it runs alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from prelaunch import Prelaunch, job  # noqa: E402
from dynabatch.loader.settings import records_from_keywords

ROOT = os.path.dirname(HERE)
PLAN = dict(cost_model="gpt", device="cpu", num_stages=2)
TOKENS = 2000
STALL_S = 90.0  # no progress line for this long: the subprocess hangs (generous: 2 busy cores)

LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc")
linux_only = pytest.mark.skipif(not LINUX, reason="finds child processes in /proc")
LAUNCHES = Prelaunch(parallel=2)


# -- the subprocess side ----------------------------------------------------------------------------
def _say(*parts) -> None:
    print(*parts, flush=True)


def _churn(stop: threading.Event) -> None:
    """Another thread of the process compiling numba functions, one after another (what the
    planning thread of another rank does the first time it plans)."""
    import numba
    import numpy as np

    i = 0
    while not stop.is_set():
        ns: dict = {}
        exec(f"def f(x):\n    s = 0.0\n    for k in range(x.shape[0]):\n        s += x[k] * {i}\n    return s\n", ns)
        numba.njit(ns["f"])(np.ones(3))
        i += 1
        time.sleep(0.01)


def _stress(data: str, index: str, world: int, steps: int) -> None:
    """``world`` ranks as threads of this process, each an indexed DataLoader with 2 workers,
    while another thread compiles; prints one line per batch."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from dynabatch import DataLoader

    stop = threading.Event()
    threading.Thread(target=_churn, args=(stop,), daemon=True).start()
    errors: list = []

    def rank(r: int) -> None:
        try:
            dl = DataLoader(data,
                            **records_from_keywords(dict(index=index, world_size=world, rank=r, num_workers=2,
                                                    global_batch_tokens=TOKENS, seed=r, **PLAN)))
            for b in dl.microbatches():
                _say("batch", r, b["step"], b["microbatch"])
                if b["step"] >= steps:
                    break
            dl.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if errors:
        raise errors[0]
    _say("done")


def _orphan(mode: str, data: str, index: str) -> None:
    """Iterate a loader with child processes, report once they run, then wait to be killed."""
    from dynabatch import DataLoader

    if mode.endswith("_thread"):  # the loader iterated by another thread than the main one
        t = threading.Thread(target=_orphan, args=(mode[:-len("_thread")], data, index), daemon=True)
        t.start()
        t.join()
        return
    kw = dict(global_batch_tokens=TOKENS, **PLAN)
    if mode.endswith("_forkserver"):  # workers are children of the fork server, not of this process
        mode, kw["multiprocessing_context"] = mode[:-len("_forkserver")], "forkserver"
    if mode == "indexed":
        dl = DataLoader(data, **records_from_keywords(dict(index=index, num_workers=2, **kw)))
    elif mode == "plan_processes":
        dl = DataLoader(data, **records_from_keywords(dict(index=index, num_workers=0, plan_processes=2, **kw)))
    else:
        dl = DataLoader(data, **records_from_keywords(dict(mode="streaming", num_workers=2, chunk_size=64, **kw)))
    it = iter(dl)
    next(it)
    _say("ready", os.getpid())
    time.sleep(3600)


# -- the test side -------------------------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, args)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


class _Lines:
    """Lines of a subprocess's stdout, read by a thread; `wait_for` waits with a liveness timeout."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.last = proc, [], time.monotonic()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self.last = time.monotonic()
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # EOF
            self._cond.notify_all()

    def wait_for(self, prefix: str, stall: float) -> str | None:
        """The first line starting with ``prefix``; None at EOF or after ``stall`` s without a line."""
        i = 0
        with self._cond:
            while True:
                while i < len(self.lines):
                    line = self.lines[i]
                    i += 1
                    if line is None:
                        return None
                    if line.startswith(prefix):
                        return line
                if time.monotonic() - self.last > stall:
                    return None
                self._cond.wait(1.0)


def _descendants(pid: int) -> set[int]:
    """Live (non-zombie) descendants of ``pid`` (from /proc)."""
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z":
                parents[int(d)] = int(fields[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def _kill_tree(proc: subprocess.Popen, also=()) -> None:
    for p in list(_descendants(proc.pid)) + list(also):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.kill()
    proc.wait(10)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from test_dataloader_data import records, write_jsonl, write_parquet

    from dynabatch import DataLoader

    d = tmp_path_factory.mktemp("procs")
    recs = records(4000, seed=3, long=True)
    parquet = write_parquet(d / "train.parquet", recs, row_group_size=24)
    jsonl = write_jsonl(d / "train.jsonl", recs)
    index = str(d / "index.parquet")
    DataLoader(parquet, **records_from_keywords(dict(index_cache=index, global_batch_tokens=TOKENS, **PLAN)))  # writes the length index once
    return {"parquet": parquet, "jsonl": jsonl, "index": index}


@pytest.fixture(scope="module", autouse=True)
def _launches(request, data):
    yield from LAUNCHES.started(request, data=data)


@linux_only
def test_threaded_ranks_with_workers_never_deadlock(data):
    """Point 7: ranks as threads of one process, each an indexed loader with 2 workers, while
    another thread compiles numba code; the job restarted several times. Each run must finish; a
    run without progress for STALL_S seconds is a deadlock (a worker forked mid-compile)."""
    restarts, world, steps = 4, 3, 2
    at_once = 2  # runs at a time (each is mostly one busy core: the other would idle)
    stalled = []
    for first in range(0, restarts, at_once):
        runs = []
        try:
            for run in range(first, min(first + at_once, restarts)):
                proc = _spawn("stress", data["parquet"], data["index"], world, steps)
                runs.append((run, proc, _Lines(proc)))
            for run, proc, lines in runs:
                done = lines.wait_for("done", STALL_S)
                if done is None:
                    if proc.poll() is None:
                        stalled.append(run)
                        try:
                            os.kill(proc.pid, signal.SIGUSR1)  # stacks of the stuck process, for the report
                            time.sleep(1.0)
                        except OSError:
                            pass
                        continue
                    pytest.fail(f"run {run} failed: {proc.stderr.read()[-3000:]}")
                assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
        finally:
            for _, proc, _ in runs:
                if proc.poll() is None:
                    _kill_tree(proc)
    assert not stalled, f"{len(stalled)} of {restarts} runs hung (no progress for {STALL_S:.0f} s): runs {stalled}"


def _runnable(mode: str) -> bool:
    if mode.startswith("plan_processes"):
        from dynabatch.loader.ahead import fork_available

        return fork_available()
    if mode.endswith("_forkserver"):
        import multiprocessing

        return "forkserver" in multiprocessing.get_all_start_methods()
    return True


def _sigkill_run(mode: str, data: dict) -> dict:
    """Start a loader in ``mode``, SIGKILL its process once its children run; which children outlived it."""
    src = data["jsonl"] if mode.startswith("streaming") else data["parquet"]
    proc = _spawn("orphan", mode, src, data["index"])
    lines = _Lines(proc)
    children: set[int] = set()
    try:
        # a forkserver worker imports torch and loads the kernels itself before the first step
        ready = lines.wait_for("ready", STALL_S * (3 if mode.endswith("_forkserver") else 1))
        if ready is None:
            return {"ready": None, "stderr": proc.stderr.read()[-3000:] if proc.poll() is not None else ""}
        time.sleep(1.0)  # let the workers fill their queues
        children = _descendants(proc.pid)
        if len(children) < 2:
            return {"ready": ready, "children": children}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30.0  # the parent watch polls every 0.5 s; PDEATHSIG is immediate
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        return {"ready": ready, "children": children, "left": sorted(p for p in children if _alive(p))}
    finally:
        _kill_tree(proc, also=children)


def sigkill_job(mode, data):
    return job(("sigkill", mode), _sigkill_run, mode, data, weight=3)


@linux_only
@pytest.mark.parametrize("mode", ["indexed", "streaming", "plan_processes", "streaming_thread", "indexed_forkserver"])
@LAUNCHES.plan(lambda mode, data: [sigkill_job(mode, data)] if LINUX and _runnable(mode) else [])
def test_children_die_with_a_sigkilled_parent(data, mode):
    """Point 8: SIGKILL the process iterating a loader: none of its children may outlive it (with
    the loader iterated by another thread, only the parent watch thread of the children acts)."""
    if not _runnable(mode):
        pytest.skip("plan processes need fork and more than one CPU")
    run = LAUNCHES.result(sigkill_job(mode, data))
    assert run["ready"] is not None, f"the loader did not start: {run['stderr']}"
    children = run["children"]
    assert len(children) >= 2, f"expected the loader's child processes, found {children}"
    left = run["left"]
    assert not left, f"{len(left)} of {len(children)} child processes outlived the SIGKILLed parent: {left}"


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    cmd, *rest = sys.argv[1:]
    if cmd == "stress":
        _stress(rest[0], rest[1], int(rest[2]), int(rest[3]))
    elif cmd == "orphan":
        _orphan(rest[0], rest[1], rest[2])
    else:
        raise SystemExit(f"unknown command {cmd}")
