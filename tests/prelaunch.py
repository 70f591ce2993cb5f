"""Start the launches of a test module's selected tests together, in the background (shared by the tests).

A multi-process test spends much of its time where the 2 cores are partly idle: starting processes
one after the other, ranks waiting on each other, waiting on purpose (for a liveness timeout to
expire, a culprit to linger, a kill to land). So the launches of a module's selected tests can
overlap, and launches of one kind can share one set of processes:

* ``LAUNCHES = Prelaunch(parallel=2)`` in a test module, and a module fixture
  ``yield from LAUNCHES.started(request, **context)``;
* ``@LAUNCHES.plan(lambda **params: [...])`` on a test: its `Job` s and `Part` s (``params``: the
  test's parametrization plus the fixture's ``context``, e.g. a data fixture);
* in the test, ``LAUNCHES.result(job_or_part)``: its return value, checked exactly as before.

When the module's first test begins, every selected test's jobs start on ``parallel`` threads
(heaviest ``weight`` first). The parts of one ``group`` (e.g. configurations of one topology, each
asked for by its own test) become one launch that runs all of them, and each part gets its own
result back. A job or part that was not started (the test runs without the fixture, or was not
planned) runs in place, alone; an exception in a launch is raised in every test that asks for it.

Nothing here is a wall clock: every launch keeps its own liveness timeouts. Overlapping launches
only share the CPU, which the tests' margins are made for (they pass on a busy machine).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Job:
    key: object
    fn: object
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    weight: float = 0.0  # expected seconds: the heaviest start first


def job(key, fn, *args, weight: float = 0.0, **kwargs) -> Job:
    """One launch: ``fn(*args, **kwargs)``, asked for by ``key``."""
    return Job(key, fn, args, kwargs, weight)


@dataclass(frozen=True)
class Part:
    group: object  # hashable: the parts of one group run as one launch, ``run(items)``
    item: object  # hashable: what this part adds to the launch (e.g. one configuration)
    run: object  # run(items) -> one result per item, in order
    weight: float = 0.0


def part(group, item, run, weight: float = 0.0) -> Part:
    """``item`` of launch ``group``: ``run(items)`` runs the group's items (every selected test's) at once
    and returns one result per item."""
    return Part(group, item, run, weight)


class Prelaunch:
    """The background launches of one test module (see the module docstring)."""

    def __init__(self, parallel: int = 2):
        self.parallel = parallel
        self._plans: dict = {}
        self._futures: dict = {}  # job key or part group -> Future
        self._items: dict = {}  # part group -> the items its launch runs, in order
        self._pool: ThreadPoolExecutor | None = None

    def plan(self, jobs_of):
        """Decorator of a test: ``jobs_of(**params, **context)`` lists the jobs and parts the test will ask for."""
        def deco(test):
            self._plans[test.__name__] = jobs_of
            return test
        return deco

    def started(self, request, **context):
        """Generator for a module-scoped fixture: start the launches of the module's selected tests,
        yield, then wait for the launches still running (their own timeouts bound them) and drop the rest."""
        launches: dict = {}  # job key or part group -> [fn, args, kwargs, weight]
        for item in request.session.items:
            if item.module is not request.module:
                continue
            jobs_of = self._plans.get(getattr(item, "originalname", item.name))
            if jobs_of is None:
                continue
            callspec = getattr(item, "callspec", None)
            for j in jobs_of(**(callspec.params if callspec else {}), **context):
                if isinstance(j, Part):
                    items = self._items.setdefault(j.group, [])
                    if j.item not in items:
                        items.append(j.item)
                        launches.setdefault(j.group, [j.run, (items,), {}, 0.0])[3] += j.weight
                else:
                    launches.setdefault(j.key, [j.fn, j.args, j.kwargs, j.weight])
        self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="prelaunch")
        for key, (fn, args, kwargs, _) in sorted(launches.items(), key=lambda kv: -kv[1][3]):
            self._futures[key] = self._pool.submit(fn, *args, **kwargs)
        try:
            yield self
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._futures, self._items = None, {}, {}

    def result(self, j: Job | Part):
        """The return value of job (or part) ``j``: from its background launch when it was started, else
        of running it now (a part alone)."""
        if isinstance(j, Part):
            fut: Future | None = self._futures.get(j.group)
            if fut is None or j.item not in self._items.get(j.group, ()):
                return j.run([j.item])[0]
            return fut.result()[self._items[j.group].index(j.item)]
        fut = self._futures.get(j.key)
        return fut.result() if fut is not None else j.fn(*j.args, **j.kwargs)
