"""Where `Shapes` come from for planning and benchmarks without a tokenizer pass.

* `read_shapes`: files holding either precomputed token counts (``input_tokens`` /
  ``target_tokens`` / ``vision_tokens`` columns in Parquet, JSONL or CSV), vision-language length
  records (``vit_num`` 448-px tiles and ``token_num`` LLM tokens including 256 per tile, as
  OmniBal publishes them), or raw text (``inputs``/``targets`` and the usual alternates), whose
  token counts are *estimated* as ``ceil(utf8_bytes / 4)`` (+1 end-of-sequence token for
  targets): the common 4-characters-per-token rule for English BPE. Use
  ``tokenization.scan_shapes`` with the real tokenizer when exact counts matter.
* `synthetic_shapes`: the project's own generator of FLAN-like multi-task text shapes and
  vision-language shapes, deterministic for a seed.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from .core.shapes import Shapes

CHARS_PER_TOKEN = 4
TOKENS_PER_TILE = 256
INPUT_FIELDS = ("inputs", "input", "source", "prompt", "instruction", "question")
TARGET_FIELDS = ("targets", "target", "output", "response", "completion", "answer")
TASK_FIELDS = ("task", "task_name", "dataset", "source")
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet", ".arrow", ".csv", ".csv.gz")


class ShapeSourceError(ValueError):
    """A file that cannot be read into `Shapes`: the message names the file and what is wrong."""


def _expand(paths) -> list[Path]:
    out = []
    for p in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.endswith(SUFFIXES))
            if not found:
                raise ShapeSourceError(f"{p}: directory holds no {'/'.join(SUFFIXES)} files")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise ShapeSourceError(f"{p}: no such file or directory")
    return out


def _read_table(path: Path) -> pa.Table:
    name = path.name
    try:
        if name.endswith(".parquet"):
            return pq.read_table(path)
        if name.endswith(".arrow"):
            with pa.memory_map(str(path)) as src:
                return pa.ipc.open_file(src).read_all()
        if name.endswith((".csv", ".csv.gz")):
            return pacsv.read_csv(path)
        if name.endswith((".json", ".json.gz")):
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                first = f.read(1)
                while first.isspace():
                    first = f.read(1)
            if first == "[":  # a JSON array of records (OmniBal's length files)
                with opener(path, "rt", encoding="utf-8") as f:
                    return pa.Table.from_pylist(json.load(f))
        compression = "gzip" if name.endswith(".gz") else None
        with pa.input_stream(str(path), compression=compression) as stream:
            return pajson.read_json(stream)
    except (pa.ArrowInvalid, json.JSONDecodeError, OSError, EOFError, UnicodeDecodeError) as e:
        raise ShapeSourceError(f"{path}: cannot read ({e})") from e


def _text_tokens(col: pa.ChunkedArray) -> np.ndarray:
    col = pc.fill_null(col.cast(pa.string()), "")
    nbytes = pc.binary_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    return -(-nbytes // CHARS_PER_TOKEN)


def _first(names, candidates):
    return next((c for c in candidates if c in names), None)


def _table_to_shapes(path: Path, table: pa.Table, shard: int) -> tuple[Shapes, list[str]]:
    names = set(table.column_names)
    n = table.num_rows
    ids = (np.int64(shard) << 32) + np.arange(n, dtype=np.int64)
    task_col = _first(names, TASK_FIELDS)
    tasks = (pc.fill_null(table.column(task_col).cast(pa.string()), "").to_pylist() if task_col
             else [path.stem] * n)
    if "input_tokens" in names:
        get = lambda c: table.column(c).to_numpy(zero_copy_only=False).astype(np.int64) if c in names else 0  # noqa: E731
        inp, tgt, vis = get("input_tokens"), get("target_tokens"), get("vision_tokens")
        if "sample_id" in names:
            ids = table.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
    elif "token_num" in names and "vit_num" in names:
        tiles = table.column("vit_num").to_numpy(zero_copy_only=False).astype(np.int64)
        total = table.column("token_num").to_numpy(zero_copy_only=False).astype(np.int64)
        vis = tiles * TOKENS_PER_TILE
        inp = total - vis
        bad = np.flatnonzero(inp < 0)
        if len(bad):
            raise ShapeSourceError(f"{path}: record {int(bad[0])} has token_num {int(total[bad[0]])} smaller than "
                                   f"{TOKENS_PER_TILE} x vit_num {int(tiles[bad[0]])}")
        tgt = 0
        if not task_col:
            tasks = [path.name.split("_wh_token")[0].split(".")[0]] * n
    else:
        icol, tcol = _first(names, INPUT_FIELDS), _first(names, TARGET_FIELDS)
        if icol is None:
            raise ShapeSourceError(
                f"{path}: no token columns (input_tokens, or vit_num+token_num) and no text field "
                f"({'/'.join(INPUT_FIELDS)}); columns are {sorted(names)}")
        inp = _text_tokens(table.column(icol))
        tgt = _text_tokens(table.column(tcol)) + 1 if tcol else 0
        vis = 0
    z = np.zeros(n, np.int64)
    uniq, task_id = np.unique(np.array(tasks, dtype=object).astype(str), return_inverse=True)
    shapes = Shapes(ids, np.asarray(inp + z), np.asarray(tgt + z), np.asarray(vis + z), task_id.astype(np.int32))
    return shapes, list(uniq)


def read_shapes(paths) -> tuple[Shapes, list[str]]:
    """Read `Shapes` (and the task names that ``task_id`` indexes) from files or directories.

    Sample ids are ``(file index << 32) | row`` in the sorted, expanded file list, unless the file
    carries a ``sample_id`` column.
    """
    parts, names = [], []
    for shard, path in enumerate(_expand(paths)):
        shapes, tasks = _table_to_shapes(path, _read_table(path), shard)
        offset = len(names)
        names.extend(tasks)
        parts.append(Shapes(shapes.sample_id, shapes.input_tokens, shapes.target_tokens, shapes.vision_tokens,
                            shapes.task_id + offset))
    if not parts:
        raise ShapeSourceError("no input files")
    merged = Shapes.concat(parts)
    # Same task name in several files -> one id.
    uniq, inv = np.unique(np.array(names, dtype=object).astype(str), return_inverse=True)
    return Shapes(merged.sample_id, merged.input_tokens, merged.target_tokens, merged.vision_tokens,
                  inv[merged.task_id].astype(np.int32)), list(uniq)


# (name, weight, input median tokens, input sigma, target median tokens, target sigma)
_TEXT_TASKS = (
    ("qa_short", 0.20, 90, 0.6, 3, 0.8),
    ("classification", 0.20, 160, 0.7, 2, 0.5),
    ("fewshot_niv2", 0.20, 380, 0.7, 6, 1.2),
    ("summarization", 0.10, 700, 0.6, 60, 0.6),
    ("translation", 0.10, 60, 0.5, 55, 0.5),
    ("cot", 0.15, 130, 0.6, 45, 0.6),
    ("long_context", 0.05, 1500, 0.5, 20, 1.0),
)
# (name, weight, tiles choices, tiles probabilities, text median tokens, sigma)
_VL_TASKS = (
    ("captioning", 0.3, (1, 3, 5), (0.6, 0.3, 0.1), 60, 0.5),
    ("document_qa", 0.3, (3, 5, 7, 9, 12), (0.1, 0.3, 0.3, 0.2, 0.1), 180, 0.6),
    ("chart_qa", 0.2, (5, 7), (0.7, 0.3), 90, 0.5),
    ("conversation", 0.2, (0, 1, 5), (0.2, 0.4, 0.4), 450, 0.8),
)
#: Task family names of `synthetic_shapes` (``text``, ``vision``), in the order of their task ids.
TEXT_TASKS = tuple(t[0] for t in _TEXT_TASKS)
VISION_TASKS = tuple(t[0] for t in _VL_TASKS)


def synthetic_shapes(kind: str = "text", num_samples: int = 20000, seed: int = 0) -> tuple[Shapes, list[str]]:
    """Deterministic synthetic shapes: ``text`` (a FLAN-like mixture of 7 task families with
    heavy-tailed lognormal input and target lengths, in tokens) or ``vision`` (4 families of
    image+text samples: 448-px tiles and text tokens). Returns (shapes, task names)."""
    rng = np.random.default_rng(seed)
    if kind == "text":
        tasks = _TEXT_TASKS
        w = np.array([t[1] for t in tasks])
        task = rng.choice(len(tasks), size=num_samples, p=w / w.sum())
        med_i = np.array([t[2] for t in tasks])[task]
        sig_i = np.array([t[3] for t in tasks])[task]
        med_t = np.array([t[4] for t in tasks])[task]
        sig_t = np.array([t[5] for t in tasks])[task]
        inp = np.ceil(med_i * np.exp(sig_i * rng.standard_normal(num_samples))).astype(np.int64)
        tgt = np.ceil(med_t * np.exp(sig_t * rng.standard_normal(num_samples))).astype(np.int64) + 1
        vis = np.zeros(num_samples, np.int64)
    elif kind == "vision":
        tasks = _VL_TASKS
        w = np.array([t[1] for t in tasks])
        task = rng.choice(len(tasks), size=num_samples, p=w / w.sum())
        tiles = np.zeros(num_samples, np.int64)
        for k, t in enumerate(tasks):
            sel = task == k
            tiles[sel] = rng.choice(t[2], size=int(sel.sum()), p=t[3])
        med = np.array([t[4] for t in tasks])[task]
        sig = np.array([t[5] for t in tasks])[task]
        inp = np.ceil(med * np.exp(sig * rng.standard_normal(num_samples))).astype(np.int64)
        tgt = np.zeros(num_samples, np.int64)
        vis = tiles * TOKENS_PER_TILE
    else:
        raise ValueError(f"synthetic kind must be 'text' or 'vision', got {kind!r}")
    shapes = Shapes(np.arange(num_samples, dtype=np.int64), np.maximum(inp, 1), tgt, vis, task.astype(np.int32))
    return shapes, [t[0] for t in tasks]


def bench_shapes(data, model: str, samples: int, seed: int) -> tuple[Shapes, str]:
    """The shapes a planning bench runs on and how its table names them: ``data`` files (`read_shapes`), else
    ``samples`` synthetic samples of ``model``'s kind (vision for ``vlm``, else text; `synthetic_shapes`)."""
    if data:
        shapes, _ = read_shapes(data)
        return shapes, " ".join(Path(d).name for d in data)
    shapes, _ = synthetic_shapes("vision" if model == "vlm" else "text", samples, seed=seed)
    return shapes, f"synthetic ({samples} samples)"
