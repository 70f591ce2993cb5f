"""Set-up under the failure monitor (`dynabatch.pipeline.runtime.failure`): what a rank does before its
first step (reading its stage's weights, building its runner and the process groups of tied parameters,
checking their copies) follows the failure protocol of a step, so a rank that raises, is killed or leaves
with ``os._exit`` during set-up stops every other rank with an error naming it, instead of leaving them
blocked in a gloo call that cannot be interrupted.

* `setup_phase(ctx, text)`: a block of set-up. The monitor knows the rank is inside library code (state
  busy ``text``: a rank blocked after another's failure is ended after ``abort_after_s``), and an exception
  raised in it is published as this rank's failure (the root cause, with its traceback tail) or, when
  another rank failed first, becomes `PipelineAborted` naming that rank.
* `setup_call(ctx, fn, text, peers)`: a blocking collective call (``dist.new_group``: gloo's rendezvous
  waits in C++ until every member arrives) run on the monitor's wait thread while the main thread watches
  it as `FailureMonitor.wait` watches a step's transfers: a failure published anywhere, a peer whose
  heartbeat stopped (killed) or that made no progress for ``timeout_s`` ends it with `PipelineAborted`.
* `setup_all_reduce`: an all-reduce watched the same way.

Each works with a context without a monitor (a single process: ``SimpleNamespace(stage=..., ...)``) by
running the call in place.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from .failure import PipelineAborted

_REPORTED = "_dynabatch_reported"  # set on an exception a set-up phase already published or translated
_COMM = "_dynabatch_comm_error"  # set on an exception raised by a watched collective (likely a consequence)


class _Call:
    """A blocking call as a communication handle: ``wait()`` runs it (on the monitor's wait thread)."""

    def __init__(self, fn):
        self.fn = fn
        self.value = None

    def wait(self) -> bool:
        self.value = self.fn()
        return True


def _monitor(ctx):
    return getattr(ctx, "monitor", None)


@contextlib.contextmanager
def setup_phase(ctx, text: str):
    """Run the block as set-up on ``ctx``'s monitor (module doc); ``text`` says what the rank does (``loading
    the weights of layers 0..2``), as other ranks' errors will quote it. Phases nest: the outermost
    publishes, an inner one gives the outer's state back when it ends."""
    mon = _monitor(ctx)
    if mon is None:
        yield
        return
    mon.raise_if_failed()
    before, outer = mon.state, not mon.active
    mon.enter()
    mon.set_state("busy", text)
    try:
        yield
    except BaseException as e:
        if getattr(e, _REPORTED, False):
            raise
        out = mon.report(e, comm_error=bool(getattr(e, _COMM, False)))
        for x in {id(e): e, id(out): out}.values():
            _mark(x, _REPORTED)
        if out is e:
            raise
        raise out from e
    finally:
        mon.leave()
        if outer:
            mon.set_state("idle", f"outside the runner after set-up ({text})")
        else:
            mon.set_state(*before)


def setup_call(ctx, fn, text: str, peers=()):
    """``fn()`` (a blocking collective call involving ``peers``, global ranks) on the monitor's wait thread,
    watched from this one; returns its value. ``text`` reads after ``waiting``: ``in the creation of the
    process group of ...``."""
    peers = [int(p) for p in peers if int(p) != getattr(ctx, "rank", -1)]
    mon = _monitor(ctx)
    if mon is None or not peers:
        return fn()
    call = _Call(fn)
    with setup_phase(ctx, text):
        _watch(mon, [call], text, peers)
    return call.value


def setup_all_reduce(ctx, tensor, text: str, peers, *, op=dist.ReduceOp.SUM, group=None) -> None:
    """All-reduce ``tensor`` in place over ``group`` (``peers``: its global ranks), watched like `setup_call`."""
    peers = [int(p) for p in peers if int(p) != getattr(ctx, "rank", -1)]
    mon = _monitor(ctx)
    if mon is None:
        dist.all_reduce(tensor, op=op, group=group)
        return
    with setup_phase(ctx, text):
        mon.raise_if_failed()
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
        _watch(mon, [work], text, peers)


def _watch(mon, works, text: str, peers) -> None:
    try:
        mon.wait(works, f"waiting {text} for ranks {list(peers)}", peers)
    except PipelineAborted:
        raise
    except BaseException as e:  # a transport error no liveness verdict explained: judged as a consequence
        _mark(e, _COMM)
        raise


def _mark(exc: BaseException, flag: str) -> None:
    try:
        setattr(exc, flag, True)
    except AttributeError:  # an exception type without attributes: it is then published again, harmlessly
        pass
