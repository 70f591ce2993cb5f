"""Integrity of a plan file: the one `PlanMismatchError`, and the check that refuses rows edited
after writing (a sample placed twice in an epoch, rows deleted, added or changed), naming the step
and rank, and values or metadata edited (naming the column or entry). The record itself
(`integrity_metadata`, checksums) is defined in `format`, the column checksums in
`dynabatch.integrity`."""

from __future__ import annotations

import json

import numpy as np

from .. import integrity
from . import format as fmt

_SHOW = 3  # problems of one kind named in a message


class PlanMismatchError(ValueError):
    """A plan file that cannot be used: not a valid plan, edited after it was written, or made for
    another dataset, world layout or options. The message names the file and what differs."""


def _more(items: list[str], total: int) -> str:
    return ", ".join(items) + (f" and {total - len(items)} more" if total > len(items) else "")


def verify_rows(where: str, metadata: dict, table, steps, rank, ids, epoch_rows) -> None:
    """Refuse (`PlanMismatchError`, naming the step and rank) a sample placed twice in one epoch, and
    rows that do not match the integrity record the writer left in ``metadata``. ``epoch_rows``: the
    epoch of every row, or None when the file does not say."""
    mb = table.column(fmt.MICROBATCH).to_numpy()
    if epoch_rows is not None and len(ids):
        twice = []  # (epoch, sample id) placed more than once
        for e, rows in enumerate(fmt.epoch_slices(epoch_rows)):
            v = np.sort(ids[rows])
            again = v[1:][v[1:] == v[:-1]]
            if len(again):
                twice += [(e, int(x)) for x in np.unique(again)]  # few: np.unique is fine here
        if twice:
            shown = []
            for e, sid in twice[:_SHOW]:
                at = np.flatnonzero((ids == sid) & (epoch_rows == e))
                places = " and ".join(f"step {int(steps[i])} rank {int(rank[i])} micro-batch {int(mb[i])}"
                                      for i in at[:4])
                shown.append(f"sample id {int(sid)} appears {len(at)} times in epoch {e} ({places})")
            raise PlanMismatchError(
                f"{where} places a sample twice in one epoch: {_more(shown, len(twice))}; a plan places each "
                "sample at most once per epoch, so the file was edited or damaged: re-create it with "
                "`dynabatch plan`")
    raw = metadata.get(fmt.INTEGRITY_KEY)
    if raw is None:
        return  # written by an older release: nothing recorded to compare with
    try:
        rec = json.loads(raw)
        first, nsteps, ranks = int(rec["first_step"]), int(rec["steps"]), int(rec["num_ranks"])
        written = fmt.decode_step_rank_checksums(rec)
        written_counts = fmt.decode_step_rank_counts(rec)
    except (ValueError, KeyError, TypeError) as e:
        raise PlanMismatchError(f"{where}: {fmt.INTEGRITY_KEY} cannot be read ({e})") from None
    hashes = fmt.placement_hashes(steps, rank, mb, ids)
    problems = []
    if len(ids) != int(rec["placements"]):
        change = "rows deleted" if len(ids) < int(rec["placements"]) else "rows added"
        problems.append(f"it holds {len(ids)} placements but {int(rec['placements'])} were written ({change})")
    outside = np.unique(steps[(steps < first) | (steps >= first + nsteps)])
    if len(outside):
        problems.append(f"steps {outside[:_SHOW].tolist()} were not written")
    have, have_counts = fmt.step_rank_sums(steps, rank, hashes, first, nsteps, ranks)
    bad = np.argwhere(have != written)
    shown = []
    for s, r in bad[:_SHOW]:
        n_have, n_written = int(have_counts[s, r]), int(written_counts[s, r])
        if n_have != n_written:
            what = (f"holds {n_have} placements but {n_written} were written "
                    f"({'rows deleted' if n_have < n_written else 'rows added'})")
        else:
            what = "a sample id, micro-batch or step was changed"
        shown.append(f"step {first + int(s)} rank {int(r)} {what}")
    if shown:
        problems.append(_more(shown, len(bad)))
    if not problems and f"{fmt.checksum(hashes):016x}" != rec.get("sample_id_checksum"):  # belt and braces
        problems.append("the sample-id checksum differs")
    distinct = rec.get("distinct_samples")
    if epoch_rows is not None and distinct is not None:
        now = fmt.distinct_per_epoch(epoch_rows, ids)
        for e, (a, b) in enumerate(zip(now + [0] * (len(distinct) - len(now)), distinct)):
            if a != b:
                problems.append(f"epoch {e} has {a} distinct sample ids but {b} were written")
                break
    if problems:
        raise PlanMismatchError(f"{where} was changed after it was written: " + "; ".join(problems)
                                + "; re-create it with `dynabatch plan`")
    if "columns" in rec:  # plans of older releases record the placements only
        fix = "re-plan with `dynabatch plan` (or use the plan file exactly as it was written)"
        integrity.check(PlanMismatchError, where, "column", rec["columns"], fmt.column_checksums(table), fix)
        integrity.check(PlanMismatchError, where, "metadata entry", rec.get("metadata", {}),
                        fmt.metadata_digests(metadata), fix)
