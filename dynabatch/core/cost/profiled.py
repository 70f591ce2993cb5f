"""`ProfiledTable`: measured time (seconds) and activation memory (bytes) of padded micro-batches on a
grid of shapes, the measured source of truth behind `dynabatch.core.cost.model.CostModel.profiled`
(`dynabatch profile` builds one)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.cost import profiled_lookup


@dataclass(frozen=True)
class ProfiledTable:
    """Measured costs of padded micro-batches on a grid of (rows, main length, decoder length).

    ``time_s`` and ``memory_bytes`` have shape [len(rows), len(main_len), len(dec_len)]; use a
    single decoder length of 0 for decoder-only models. Shapes beyond the grid are infeasible
    (+inf) unless ``extrapolate`` is set, in which case they are extrapolated linearly.
    """

    rows: np.ndarray
    main_len: np.ndarray
    dec_len: np.ndarray
    time_s: np.ndarray
    memory_bytes: np.ndarray
    extrapolate: bool = False

    def __post_init__(self) -> None:
        for name in ("rows", "main_len", "dec_len"):
            g = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if g.ndim != 1 or len(g) == 0 or np.any(np.diff(g) <= 0):
                raise ValueError(f"ProfiledTable.{name} must be a non-empty strictly increasing 1-D grid")
            object.__setattr__(self, name, g)
        shape = (len(self.rows), len(self.main_len), len(self.dec_len))
        for name in ("time_s", "memory_bytes"):
            v = np.ascontiguousarray(getattr(self, name), dtype=np.float64)
            if v.shape != shape:
                raise ValueError(f"ProfiledTable.{name} must have shape {shape}, got {v.shape}")
            object.__setattr__(self, name, v)

    def lookup(self, rows, main_len, dec_len) -> tuple[np.ndarray, np.ndarray]:
        """Interpolated (time seconds, memory bytes) at arrays of padded shapes."""
        rows, main_len, dec_len = np.broadcast_arrays(
            np.asarray(rows, np.int64), np.asarray(main_len, np.int64), np.asarray(dec_len, np.int64)
        )
        t = np.empty(rows.shape)
        m = np.empty(rows.shape)
        for idx in np.ndindex(rows.shape):
            t[idx] = profiled_lookup(self.rows, self.main_len, self.dec_len, self.time_s, rows[idx],
                                     main_len[idx], dec_len[idx], self.extrapolate)
            m[idx] = profiled_lookup(self.rows, self.main_len, self.dec_len, self.memory_bytes, rows[idx],
                                     main_len[idx], dec_len[idx], self.extrapolate)
        return t, m
