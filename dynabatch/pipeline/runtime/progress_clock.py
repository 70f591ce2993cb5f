"""How long a rank has gone without progress, as the pipeline's stall rule counts it (`FailureMonitor`).

A busy rank's idle time counts its main thread's CPU seconds instead of wall seconds while that thread
keeps using at least `BUSY_CPU_SHARE` of a core: it is computing, only slowly (starved on a shared
machine), and a hang that spins is still caught after ``timeout_s`` of CPU; a stall in a sleep, a
lock or I/O uses no CPU and is caught after ``timeout_s`` of wall time. `FailureMonitor` counts a rank
outside the runner (set-up, the data loader) this way too; waiting ranks count wall time."""

from __future__ import annotations

import threading
import time

#: a busy main thread that used at least this share of one core since its last progress is working,
#: not stalled: a rank at a fair share of a 2-core machine under load 12 gets ~17%, a thread blocked
#: in a sleep, a lock or a read ~0%
BUSY_CPU_SHARE = 0.03


def thread_cpu_clock(ident: int):
    """The clock id of thread ``ident``'s CPU time (readable from any thread), or None where the
    platform has none."""
    try:
        clock = time.pthread_getcpuclockid(ident)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return None
    return clock


class ProgressClock:
    """When the thread calling `mark` last made progress (``at``, monotonic seconds), and `idle`."""

    def __init__(self):
        self.at = time.monotonic()
        self._mark = (self.at, 0.0)  # (monotonic, thread CPU) seconds at the last progress, set together
        self._thread: int | None = None
        self._clock = None  # the CPU clock of the thread calling mark (None: not on this platform)

    def mark(self) -> None:
        """Progress now (cheap: one clock read)."""
        me = threading.get_ident()
        if me != self._thread:
            self._thread, self._clock = me, thread_cpu_clock(me)
        self.at = time.monotonic()
        self._mark = (self.at, time.clock_gettime(self._clock) if self._clock is not None else 0.0)

    def idle(self, busy: bool, now: float) -> float:
        """Seconds without progress that count towards a stall at ``now`` (see the module doc), from
        any thread."""
        at, cpu_at = self._mark
        wall = now - at
        if not busy or self._clock is None:
            return wall
        try:
            cpu = time.clock_gettime(self._clock) - cpu_at
        except OSError:  # the thread ended
            return wall
        return cpu if cpu >= BUSY_CPU_SHARE * wall else wall
