"""Tokenizer adapters, formatting and sample shaping (token and vision-token counts).

Standalone: this package never imports ``dynabatch`` or ``loaders``. It reads sample dicts
(``sample_id``, ``key``, ``inputs``, ``targets``, ``task``, ``images``, optional
``image_sizes`` and ``messages``; or pre-tokenized ``input_ids`` with optional ``labels``) and
writes the length table that ``dynabatch.Shapes`` reads (`SHAPE_SCHEMA`). Tokenizers come from
local files or from tokenizer objects (`load_tokenizer`); nothing here ever downloads one.
"""

from ._adapters import (
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    TransformersTokenizer,
    load_tokenizer,
)
from ._chat import ChatRenderer, ChatTemplate, ChatTemplateWarning, resolve_chat
from ._fingerprint import tokenizer_fingerprint
from ._config import FormatConfig
from ._format import EncodedSample, Formatter
from ._protocol import IGNORE_INDEX, ByteTokenizer, SampleError, Tokenizer
from ._scan import (
    ID_COLUMNS,
    LABEL_COLUMN,
    SCAN_STATS_KEY,
    SHAPE_SCHEMA,
    TASK_NAMES_KEY,
    ScanStats,
    concat_length_tables,
    count_labels,
    ragged_take,
    scan_shapes,
    scan_stats,
    task_names_of,
)
from ._segments import IMAGE_MARKER
from ._vision import (
    DynamicTiling,
    FixedResolution,
    ImageError,
    VisionPolicy,
    read_image_size,
    sample_image_sizes,
)

__all__ = [
    "ByteTokenizer",
    "ChatRenderer",
    "ChatTemplate",
    "ChatTemplateWarning",
    "DynamicTiling",
    "EncodedSample",
    "FixedResolution",
    "FormatConfig",
    "Formatter",
    "HFTokenizer",
    "ID_COLUMNS",
    "IMAGE_MARKER",
    "IGNORE_INDEX",
    "ImageError",
    "LABEL_COLUMN",
    "SCAN_STATS_KEY",
    "SHAPE_SCHEMA",
    "SampleError",
    "ScanStats",
    "SentencePieceTokenizer",
    "TASK_NAMES_KEY",
    "TiktokenTokenizer",
    "Tokenizer",
    "TransformersTokenizer",
    "VisionPolicy",
    "concat_length_tables",
    "count_labels",
    "load_tokenizer",
    "ragged_take",
    "read_image_size",
    "resolve_chat",
    "sample_image_sizes",
    "scan_shapes",
    "scan_stats",
    "task_names_of",
    "tokenizer_fingerprint",
]
