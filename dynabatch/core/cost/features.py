"""Features of a plan's micro-batches under a cost model: the one place a `BatchPlan` becomes the
feature rows (`dynabatch.core.kernels.cost.FEATURES`) a `CostModel` prices. The planner's
evaluation and recompute pricing use all of them (`microbatch_features`), the feedback loop those of
one rank (`plan_features`). Padded collations read the plan's shape columns; packed plans need the
samples' lengths (``shapes``), truncated as the plan records (``max_len``/``max_target_len``).
"""

from __future__ import annotations

import numpy as np

from ..kernels.cost import NUM_FEATURES, Q_PAD


def packed_rows(main_len, dec_len, tiles, group, tile_patches: int, dense: bool) -> np.ndarray:
    """Features ``[G, NUM_FEATURES]`` of packed micro-batches, each one row: per-sample main and decoder
    lengths (tokens) and image tiles summed by ``group`` id (0..G-1), ``tile_patches`` ViT tokens per tile.
    A varlen kernel's attention is quadratic per sample (``sum(s**2)``). ``dense``: the row of ``N`` main
    (``Nt`` decoder) tokens is attended whole, the samples kept apart by a mask, so it costs what one
    padded row of that length with a mask does: ``N**2`` (``Nt**2``, ``Nt * N``) and, for a row of
    several samples, ``q_pad = N**2`` (one sample alone needs no mask). The DP prices its packed
    segments the same way (`dynabatch.core.kernels.segments`)."""
    main_len = np.asarray(main_len, np.float64)
    dec_len = np.asarray(dec_len, np.float64)
    v = np.asarray(tiles, np.float64) * tile_patches
    group = np.asarray(group, np.int64)
    g = int(group.max()) + 1 if len(group) else 0
    cols = [main_len, main_len**2, dec_len, dec_len**2, dec_len * main_len, v, v * tile_patches]
    phi = np.zeros((g, NUM_FEATURES))
    for k, c in enumerate(cols):
        phi[:, k] = np.bincount(group, weights=c, minlength=g)
    count = np.bincount(group, minlength=g)
    phi[:, 7] = count > 0
    phi[:, 8] = phi[:, 5] > 0
    if dense:
        n, t = phi[:, 0], phi[:, 2]
        phi[:, 1], phi[:, 3], phi[:, 4] = n * n, t * t, t * n
        phi[:, Q_PAD] = np.where(count > 1, n * n, 0.0)
    return phi


def main_padding(main_tokens, rows, main_len) -> np.ndarray:
    """Whether each padded micro-batch holds padding on its main stack (``q_pad``): fewer real
    main-stack tokens ``main_tokens`` than its ``rows`` x (rounded) ``main_len`` slots. No row holds
    more than ``main_len``, so this is exactly "some row is shorter" (bool array)."""
    return np.asarray(main_tokens, np.int64) < np.asarray(rows, np.int64) * np.asarray(main_len, np.int64)


def microbatch_features(plan, cost, shapes=None) -> np.ndarray:
    """Features ``[M, NUM_FEATURES]`` of a plan's micro-batches (plan order) under ``cost``: from the
    plan's shape columns for padded collations; packed plans need the samples' ``shapes`` (any
    `Shapes` holding their sample ids)."""
    sizes = np.diff(plan.mb_offsets)
    if plan.collation != "packed":
        padding = main_padding(plan.mb_real_tokens - plan.mb_target_tokens, plan.mb_rows, plan.mb_input_len)
        return cost.padded_features(plan.mb_rows, plan.mb_input_len, plan.mb_target_len, plan.mb_vision_tiles, padding)
    if shapes is None:
        raise ValueError(f"the features of a packed plan (step {plan.step}) need the samples' lengths: pass "
                         "shapes= (the global batch's Shapes)")
    order = np.argsort(shapes.sample_id, kind="stable")
    pos = np.minimum(np.searchsorted(shapes.sample_id, plan.sample_ids, sorter=order), max(len(order) - 1, 0))
    where = order[pos] if len(order) else pos
    if not len(order) or not np.array_equal(shapes.sample_id[where], plan.sample_ids):
        missing = plan.sample_ids[~np.isin(plan.sample_ids, shapes.sample_id)]
        raise ValueError(f"shapes= does not hold every sample of the plan of step {plan.step}: sample_id "
                         f"{int(missing[0])} (and {len(missing) - 1} more) missing")
    main, dec, tiles = cost.sample_dims(shapes.take(where), plan.options.get("max_len"),
                                        plan.options.get("max_target_len"))
    return cost.packed_features(main, dec, tiles, np.repeat(np.arange(len(sizes)), sizes))


def plan_features(cost, plan, shapes=None, rank: int | None = None) -> np.ndarray:
    """`microbatch_features` of ``plan``'s micro-batches of ``rank`` (all ranks if None), plan order."""
    phi = microbatch_features(plan, cost, shapes)
    return phi if rank is None else phi[np.flatnonzero(plan.mb_rank == rank)]
