"""The liveness verdict of a waiting rank (`FailureMonitor.wait`, `FailureMonitor.explain`): read the
heartbeats the other ranks publish under ``dynabatch/live/R`` and follow the wait-for chain from the ranks
waited on (a rank waiting on another points at it) to the first rank that is not waiting, then judge it:
a heartbeat silent for ``dead_after_s`` (a dead rank cannot report) before a closed context, before a rank
without progress for ``timeout_s``; a chain of ranks that all only wait is a deadlock. Seconds throughout
(monotonic clock)."""

from __future__ import annotations

import json

from .failure_text import short

LIVE_PREFIX = "dynabatch/live/"


class Seen:
    """What this rank observed of another rank's heartbeat key: the raw value, when it last changed and was
    first looked at (this rank's monotonic seconds), and the decoded heartbeat."""

    __slots__ = ("raw", "changed_at", "first_at", "info")

    def __init__(self, now: float):
        self.raw: bytes | None = None
        self.changed_at = now
        self.first_at = now
        self.info: dict | None = None


class StoreGone(Exception):
    """The store stopped answering while reading a heartbeat (its host, rank 0, is gone)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class Peers:
    """The other ranks as rank ``rank`` of ``world_size`` sees them through ``store`` (main thread only).
    ``name(r)`` names a rank in messages; ``timeout_s``: no progress for that long is a stall."""

    def __init__(self, store, rank: int, world_size: int, name, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self.timeout_s = timeout_s
        self.seen: dict[int, Seen] = {}

    def observe(self, r: int, now: float) -> Seen:
        """Rank ``r``'s heartbeat now (raises `StoreGone` when the store does not answer)."""
        seen = self.seen.get(r)
        if seen is None:
            seen = self.seen[r] = Seen(now)
        try:
            raw = self.store.get(f"{LIVE_PREFIX}{r}") if self.store.check([f"{LIVE_PREFIX}{r}"]) else None
        except Exception as e:
            raise StoreGone(e) from e
        if raw != seen.raw:
            seen.raw, seen.changed_at = raw, now
            try:
                seen.info = json.loads(raw) if raw is not None else None
            except ValueError:
                seen.info = None
        return seen

    def verdict(self, peers, now: float, dead_after_s: float, cause: str, my_progress_at: float, doing: str):
        """(culprit, message, dead) for the wait-for chain from ``peers``, or None while nobody is at fault.
        ``cause``: the transport error that made this rank look (quoted); ``my_progress_at``/``doing``: this
        rank's last progress and what it waits in (for a deadlock's message). Raises `StoreGone`."""
        todo, visited, order = list(peers), set(), []
        while todo:
            r = int(todo.pop(0))
            if r in visited or r == self.rank or not 0 <= r < self.world_size:
                continue
            visited.add(r)
            seen = self.observe(r, now)
            order.append((r, seen))
            if seen.info is not None and seen.info.get("k") == "wait":
                todo.extend(seen.info.get("w", ()))
        # a silent heartbeat first (a dead rank cannot report), then closed, then stalled ranks
        dead = [(now - s.changed_at, r, s) for r, s in order if now - s.changed_at >= dead_after_s]
        if dead:
            silent, r, s = max(dead, key=lambda x: x[0])
            last = f"; last seen {s.info['t']}" if s.info else "; it never reported what it was doing"
            why = f"; {self.name(self.rank)} saw: {short(cause)}" if cause else ""
            return r, f"{self.name(r)} died (no heartbeat for {silent:.0f} s){last}{why}", True
        for r, s in order:
            if s.info is not None and s.info.get("k") == "closed":
                return r, (f"{self.name(r)} already closed its pipeline context ({s.info['t']}) while "
                           f"{self.name(self.rank)} waits for it: the ranks ran different numbers of steps"), False
        stalled = []
        for r, s in order:
            if s.info is None or s.info.get("k") == "wait":
                continue
            idle = float(s.info.get("i", 0.0)) + (now - s.changed_at)
            if idle >= self.timeout_s:
                stalled.append((idle, r, s))
        if stalled:
            idle, r, s = max(stalled, key=lambda x: x[0])
            return r, f"{self.name(r)} stalled for {idle:.0f} s {s.info['t']} (no progress within timeout_s=" \
                      f"{self.timeout_s:g})", False
        # everyone on the chain waits and nobody moves: a deadlock (e.g. programs that do not pair)
        mine = now - my_progress_at
        if order and mine >= self.timeout_s and all(
                s.info is not None and s.info.get("k") == "wait"
                and float(s.info.get("i", 0.0)) + (now - s.changed_at) >= self.timeout_s for _, s in order):
            chain = "; ".join([f"{self.name(self.rank)} {doing}"] + [f"{self.name(r)} {s.info['t']}" for r, s in order])
            return order[0][0], f"no progress for {mine:.0f} s, every rank waiting for another (deadlock): {chain}", False
        return None
