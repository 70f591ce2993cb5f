"""`Shapes`: the columnar per-sample description that planning works on.

A sample's *shape* is what its cost depends on: input tokens, target tokens (0 for
decoder-only data), vision tokens (0 for text-only data) and a task id for mixture
reporting. Everything in the planner works on these numpy columns, never on Python
lists of samples. The Arrow form (`to_arrow`/`from_arrow`) is the on-disk length index
that `tokenization.scan_shapes` writes, so the column names below are a contract
shared with the `tokenization` package (which does not import `dynabatch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

#: Column name -> numpy dtype of the Shapes table (shared with ``tokenization``).
SHAPES_SCHEMA: dict[str, np.dtype] = {
    "sample_id": np.dtype(np.int64),
    "input_tokens": np.dtype(np.int32),
    "target_tokens": np.dtype(np.int32),
    "vision_tokens": np.dtype(np.int32),
    "task_id": np.dtype(np.int32),
}


@dataclass(frozen=True)
class Shapes:
    """Per-sample token counts of a set of samples, as parallel numpy columns.

    ``sample_id`` is the stable global id (int64) of each sample; ``input_tokens``,
    ``target_tokens`` and ``vision_tokens`` are token counts (int32); ``task_id``
    indexes the task/source of each sample (int32, -1 when unknown).
    """

    sample_id: np.ndarray
    input_tokens: np.ndarray
    target_tokens: np.ndarray
    vision_tokens: np.ndarray
    task_id: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.sample_id)
        for name, dtype in SHAPES_SCHEMA.items():
            col = np.ascontiguousarray(getattr(self, name))
            if col.ndim != 1 or len(col) != n:
                raise ValueError(
                    f"Shapes.{name} must be a 1-D array of length {n} (like sample_id), got shape {col.shape}"
                )
            if col.dtype != dtype:
                if col.dtype.kind not in "iu" and not (col.dtype.kind == "f" and np.all(col == np.round(col))):
                    raise TypeError(f"Shapes.{name} must hold integers, got dtype {col.dtype}")
                col = col.astype(dtype)
            object.__setattr__(self, name, col)
        for name in ("input_tokens", "target_tokens", "vision_tokens"):
            col = getattr(self, name)
            if n and col.min() < 0:
                bad = int(np.flatnonzero(col < 0)[0])
                raise ValueError(
                    f"Shapes.{name} is negative ({int(col[bad])}) for sample_id {int(self.sample_id[bad])}"
                )

    @classmethod
    def from_lengths(
        cls,
        input_tokens,
        target_tokens=None,
        vision_tokens=None,
        task_id=None,
        sample_id=None,
    ) -> "Shapes":
        """Build Shapes from length arrays; missing columns default to 0 (task -1), ids to 0..n-1."""
        inp = np.asarray(input_tokens)
        n = len(inp)
        zeros = np.zeros(n, dtype=np.int32)
        return cls(
            sample_id=np.arange(n, dtype=np.int64) if sample_id is None else np.asarray(sample_id),
            input_tokens=inp,
            target_tokens=zeros if target_tokens is None else np.asarray(target_tokens),
            vision_tokens=zeros if vision_tokens is None else np.asarray(vision_tokens),
            task_id=np.full(n, -1, np.int32) if task_id is None else np.asarray(task_id),
        )

    def __len__(self) -> int:
        return len(self.sample_id)

    def take(self, index) -> "Shapes":
        """The samples at positions ``index`` (an integer array or slice), in that order."""
        return Shapes(**{name: getattr(self, name)[index] for name in SHAPES_SCHEMA})

    @staticmethod
    def concat(parts: "list[Shapes]") -> "Shapes":
        """Concatenate several Shapes in order."""
        if not parts:
            return Shapes.from_lengths(np.zeros(0, np.int32))
        return Shapes(**{name: np.concatenate([getattr(p, name) for p in parts]) for name in SHAPES_SCHEMA})

    def clip(self, max_input: int | None = None, max_target: int | None = None) -> "Shapes":
        """Truncate input/target token counts to the given maxima (the model's max lengths)."""
        inp = self.input_tokens if max_input is None else np.minimum(self.input_tokens, max_input)
        tgt = self.target_tokens if max_target is None else np.minimum(self.target_tokens, max_target)
        return Shapes(self.sample_id, inp, tgt, self.vision_tokens, self.task_id)

    @property
    def total_tokens(self) -> np.ndarray:
        """Per-sample input + target + vision tokens (int64)."""
        return (
            self.input_tokens.astype(np.int64) + self.target_tokens + self.vision_tokens.astype(np.int64)
        )

    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of every column: the dataset identity offline plans are tied to."""
        import hashlib

        h = hashlib.sha256()
        for name in SHAPES_SCHEMA:
            h.update(name.encode())
            h.update(np.ascontiguousarray(getattr(self, name)).tobytes())
        return h.hexdigest()[:16]

    def to_arrow(self) -> pa.Table:
        """Zero-copy Arrow table with the columns of ``SHAPES_SCHEMA``."""
        return pa.table({name: pa.array(getattr(self, name)) for name in SHAPES_SCHEMA})

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "Shapes":
        """Read Shapes from an Arrow table; only ``sample_id`` and ``input_tokens`` are required."""
        names = set(table.column_names)
        missing = {"sample_id", "input_tokens"} - names
        if missing:
            raise ValueError(
                f"a Shapes table needs the columns {sorted(missing)}; it has {sorted(names)}"
            )
        n = table.num_rows
        cols = {}
        for name, dtype in SHAPES_SCHEMA.items():
            if name in names:
                cols[name] = table.column(name).to_numpy(zero_copy_only=False)
            else:
                cols[name] = np.full(n, -1 if name == "task_id" else 0, dtype)
        return cls(**cols)
