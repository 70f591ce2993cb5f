"""The project's own sample data: FLAN-like text shards and LLaVA-like image+text webdataset shards.

Both generators draw their lengths from `synthetic_shapes` (same task families, same
heavy-tailed lognormal token lengths), then write *text* of about that many tokens, so
the shards look like real training data to every stage: loaders, tokenizers, vision
tiling and the planner.

* Text is made of pseudo-words ("kazo", "mibuten", ...) from a small fixed vocabulary with
  Zipf frequencies, wrapped in task templates (few-shot prompts, chain-of-thought rationales,
  summaries, translations, ...). A byte tokenizer sees ~5 bytes per word; a BPE trained on it
  learns whole words. Lengths are calibrated so that ``ceil(utf8_bytes / 4)`` (the estimate
  `read_shapes` uses) is close to the token counts `synthetic_shapes` draws.
* Images are cheap PIL drawings (gradients, rectangles, ellipses) saved as low-quality JPEG
  (a few as PNG). Their sizes (about 200 to 2000 px per side) are picked from a tile grid so
  that InternVL's dynamic tiling (`tokenization.DynamicTiling`) gives the 1 to 13 tiles the
  vision families of `synthetic_shapes` ask for.

Everything is deterministic for a seed: the same call writes byte-identical files (gzip
headers carry no time or name, tar members a fixed mtime and owner).
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np

from .progress import progress_bar
from .shape_sources import TEXT_TASKS, VISION_TASKS, synthetic_shapes  # noqa: F401  (the generated data's tasks)

TEXT_FORMATS = ("jsonl", "jsonl.gz", "parquet")
#: Rows per Parquet row group: small enough that one file still splits over several workers.
PARQUET_ROW_GROUP = 1024
#: Tile edge of InternVL's dynamic tiling, in pixels.
TILE_PX = 448
#: Image sides are kept in [MIN_SIDE_PX, MAX_SIDE_PX].
MIN_SIDE_PX, MAX_SIDE_PX = 200, 2000
JPEG_QUALITY = 30

# ----------------------------------------------------------------------------------------
# Vocabulary: fixed (independent of the seed), so every generated file shares it.
_CONSONANTS = "bdfghklmnprstvz"
_VOWELS = "aeiou"
_VOCAB_SIZE = 1500
_LANGS = ("Velan", "Orish", "Tamuri", "Kesh", "Lorvic", "Banu")
_LETTERS = "ABCDE"


def _build_vocab(size: int = _VOCAB_SIZE) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(20240601)  # fixed: the vocabulary is part of the format
    words: set[str] = set()
    while len(words) < size:
        n_syl = int(rng.choice([1, 2, 3], p=[0.3, 0.5, 0.2]))
        w = "".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
                    for _ in range(n_syl))
        if rng.random() < 0.3:
            w += _CONSONANTS[rng.integers(len(_CONSONANTS))]
        words.add(w)
    # Frequent words are short, as in natural language; Zipf weights over the ranks.
    vocab = np.array(sorted(words, key=lambda w: (len(w), w)), dtype=object)
    p = 1.0 / (np.arange(size) + 2.7)
    return vocab, np.cumsum(p / p.sum())


_VOCAB, _CDF = _build_vocab()
# Variants by position in a sentence: plain, sentence start, sentence end, both.
_TABLE = np.concatenate([_VOCAB, np.array([w.capitalize() for w in _VOCAB], dtype=object),
                         np.array([w + "." for w in _VOCAB], dtype=object),
                         np.array([w.capitalize() + "." for w in _VOCAB], dtype=object)])
#: Mean UTF-8 bytes of a word plus its separator (measured on the Zipf mixture, ~5).
BYTES_PER_WORD = float(np.sum(np.diff(np.concatenate([[0.0], _CDF])) * [len(w) + 1 for w in _VOCAB]))
#: Words per synthetic token: tokens are ~4 bytes (the estimate `read_shapes` uses).
WORDS_PER_TOKEN = 4.0 / BYTES_PER_WORD


def _words(tokens: float) -> int:
    return max(1, int(round(tokens * WORDS_PER_TOKEN)))


def _clause(rng: np.random.Generator, n: int) -> str:
    """``n`` lower-case words, no punctuation."""
    return " ".join(_VOCAB[np.searchsorted(_CDF, rng.random(max(1, n)))].tolist())


def _prose(rng: np.random.Generator, n: int, paragraph_words: int = 0) -> str:
    """``n`` words in sentences of 5..18 words; paragraphs of ~``paragraph_words`` (0 = one)."""
    n = max(1, n)
    idx = np.searchsorted(_CDF, rng.random(n))
    lens = rng.integers(5, 19, size=n // 5 + 2)
    ends = np.cumsum(lens)
    ends = ends[ends < n] - 1
    variant = np.zeros(n, np.int64)
    variant[0] |= 1
    variant[ends] |= 2
    variant[ends + 1] |= 1
    variant[n - 1] |= 2
    words = _TABLE[variant * _VOCAB_SIZE + idx].tolist()
    if paragraph_words and n > paragraph_words:
        # Break paragraphs after sentence ends roughly every paragraph_words words.
        parts, start = [], 0
        for e in ends:
            if e - start + 1 >= paragraph_words:
                parts.append(" ".join(words[start:e + 1]))
                start = e + 1
        parts.append(" ".join(words[start:]))
        return "\n\n".join(p for p in parts if p)
    return " ".join(words)


def _split(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """Split ``total`` words into ``parts`` positive shares at random."""
    w = rng.dirichlet(np.full(parts, 2.0))
    return [max(1, int(round(total * x))) for x in w]


# ----------------------------------------------------------------------------------------
# Text-to-text rows, one template per task family of synthetic_shapes("text").

def _text_row(rng: np.random.Generator, family: str, in_tokens: int, tgt_tokens: int) -> tuple[str, str]:
    """(inputs, targets) of about ``in_tokens`` / ``tgt_tokens`` tokens for one task family."""
    wi, wt = _words(in_tokens), _words(tgt_tokens)
    if family == "qa_short":
        q = min(12, max(3, wi // 4))
        return f"{_prose(rng, wi - q)}\n\nQuestion: {_clause(rng, q)}?\nAnswer:", _clause(rng, wt)
    if family == "classification":
        opts = [_clause(rng, 1) for _ in range(int(rng.integers(2, 5)))]
        listed = "\n".join(f"- {o}" for o in opts)
        target = opts[int(rng.integers(len(opts)))] if wt <= 2 else _clause(rng, wt)
        return (f"Classify the text into one of the options.\n\nText: {_prose(rng, wi - 8)}\n"
                f"Options:\n{listed}\nAnswer:"), target
    if family == "fewshot_niv2":
        shots = int(rng.integers(0, 4))
        shares = _split(rng, wi, 2 + 2 * shots)
        body = [f"Definition: {_prose(rng, shares[0])}"]
        for k in range(shots):
            body.append(f"Example input: {_prose(rng, shares[2 + 2 * k])}\n"
                        f"Example output: {_clause(rng, min(shares[3 + 2 * k], wt + 3))}")
        body.append(f"Input: {_prose(rng, shares[1])}\nOutput:")
        return "\n\n".join(body), _clause(rng, wt)
    if family == "summarization":
        return (f"Summarize the following article.\n\n{_prose(rng, wi, paragraph_words=90)}\n\nSummary:",
                _prose(rng, wt))
    if family == "translation":
        a, b = rng.choice(len(_LANGS), 2, replace=False)
        return f"Translate from {_LANGS[a]} to {_LANGS[b]}:\n{_prose(rng, wi - 4)}", _prose(rng, wt)
    if family == "cot":
        letter = _LETTERS[int(rng.integers(5))]
        target = f"{_prose(rng, max(1, wt - 5))} So the answer is ({letter})."
        if rng.random() < 0.5:  # zero-shot, as half of FLAN's cot_submix
            return f"{_prose(rng, wi - 5)}\nLet's think step by step.", target
        shots = int(rng.integers(1, 4))
        shares = _split(rng, wi, shots + 1)
        ex = "".join(f"Q: {_prose(rng, s // 2)}\nA: {_prose(rng, s - s // 2)} So the answer is "
                     f"({_LETTERS[int(rng.integers(5))]}).\n\n" for s in shares[1:])
        return f"{ex}Q: {_prose(rng, shares[0])}\nA:", target
    if family == "long_context":
        q = min(20, max(4, wi // 50))
        return (f"Read the document and answer the question.\n\nDocument:\n"
                f"{_prose(rng, wi - q, paragraph_words=120)}\n\nQuestion: {_clause(rng, q)}?\nAnswer:",
                _prose(rng, wt))
    raise ValueError(f"unknown text task family {family!r}")


def text_records(num_samples: int, seed: int = 0, progress: bool = False) -> list[dict]:
    """FLAN-like rows ``{"id", "task", "inputs", "targets"}``, lengths as `synthetic_shapes("text")`.

    ``inputs``/``targets`` hold about ``input_tokens`` / ``target_tokens - 1`` tokens of the
    synthetic shapes (tokens ~ 4 UTF-8 bytes; the 1 is the end-of-sequence token).
    Deterministic for ``(num_samples, seed)``; row i does not depend on ``num_samples``.
    """
    shapes, names = synthetic_shapes("text", num_samples, seed=seed)
    rng = np.random.default_rng([seed, 1])
    rows = []
    with progress_bar(num_samples, "datagen text rows", "sample", progress) as bar:
        for i in range(num_samples):
            family = names[int(shapes.task_id[i])]
            inputs, targets = _text_row(rng, family, int(shapes.input_tokens[i]), int(shapes.target_tokens[i]) - 1)
            rows.append({"id": f"gen{seed}-{i:08d}", "task": family, "inputs": inputs, "targets": targets})
            bar.update(1)
    return rows


def _shard_slices(n: int, num_shards: int) -> list[slice]:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    cuts = [n * k // num_shards for k in range(num_shards + 1)]
    return [slice(cuts[k], cuts[k + 1]) for k in range(num_shards)]


def write_text_shards(out_dir, num_samples: int, num_shards: int = 1, seed: int = 0,
                      format: str = "jsonl", progress: bool = False) -> list[Path]:
    """Write `text_records` as ``shard-000000.<format>`` ... in ``out_dir``; returns the paths.

    ``format`` is ``"jsonl"``, ``"jsonl.gz"`` (gzip without name or time in the header, so
    files are byte-identical across runs) or ``"parquet"`` (row groups of `PARQUET_ROW_GROUP`
    rows). Samples are split into ``num_shards`` contiguous, nearly equal shards.
    """
    if format not in TEXT_FORMATS:
        raise ValueError(f"format must be one of {TEXT_FORMATS}, got {format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = text_records(num_samples, seed, progress)
    paths = []
    for k, part in enumerate(_shard_slices(num_samples, num_shards)):
        path = out / f"shard-{k:06d}.{format}"
        chunk = rows[part]
        if format == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            schema = pa.schema([(c, pa.string()) for c in ("id", "task", "inputs", "targets")])
            pq.write_table(pa.Table.from_pylist(chunk, schema=schema), path, row_group_size=PARQUET_ROW_GROUP)
        else:
            data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chunk).encode("utf-8")
            with open(path, "wb") as raw:
                if format == "jsonl.gz":
                    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                        gz.write(data)
                else:
                    raw.write(data)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------
# Image + text samples, one template per family of synthetic_shapes("vision").

_CAPTION_PROMPTS = ("Describe the image briefly.", "Write a short caption for this picture.",
                    "What is shown in this image?", "Give a one-sentence description of the photo.")


def _grids_by_tiles() -> dict[int, list[tuple[int, int]]]:
    """Grids (columns, rows) with at most 12 tiles whose sides fit [200, 2000] px, by tile count
    (grid tiles + the thumbnail tile InternVL adds to multi-tile grids)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for i in range(1, 13):
        for j in range(1, 13):
            if i * j <= 12 and max(i, j) / min(i, j) <= 5:
                out.setdefault(i * j + (i * j > 1), []).append((i, j))
    return out


_GRIDS = _grids_by_tiles()


def _image_size(rng: np.random.Generator, tiles: int) -> tuple[int, int]:
    """A (width, height) in pixels that dynamic tiling cuts into about ``tiles`` tiles.

    The image gets the grid's aspect ratio (±4 %, so the grid stays the closest one) and an
    area between 0.55 and 1.0 of the grid's pixel area: above InternVL's 0.5 threshold that
    settles ties between grids of the same ratio, below the next larger grid's threshold.
    """
    tiles = max(1, tiles)
    have = np.array(sorted(_GRIDS))
    t = int(have[np.argmin(np.abs(have - tiles))])
    cols, rows = _GRIDS[t][int(rng.integers(len(_GRIDS[t])))]
    if t == 1:  # one tile: any roughly square image up to one tile
        side = rng.uniform(MIN_SIDE_PX, TILE_PX)
        ratio = rng.uniform(0.9, 1.1)
        return int(round(side * np.sqrt(ratio))), int(round(side / np.sqrt(ratio)))
    lo = max(np.sqrt(0.55), MIN_SIDE_PX / (min(cols, rows) * TILE_PX))
    hi = min(1.0, MAX_SIDE_PX / (max(cols, rows) * TILE_PX))
    scale = rng.uniform(lo, max(lo, hi))
    jitter = rng.uniform(0.96, 1.04)
    w = int(np.clip(round(cols * TILE_PX * scale * jitter), MIN_SIDE_PX, MAX_SIDE_PX))
    h = int(np.clip(round(rows * TILE_PX * scale), MIN_SIDE_PX, MAX_SIDE_PX))
    return w, h


def image_bytes(rng: np.random.Generator, width: int, height: int, fmt: str) -> bytes:
    """A cheap ``width`` x ``height`` pixel drawing (two gradients, a flat channel, a few shapes), encoded as
    ``fmt`` (``"jpg"`` or ``"png"``): the file's bytes."""
    from PIL import Image, ImageDraw

    grad = Image.linear_gradient("L")
    bands = (grad.resize((width, height)), grad.rotate(90).resize((width, height)),
             Image.new("L", (width, height), int(rng.integers(256))))
    order = rng.permutation(3)
    img = Image.merge("RGB", tuple(bands[k] for k in order))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = int(rng.integers(width)), int(rng.integers(height))
        x1, y1 = x0 + int(rng.integers(8, max(9, width // 2))), y0 + int(rng.integers(8, max(9, height // 2)))
        color = tuple(int(c) for c in rng.integers(256, size=3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=color)
    buf = io.BytesIO()
    if fmt == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        img.save(buf, format="JPEG", quality=JPEG_QUALITY)
    return buf.getvalue()


def _conversation(rng: np.random.Generator, family: str, text_tokens: int) -> list[dict]:
    """LLaVA turns ``{"from": "human"|"gpt", "value"}``; the first human turn starts with ``<image>\\n``."""
    w = _words(text_tokens)
    if family == "captioning":
        turns = [(_CAPTION_PROMPTS[int(rng.integers(len(_CAPTION_PROMPTS)))], _prose(rng, w))]
    elif family == "document_qa":
        q = max(4, w // 4)
        turns = [(f"Read the document. {_clause(rng, q).capitalize()}?", _prose(rng, w - q))]
    elif family == "chart_qa":
        q = max(4, w // 3)
        turns = [(f"What does the chart show about {_clause(rng, q)}?", _prose(rng, w - q))]
    elif family == "conversation":
        rounds = int(rng.integers(1, 4))
        shares = _split(rng, w, 2 * rounds)
        turns = [(f"{_clause(rng, shares[2 * k]).capitalize()}?", _prose(rng, shares[2 * k + 1]))
                 for k in range(rounds)]
    else:
        raise ValueError(f"unknown vision task family {family!r}")
    conv = []
    for k, (question, answer) in enumerate(turns):
        conv.append({"from": "human", "value": ("<image>\n" if k == 0 else "") + question})
        conv.append({"from": "gpt", "value": answer})
    return conv


def image_text_samples(num_samples: int, seed: int = 0):
    """Yield ``(key, image_ext, image_bytes, record)`` per sample, lengths as `synthetic_shapes("vision")`.

    ``record`` is LLaVA-like: ``{"id", "task", "image", "conversations"}``; ``key`` is
    ``sample-00000000``-style (no dots: webdataset splits keys at the first dot).
    Deterministic for ``(num_samples, seed)``.
    """
    shapes, names = synthetic_shapes("vision", num_samples, seed=seed)
    rng = np.random.default_rng([seed, 2])
    tiles = shapes.vision_tokens // 256
    for i in range(num_samples):
        family = names[int(shapes.task_id[i])]
        # The families use a few tile counts (1, 3, 5, 7, 9, 12); nudge a quarter of the
        # images by one tile so that the other grids (aspect ratios) occur too.
        nudge = int(rng.choice([-1, 0, 0, 0, 0, 0, 0, 1]))
        w, h = _image_size(rng, int(tiles[i]) + nudge)
        # A few small images as PNG, as real mixes have both.
        ext = "png" if max(w, h) <= TILE_PX and rng.random() < 0.25 else "jpg"
        data = image_bytes(rng, w, h, ext)
        key = f"sample-{i:08d}"
        record = {"id": f"gen{seed}-vl-{i:08d}", "task": family, "image": f"{key}.{ext}",
                  "conversations": _conversation(rng, family, int(shapes.input_tokens[i]))}
        yield key, ext, data, record


def _add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # fixed metadata: byte-identical archives for a seed
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tf.addfile(info, io.BytesIO(data))


def write_image_text_shards(out_dir, num_samples: int, num_shards: int = 1, seed: int = 0,
                            progress: bool = False) -> list[Path]:
    """Write `image_text_samples` as webdataset shards ``shard-000000.tar`` ... in ``out_dir``.

    Each sample is two members, ``<key>.jpg`` (or ``.png``) and ``<key>.json``. Images take
    ~15 ms each to draw and encode (about 5-60 kB each at JPEG quality 30). Returns the paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = image_text_samples(num_samples, seed)
    paths = []
    with progress_bar(num_samples, "datagen image+text shards", "sample", progress) as bar:
        for k, part in enumerate(_shard_slices(num_samples, num_shards)):
            path = out / f"shard-{k:06d}.tar"
            with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
                for _ in range(part.stop - part.start):
                    key, ext, data, record = next(samples)
                    _add_member(tf, f"{key}.{ext}", data)
                    _add_member(tf, f"{key}.json", json.dumps(record, ensure_ascii=False).encode("utf-8"))
                    bar.update(1)
            paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------
# Command line: `dynabatch datagen` (its parser: `dynabatch.commands.datagen`)

def datagen_command(args) -> int:
    """Run ``dynabatch datagen`` with its parsed arguments; 1 with a one-line error on bad counts."""
    import sys

    from .progress import show_progress

    if args.text < 0 or args.image_text < 0 or args.shards < 1:
        print("dynabatch: error: --text and --image-text must be >= 0 and --shards >= 1", file=sys.stderr)
        return 1
    if not args.text and not args.image_text:
        print("dynabatch: error: nothing to write: give --text N and/or --image-text N", file=sys.stderr)
        return 1
    out, progress = Path(args.out), show_progress(args)
    for kind, n, write in (("text", args.text, lambda d: write_text_shards(
            d, args.text, min(args.shards, args.text), args.seed, format=args.text_format, progress=progress)),
            ("image_text", args.image_text, lambda d: write_image_text_shards(
                d, args.image_text, min(args.shards, args.image_text), args.seed, progress=progress))):
        if n:
            paths = write(out / kind)
            size = sum(p.stat().st_size for p in paths)
            print(f"{kind}: {n} samples in {len(paths)} shards, {size / 1e6:.1f} MB -> {out / kind}")
    return 0
