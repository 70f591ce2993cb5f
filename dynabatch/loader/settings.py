"""The `DataLoader`'s settings records: what is not a planning option (`PlanOptions`) nor one of
``torch.utils.data.DataLoader``'s own arguments, in four typed groups:

* `Tokenization`: how a record becomes tokens (tokenizer, format, chat template, images);
* `DataSource`: how the data is opened and read (source options, mode, length index, plan file);
* `Costing`: what a micro-batch costs (cost model, device, collation, padding);
* `Runtime`: where this loader runs and how far it plans ahead (rank, world size, planning
  threads/processes, streaming lookahead).

Each field keeps the name of the loose keyword it replaces (``DataLoader(tokenizer=...)`` is now
``DataLoader(tokenization=Tokenization(tokenizer=...))``); `record_of` names the record of an old
keyword, for the error an old-style call gets, and `records_from_keywords` converts a whole old
call's keywords. `LoaderSettings` bundles the records with the
torch worker arguments (`Workers`) for the modes, which read any field by its name.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from ..core.options import DEPRECATED_NAMES, PlanOptions, check_int, renamed
from .pixels import IMAGENET_MEAN, IMAGENET_STD

MODES = ("auto", "indexed", "streaming")


@dataclass(frozen=True)
class Tokenization:
    """How a record becomes model inputs (see `tokenization.FormatConfig` for the format fields).

    tokenizer: a ``tokenization.load_tokenizer`` spec or tokenizer object (``"bytes"``: one token
        per UTF-8 byte).
    family: ``"decoder"`` or ``"encoder_decoder"``; None: from the cost model's kind.
    add_bos, truncation_side, format_config: formatting; ``format_config`` (a
        `tokenization.FormatConfig`) replaces the loader's own (then leave ``pretokenized``,
        ``image_token_id`` and ``chat_template`` unset).
    pretokenized: rows carry ``input_ids`` (and optional ``labels``); None takes a row's ids as
        given when it has no text field, True whenever it has them.
    chat_template: how ``messages`` records are rendered (`tokenization.FormatConfig.chat_template`):
        None (default) the tokenizer's own Jinja chat template, loss on the assistant turns only
        (else the plain ``User:/Assistant:`` format, with a `tokenization.ChatTemplateWarning`); a
        Jinja template's text; ``"tokenizer"``; ``"plain"`` or a ``tokenization.ChatTemplate``.
    decoder_start_token_id: first decoder input of an encoder-decoder model (None: the model's
        ``config.decoder_start_token_id`` when ``model`` is known, else the pad id).
    vision: a ``tokenization`` vision policy (None: ``DynamicTiling()`` for a vision-language cost
        model, else text only); micro-batches then carry ``image_tiles``.
    image_token_id: None: ``input_ids`` hold text only; an id: LLaVA-style placeholder runs of that
        id, one per vision token, counted towards ``max_len`` and never cut.
    load_pixels: also decode images into ``pixel_values`` (needs ``vision``), normalized with
        ``pixel_mean`` / ``pixel_std`` (per channel, 0..1 scale).
    model: the Hugging Face model these samples are for: a ``save_pretrained`` folder, a ``config.json``
        path, a config or a model object (None: ``tokenizer`` when it is a folder holding a
        ``config.json``). Its config fills the unset ``family``, ``decoder_start_token_id``,
        ``image_token_id``, ``vision`` and pixel statistics, a stated value that differs is warned
        about, and a tokenizer with more ids than the model's ``vocab_size`` is refused
        (`dynabatch.loader.model_facts`).
    """

    tokenizer: Any = "bytes"
    family: str | None = None
    add_bos: bool = False
    truncation_side: str = "right"
    format_config: Any = None
    pretokenized: bool | None = None
    chat_template: Any = None
    decoder_start_token_id: int | None = None
    vision: Any = None
    image_token_id: int | None = None
    load_pixels: bool = False
    pixel_mean: tuple = IMAGENET_MEAN
    pixel_std: tuple = IMAGENET_STD
    model: Any = None


@dataclass(frozen=True)
class DataSource:
    """How the data is opened and read.

    source_options: keywords of ``loaders.open_source`` (``mapping=`` for your own field names,
        ``storage_options=``, ``shuffle=``...); only when the loader opens the data itself.
    split: the split of a ``DatasetDict``.
    on_error: bad records: ``"raise"`` (an error naming file and line) or ``"skip"`` (counted).
    mode: ``"auto"`` (indexed for map-style data, an ``index`` or a ``plan``, else streaming),
        ``"indexed"`` or ``"streaming"``.
    index / index_cache: the indexed mode's length index (a path or table; else the data is scanned
        once), and where to keep the scanned one between runs.
    cache_tokens: keep every sample's token ids in a token file on disk, read per step with pread (beside
        ``index_cache``, else under ``$DYNABATCH_CACHE_DIR``), checked against the tokenizer and the data
        (None: when the disk has room for them).
    plan: a plan file (``dynabatch plan``) to replay exactly.
    progress: tqdm bars while the index and token cache are built (None: on a terminal only).
    """

    source_options: dict | None = None
    split: str | None = None
    on_error: str = "raise"
    mode: str = "auto"
    index: Any = None
    index_cache: Any = None
    cache_tokens: bool | None = None
    plan: Any = None
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"DataSource(mode=) must be 'auto', 'indexed' or 'streaming', got {self.mode!r}")
        if self.plan is not None and self.mode == "streaming":
            raise ValueError("DataSource(plan=) replays a plan by sample id, which needs the indexed mode")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"DataSource(on_error=) must be 'raise' or 'skip', got {self.on_error!r}")


@dataclass(frozen=True)
class Costing:
    """What a micro-batch costs, for the planner.

    cost_model: a `CostModel`, or a preset name on ``device`` (None: a replayed plan file's, else
        ``"gpt"`` on a GPU and ``"gpt-tiny"`` / ``"t5-tiny"`` on a CPU).
    device: a device preset, or ``"auto"``: this machine's (`dynabatch.devices`).
    collate: ``"padded"``, ``"packed"`` or ``"packed_rows"`` (None: the method's); picks the
        method when ``PlanOptions.method`` is at its default (``"dp"``), else must be its collation.
    pad_to_multiple_of: padding multiple of the batches, in tokens (None: the cost model's).
    """

    cost_model: Any = None
    device: str = "auto"
    collate: str | None = None
    pad_to_multiple_of: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pad_to_multiple_of", check_int("pad_to_multiple_of", self.pad_to_multiple_of))


@dataclass(frozen=True)
class Runtime:
    """Where this loader runs and how it plans in the background.

    rank, world_size: this process's data-parallel rank and the world size (None: from
        ``torch.distributed`` when initialized, else 0 / 1; a world size > 1 needs both, or
        ``torch.distributed``).
    collective: the streaming mode's `Collective` (None: torch.distributed's, or one rank's).
    plan_ahead: steps planned ahead by the planning thread.
    plan_processes: indexed mode without workers: plan in this many forked processes.
    buffer_tokens: streaming lookahead in tokens (None: from the global batch).
    chunk_size: records tokenized per call in the streaming mode.
    """

    rank: int | None = None
    world_size: int | None = None
    collective: Any = None
    plan_ahead: int = 2
    plan_processes: int | None = None
    buffer_tokens: int | None = None
    chunk_size: int = 64

    def __post_init__(self) -> None:
        for name, minimum, optional in (("plan_ahead", 0, False), ("plan_processes", 0, True), ("chunk_size", 1, False),
                                        ("buffer_tokens", 1, True), ("world_size", 1, True), ("rank", 0, True)):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=minimum, optional=optional))


@dataclass(frozen=True)
class Workers:
    """``torch.utils.data.DataLoader``'s worker arguments, as the DataLoader takes them."""

    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    timeout: float = 0
    multiprocessing_context: Any = None
    worker_init_fn: Any = None
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_workers", check_int("num_workers", self.num_workers, minimum=0, optional=False))
        object.__setattr__(self, "prefetch_factor", check_int("prefetch_factor", self.prefetch_factor))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {self.timeout!r}")

    @property
    def loader_kwargs(self) -> dict:
        """Keywords for the ``torch.utils.data.DataLoader`` of the workers."""
        kw = {"timeout": self.timeout, "multiprocessing_context": self.multiprocessing_context,
              "worker_init_fn": self.worker_init_fn}
        if self.num_workers > 0 and self.prefetch_factor is not None:
            kw["prefetch_factor"] = self.prefetch_factor
        if self.num_workers > 0 and self.persistent_workers:
            kw["persistent_workers"] = True
        return kw


#: The settings records, by the DataLoader keyword that takes each.
RECORDS: dict[str, type] = {"tokenization": Tokenization, "source": DataSource, "costing": Costing,
                            "runtime": Runtime}
_FIELD_RECORD = {f.name: key for key, cls in {**RECORDS, "workers": Workers}.items()
                 for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class LoaderSettings:
    """The records a `DataLoader` was given (defaults filled in); a field of any of them reads by
    its name (``settings.on_error``, ``settings.plan_ahead``): the names are unique."""

    tokenization: Tokenization = Tokenization()
    source: DataSource = DataSource()
    costing: Costing = Costing()
    runtime: Runtime = Runtime()
    workers: Workers = Workers()

    def __getattr__(self, name: str):
        record = _FIELD_RECORD.get(name)
        if record is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(object.__getattribute__(self, record), name)

    @property
    def loader_kwargs(self) -> dict:
        return self.workers.loader_kwargs

    @classmethod
    def of(cls, workers: Workers, *, tokenization: Tokenization | None = None, source: DataSource | None = None,
           costing: Costing | None = None, runtime: Runtime | None = None) -> "LoaderSettings":
        """From the DataLoader's keywords: each record given (or None: its defaults), type-checked."""
        out = {}
        records = {"tokenization": tokenization, "source": source, "costing": costing, "runtime": runtime}
        for key, value in records.items():
            kind = RECORDS[key]
            if value is None:
                value = kind()
            elif not isinstance(value, kind):
                raise TypeError(f"DataLoader({key}=) takes a {kind.__name__}(...), got {type(value).__name__}"
                                + (f"; e.g. {key}={kind.__name__}({_first_field(kind)}={value!r})"
                                   if not dataclasses.is_dataclass(value) else ""))
            out[key] = value
        return cls(workers=workers, **out)


def _first_field(kind: type) -> str:
    return dataclasses.fields(kind)[0].name


def record_of(keyword: str) -> str | None:
    """Where an old loose DataLoader keyword now goes, as code (``"tokenization=Tokenization(tokenizer=...)"``),
    or None when it was never one."""
    plan_fields = {f.name for f in dataclasses.fields(PlanOptions)} - {"num_ranks"}
    new = DEPRECATED_NAMES.get(keyword, keyword)
    if new in plan_fields:
        return f"options=PlanOptions({new}=...)"
    key = _FIELD_RECORD.get(keyword)
    if key is None or key == "workers":
        return None
    return f"{key}={RECORDS[key].__name__}({keyword}=...)"


#: What `DataLoader` takes by keyword besides the records: torch's arguments, options, feedback.
DIRECT = ("batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn", "pin_memory", "drop_last",
          "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor", "persistent_workers",
          "pin_memory_device", "in_order", "options", "feedback", *RECORDS)


def records_from_keywords(old: Mapping[str, Any]) -> dict:
    """Migration from earlier releases: the loose keywords of a ``DataLoader(...)`` call, as one mapping
    (any of them, as that call wrote them) -> the keywords it takes now (``options=PlanOptions(...)`` and
    the settings records), so that
    ``DataLoader(data, **records_from_keywords(dict(tokenizer=t, global_batch_tokens=n)))`` is the old
    call. Planning keywords (deprecated names too, with a warning) go into one `PlanOptions`
    (with ``shuffle``/``drop_last`` when any goes there); torch's arguments stay as they are."""
    loose = dict(old)
    out = {k: loose.pop(k) for k in list(loose) if k in DIRECT}
    loose = renamed(loose, where="records_from_keywords", stacklevel=3)
    plan_fields = {f.name for f in dataclasses.fields(PlanOptions)} - {"num_ranks"}
    planning = {k: loose.pop(k) for k in list(loose) if k in plan_fields}
    planning = {k: v for k, v in planning.items() if v is not None}  # None meant "the default"
    if planning:
        if out.get("options") is not None:
            raise TypeError(f"give the planning options in options= only, not also {sorted(planning)}")
        planning.update({k: out.pop(k) for k in ("shuffle", "drop_last") if out.get(k) is not None})
        out["options"] = PlanOptions(**planning)
    groups: dict = {}
    for k in list(loose):
        key = _FIELD_RECORD.get(k)
        if key in RECORDS:
            groups.setdefault(key, {})[k] = loose.pop(k)
    if loose:
        raise TypeError(f"DataLoader got unexpected keyword argument(s) {sorted(loose)}")
    for key, fields in groups.items():
        given = out.get(key)
        out[key] = dataclasses.replace(given, **fields) if given is not None else RECORDS[key](**fields)
    return out


def refusing_old_keywords(init):
    """``DataLoader.__init__`` wrapped so that a keyword it does not take (a loose keyword of earlier
    releases) raises `refuse_old_keywords`' TypeError, naming the record it now belongs to, rather
    than Python's bare one. The signature ``help`` and `inspect` show stays the one written."""
    names = set(inspect.signature(init).parameters)

    @functools.wraps(init)
    def init_refusing_old_keywords(self, *args, **keywords):
        refuse_old_keywords({k: v for k, v in keywords.items() if k not in names})
        return init(self, *args, **keywords)

    return init_refusing_old_keywords


def refuse_old_keywords(old: dict) -> None:
    """TypeError for keywords DataLoader does not take, naming the record each now belongs to."""
    if not old:
        return
    moved = {k: record_of(k) for k in sorted(old)}
    unknown = [k for k, v in moved.items() if v is None]
    if unknown:
        raise TypeError(f"DataLoader got unexpected keyword argument(s) {unknown}")
    raise TypeError("DataLoader takes its settings in records now: " + "; ".join(
        f"{k}= -> {v}" for k, v in moved.items()) + " (see help(dynabatch.DataLoader))")


__all__ = ["Costing", "DIRECT", "DataSource", "LoaderSettings", "MODES", "RECORDS", "Runtime", "Tokenization",
           "Workers", "record_of", "records_from_keywords", "refuse_old_keywords", "refusing_old_keywords"]
