"""What the DP (`dynabatch.core.kernels.dp`) pays for each candidate micro-batch: a segment of consecutive
samples, priced in seconds from the cost model's linear coefficients or its profiled table, padded or
packed (`SegmentCost`), and every memory-feasible segment enumerated once (`enumerate_segments`), so
the DP's passes over caps only read their times. `dp_reference` prices segments in plain Python by the
same definitions (`CostModel.padded_features` / `packed_features`); the DP tests compare the two.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from .compile_once import njit

from .arrays import kernel_array
from .cost import NUM_FEATURES, Q_PAD, padded_features, profiled_lookup, round_up


class SegmentCost(NamedTuple):
    """How the DP prices a segment (a candidate micro-batch of consecutive samples), as numba takes it:
    packed (``varlen``) or padded to ``pad_multiple`` tokens, ``tile_patches`` ViT tokens per tile, the
    linear ``time_coef`` (seconds) and ``mem_coef`` (bytes) per feature, at most ``mem_limit`` bytes;
    padded segments of a profiled table (``use_table``) are looked up in ``table_time``/``table_mem``
    ``[rows, len, dec]`` over ``grid_rows``/``grid_len``/``grid_dec`` (``extrapolate`` beyond them).
    ``dense``: a packed segment is one row attended whole with a mask (`CostModel.packed_features`
    with ``packed_attention="dense"``). Build it with `segment_cost`."""

    varlen: bool
    pad_multiple: int
    tile_patches: int
    time_coef: np.ndarray
    mem_coef: np.ndarray
    mem_limit: float
    use_table: bool
    grid_rows: np.ndarray
    grid_len: np.ndarray
    grid_dec: np.ndarray
    table_time: np.ndarray
    table_mem: np.ndarray
    extrapolate: bool
    dense: bool


def segment_cost(varlen: bool, pad_multiple: int, tile_patches: int, time_coef, mem_coef, mem_limit: float,
                 table=None, dense: bool = False) -> SegmentCost:
    """A `SegmentCost` with numba's types; ``table``: a profiled table (``rows``, ``main_len``,
    ``dec_len``, ``time_s``, ``memory_bytes``, ``extrapolate``; used for padded segments) or None;
    ``dense``: the cost model's ``packed_attention == "dense"`` (packed segments only)."""
    f64 = lambda x: kernel_array(x, np.float64)  # noqa: E731  (a cost model unpickled by Ray is read-only)
    if table is None or varlen:
        z1, z3 = np.zeros(1), np.zeros((1, 1, 1))
        grid, extrapolate = (z1, z1, z1, z3, z3), False
    else:
        grid = (f64(table.rows), f64(table.main_len), f64(table.dec_len), f64(table.time_s), f64(table.memory_bytes))
        extrapolate = bool(table.extrapolate)
    return SegmentCost(bool(varlen), int(pad_multiple), int(tile_patches), f64(time_coef), f64(mem_coef),
                       float(mem_limit), table is not None and not varlen, *grid, extrapolate, bool(dense))


@njit(cache=True, nogil=True)
def _dot_nz(coef, nz, phi) -> float:
    """`kernels.cost.dot` over the positions ``nz`` (those of the nonzero coefficients), left to right."""
    s = 0.0
    for q in range(nz.shape[0]):
        k = nz[q]
        s += coef[k] * phi[k]
    return s


@njit(cache=True, nogil=True)
def enumerate_segments(main, dec, tiles, cost):
    """All memory-feasible segments, grouped by end: for end i (exclusive) the starts are
    i-1, i-2, ... i-count[i]; their times are seg_time[offset[i] : offset[i]+count[i]] (priced by
    ``cost``, a `SegmentCost`).

    Returns (offset, count, seg_time, bad) where bad is the position of a sample that does not
    fit even alone (-1 if none). Growing a segment never lowers its memory, so the scan for each
    end stops at the first infeasible start.
    """
    varlen, pad_multiple, tile_patches, mem_limit = cost.varlen, cost.pad_multiple, cost.tile_patches, cost.mem_limit
    tcoef, mcoef, use_table, extrapolate = cost.time_coef, cost.mem_coef, cost.use_table, cost.extrapolate
    dense = cost.dense
    grid_r, grid_l, grid_d, tab_t, tab_m = cost.grid_rows, cost.grid_len, cost.grid_dec, cost.table_time, cost.table_mem
    n = main.shape[0]
    phi = np.zeros(NUM_FEATURES)
    # The dot products skip zero coefficients: a skipped term is +-0.0 (features are finite), so
    # the left-to-right sums, and every segment time, are bit for bit those of `kernels.cost.dot`.
    tnz = np.flatnonzero(tcoef)
    mnz = np.flatnonzero(mcoef)
    offset = np.zeros(n + 1, np.int64)
    count = np.zeros(n + 1, np.int64)
    cap = 16 * n + 16
    seg_time = np.empty(cap)
    used = 0
    # running aggregates while extending a segment to the left
    for i in range(1, n + 1):
        offset[i] = used
        L = 0
        low = main[i - 1]  # the segment's shortest main length: padded rows need a mask (q_pad)
        T = 0
        v = 0
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        s4 = 0.0
        s5 = 0.0
        s6 = 0.0
        for j in range(i - 1, -1, -1):
            if varlen:
                Lf = float(main[j])
                Tf = float(dec[j])
                vf = float(tiles[j]) * tile_patches
                s0 += Lf
                s1 += Lf * Lf
                s2 += Tf
                s3 += Tf * Tf
                s4 += Tf * Lf
                s5 += vf
                s6 += vf * tile_patches
                phi[0] = s0
                phi[1] = s1
                phi[2] = s2
                phi[3] = s3
                phi[4] = s4
                phi[5] = s5
                phi[6] = s6
                phi[7] = 1.0
                phi[8] = 1.0 if s5 > 0 else 0.0
                if dense:  # one row attended whole, with a mask for several samples (CostModel.packed_features)
                    phi[1] = s0 * s0
                    phi[3] = s2 * s2
                    phi[4] = s2 * s0
                    phi[Q_PAD] = s0 * s0 if i - j > 1 else 0.0
                t = _dot_nz(tcoef, tnz, phi)
                m = _dot_nz(mcoef, mnz, phi)
            else:
                L = max(L, main[j])
                low = min(low, main[j])
                T = max(T, dec[j])
                v += tiles[j]
                Lp = round_up(L, pad_multiple)
                Tp = round_up(T, pad_multiple)
                if use_table:  # the table holds full rows; a padded segment adds its mask's cost
                    t = profiled_lookup(grid_r, grid_l, grid_d, tab_t, i - j, Lp, Tp, extrapolate)
                    m = profiled_lookup(grid_r, grid_l, grid_d, tab_m, i - j, Lp, Tp, extrapolate)
                    if low < Lp and tcoef[Q_PAD] > 0:  # q_pad as `padded_features` defines it
                        padded_features(i - j, Lp, Tp, v, tile_patches, phi, np.bool_(True))
                        t += tcoef[Q_PAD] * phi[Q_PAD]
                else:
                    padded_features(i - j, Lp, Tp, v, tile_patches, phi, low < Lp)
                    t = _dot_nz(tcoef, tnz, phi)
                    m = _dot_nz(mcoef, mnz, phi)
            if m > mem_limit or not np.isfinite(t):
                break
            if used == cap:
                cap *= 2
                grown = np.empty(cap)
                grown[:used] = seg_time[:used]
                seg_time = grown
            seg_time[used] = t
            used += 1
        count[i] = used - offset[i]
        if count[i] == 0:
            return offset, count, seg_time[:used], i - 1
    return offset, count, seg_time[:used], -1
