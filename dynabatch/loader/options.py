"""The `DataLoader`'s arguments, resolved once (nothing is declared here: the planning options are
`dynabatch.core.options.PlanOptions`, the loader's settings records `dynabatch.loader.settings`): the records
and ONE `PlanOptions` (how steps are formed and planned) that every mode gets; `resolve` fills
the options from ``options=``, torch's ``batch_size``/``shuffle``/``drop_last`` and a replayed
plan file. ``num_ranks`` is the loader's world size.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.cost.model import CostModel
from ..core.options import PlanOptions, check_int, default_method, method_collation
from .settings import LoaderSettings

PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(PlanOptions) if f.name != "num_ranks")


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
    if rank is None and world_size is not None and world_size > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"world_size={world_size} without rank=: say which rank this process is (rank=0.."
                             f"{world_size - 1}), or initialize torch.distributed (init_process_group) and leave both "
                             "unset")
        rank = dist.get_rank()
    if rank is not None and world_size is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not a rank of world_size={world_size} (0..{world_size - 1})")
    layout = Layout.resolve(rank=rank, world_size=world_size, worker_id=0, num_workers=1)
    return layout.rank, layout.world_size


def resolve(s: LoaderSettings, options: PlanOptions | None, torch_planning: dict) -> Resolved:
    """The one `PlanOptions`, the cost model and the family of a DataLoader's arguments
    (``torch_planning``: the `PlanOptions` fields torch's arguments gave, `torch_args.torch_planning`)."""
    if options is not None and not isinstance(options, PlanOptions):
        raise TypeError(f"options= must be a PlanOptions, got {type(options).__name__}")
    planning = dict(torch_planning)
    if options is not None:
        # a field at PlanOptions' default is not stated: the method then follows costing.collate, and a
        # replayed plan file decides it
        default = PlanOptions()
        planning = {k: getattr(options, k) for k in PLAN_FIELDS}
        planning["method"] = None if options.method == default.method else options.method
        if s.plan is not None:
            planning = {k: v for k, v in planning.items() if v != getattr(default, k)}
        _merge_torch(planning, torch_planning)
    rank, world_size = resolve_layout(s.rank, s.world_size)
    if options is not None and options.num_ranks not in (1, world_size):
        raise ValueError(f"options.num_ranks={options.num_ranks} but the loader's world size is {world_size}; the "
                         "loader plans for its world size (leave num_ranks at 1 or set it to the world size)")
    method, collate = planning.pop("method", None), s.collate
    # shuffle counts as stated when torch's shuffle= gives it (PlanOptions' default is True either way)
    explicit = {"method": method, "collation": collate, "family": s.family, "shuffle": torch_planning.get("shuffle"),
                **{k: planning.get(k) for k in ("global_batch_tokens", "global_batch_size", "max_len",
                                                 "max_target_len")}}
    plan_file, cost_model, family = None, s.cost_model, s.family
    if s.plan is not None:  # replay: the plan decides what was not given explicitly
        from .modes.replay import load_run_plan

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
            raise ValueError("give the global batch size: options=PlanOptions(global_batch_tokens=...) (tokens) or "
                             "options=PlanOptions(global_batch_size=...) (samples), or torch's batch_size= (samples "
                             "per rank)") from None
    cost = _cost_model(cost_model, s.device, opts.num_stages, s.pad_to_multiple_of, family)
    family = family or ("encoder_decoder" if cost.kind == "encoder_decoder" else "decoder")
    if family not in ("decoder", "encoder_decoder"):
        raise ValueError(f"family must be 'decoder' or 'encoder_decoder', got {family!r}")
    return Resolved(s, opts, cost, family, rank, world_size, plan_file, explicit)


def _merge_torch(planning: dict, torch_planning: dict) -> None:
    """Torch's ``batch_size`` fills the global batch of an ``options`` without one; torch's
    ``shuffle``/``drop_last`` beside ``options`` must agree with it (TypeError otherwise)."""
    for name, value in torch_planning.items():
        if name == "global_batch_size":
            if planning.get("global_batch_tokens") is not None or planning.get("global_batch_size") is not None:
                raise TypeError("batch_size= (samples per step on each rank) and options= both give the step size; "
                                "give one")
            planning[name] = value
        elif planning.get(name) != value:
            raise TypeError(f"{name}={value} but options.{name}={planning.get(name)}: give it in one place "
                            f"(options=PlanOptions({name}={value}))")


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
                   truncation_side="right", format_config=None, vision=None, pretokenized=None, image_token_id=None,
                   chat_template=None):
    """The `tokenization.Formatter` the loader tokenizes with: ``max_len`` caps the whole sequence
    (decoder-only) or the input (encoder-decoder), vision tokens included (never cut: the text is
    cut to make room, as the planner's `CostModel.sample_dims` does), ``max_target_len`` the
    target; ``pretokenized`` as `tokenization.FormatConfig`'s (None: rows without text but with
    ``input_ids`` are taken as given; True: every row's ``input_ids``, even beside a text column);
    ``image_token_id`` as `tokenization.FormatConfig`'s (None: no image placeholders in the ids;
    an id: each image's run of that id, one per vision token, at its ``<image>`` marker or before
    the text); ``chat_template`` as `tokenization.FormatConfig`'s (how ``messages`` are rendered: None,
    the tokenizer's Jinja chat template, else the plain format with a warning; ``"tokenizer"``,
    ``"plain"``, a ``ChatTemplate`` or a Jinja template's text)."""
    from tokenization import FormatConfig, Formatter, load_tokenizer

    if format_config is None:
        if family == "decoder":
            format_config = FormatConfig(family="decoder", max_total_tokens=max_len, add_bos=add_bos,
                                         truncation_side=truncation_side, pretokenized=pretokenized,
                                         image_token_id=image_token_id, chat_template=chat_template)
        else:
            format_config = FormatConfig(family="encoder_decoder", max_input_tokens=max_len,
                                         max_target_tokens=max_target_len, add_bos=add_bos,
                                         truncation_side=truncation_side, pretokenized=pretokenized,
                                         image_token_id=image_token_id, chat_template=chat_template)
    elif format_config.family != family:
        raise ValueError(f"format_config.family={format_config.family!r} but the loader's family is {family!r}")
    elif pretokenized is not None:
        raise TypeError("give pretokenized= in format_config or as a keyword, not both")
    elif image_token_id is not None:
        raise TypeError("give image_token_id= in format_config or as a keyword, not both")
    elif chat_template is not None:
        raise TypeError("give chat_template= in format_config or as a keyword, not both")
    return Formatter(load_tokenizer(tokenizer), format_config, vision=vision)


def open_data(data, source_options: dict | None, split):
    """A ``loaders`` source or mixture as is, else ``loaders.open_source(data, split=, **source_options)``."""
    import loaders

    if isinstance(data, (loaders.Source, loaders.Mixture)):
        if source_options:
            raise TypeError("source_options only apply when the loader opens the data itself")
        return data
    return loaders.open_source(data, split=split, **dict(source_options or {}))


__all__ = ["PLAN_FIELDS", "Resolved", "make_formatter", "open_data", "resolve", "resolve_layout"]
