"""Numba kernel of the padded collator (`dynabatch.loader.collate`) beside its plain-Python
reference: token ids of ragged samples written into right-padded rows.

=============  =====================
kernel         reference
=============  =====================
`pad_rows`     `pad_rows_reference`
=============  =====================
"""

from __future__ import annotations

from .compile_once import njit


@njit(cache=True)
def pad_rows(flat, lengths, fill, out, mask):
    """Row i of ``out`` [n, L]: sample i's values from ``flat`` (samples concatenated in row
    order), then ``fill``. ``mask`` (same shape, or 0 rows to skip) gets 1 on real tokens, else 0.
    One pass instead of a boolean mask, a fill and a scatter per micro-batch. A sample longer than
    ``L`` is cut to ``L``."""
    pos = 0
    L = out.shape[1]
    for i in range(lengths.shape[0]):
        n = lengths[i]
        for j in range(L):
            out[i, j] = flat[pos + j] if j < n else fill
        if mask.shape[0]:
            for j in range(L):
                mask[i, j] = 1 if j < n else 0
        pos += n


def pad_rows_reference(flat, lengths, fill, width):
    """Plain-Python `pad_rows`: (rows, mask) as lists of ``width`` ints per sample."""
    rows, mask, pos = [], [], 0
    for n in (int(x) for x in lengths):
        values = [int(v) for v in flat[pos: pos + n]][:width]
        pad = width - len(values)
        rows.append(values + [fill] * pad)
        mask.append([1] * len(values) + [0] * pad)
        pos += n
    return rows, mask
