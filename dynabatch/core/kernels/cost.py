"""Numba kernels of the cost model, each beside its plain-Python reference.

A micro-batch's cost is ``coef @ phi`` over the features `FEATURES` (defined in
`dynabatch.core.cost.model`'s module docstring), or a lookup in a measured table of padded shapes. The
planner's DP (`dynabatch.core.kernels.dp`) evaluates costs with these kernels for every candidate
segment; `dynabatch.core.cost.model.CostModel` offers the same costs vectorized over numpy arrays.

==========================  ================================
kernel                      reference
==========================  ================================
`padded_features`           `padded_features_reference`
`profiled_lookup`           `profiled_lookup_reference`
`round_up`, `dot`,          helpers of the two above and of the DP, covered by their references
`_interp_axis`
==========================  ================================
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from .compile_once import njit

#: Feature layout of ``phi``; `padded_features` and the DP write these slots by position.
FEATURES = ("n_main", "q_main", "n_dec", "q_dec", "x_dec", "n_vis", "q_vis", "one", "has_vis", "q_pad")
NUM_FEATURES = len(FEATURES)
Q_PAD = FEATURES.index("q_pad")  # its slot, for the kernels that add a padded micro-batch's mask cost


# --------------------------------------------------------------------------- features


@njit(cache=True)
def round_up(x: int, multiple: int) -> int:
    """``x`` rounded up to a multiple of ``multiple`` (``multiple`` <= 1 leaves it unchanged)."""
    if multiple <= 1:
        return x
    return ((x + multiple - 1) // multiple) * multiple


@njit(cache=True)
def padded_features(rows, main_len, dec_len, tiles, tile_patches, out, padding=False):
    """Fill ``out`` (length NUM_FEATURES) with the features of a padded micro-batch of ``rows``
    rows padded to ``main_len``/``dec_len`` tokens, holding ``tiles`` vision tiles in total
    (``tile_patches`` ViT tokens each); ``padding``: some row's main-stack sample is shorter than
    ``main_len`` (its attention needs a padding mask)."""
    r = float(rows)
    L = float(main_len)
    T = float(dec_len)
    v = float(tiles) * tile_patches
    out[0] = r * L
    out[1] = r * L * L
    out[2] = r * T
    out[3] = r * T * T
    out[4] = r * T * L
    out[5] = v
    out[6] = v * tile_patches
    out[7] = 1.0 if rows > 0 else 0.0
    out[8] = 1.0 if tiles > 0 else 0.0
    out[9] = r * L * L if padding else 0.0


def padded_features_reference(rows, main_len, dec_len, tiles, tile_patches, padding=False):
    """Plain-Python `padded_features`: the feature list of a padded micro-batch, by name."""
    rows, length, target = float(rows), float(main_len), float(dec_len)
    vis_tokens = float(tiles) * tile_patches
    named = {
        "n_main": rows * length,  # every row is padded to the longest sample
        "q_main": rows * length * length,  # attention is quadratic in the padded length
        "n_dec": rows * target,
        "q_dec": rows * target * target,
        "x_dec": rows * target * length,  # cross-attention: decoder x encoder tokens
        "n_vis": vis_tokens,
        "q_vis": vis_tokens * tile_patches,  # ViT attention is quadratic per tile
        "one": 1.0 if rows > 0 else 0.0,
        "has_vis": 1.0 if tiles > 0 else 0.0,
        # attention with a padding mask: Hugging Face models take their causal fast path (SDPA
        # is_causal, no [rows, 1, L, L] mask) only when no row is padded
        "q_pad": rows * length * length if padding else 0.0,
    }
    return [named[name] for name in FEATURES]


@njit(cache=True)
def dot(coef, phi) -> float:
    """``coef @ phi`` for two short float64 vectors, summed left to right."""
    s = 0.0
    for k in range(coef.shape[0]):
        s += coef[k] * phi[k]
    return s


# --------------------------------------------------------------------------- profiled table


@njit(cache=True)
def _interp_axis(grid, x):
    """Index ``i`` and weight ``w`` so that x ~ (1-w)*grid[i] + w*grid[i+1]; w outside [0,1] extrapolates."""
    n = grid.shape[0]
    if n == 1:
        return 0, 0.0
    i = 0
    while i < n - 2 and x > grid[i + 1]:
        i += 1
    w = (x - grid[i]) / (grid[i + 1] - grid[i])
    return i, w


@njit(cache=True)
def _trilinear(grid_rows, grid_len, grid_dec, values, x_rows, x_len, x_dec) -> float:
    """Trilinear blend of ``values`` at a point (a weight beyond [0, 1] extrapolates the edge cell)."""
    i, wi = _interp_axis(grid_rows, x_rows)
    j, wj = _interp_axis(grid_len, x_len)
    k, wk = _interp_axis(grid_dec, x_dec)
    ni = 1 if grid_rows.shape[0] > 1 else 0
    nj = 1 if grid_len.shape[0] > 1 else 0
    nk = 1 if grid_dec.shape[0] > 1 else 0
    acc = 0.0
    for di in range(ni + 1):
        for dj in range(nj + 1):
            for dk in range(nk + 1):
                w = (wi if di else 1.0 - wi) if ni else 1.0
                w *= (wj if dj else 1.0 - wj) if nj else 1.0
                w *= (wk if dk else 1.0 - wk) if nk else 1.0
                acc += w * values[i + di, j + dj, k + dk]
    return acc


@njit(cache=True)
def profiled_lookup(grid_rows, grid_len, grid_dec, values, rows, main_len, dec_len, extrapolate) -> float:
    """Trilinear interpolation of ``values[r, l, t]`` at a padded shape; +inf outside the grid
    unless ``extrapolate``: then linear extrapolation from the edge cell, but above the grid never
    less than the value at the grid's edge scaled in proportion (x / largest grid point, per axis
    beyond it), so that noisy edge measurements cannot make a larger shape cheaper; clipped at 0.

    The result has the unit of ``values`` (seconds or bytes); the grids are strictly increasing
    float64 rows, tokens and decoder tokens.
    """
    r, ml, dl = float(rows), float(main_len), float(dec_len)
    if not extrapolate:
        if (r < grid_rows[0] or r > grid_rows[-1] or ml < grid_len[0] or ml > grid_len[-1]
                or dl < grid_dec[0] or dl > grid_dec[-1]):
            return np.inf
    acc = _trilinear(grid_rows, grid_len, grid_dec, values, r, ml, dl)
    if extrapolate and (r > grid_rows[-1] or ml > grid_len[-1] or dl > grid_dec[-1]):
        scale = 1.0
        for x, top in ((r, grid_rows[-1]), (ml, grid_len[-1]), (dl, grid_dec[-1])):
            if x > top and top > 0.0:
                scale *= x / top
        edge = _trilinear(grid_rows, grid_len, grid_dec, values, min(r, grid_rows[-1]), min(ml, grid_len[-1]),
                          min(dl, grid_dec[-1]))
        acc = max(acc, edge * scale)
    return max(acc, 0.0)


def profiled_lookup_reference(grid_rows, grid_len, grid_dec, values, rows, main_len, dec_len, extrapolate):
    """Plain-Python `profiled_lookup`: the table value at a padded shape, interpolated linearly
    along each axis (same units as ``values``)."""
    grids = [[float(g) for g in grid] for grid in (grid_rows, grid_len, grid_dec)]
    point = [float(rows), float(main_len), float(dec_len)]
    outside = any(x < grid[0] or x > grid[-1] for x, grid in zip(point, grids))
    if outside and not extrapolate:
        return math.inf
    # Per axis, the (index, weight) pairs to blend: both ends of the grid cell holding x, or of the
    # first / last cell when x lies outside (a weight beyond [0, 1] then extrapolates); an axis
    # with a single grid point contributes that point alone.
    axes = []
    for x, grid in zip(point, grids):
        if len(grid) == 1:
            axes.append([(0, 1.0)])
            continue
        cell = 0
        while cell < len(grid) - 2 and x > grid[cell + 1]:
            cell += 1
        w = (x - grid[cell]) / (grid[cell + 1] - grid[cell])
        axes.append([(cell, 1.0 - w), (cell + 1, w)])
    total = 0.0
    for (i, wi), (j, wj), (k, wk) in itertools.product(*axes):
        total += wi * wj * wk * float(values[i][j][k])
    above = [x > grid[-1] for x, grid in zip(point, grids)]
    if any(above):  # never below the edge's value in proportion: noise at the edge cannot make it cheaper
        edge = profiled_lookup_reference(grid_rows, grid_len, grid_dec, values,
                                         *[min(x, grid[-1]) for x, grid in zip(point, grids)], extrapolate)
        total = max(total, edge * math.prod(x / grid[-1] for x, grid, up in zip(point, grids, above)
                                            if up and grid[-1] > 0))
    return max(total, 0.0)  # extrapolation can go below zero; a cost cannot
