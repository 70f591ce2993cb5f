"""`PlanOptions`: every planning option, declared once.

One frozen record says how a run's steps are formed and planned: the global batch (in tokens or
samples), truncation, the method and its knobs, the world layout, the schedule, the memory limit,
the seed and whether a final partial step is dropped. `plan_microbatches`, the `DataLoader` (all
modes), offline planning (``dynabatch plan``), the plan file's ``dynabatch.options`` metadata and
every benchmark read the same record, so one name means one thing everywhere.

Every field is declared once, in `PlanOptions` below: its name, type and default, and as field
metadata its meaning (units) and the command-line flag that sets it (`option_help`, `option_flag`,
`option_default`). `dynabatch.option_flags` builds ``dynabatch plan``'s and ``bench plan``'s flags
from them, the DataLoader takes the same record (``options=``), and docs/planner.md tabulates them
(a test checks the table, the flags and the declarations against each other). The DataLoader's own
settings (tokenization, source, costing, runtime) are declared in `dynabatch.loader.settings`.

Names of earlier releases (`DEPRECATED_NAMES`) still work for one release and raise a
`DeprecationWarning` naming the new one.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .methods import BASELINE_COLLATION, BASELINES
from .schedule.registry import SCHEDULE_CODES, SCHEDULE_NAMES

#: Per-stage activation recomputation policies (`dynabatch.core.plan.recompute`, which prices them).
RECOMPUTE: tuple[str, ...] = ("none", "full", "adaptive")

#: Every planning method: dynabatch's dynamic program (padded / packed varlen) and the baselines.
METHODS: tuple[str, ...] = ("dp", "dp_varlen") + BASELINES

#: How micro-batches are laid out: one sample per row (padded), one varlen row (packed), or
#: fixed-length rows holding several samples (packed_rows).
COLLATIONS: tuple[str, ...] = ("padded", "packed", "packed_rows")

#: Every pipeline schedule name (and, in `SCHEDULE_CODES`, its code), registered once in
#: `dynabatch.core.schedule.registry`: the simulator, the planner and the runner all model all of them.
SCHEDULES: tuple[str, ...] = SCHEDULE_NAMES

#: Old option name -> its one name now (accepted for one release with a DeprecationWarning).
DEPRECATED_NAMES: Mapping[str, str] = MappingProxyType({
    "batch_tokens": "global_batch_tokens",
    "tokens_per_batch": "global_batch_tokens",
    "batch_size": "global_batch_size",
    "samples_per_batch": "global_batch_size",
    "ranks": "num_ranks",
    "stages": "num_stages",
})


def method_collation(method: str) -> str:
    """The collation a planning method's micro-batches are costed and collated with."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    return {"dp": "padded", "dp_varlen": "packed"}.get(method) or BASELINE_COLLATION[method]


def default_method(collation: str) -> str:
    """The planning method of a collation: ``dp`` (padded), ``dp_varlen`` (packed), ``pack`` (rows)."""
    if collation not in COLLATIONS:
        raise ValueError(f"collation must be one of {COLLATIONS}, got {collation!r}")
    return {"padded": "dp", "packed": "dp_varlen", "packed_rows": "pack"}[collation]


class _Unset:
    """The type of `UNSET`."""

    def __repr__(self) -> str:
        return "UNSET"


#: The default of a planning keyword not given (``plan_microbatches(shapes, cost, options, num_stages=...)``):
#: the value of ``options`` (or `PlanOptions`' default) applies.
UNSET: Any = _Unset()


def given(values: Mapping[str, Any]) -> dict:
    """The entries of ``values`` that were given (not `UNSET`), as a dict."""
    return {k: v for k, v in values.items() if v is not UNSET}


def renamed(kwargs: dict, *, where: str, stacklevel: int = 3) -> dict:
    """``kwargs`` with deprecated option names replaced by their new names (warns once per name).

    Raises TypeError when an old and a new name are both given."""
    out = dict(kwargs)
    for old, new in DEPRECATED_NAMES.items():
        if old in out:
            if new in out and out[new] is not None and out[old] is not None:
                raise TypeError(f"{where}: {old}= is the deprecated name of {new}=; give only {new}=")
            warnings.warn(f"{where}: {old}= is deprecated, use {new}= (the same option)", DeprecationWarning,
                          stacklevel=stacklevel)
            value = out.pop(old)
            if out.get(new) is None:
                out[new] = value
    return out


def _positive(name: str, value, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_int(name: str, value, *, minimum: int = 1, optional: bool = True, unit: str = "") -> int | None:
    """``value`` as an int, or ValueError naming ``name`` unless it is an integer >= ``minimum``
    (an integral float such as ``65536.0`` is accepted; None passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {what}{' (' + unit + ')' if unit else ''}, got {value!r}")
    return int(value.__index__())


def _option(default, flag: str | None, help: str):
    """A `PlanOptions` field: ``default`` (a callable: its factory), the command-line flag that sets it
    (None: none) and what it means (units)."""
    meta = MappingProxyType({"flag": flag, "help": help})
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def option_help(name: str) -> str:
    """What the `PlanOptions` field ``name`` means (its declaration's help)."""
    return _FIELDS[name].metadata["help"]


def option_flag(name: str) -> str | None:
    """The command-line flag that sets the `PlanOptions` field ``name`` (None: no flag)."""
    return _FIELDS[name].metadata["flag"]


def option_default(name: str):
    """The default of the `PlanOptions` field ``name`` (a factory's product for ``method_options``)."""
    f = _FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


@dataclass(frozen=True)
class PlanOptions:
    """How steps are formed and planned (see the module docstring for every field; tokens, bytes).

    Give the global batch either in tokens (``global_batch_tokens``) or in samples
    (``global_batch_size``) when forming steps; `plan_microbatches` of one given global batch needs
    neither. ``method_options`` is stored as a read-only mapping.
    """

    # Every option is declared here and only here: its name, type and default, and (field metadata, read
    # with `option_help` / `option_flag`) its meaning and its command-line flag, which
    # `dynabatch.option_flags` builds the flags of ``dynabatch plan`` / ``bench plan`` from.
    global_batch_tokens: int | None = _option(None, "--global-batch-tokens",
                                              "tokens of one step over all ranks (main + decoder tokens after truncation)")
    global_batch_size: int | None = _option(None, "--global-batch-size",
                                            "samples of one step over all ranks, instead of tokens (give one of the two)")
    max_len: int | None = _option(None, "--max-len", "cap on a sample's main-stack tokens (decoder-only: the whole "
                                                     "sequence; encoder-decoder: the input)")
    max_target_len: int | None = _option(None, "--max-target-len",
                                         "cap on an encoder-decoder sample's target (decoder) tokens")
    method: str = _option("dp", "--method", "planning method: dp (padded micro-batches), dp_varlen (packed varlen) "
                                            "or a baseline")
    method_options: Mapping[str, Any] = _option(dict, "--method-option",
                                                "the method's knobs (a baseline's rows/max_tokens..., dp's order)")
    num_stages: int = _option(1, "--num-stages", "pipeline stages")
    num_ranks: int = _option(1, "--num-ranks", "data-parallel ranks")
    schedule: str = _option("1f1b", "--schedule",
                            "pipeline schedule the micro-batches are ordered and simulated for")
    memory_limit: float | None = _option(None, "--memory-limit",
                                         "activation bytes one micro-batch may use on one stage (None: the cost "
                                         "model's limit)")
    recompute: str = _option("none", "--recompute", "per-stage activation recomputation: none, full or adaptive")
    device_memory_limit: float | None = _option(None, "--device-memory-limit",
                                                "activation bytes one device may hold at once, every micro-batch in "
                                                "flight together (None: unchecked)")
    flush: bool = _option(True, "--no-flush", "whether every step ends with a pipeline flush (False: steps stream "
                                              "flush-free, asynchronous 1F1B across steps)")
    seed: int = _option(0, "--seed", "seed of the global batches: epoch e shuffles with seed + e")
    shuffle: bool = _option(True, "--no-shuffle", "whether to permute the samples each epoch (False: global "
                                                  "batches in sample-id order, for evaluation)")
    drop_last: bool = _option(False, "--drop-last",
                              "drop each epoch's last global batch when it is smaller than the others")
    equal_microbatches: bool = _option(True, None, "every rank gets the same number of micro-batches (dp methods; "
                                                   "steps always ask for it)")
    max_caps: int = _option(48, "--max-caps", "candidate caps on the largest micro-batch the dp search tries")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {METHODS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.global_batch_tokens is not None and self.global_batch_size is not None:
            raise ValueError("give the global batch either in tokens (global_batch_tokens=) or in samples "
                             "(global_batch_size=), not both")
        units = {"global_batch_tokens": "tokens", "global_batch_size": "samples", "max_len": "tokens",
                 "max_target_len": "tokens"}
        for name, unit in units.items():
            object.__setattr__(self, name, check_int(name, getattr(self, name), unit=unit))
        _positive("memory_limit", self.memory_limit)
        _positive("device_memory_limit", self.device_memory_limit)
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"unknown recompute policy {self.recompute!r}; choose one of {RECOMPUTE}")
        if self.recompute == "adaptive" and self.device_memory_limit is None:
            raise ValueError("recompute='adaptive' needs device_memory_limit= (activation bytes one device may hold)")
        for name in ("num_stages", "num_ranks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_caps < 2:
            raise ValueError(f"max_caps must be >= 2 (candidate caps on the largest micro-batch), got {self.max_caps}")
        if not isinstance(self.method_options, Mapping):
            raise TypeError(f"method_options must be a mapping, got {type(self.method_options).__name__}")
        object.__setattr__(self, "method_options", MappingProxyType(dict(self.method_options)))
        for name in ("shuffle", "drop_last", "equal_microbatches", "flush"):
            if not isinstance(getattr(self, name), (bool, int)):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if isinstance(self.seed, bool) or not hasattr(self.seed, "__index__"):
            raise TypeError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed.__index__()))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def collation(self) -> str:
        """``padded``, ``packed`` or ``packed_rows``: what the method's micro-batches look like."""
        return method_collation(self.method)

    @property
    def schedule_code(self) -> int:
        """`SCHEDULE_CODES` of the schedule the planner orders micro-batches for."""
        return SCHEDULE_CODES[self.schedule]

    def epoch_seed(self, epoch: int) -> int:
        """Seed of epoch ``epoch``'s global-batch permutation (``seed + epoch``)."""
        return self.seed + int(epoch)

    def require_batch(self) -> None:
        """Raise ValueError unless the global batch size is given (tokens or samples)."""
        if self.global_batch_tokens is None and self.global_batch_size is None:
            raise ValueError("give the global batch size either in tokens (global_batch_tokens=) or in samples "
                             "(global_batch_size=)")

    def replace(self, **changes) -> "PlanOptions":
        """A copy with ``changes``: fields by name, passed to `dataclasses.replace` (the stdlib's, which
        takes any field; deprecated names are accepted with a warning)."""
        return dataclasses.replace(self, **renamed(changes, where="PlanOptions.replace"))

    # -- serialization (plan-file metadata, loader states, spawned workers) ------------------------
    def __reduce__(self):
        # a mappingproxy does not pickle: spawn/forkserver workers get method_options as a dict,
        # wrapped again by __post_init__
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["method_options"] = dict(self.method_options)
        return _rebuild_options, (type(self), fields)

    def to_dict(self) -> dict:
        """Plain JSON-able dict of every field, plus ``collation`` (derived, for readers)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["method_options"] = dict(self.method_options)
        d["collation"] = self.collation
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PlanOptions":
        """Inverse of `to_dict`; keys that are not fields (``collation``, recorded extras) are ignored
        and deprecated names of older plan files are read silently."""
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        for old, new in DEPRECATED_NAMES.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        return cls(**{k: v for k, v in d.items() if k in names})


_FIELDS = {f.name: f for f in dataclasses.fields(PlanOptions)}


def _rebuild_options(cls, fields: dict) -> PlanOptions:
    """Unpickle a `PlanOptions` (see ``PlanOptions.__reduce__``)."""
    return cls(**fields)
