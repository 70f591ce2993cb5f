"""The `DataLoader`'s keyword arguments, normalized once: `LoaderSettings` (data, tokenization,
distribution, loading) and ONE `PlanOptions` (how steps are formed and planned) that every mode
gets; `resolve` fills both from the keywords, a given ``options=`` record and a replayed plan file.

Planning keywords are `PlanOptions` fields (``global_batch_tokens``, ``global_batch_size``,
``max_len``, ``max_target_len``, ``method``, ``method_options``, ``num_stages``, ``schedule``,
``memory_limit``, ``seed``, ``drop_last``, ...); the old names ``batch_tokens=`` / ``batch_size=``
still work for one release with a DeprecationWarning. ``num_ranks`` is the loader's world size.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.cost.model import CostModel
from ..core.options import DEPRECATED_NAMES, PlanOptions, check_int, default_method, method_collation, renamed
from .pixels import IMAGENET_MEAN, IMAGENET_STD

MODES = ("auto", "indexed", "streaming")
PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(PlanOptions) if f.name != "num_ranks")


@dataclass
class LoaderSettings:
    """Every `DataLoader` keyword that is not a planning option (see `DataLoader` for each)."""

    tokenizer: Any = "bytes"
    cost_model: Any = None
    device: str = "auto"  # a device preset, or "auto": this machine's (dynabatch.devices)
    rank: int | None = None
    world_size: int | None = None
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    timeout: float = 0
    multiprocessing_context: Any = None
    worker_init_fn: Any = None
    persistent_workers: bool = False
    collate: str | None = None
    pad_to_multiple_of: int | None = None
    family: str | None = None
    plan: Any = None
    mode: str = "auto"
    index: Any = None
    index_cache: Any = None
    vision: Any = None
    load_pixels: bool = False
    pixel_mean: tuple = IMAGENET_MEAN
    pixel_std: tuple = IMAGENET_STD
    add_bos: bool = False
    truncation_side: str = "right"
    format_config: Any = None
    decoder_start_token_id: int | None = None
    plan_ahead: int = 2
    buffer_tokens: int | None = None
    chunk_size: int = 64
    collective: Any = None
    on_error: str = "raise"
    source_options: dict | None = None
    split: str | None = None
    cache_tokens: bool | None = None
    plan_processes: int | None = None
    progress: bool | None = None
    pretokenized: bool | None = None
    image_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'auto', 'indexed' or 'streaming', got {self.mode!r}")
        for name, minimum in (("num_workers", 0), ("plan_ahead", 0), ("plan_processes", 0), ("chunk_size", 1),
                              ("buffer_tokens", 1), ("prefetch_factor", 1), ("pad_to_multiple_of", 1)):
            setattr(self, name, check_int(name, getattr(self, name), minimum=minimum,
                                          optional=name not in ("num_workers", "plan_ahead", "chunk_size")))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {self.timeout!r}")
        if self.plan is not None and self.mode == "streaming":
            raise ValueError("plan= replays a plan by sample id, which needs the indexed mode")

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


@dataclass
class Resolved:
    """The outcome of `resolve`: settings, the one `PlanOptions`, the cost model and family."""

    settings: LoaderSettings
    options: PlanOptions
    cost: CostModel
    family: str
    rank: int
    world_size: int
    plan_file: Any = None
    #: options given explicitly (checked against a replayed plan file, by `PlanOptions` field name)
    explicit: dict = dataclasses.field(default_factory=dict)


def resolve_layout(rank, world_size) -> tuple[int, int]:
    """(rank, world size): explicit values, else torch.distributed's when initialized, else (0, 1)."""
    from loaders import Layout

    check_int("world_size", world_size)
    check_int("rank", rank, minimum=0)
    layout = Layout.resolve(rank=rank, world_size=world_size, worker_id=0, num_workers=1)
    return layout.rank, layout.world_size


def resolve(kwargs: dict, options: PlanOptions | None) -> Resolved:
    """Split and normalize the DataLoader's keywords (TypeError for an unknown one)."""
    kwargs = renamed(kwargs, where="DataLoader", stacklevel=4)
    planning = {k: kwargs.pop(k) for k in list(kwargs) if k in PLAN_FIELDS}
    names = {f.name for f in dataclasses.fields(LoaderSettings)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"DataLoader got unexpected keyword argument(s) {unknown}")
    s = LoaderSettings(**kwargs)
    if options is not None:
        if not isinstance(options, PlanOptions):
            raise TypeError(f"options= must be a PlanOptions, got {type(options).__name__}")
        given = {k: v for k, v in planning.items() if v is not None}
        if given:
            raise TypeError(f"give the planning options either in options= or as keywords, not both ({sorted(given)})")
        planning = {k: getattr(options, k) for k in PLAN_FIELDS}
    rank, world_size = resolve_layout(s.rank, s.world_size)
    if options is not None and options.num_ranks not in (1, world_size):
        raise ValueError(f"options.num_ranks={options.num_ranks} but the loader's world size is {world_size}; the "
                         "loader plans for its world size (leave num_ranks at 1 or set it to the world size)")
    method, collate = planning.pop("method", None), s.collate
    explicit = {"method": method, "collation": collate, "family": s.family, "shuffle": planning.get("shuffle"),
                **{k: planning.get(k) for k in ("global_batch_tokens", "global_batch_size", "max_len",
                                                 "max_target_len")}}
    plan_file, cost_model, family = None, s.cost_model, s.family
    if s.plan is not None:  # replay: the plan decides what was not given explicitly
        from .replay_planner import load_run_plan

        plan_file = pf = load_run_plan(s.plan)
        method, collate = method or pf.method, collate or pf.collation
        if planning.get("num_stages") is None:
            planning["num_stages"] = pf.num_stages
        family = family or pf.family
        if cost_model is None:
            cost_model = pf.cost_model()
        for name in ("max_len", "max_target_len"):
            if planning.get(name) is None:
                planning[name] = pf.option(name)
    if collate is not None:
        default_method(collate)  # validates the collation
    method = method or default_method(collate or "padded")
    collation = method_collation(method)
    if collate is not None and collate != collation:
        raise ValueError(f"method {method!r} plans {collation!r} micro-batches, but collate={collate!r}; "
                         f"use collate={collation!r} or another method")
    planning = {k: v for k, v in planning.items() if v is not None}
    planning["method_options"] = dict(planning.get("method_options") or {})
    opts = PlanOptions(method=method, num_ranks=world_size, **planning)
    if plan_file is None:
        try:
            opts.require_batch()
        except ValueError:
            raise ValueError("give the global batch size either in tokens (global_batch_tokens=) or in samples "
                             "(global_batch_size=), not both or neither") from None
    cost = _cost_model(cost_model, s.device, opts.num_stages, s.pad_to_multiple_of, family)
    family = family or ("encoder_decoder" if cost.kind == "encoder_decoder" else "decoder")
    if family not in ("decoder", "encoder_decoder"):
        raise ValueError(f"family must be 'decoder' or 'encoder_decoder', got {family!r}")
    return Resolved(s, opts, cost, family, rank, world_size, plan_file, explicit)


def _cost_model(cost_model, device: str, num_stages: int, pad_to_multiple_of, family: str | None = None) -> CostModel:
    """A preset name (default: ``gpt`` on a GPU, ``gpt-tiny``/``t5-tiny`` by ``family`` on the cpu) on
    ``device`` (``"auto"``: this machine's; an explicit GPU preset is checked against it), or a
    `CostModel` as given; see `dynabatch.devices.loader_cost_model`."""
    from ..devices import loader_cost_model

    cost_model = loader_cost_model(cost_model, device, num_stages, family)
    if pad_to_multiple_of is not None and int(pad_to_multiple_of) != cost_model.pad_multiple:
        cost_model = copy.copy(cost_model)  # plan with the padding the batches will have
        cost_model.pad_multiple = int(pad_to_multiple_of)
    return cost_model


def make_formatter(tokenizer, family: str, *, max_len=None, max_target_len=None, add_bos=False,
                   truncation_side="right", format_config=None, vision=None, pretokenized=None, image_token_id=None):
    """The `tokenization.Formatter` the loader tokenizes with: ``max_len`` caps the whole sequence
    (decoder-only) or the input (encoder-decoder), vision tokens included (never cut: the text is
    cut to make room, as the planner's `CostModel.sample_dims` does), ``max_target_len`` the
    target; ``pretokenized`` as `tokenization.FormatConfig`'s (None: rows without text but with
    ``input_ids`` are taken as given; True: every row's ``input_ids``, even beside a text column);
    ``image_token_id`` as `tokenization.FormatConfig`'s (None: no image placeholders in the ids;
    an id: each image's run of that id, one per vision token, at its ``<image>`` marker or before
    the text)."""
    from tokenization import FormatConfig, Formatter, load_tokenizer

    if format_config is None:
        if family == "decoder":
            format_config = FormatConfig(family="decoder", max_total_tokens=max_len, add_bos=add_bos,
                                         truncation_side=truncation_side, pretokenized=pretokenized,
                                         image_token_id=image_token_id)
        else:
            format_config = FormatConfig(family="encoder_decoder", max_input_tokens=max_len,
                                         max_target_tokens=max_target_len, add_bos=add_bos,
                                         truncation_side=truncation_side, pretokenized=pretokenized,
                                         image_token_id=image_token_id)
    elif format_config.family != family:
        raise ValueError(f"format_config.family={format_config.family!r} but the loader's family is {family!r}")
    elif pretokenized is not None:
        raise TypeError("give pretokenized= in format_config or as a keyword, not both")
    elif image_token_id is not None:
        raise TypeError("give image_token_id= in format_config or as a keyword, not both")
    return Formatter(load_tokenizer(tokenizer), format_config, vision=vision)


def open_data(data, source_options: dict | None, split):
    """A ``loaders`` source or mixture as is, else ``loaders.open_source(data, split=, **source_options)``."""
    import loaders

    if isinstance(data, (loaders.Source, loaders.Mixture)):
        if source_options:
            raise TypeError("source_options only apply when the loader opens the data itself")
        return data
    return loaders.open_source(data, split=split, **dict(source_options or {}))


__all__ = ["DEPRECATED_NAMES", "LoaderSettings", "PLAN_FIELDS", "Resolved", "make_formatter", "open_data", "resolve",
           "resolve_layout"]
