"""The plan-file format, defined once: metadata keys, versions, column names and the integrity record.

A plan file is an Arrow table (written as Parquet, or Arrow IPC) with **one row per sample
placement**, grouped by step, then rank, then micro-batch in execution order. Every writer
(`BatchPlan.to_arrow`, `plans_to_arrow`, `dynabatch.offline.plan_run`) and the one reader
(`dynabatch.planfile.RunPlan`) import their names from here.

Columns (`COLUMNS`; the first five are required, the others optional):

    step           int64    global step, 0-based across epochs
    rank           int32    data-parallel rank that runs the micro-batch
    microbatch     int32    position of the micro-batch in its rank's execution order
    row            int32    row of the sample in the micro-batch (packed_rows: the packed row it shares)
    sample_id      int64    the sample (the loaders' stable id)
    rows           int64    rows (padded), sequences (packed) or packed rows of the micro-batch
    input_len      int64    padded main-stack length, tokens (packed: longest sample)
    target_len     int64    padded decoder length, tokens
    vision_tiles   int64    image tiles the vision encoder processes
    tokens         int64    tokens computed: rows x (input_len + target_len), or the packed total
                            (an encoder-decoder's two rows)
    real_tokens    int64    tokens of the micro-batch's samples
    target_tokens  int64    decoder (target) tokens of the micro-batch's samples (packed: the decoder
                            row a pipeline stage sends); files of older releases lack it: read as 0
                            where target_len is 0, refused (re-plan) where a micro-batch has decoder tokens
    time_s         float64  predicted forward+backward seconds of the micro-batch on one stage
    memory_bytes   float64  predicted peak activation bytes of the micro-batch on one stage
    epoch          int32    epoch of the step (files of older releases may lack it)
    task_id        int32    the sample's task (index into dynabatch.task_names), -1 unknown
    sample_tokens  int32    the sample's own tokens after truncation (they sum to real_tokens)
    stage_time_s   list<float64>[S]  per-stage plans only (a cost model with a non-uniform layer
                   layout, `dynabatch.core.cost.stages`): the micro-batch's seconds on each stage
    stage_memory_bytes  list<float64>[S]  the same, activation bytes; absent columns mean every stage
                   costs time_s / memory_bytes (older files never have them; no version change)
    op_slots       list<int32>[2S]  the op order the planner simulated (`BatchPlan.op_slots`): per stage
                   the positions of the micro-batch's forward and backward in its rank's op list;
                   files of older releases lack it (their order is derived again, `core.orders`)

Metadata keys (all strings; JSON where noted):

    dynabatch.plan_schema_version  the row format above (`PLAN_SCHEMA_VERSION`); required
    dynabatch.run_plan_version     the run-level layout (`RUN_PLAN_VERSION`); absent in bare
                                   `plans_to_arrow` tables and files of older releases
    dynabatch.method / collation / schedule / num_ranks / num_stages  (schedule: the one order of
                                   every step, or ``auto`` when steps differ)
    dynabatch.step_schedule        JSON {step: the concrete order (gpipe, 1f1b, adaptive) the step was
                                   simulated with and the runner follows}; files of older releases
                                   lack it: every step then uses dynabatch.schedule
    dynabatch.dataset_fingerprint  `Shapes.fingerprint()` of the planned length index
    dynabatch.cost_model           JSON `CostModel.to_dict()` of the model that predicted the costs
    dynabatch.options              JSON `PlanOptions.to_dict()` (every planning option, plus the
                                   derived ``collation``) and the run's ``epochs``, ``tokenizer`` and
                                   ``family`` (`OPTION_EXTRAS`). Older files used other names for
                                   the global batch (``batch_tokens``, ``tokens_per_batch``...):
                                   `PlanOptions.from_dict` reads them.
    dynabatch.epochs, dynabatch.seed
    dynabatch.steps_per_epoch      JSON list: steps of epoch 0, 1, ... (steps are numbered across epochs)
    dynabatch.rank_time_s          JSON {step: [simulated pipeline seconds of each rank]}
    dynabatch.step_options         JSON {"default": options of every step's BatchPlan, "steps": {step: exceptions}}
    dynabatch.task_names           JSON list that the task_id column indexes (the same key as
                                   `tokenization.TASK_NAMES_KEY` in a length index)
    dynabatch.index                JSON: paths of the planned data/index, samples, whether it was scanned
    dynabatch.created_by           "dynabatch <version>"
    dynabatch.integrity            JSON (`integrity_record`): what the writer wrote, so a reader
                                   notices rows deleted, duplicated or changed afterwards:
                                   ``placements`` (rows), ``num_ranks``, ``distinct_samples`` (distinct sample ids
                                   per epoch, when the table has an ``epoch`` column),
                                   ``sample_id_checksum`` (64-bit hash of every row's sample id
                                   together with its step, rank and micro-batch, independent of row
                                   order), and ``first_step`` + ``step_rank_checksums`` (base64 of
                                   the same sum mod 2**32 per step and rank, little-endian uint32,
                                   [steps, num_ranks]) with ``step_rank_counts`` (base64 of zlib of
                                   uint32 rows per step and rank), so a mismatch names the step
                                   and rank; ``columns``: a checksum of every other column
                                   (`dynabatch.integrity.column_checksums`, rows ordered by step,
                                   rank and micro-batch, however they are stored) and ``metadata``: a
                                   digest of every other ``dynabatch.*`` entry, so an edited
                                   ``input_len``, ``time_s``, ``row``, ... or option is named.
    dynabatch.data_files           JSON list of the planned data files (`loaders.file_fingerprints`
                                   of the index), when the index recorded them
    dynabatch.tokenizer_hash       `tokenization.tokenizer_fingerprint` of the tokenizer that counted
                                   the index, when recorded
"""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np
import pyarrow as pa

from .. import integrity
from ..core.batchplan import MB_FIELDS

#: Version of the row format (`BatchPlan.to_arrow`).
PLAN_SCHEMA_VERSION = 1
#: Version of the run-level layout (`dynabatch.offline.plan_run`).
RUN_PLAN_VERSION = 1

# -- metadata keys ------------------------------------------------------------------------------------
PLAN_SCHEMA_VERSION_KEY = "dynabatch.plan_schema_version"
RUN_PLAN_VERSION_KEY = "dynabatch.run_plan_version"
METHOD_KEY = "dynabatch.method"
COLLATION_KEY = "dynabatch.collation"
SCHEDULE_KEY = "dynabatch.schedule"
STEP_SCHEDULE_KEY = "dynabatch.step_schedule"
NUM_RANKS_KEY = "dynabatch.num_ranks"
NUM_STAGES_KEY = "dynabatch.num_stages"
FINGERPRINT_KEY = "dynabatch.dataset_fingerprint"
COST_MODEL_KEY = "dynabatch.cost_model"
OPTIONS_KEY = "dynabatch.options"
EPOCHS_KEY = "dynabatch.epochs"
SEED_KEY = "dynabatch.seed"
STEPS_PER_EPOCH_KEY = "dynabatch.steps_per_epoch"
RANK_TIME_KEY = "dynabatch.rank_time_s"
STEP_OPTIONS_KEY = "dynabatch.step_options"
TASK_NAMES_KEY = "dynabatch.task_names"
INDEX_KEY = "dynabatch.index"
CREATED_BY_KEY = "dynabatch.created_by"
INTEGRITY_KEY = "dynabatch.integrity"
DATA_FILES_KEY = "dynabatch.data_files"
TOKENIZER_HASH_KEY = "dynabatch.tokenizer_hash"

#: Keys every step of a multi-step table shares (`plans_to_arrow` refuses plans that differ; the
#: schedule may differ per step, see ``dynabatch.step_schedule``).
SHARED_KEYS = (PLAN_SCHEMA_VERSION_KEY, METHOD_KEY, COLLATION_KEY, NUM_RANKS_KEY, NUM_STAGES_KEY)

#: Entries of ``dynabatch.options`` that are no `PlanOptions` field: how the run was tokenized and
#: how many epochs it has.
OPTION_EXTRAS = ("epochs", "tokenizer", "family")

# -- columns -------------------------------------------------------------------------------------------
STEP = "step"
RANK = "rank"
MICROBATCH = "microbatch"
ROW = "row"
SAMPLE_ID = "sample_id"
EPOCH = "epoch"
TASK_ID = "task_id"
SAMPLE_TOKENS = "sample_tokens"

#: Every column: name -> (numpy dtype, meaning).
COLUMNS = {
    STEP: (np.int64, "global step, 0-based across epochs"),
    RANK: (np.int32, "data-parallel rank that runs the micro-batch"),
    MICROBATCH: (np.int32, "position of the micro-batch in its rank's execution order"),
    ROW: (np.int32, "row of the sample in the micro-batch (packed_rows: the packed row it shares)"),
    SAMPLE_ID: (np.int64, "the sample"),
    # the micro-batch's own fields, repeated on each of its rows (defined once, on `BatchPlan`)
    **{name[3:]: spec for name, spec in MB_FIELDS.items() if name not in ("mb_rank", "mb_order")},
    EPOCH: (np.int32, "epoch of the step"),
    TASK_ID: (np.int32, "the sample's task (index into dynabatch.task_names)"),
    SAMPLE_TOKENS: (np.int32, "the sample's own tokens after truncation"),
}
#: Columns a plan file must have.
REQUIRED_COLUMNS = (STEP, RANK, MICROBATCH, SAMPLE_ID)


# -- integrity -----------------------------------------------------------------------------------------
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)


def placement_hashes(step, rank, microbatch, sample_id) -> np.ndarray:
    """One 64-bit hash per row of (step, rank, micro-batch, sample id); summed (mod 2**64) they give a
    checksum that does not depend on row order but changes when a row is deleted, duplicated or edited."""
    with np.errstate(over="ignore"):
        x = np.asarray(sample_id, np.int64).astype(np.uint64) * integrity.GOLDEN
        x += np.asarray(step, np.int64).astype(np.uint64) * _M1
        x += np.asarray(rank, np.int64).astype(np.uint64) * _M2
        x += np.asarray(microbatch, np.int64).astype(np.uint64)
        return integrity.mix(integrity.mix(x))


def step_rank_sums(step, rank, hashes: np.ndarray, first_step: int, num_steps: int,
                   num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step (from ``first_step``) and rank, [num_steps, num_ranks] each: the row hashes summed
    mod 2**32 (uint32) and the rows (int64); rows outside that range are ignored."""
    s = np.asarray(step, np.int64) - int(first_step)
    r = np.asarray(rank, np.int64)
    ok = (s >= 0) & (s < num_steps) & (r >= 0) & (r < num_ranks)
    key = (s * num_ranks + r)[ok]
    size = num_steps * num_ranks
    # float64 sums of 32-bit values are exact below 2**21 rows per bucket, far above any rank's step
    sums = np.bincount(key, weights=(hashes[ok] & _LOW32).astype(np.float64), minlength=size)
    counts = np.bincount(key, minlength=size).astype(np.int64)
    checks = (sums.astype(np.uint64) & _LOW32).astype(np.uint32)
    return checks.reshape(num_steps, num_ranks), counts.reshape(num_steps, num_ranks)


def checksum(hashes: np.ndarray) -> int:
    """The file-level checksum: the row hashes summed mod 2**64."""
    return integrity.sum64(hashes)


def distinct_count(values: np.ndarray) -> int:
    """Distinct values of an int64 array (by sorting: cheaper than `np.unique` on large arrays)."""
    if not len(values):
        return 0
    v = np.sort(values)
    return int(np.count_nonzero(v[1:] != v[:-1])) + 1


def epoch_slices(epoch: np.ndarray) -> list[np.ndarray | slice]:
    """Rows of each epoch 0..max(epoch): slices when the rows are grouped by epoch, else index arrays."""
    epoch = np.asarray(epoch, np.int64)
    n = int(epoch.max()) + 1 if len(epoch) else 0
    if len(epoch) and np.all(epoch[1:] >= epoch[:-1]):
        bounds = np.searchsorted(epoch, np.arange(n + 1))
        return [slice(int(bounds[e]), int(bounds[e + 1])) for e in range(n)]
    return [np.flatnonzero(epoch == e) for e in range(n)]


def distinct_per_epoch(epoch: np.ndarray, sample_id: np.ndarray) -> list[int]:
    """Distinct sample ids of each epoch 0..max(epoch)."""
    sample_id = np.asarray(sample_id, np.int64)
    return [distinct_count(sample_id[rows]) for rows in epoch_slices(epoch)]


def _b64(arr: np.ndarray, dtype: str, compress: bool = False) -> str:
    raw = np.ascontiguousarray(arr, dtype=dtype).tobytes()
    return base64.b64encode(zlib.compress(raw, 6) if compress else raw).decode("ascii")


def _unb64(text: str, dtype: str, compressed: bool = False) -> np.ndarray:
    raw = base64.b64decode(text)
    return np.frombuffer(zlib.decompress(raw) if compressed else raw, dtype=dtype)


def column_checksums(table: pa.Table) -> dict[str, str]:
    """Checksums of every column but the placement (`REQUIRED_COLUMNS`, which the placement hashes
    cover), the rows ordered by step, rank and micro-batch (their order within a micro-batch, the
    sample order, counts)."""
    step, rank, mb = (table.column(c).to_numpy().astype(np.int64) for c in (STEP, RANK, MICROBATCH))
    key = step - (int(step.min()) if len(step) else 0)
    key = (key * (int(rank.max(initial=0)) + 1) + rank) * (int(mb.max(initial=0)) + 1) + mb
    return integrity.column_checksums(table, key, skip=REQUIRED_COLUMNS)


def metadata_digests(metadata) -> dict[str, str]:
    """Digests of a plan's ``dynabatch.*`` metadata entries but the integrity record itself."""
    return integrity.metadata_digests(metadata, skip=(INTEGRITY_KEY,))


def integrity_record(table: pa.Table, num_ranks: int) -> dict:
    """The ``dynabatch.integrity`` record of a plan table (its columns named as in `COLUMNS`, and
    its metadata but this record)."""
    columns = {c: table.column(c).to_numpy() for c in (STEP, RANK, MICROBATCH, SAMPLE_ID, EPOCH)
               if c in table.column_names}
    step = np.asarray(columns[STEP], np.int64)
    hashes = placement_hashes(step, columns[RANK], columns[MICROBATCH], columns[SAMPLE_ID])
    first = int(step.min()) if len(step) else 0
    steps = int(step.max()) - first + 1 if len(step) else 0
    per, counts = step_rank_sums(step, columns[RANK], hashes, first, steps, int(num_ranks))
    rec = {
        "placements": int(len(step)),
        "num_ranks": int(num_ranks),
        "sample_id_checksum": f"{checksum(hashes):016x}",
        "first_step": first,
        "steps": steps,
        "step_rank_checksums": _b64(per, "<u4"),
        "step_rank_counts": _b64(counts, "<u4", compress=True),
    }
    if columns.get(EPOCH) is not None:
        rec["distinct_samples"] = distinct_per_epoch(columns[EPOCH], columns[SAMPLE_ID])
    rec["columns"] = column_checksums(table)
    rec["metadata"] = metadata_digests(table.schema.metadata)
    return rec


def integrity_metadata(table: pa.Table, num_ranks: int) -> dict[str, str]:
    """``{INTEGRITY_KEY: JSON of integrity_record(...)}``, ready to merge into the table's metadata
    (made last: it covers every other entry)."""
    return {INTEGRITY_KEY: json.dumps(integrity_record(table, num_ranks), sort_keys=True)}


def decode_step_rank_checksums(record: dict) -> np.ndarray:
    """The recorded [steps, num_ranks] uint32 checksums of an integrity record."""
    return _unb64(record["step_rank_checksums"], "<u4").astype(np.uint32).reshape(
        int(record["steps"]), int(record["num_ranks"]))


def decode_step_rank_counts(record: dict) -> np.ndarray:
    """The recorded [steps, num_ranks] placement counts of an integrity record."""
    return _unb64(record["step_rank_counts"], "<u4", compressed=True).astype(np.int64).reshape(
        int(record["steps"]), int(record["num_ranks"]))
