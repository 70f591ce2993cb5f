"""Run one function over many independent parts: in this process, in local worker processes, or
as Ray tasks.

`map_parts(fn, items, context, ...)` calls ``fn(context, item)`` for every item and returns the
results in item order, whatever order they finish in. ``context`` is what every call shares
(a sample source, the Shapes of a dataset and a cost model...): it is sent once per worker
process (local) or stored once in Ray's object store (ray), not once per item. ``fn`` must be
a module-level function so that it pickles by reference.

Engines:

* ``local`` (default): a `concurrent.futures.ProcessPoolExecutor` of ``workers`` processes
  (default: the CPU count); ``workers=1`` (or a single item) runs in this process. A caller
  with one Python thread forks them; one with more (a DataLoader's, an async file system's, a
  test runner's) spawns them, since a child forked mid-way through another thread's work can
  crash (a segfault in the child's garbage collector was seen).
* ``ray``: one Ray task per item (``ray.remote(num_cpus=1)``), all submitted at once. Uses the running
  Ray instance, else ``ray.init(address=$RAY_ADDRESS)`` when that variable is set, else starts a
  local instance with ``num_cpus=workers``. Install with ``pip install 'dynabatch[ray]'``.

With ``progress=True`` a bar counts the items' ``weights`` (samples, steps...) as parts finish, by the
one progress rule of `dynabatch.progress` (a tqdm bar on a terminal, lines with percent and ETA off one).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

from .progress import progress_bar

ENGINES = ("local", "ray")

_CONTEXT: Any = None  # set in each local worker process by _init_worker


class EngineError(RuntimeError):
    """The engine itself cannot run (Ray missing or not startable); the message says what to do."""


def default_workers() -> int:
    """Worker processes used when ``workers`` is not given: the CPUs this process may use."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return max(os.cpu_count() or 1, 1)


SAMPLES_PER_WORKER = 16384  # the least a default local worker gets: starting a worker process costs ~1-3 s
# of CPU (imports, kernels, tokenizer), a sample well under 0.2 ms to scan or plan, so fewer run sooner here


def workers_for(num_samples: int | None, workers: int | None = None, engine: str = "local") -> int:
    """Worker processes for a job over ``num_samples`` samples: ``workers`` when given; by default the CPUs
    this process may use (`default_workers`), and on the local engine at most one per `SAMPLES_PER_WORKER`
    samples (1 runs it in this process; an unknown count, None, takes the CPUs)."""
    if workers is not None:
        return workers
    if engine != "local" or num_samples is None:
        return default_workers()
    return max(1, min(default_workers(), num_samples // SAMPLES_PER_WORKER))


def _init_worker(context: Any) -> None:
    global _CONTEXT
    _CONTEXT = context
    # Fast tokenizers start their own thread pool; one per process is oversubscription.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _call_in_worker(fn: Callable, item: Any) -> Any:
    return fn(_CONTEXT, item)


def map_parts(
    fn: Callable[[Any, Any], Any],
    items: Sequence[Any],
    context: Any = None,
    *,
    engine: str = "local",
    workers: int | None = None,
    progress: bool = True,
    desc: str = "",
    unit: str = "part",
    weights: Sequence[int] | None = None,
) -> list:
    """``[fn(context, item) for item in items]``, computed in parallel on ``engine``.

    ``workers`` is the number of processes (local) or CPUs of a Ray instance started here;
    ``weights`` the progress-bar amount of each item (default 1 each). The first exception
    raised by ``fn`` cancels the remaining work and is re-raised here.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    weights = [1] * len(items) if weights is None else [int(w) for w in weights]
    bar = progress_bar(sum(weights), desc, unit, progress)
    try:
        if engine == "ray":
            return _map_ray(fn, items, context, workers, bar, weights)
        workers = min(workers or default_workers(), max(len(items), 1))
        if workers <= 1:
            out = []
            for item, w in zip(items, weights):
                out.append(fn(context, item))
                bar.update(w)
            return out
        return _map_local(fn, items, context, workers, bar, weights)
    finally:
        bar.close()


def _other_threads() -> list[threading.Thread]:
    """Python threads besides this one, leaving out tqdm's progress-bar monitor (it sleeps 10 s
    between looks at the bars, and every progress bar here starts it)."""
    from tqdm._monitor import TMonitor

    return [t for t in threading.enumerate() if t is not threading.current_thread() and not isinstance(t, TMonitor)]


def _pool_context() -> multiprocessing.context.BaseContext:
    """The start method of local workers. A process running one Python thread forks them (cheapest:
    the workers share its imports and loaded kernels; native pools such as BLAS's handle a fork); one
    running more spawns them, since a child forked while another thread is inside the interpreter can
    crash."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if not _other_threads() and "fork" in methods else "spawn")


def _map_local(fn, items, context, workers, bar, weights) -> list:
    results: list = [None] * len(items)
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=_init_worker,
                               initargs=(context,))
    try:
        index = {pool.submit(_call_in_worker, fn, item): i for i, item in enumerate(items)}
        pending = set(index)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i = index[fut]
                results[i] = fut.result()  # re-raises the worker's exception
                bar.update(weights[i])
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _ray_part(fn, context, item) -> bytes:
    """One Ray task: ``fn(context, item)`` pickled as ``("ok", value)`` or ``("error", exception)``. An
    exception is sent back as a value: Ray's own wrappers would lose its type and message."""
    try:
        out = ("ok", fn(context, item))
    except Exception as e:
        out = ("error", _portable(e))
    return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)


def _portable(e: Exception) -> Exception:
    """``e`` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def ray_init(workers: int | None = None) -> None:
    """Connect to Ray: the running instance, ``$RAY_ADDRESS``, or a new local one of ``workers`` CPUs."""
    try:
        import ray
    except ImportError as e:
        raise EngineError(f"--engine ray needs Ray: pip install 'dynabatch[ray]' (or 'ray>=2.9'): {e}") from None
    if ray.is_initialized():
        return
    import logging

    kw = dict(ignore_reinit_error=True, log_to_driver=False, logging_level=logging.WARNING)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**kw)
    else:
        # Ray starts its workers at niceness 15 (to keep its own daemons responsive); here they are the job
        # the user is waiting on, and beside other work (two busy processes on 2 cores) a nice-15 worker gets
        # about 3% of a core: `scan --engine ray` took 77 s there against 11 s locally. A Ray started here
        # runs them at this process's priority; a running instance or $RAY_ADDRESS keeps its own settings.
        ray.init(num_cpus=workers or default_workers(), include_dashboard=False,
                 _system_config={"worker_niceness": 0}, **kw)


def _map_ray(fn, items, context, workers, bar, weights) -> list:
    # Plain Ray tasks, one per part, all submitted at once: the parts are few and independent, so Ray's
    # scheduler hands each to the next free worker (Ray Data's streaming executor, used before, added
    # start-up and polling to every map for nothing these maps need).
    ray_init(workers)
    import ray

    n = len(items)
    if n == 0:
        return []
    task = ray.remote(num_cpus=1, max_retries=0)(_ray_part)
    context_ref = ray.put(context)  # stored once; every task reads the same object
    index = {task.remote(fn, context_ref, item): i for i, item in enumerate(items)}
    results: list = [None] * n
    pending = list(index)
    try:
        while pending:
            try:  # only Ray's own failures here; a part's exception is a value, raised below as it was
                (ref,), pending = ray.wait(pending, num_returns=1)
                status, value = pickle.loads(ray.get(ref))
            except Exception as e:
                raise _ray_failure(e) from e
            if status == "error":
                raise value from None
            results[index[ref]] = value
            bar.update(weights[index[ref]])
    finally:  # the first error, or an interrupt, stops the parts not yet finished (none left on success)
        for ref in pending:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished or already gone: nothing to stop
                pass
    return results


def _ray_failure(e: BaseException) -> EngineError:
    """A failure of Ray itself (a worker died, the cluster went away) as a one-line EngineError."""
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return EngineError(f"Ray failed ({type(e).__name__}): {first}")
