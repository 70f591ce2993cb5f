"""The coefficient store of a `CostModel`: its time coefficients, their version counter and the optional
per-stage rows, in one buffer that forked and started processes can share.

A `CostModel` prices with the coefficients held here (``cost.coefficients``); a `FeedbackLoop` refit
writes them (``cost.time_coef = ...``, ``cost.set_stage_time_coef(rows)``), and any process holding the
same shared store reads every refit with its version. Nothing here prices or fits: pricing is
`dynabatch.core.cost.model`, the refit math `dynabatch.core.cost.fit`, the file format
`dynabatch.core.cost.fileformat`.

Layout of the buffer (float64 words): ``F`` coefficients, one int64 sequence counter (even when no write
is in progress; ``version = counter // 2``), one int64 row count, then `MAX_STAGE_ROWS` rows of ``F``
coefficients. One process writes (odd counter during a write), any number read (`read` retries a read
that overlapped a write).
"""

from __future__ import annotations

import time

import numpy as np

#: Most stages per-stage coefficients can be kept for (the shared buffer is fixed-size).
MAX_STAGE_ROWS = 128


def buffer_words(num_features: int) -> int:
    """float64 words of a store of ``num_features`` coefficients: the coefficients, the sequence counter,
    the row count and `MAX_STAGE_ROWS` rows."""
    return num_features + 2 + MAX_STAGE_ROWS * num_features


class Coefficients:
    """Time coefficients (seconds per feature unit), their version and optional per-stage rows ``[S, F]``.

    ``coef``: the initial coefficients (``F`` float64); ``version``: the version they count as; ``rows``:
    per-stage rows or None; ``raw``: a `multiprocessing.RawArray` of `buffer_words` float64 words to live
    in (shared memory), or None for a private buffer.

    Copies: ``copy.copy`` of a shared store is the same store (a copy of its model sees every refit);
    of a private one, and ``copy.deepcopy`` of any, an independent store with the same values. Pickled
    for a process being started (spawn, forkserver) a shared store stays shared; any other pickle is a
    snapshot."""

    def __init__(self, coef, version: int = 0, rows=None, raw=None):
        coef = np.asarray(coef, np.float64)
        self._view(raw, len(coef))
        self._coef[:] = coef
        self._put_rows(rows)
        self._seq[0] = 2 * int(version)

    def _view(self, raw, F: int) -> None:
        """View ``raw`` (or a new private buffer) as the coefficients, counter, row count and rows."""
        base = np.frombuffer(raw, np.float64) if raw is not None else np.zeros(buffer_words(F))
        self._raw = raw
        self._coef = base[:F]
        self._seq = base[F:F + 1].view(np.int64)
        self._rows_n = base[F + 1:F + 2].view(np.int64)
        self._rows = base[F + 2:].reshape(MAX_STAGE_ROWS, F)

    # -- reads -------------------------------------------------------------------------------------
    @property
    def coef(self) -> np.ndarray:
        """The time coefficients, a live view (in shared memory when `is_shared`)."""
        return self._coef

    @property
    def version(self) -> int:
        """How many writes the coefficients have seen (+1 per `write`, `write_rows`, `drop_rows`)."""
        return int(self._seq[0]) // 2

    @property
    def is_shared(self) -> bool:
        """Whether the store lives in shared memory."""
        return self._raw is not None

    def rows(self) -> np.ndarray | None:
        """The per-stage rows ``[S, F]`` (a live view), or None when there are none."""
        n = int(self._rows_n[0])
        return self._rows[:n] if n else None

    def read(self) -> tuple[np.ndarray, int, np.ndarray | None]:
        """(coefficients, version, per-stage rows or None), copies, consistent under a concurrent write."""
        seq = self._seq
        while True:
            before = int(seq[0])
            coef = self._coef.copy()
            rows = self.rows()
            rows = None if rows is None else rows.copy()
            if before % 2 == 0 and int(seq[0]) == before:
                return coef, before // 2, rows
            time.sleep(0)

    # -- writes (one process writes; each is one version step, seen whole or not at all) -------------
    def write(self, coef) -> None:
        """New coefficients, the per-stage rows dropped (a scalar refit: stages are priced by the
        coefficients and the layout again); version + 1."""
        self._begin()
        self._coef[:] = coef
        self._put_rows(None)
        self._end()

    def write_rows(self, rows) -> None:
        """Per-stage rows ``[S, F]`` and their mean over the stages as the coefficients; version + 1."""
        rows = np.asarray(rows, np.float64)
        self._begin()
        self._coef[:] = rows.mean(axis=0)
        self._put_rows(rows)
        self._end()

    def drop_rows(self) -> None:
        """No per-stage rows any more (coefficients unchanged); version + 1."""
        self._begin()
        self._put_rows(None)
        self._end()

    def restore(self, coef, version: int, rows=None) -> None:
        """Set coefficients, rows and the version itself (a saved state read back), in the same buffer."""
        self._begin()
        self._coef[:] = coef
        self._put_rows(rows)
        self._seq[0] = 2 * int(version)

    def _begin(self) -> None:
        self._seq[0] += 1  # odd: a write is in progress (`read` waits it out)

    def _end(self) -> None:
        self._seq[0] += 1

    def _put_rows(self, rows) -> None:
        if rows is None:
            self._rows_n[0] = 0
            return
        rows = np.asarray(rows, np.float64)
        self._rows[:len(rows)] = rows
        self._rows_n[0] = len(rows)

    # -- sharing and copies ----------------------------------------------------------------------------
    def shared(self) -> "Coefficients":
        """This store in shared memory: itself when it already is, else a shared store with its values."""
        if self._raw is not None:
            return self
        import multiprocessing

        coef, version, rows = self.read()
        return Coefficients(coef, version, rows, multiprocessing.RawArray("b", 8 * buffer_words(len(coef))))

    def private(self) -> "Coefficients":
        """An independent private store with this one's current values and version."""
        return Coefficients(*self.read())

    def __copy__(self) -> "Coefficients":
        return self if self._raw is not None else self.private()

    def __deepcopy__(self, memo) -> "Coefficients":
        return self.private()

    def __getstate__(self) -> dict:
        from multiprocessing import context

        coef, version, rows = self.read()
        # a process being started with this store shares the shared buffer; any other pickle is a snapshot
        share = self._raw is not None and context.get_spawning_popen() is not None
        return {"raw": self._raw if share else None, "coef": coef, "version": version, "rows": rows}

    def __setstate__(self, state: dict) -> None:
        if state["raw"] is None:
            self.__init__(state["coef"], state["version"], state["rows"])
        else:  # the shared buffer already holds the values: view it without writing
            self._view(state["raw"], len(state["coef"]))
