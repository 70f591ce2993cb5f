"""The batching methods dynabatch is compared against, as groupings of one global batch.

Each function returns a `Grouping`: sample positions cut into micro-batches, each tied to a
rank, plus the row each sample occupies (packing puts several samples in one row). The planner
costs, orders and simulates every grouping the same way, so a comparison is one ``method=`` flag.

* ``pad``: fixed rows per micro-batch in arrival order, each rank taking every R-th sample
  (``DistributedSampler``), padded to the micro-batch's longest sample.
* ``group_by_length``: Hugging Face ``LengthGroupedSampler``: mega-batches of 50 micro-batches
  sorted by length (longest first), cut into fixed-row micro-batches handed to ranks in turn.
* ``token_budget``: fairseq ``batch_by_size``: each rank sorts its samples by length and fills
  micro-batches while rows * padded length <= ``max_tokens``.
* ``pack``: first-fit-decreasing packing into fixed-length rows (``max_len`` input tokens and, for
  encoder-decoder, ``max_target_len`` target tokens), attention over the whole row (DynaPipe's
  packing baseline), a fixed number of rows per micro-batch.
* ``pack_varlen``: best-fit-decreasing packing into rows of ``max_len`` tokens as TRL does,
  costed with per-sample (varlen) attention: the padding-free baseline.
* ``rebalance``: length-sorted padded micro-batches whose sizes are adjusted so their estimated
  costs are equal, dealt to ranks in turn (transformers' ``BatchRebalanceSampler`` idea).
* ``kk``: OpenRLHF/verl dynamic batching: Karmarkar-Karp splits the samples over ranks with equal
  token sums, then each rank cuts ``ceil(tokens / max_tokens)`` varlen micro-batches, again by KK.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..kernels.packing import budget_cuts, pack_rows
from ..methods import BASELINE_COLLATION, BASELINE_KNOBS, BASELINES  # noqa: F401  (public from here too)

@dataclass(frozen=True)
class Grouping:
    """Micro-batches of one global batch before costing: ``positions[offsets[k]:offsets[k+1]]``
    are the samples (indices into the global batch) of micro-batch k, run on ``rank[k]``;
    ``row`` gives each sample's row inside its micro-batch."""

    positions: np.ndarray
    offsets: np.ndarray
    rank: np.ndarray
    row: np.ndarray


def _from_lists(groups: list[np.ndarray], ranks: list[int], rows: list[np.ndarray] | None = None) -> Grouping:
    groups_kept = [(g, r, None if rows is None else rows[i]) for i, (g, r) in enumerate(zip(groups, ranks)) if len(g)]
    if not groups_kept:
        z = np.zeros(0, np.int64)
        return Grouping(z, np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))
    positions = np.concatenate([g for g, _, _ in groups_kept]).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum([len(g) for g, _, _ in groups_kept]))).astype(np.int64)
    rank = np.array([r for _, r, _ in groups_kept], np.int32)
    if rows is None:
        row = np.concatenate([np.arange(len(g)) for g, _, _ in groups_kept]).astype(np.int32)
    else:
        row = np.concatenate([w for _, _, w in groups_kept]).astype(np.int32)
    return Grouping(positions, offsets, rank, row)


def _rank_shares(n: int, ranks: int) -> list[np.ndarray]:
    """Every R-th sample per rank, as ``DistributedSampler`` deals them."""
    return [np.arange(r, n, ranks) for r in range(ranks)]


def _chunks(idx: np.ndarray, size: int) -> list[np.ndarray]:
    return [idx[a:a + size] for a in range(0, len(idx), size)]


def pad(tokens: np.ndarray, ranks: int, rows: int = 8) -> Grouping:
    """Fixed ``rows`` per micro-batch in arrival order (see module docstring)."""
    groups, owner = [], []
    for r, share in enumerate(_rank_shares(len(tokens), ranks)):
        for g in _chunks(share, rows):
            groups.append(g)
            owner.append(r)
    return _from_lists(groups, owner)


def group_by_length(tokens: np.ndarray, ranks: int, rows: int = 8, megabatch_mult: int = 50) -> Grouping:
    """Hugging Face length-grouped micro-batches (see module docstring)."""
    n = len(tokens)
    mega = max(rows * min(megabatch_mult, max(n // (rows * 4), 1)), rows)
    groups = []
    for a in range(0, n, mega):
        idx = np.arange(a, min(a + mega, n))
        idx = idx[np.argsort(-tokens[idx], kind="stable")]
        groups.extend(_chunks(idx, rows))
    return _from_lists(groups, [k % ranks for k in range(len(groups))])


def token_budget(tokens: np.ndarray, ranks: int, max_tokens: int = 4096, pad_multiple: int = 8) -> Grouping:
    """fairseq-style max-tokens micro-batches per rank (see module docstring)."""
    groups, owner = [], []
    for r, share in enumerate(_rank_shares(len(tokens), ranks)):
        idx = share[np.argsort(tokens[share], kind="stable")]
        starts = budget_cuts(tokens[idx].astype(np.int64), int(max_tokens), int(pad_multiple))
        for a, b in zip(starts, list(starts[1:]) + [len(idx)]):
            groups.append(idx[a:b])
            owner.append(r)
    return _from_lists(groups, owner)


def _packed(main, dec, ranks, rows, max_len, max_target_len, best_fit) -> Grouping:
    groups, owner, row_lists = [], [], []
    for r, share in enumerate(_rank_shares(len(main), ranks)):
        order = share[np.lexsort((dec[share], -main[share]))] if len(share) else share
        row, nrows = pack_rows(order, main.astype(np.int64), dec.astype(np.int64), int(max_len),
                               int(max_target_len), best_fit)
        for first in range(0, nrows, rows):
            sel = (row >= first) & (row < first + rows)
            # Samples grouped by row keep the row-major layout the collator will build.
            o = np.argsort(row[sel], kind="stable")
            groups.append(order[sel][o])
            row_lists.append(row[sel][o] - first)
            owner.append(r)
    return _from_lists(groups, owner, row_lists)


def pack(main, dec, ranks, rows=2, max_len=2048, max_target_len=512) -> Grouping:
    """First-fit-decreasing packing into fixed-length rows (see module docstring)."""
    return _packed(main, dec, ranks, rows, max_len, max_target_len if dec.any() else 0, best_fit=False)


def pack_varlen(main, dec, ranks, rows=2, max_len=2048, max_target_len=512) -> Grouping:
    """Best-fit-decreasing packing into rows of ``max_len`` tokens (see module docstring)."""
    total = main + dec
    return _packed(total, np.zeros_like(dec), ranks, rows, max_len + (max_target_len if dec.any() else 0), 0,
                   best_fit=True)


def rebalance(tokens, sample_time, ranks, microbatches_per_rank=4) -> Grouping:
    """Length-sorted padded micro-batches of equal estimated cost (see module docstring)."""
    n = len(tokens)
    k = max(min(ranks * microbatches_per_rank, n), 1)
    idx = np.argsort(tokens, kind="stable")
    cum = np.cumsum(sample_time[idx])
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k, side="right") if n else np.zeros(0, np.int64)
    cuts = np.unique(np.clip(cuts, 1, max(n - 1, 1)))
    groups = [g for g in np.split(idx, cuts) if len(g)]
    return _from_lists(groups, [q % ranks for q in range(len(groups))])


def karmarkar_karp(weights: np.ndarray, k: int, equal_size: bool) -> list[np.ndarray]:
    """k-way largest-differencing partition of ``weights`` (indices per part), as verl's
    ``get_seqlen_balanced_partitions``: with ``equal_size`` each part gets len/k items."""
    n = len(weights)
    if k <= 0:
        raise ValueError("karmarkar_karp needs k >= 1")
    if equal_size and n % k:
        raise ValueError(f"equal_size partition needs len(weights) ({n}) divisible by k ({k})")
    order = np.argsort(weights, kind="stable")
    heap = []
    # Each state: k parts (sum, items), sorted by sum descending; seed by k items at a time when
    # equal_size (so sizes stay equal), else one item per state.
    step = k if equal_size else 1
    for a in range(0, n, step):
        items = order[a:a + step]
        parts = [[float(weights[i]), [int(i)]] for i in items] + [[0.0, []] for _ in range(k - len(items))]
        parts.sort(key=lambda p: -p[0])
        spread = parts[0][0] - parts[-1][0]
        heapq.heappush(heap, (-spread, a, parts))
    while len(heap) > 1:
        _, a1, p1 = heapq.heappop(heap)
        _, a2, p2 = heapq.heappop(heap)
        merged = [[x[0] + y[0], x[1] + y[1]] for x, y in zip(p1, reversed(p2))]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), min(a1, a2), merged))
    parts = heap[0][2] if heap else [[0.0, []] for _ in range(k)]
    return [np.array(sorted(p[1]), np.int64) for p in parts]


def kk(tokens, ranks, max_tokens=4096) -> Grouping:
    """verl/OpenRLHF dynamic batching (see module docstring)."""
    n = len(tokens)
    keep = n - n % ranks
    shares = karmarkar_karp(tokens[:keep], ranks, equal_size=True)
    # A remainder that cannot be split evenly goes to the lightest ranks, one each.
    if keep < n:
        light = np.argsort([tokens[s].sum() for s in shares], kind="stable")
        for q, extra in enumerate(range(keep, n)):
            shares[light[q]] = np.append(shares[light[q]], extra)
    groups, owner = [], []
    for r, share in enumerate(shares):
        m = max(int(np.ceil(tokens[share].sum() / max_tokens)), 1)
        m = min(m, len(share))
        for part in karmarkar_karp(tokens[share], m, equal_size=False):
            if len(part):
                groups.append(share[part])
                owner.append(r)
    return _from_lists(groups, owner)
