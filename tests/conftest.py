"""Suite-wide settings. `launch_local` ranks fork from a fork server that imported torch, dynabatch and
transformers once (``DYNABATCH_LAUNCH_START=forkserver``: ~0.3 s per rank instead of ~5-10 s for a fresh
interpreter); tests whose point is a fresh interpreter's start or teardown pin ``start_method="spawn"``
(or the environment variable). ``setdefault``: a run may still choose spawn for everything."""

import gc
import os
import sys
from types import SimpleNamespace

import pytest

os.environ.setdefault("DYNABATCH_LAUNCH_START", "forkserver")
# The fork server (one per xdist worker) imports transformers' model code once: a Hugging Face rank that
# imported modeling_utils and Llama/T5 itself paid 1.2-3 s CPU each (measured), the server pays ~1.7 s.
# Rank workers live in test modules, so a rank imports pytest with its worker's module (0.15 s CPU each,
# measured; most of the suite's ~130 ranks), and the loader's ranks pyarrow's dataset reader (0.5 s):
# the server imports both once.
os.environ.setdefault("DYNABATCH_LAUNCH_PRELOAD", "transformers,transformers.modeling_utils,"
                      "transformers.models.llama.modeling_llama,transformers.models.t5.modeling_t5,"
                      "pytest,pyarrow.dataset")
# Two xdist workers share two cores: a worker whose torch ran two intra-op threads oversubscribed them
# (OpenMP's spinning threads: 24% more user CPU on the in-process model tests, no faster). Ranks get
# their own count from launch_local's threads_per_proc; a run may still choose another.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A run starts ~120 Python interpreters (xdist workers, fork servers, spawned ranks, CLI and example
# subprocesses; counted). With PYTHONDONTWRITEBYTECODE set, each compiled the repository's own modules
# again (~1 CPU-s each for dynabatch and its pipeline, measured) and each worker re-rewrote every test
# module's asserts. The suite writes bytecode into the `__pycache__` folders beside the sources (ignored
# by git, where numba's kernel caches already are), set before the workers and children inherit the
# environment; installed packages keep the bytecode pip wrote for them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture
def run_cli(capsys):
    """``run_cli(*argv)``: ``dynabatch ARGV`` through the console script's entry point (`dynabatch.cli.main`) in
    this process, its output captured: ``returncode``, ``stdout``, ``stderr`` (as a
    `subprocess.CompletedProcess` has them). For commands whose behaviour does not depend on a fresh
    interpreter: a CLI interpreter and a fork server of its own per run (torch imported twice, ~6 CPU-s)
    were a third of a small bench run's cost; the ranks a command launches are still processes of their own."""

    def run(*argv) -> SimpleNamespace:
        from dynabatch.cli import main

        capsys.readouterr()
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return run


def pytest_configure(config):
    # pytest-xdist sorts --dist loadfile's files by their number of tests unless told not to; the
    # order from pytest_collection_modifyitems (longest files first, tests/suite_order.py) must hold.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ["DYNABATCH_LAUNCH_START"] == "forkserver":
        # A worker's first launch waited for its fork server's preload (torch, transformers, the kernels:
        # ~10 CPU-s, and on a fresh clone the compile of the kernels it warms) with its core idle; started
        # here, the server preloads while the worker collects. The server is the one that first launch
        # would start (same preload, same environment). A single-process run starts it at its first launch,
        # as before: it may run no launch at all.
        from dynabatch.pipeline.runtime.forked_ranks import fork_server
        from dynabatch.pipeline.runtime.launch import default_preload

        fork_server(default_preload(), dict(os.environ))


def pytest_collection_modifyitems(session, config, items):
    from suite_order import longest_first  # beside this file: pytest puts its folder on sys.path

    items[:] = longest_first(items)


# The collector's full passes cost a test worker 24-33 CPU-s per run (47-68 passes per worker, measured:
# each walks ~0.9 million objects, nearly all imported modules and collected tests that live to the end), and
# pytest runs five more at the end. Objects that outlive collection or a test module are frozen (kept out
# of every later pass, as `gc.freeze` is for): a pass then walks only what the running module made. A
# cycle that dies later stays in memory, which is why each freeze follows a full collection.
def _freeze_survivors() -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    gc.disable()  # importing ~150 test modules and their libraries: passes that would free nothing
    try:
        return (yield)
    finally:
        gc.enable()
        _freeze_survivors()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
            _freeze_survivors()  # the module's fixtures are gone: what is left lives on
