"""`dynabatch bench loader`: micro-batches/s and real tokens/s delivered to the training loop.

Four ways of feeding one rank (world size 1, a single process: no ``torch.distributed``) with the
same samples, the same tokenizer and formatting (`tokenization.Formatter`, decoder-only, labels
masked on prompts, truncated to ``max_len``), each at ``num_workers`` 0 and 2 by default:

* ``torch_pad``: what a user writes today. A map-style dataset of pre-tokenized samples (a list
  of int64 tensors) -> ``torch.utils.data.DataLoader(batch_size=B, shuffle=True,
  num_workers=W, collate_fn=pad_collate)``; ``pad_collate`` pads to the batch's longest sample
  like ``DataCollatorWithPadding`` (``input_ids``, ``attention_mask``, ``labels`` = -100 on
  padding).
* ``torch_pack``: the same DataLoader with a packing collator (TRL / ``DataCollatorWithFlattening``
  style): the batch's samples are concatenated, greedily in order, into rows of ``max_len``
  tokens (a sample never straddles two rows), ``position_ids`` restarting at 0 per sample,
  rows right-padded to ``max_len``.
* ``dynabatch_padded``: ``dynabatch.DataLoader(costing=Costing(collate="padded"))`` (method ``dp``).
* ``dynabatch_packed``: ``dynabatch.DataLoader(costing=Costing(collate="packed"))`` (method ``dp_varlen``).

``B`` = round(``global_batch_tokens`` / mean sample length after truncation), so a baseline batch holds
about as many real tokens as dynabatch's global batch (``global_batch_tokens``; one rank, so the global
batch is this rank's).

What is timed, symmetrically: setup is NOT timed for either side but is measured and reported
(``setup_s``): the baselines read and tokenize every sample up front (a ``.map`` a user would
run once); dynabatch builds its length index and its token cache (the loader's own scan with an
``index_cache``: the same single tokenization pass over the same files, writing the token ids to
the token file every later loader reuses, the default path) and constructs its loader. The timed loop is one epoch of ``for
batch in loader.microbatches()`` (torch: ``loader``) touching the tensors (``input_ids.numel()``, ``attention_mask.sum()``, the sample
ids). Within that loop dynabatch plans every step ("while planning": in its planning thread,
inside each worker with ``num_workers > 0``) and collates the step's micro-batches from the cached
token ids, as the baselines collate from their pre-tokenized lists.

Every method must deliver every sample exactly once per epoch; the benchmark compares the sorted
sample ids of every run and fails (`LoaderBenchError`) when they differ.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from ..core.cost.model import CostModel
from ..core.options import PlanOptions, default_method
from ._format import fmt_rate
from .load_common import failure_summary, per_s, run_command
from .load_data import resolve_text
from .loader_baselines import IGNORE_INDEX, PackCollate, PretokenizedDataset, jsonl_source, pad_collate, setup_baseline

__all__ = [
    "IGNORE_INDEX", "METHODS", "METHOD_PATHS", "REFERENCE", "LoaderBenchConfig", "LoaderBenchError",
    "PackCollate", "PretokenizedDataset", "bench_loader_command", "format_table", "pad_collate", "run_loader_bench",
    "setup_baseline",
]

METHODS = ("torch_pad", "torch_pack", "dynabatch_padded", "dynabatch_packed")
REFERENCE = "torch_pad"
METHOD_PATHS = {
    "torch_pad": "pre-tokenized list + torch DataLoader(batch_size=B, shuffle=True) + pad-to-batch-max collate",
    "torch_pack": "pre-tokenized list + torch DataLoader(batch_size=B, shuffle=True) + packing collate (rows of max_len)",
    "dynabatch_padded": "dynabatch.DataLoader(costing=Costing(collate='padded')), method dp, indexed mode, index cache + "
                        "token cache file",
    "dynabatch_packed": "dynabatch.DataLoader(costing=Costing(collate='packed')), method dp_varlen, indexed mode, index cache + "
                        "token cache file",
}


class LoaderBenchError(ValueError):
    """Bad benchmark input or a failed check (unequal sample counts); one-line message."""


@dataclass(frozen=True)
class LoaderBenchConfig:
    """What `run_loader_bench` measures.

    ``data``: .jsonl / .jsonl.gz files or folders (empty: the shared FLAN sample when present,
    else generated shards). ``limit``: first N samples (None = all). ``workers``: the
    ``num_workers`` values to run every method with. ``options``: dynabatch's `PlanOptions`; its
    ``global_batch_tokens`` also sets the baselines' ``B``, its ``max_len`` the truncation of every
    method and the packing collator's row length. ``cost_model`` / ``device``: dynabatch's costs.
    """

    data: tuple[str, ...] = ()
    limit: int | None = None
    workers: tuple[int, ...] = (0, 2)
    options: PlanOptions = field(default_factory=lambda: PlanOptions(global_batch_tokens=65536, max_len=1024))
    tokenizer: str = "bytes"
    cost_model: str = "gpt"
    device: str = "a100-80gb"
    methods: tuple[str, ...] = METHODS

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise LoaderBenchError(f"--methods must be among {list(METHODS)}, got {list(self.methods)}")
        if not self.workers or any(w < 0 for w in self.workers):
            raise LoaderBenchError(f"--workers must be >= 0, got {list(self.workers)}")
        if self.options.global_batch_tokens is None or self.options.max_len is None:
            raise LoaderBenchError("the bench needs global_batch_tokens and max_len in its options")

    @property
    def seed(self) -> int:
        """The seed of every method's shuffle (and of generated data)."""
        return self.options.seed

    def loader_options(self, collate: str) -> PlanOptions:
        """dynabatch's options for one collation (``dp`` padded, ``dp_varlen`` packed)."""
        return self.options.replace(method=default_method(collate))

        if self.limit is not None and self.limit < 1:
            raise LoaderBenchError(f"limit must be >= 1 samples, got {self.limit}")


# ---------------------------------------------------------------------------------------------
# The timed epoch

def _formatter(cfg: LoaderBenchConfig):
    """The tokenizer and formatting every method shares (decoder-only, truncated to ``max_len``)."""
    from ..loader.dataloader import make_formatter

    return make_formatter(cfg.tokenizer, "decoder", max_len=cfg.options.max_len)


def _loop(loader, on_batch=None) -> dict:
    """One epoch of ``loader``, touching the tensors; counts and the delivered sample ids."""
    mbs = samples = real = elems = 0
    seen = []
    t0 = time.perf_counter()
    # dynabatch yields steps; its micro-batches are what the torch loaders' batches compare with
    batches = loader.microbatches() if hasattr(loader, "microbatches") else loader
    for mb in batches:
        ids = mb["sample_ids"]
        x = mb["input_ids"]
        elems += x.numel()
        if "attention_mask" in mb:
            real += int(mb["attention_mask"].sum())
        else:  # dynabatch packed: one unpadded row
            real += x.numel()
        seen.append(ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids))
        samples += len(ids)
        mbs += 1
        if on_batch is not None:
            on_batch()
    sec = time.perf_counter() - t0
    return {"microbatches": mbs, "samples": samples, "real_tokens": real, "tensor_tokens": elems, "seconds": sec,
            "_ids": np.sort(np.concatenate(seen)) if seen else np.zeros(0, np.int64)}


def _rates(r: dict) -> dict:
    """Add the per-second rates and the padding efficiency to one run's counts."""
    sec = r["seconds"]
    r.update(microbatches_per_s=per_s(r["microbatches"], sec), samples_per_s=per_s(r["samples"], sec),
             real_tokens_per_s=per_s(r["real_tokens"], sec),
             padding_efficiency=r["real_tokens"] / r["tensor_tokens"] if r["tensor_tokens"] else 1.0)
    return r


def run_loader_bench(cfg: LoaderBenchConfig, progress: bool = True) -> dict:
    """Set up every method (untimed, measured), run one timed epoch per method and worker count.

    Returns ``{"config", "runs": [{"method", "workers", "microbatches", "samples", "real_tokens",
    "tensor_tokens", "seconds", "setup_s", "microbatches_per_s", "samples_per_s",
    "real_tokens_per_s", "padding_efficiency", "samples_per_s_vs_torch_pad"}], "ratios"}``.
    ``ratios[f"{method}@{workers}"]`` is that run's samples/s over ``torch_pad``'s at the same
    worker count. Raises `LoaderBenchError` (or ``loaders.LoaderError`` naming file and line).
    """
    from ..progress import progress_bar

    import dynabatch

    fmt = _formatter(cfg)
    with tempfile.TemporaryDirectory(prefix="dynabatch-bench-loader-") as tmp_name:
        files, label = resolve_text(cfg, Path(tmp_name), progress)
        # -- setup (untimed for the rates, measured) ---------------------------------------------
        t0 = time.perf_counter()
        ds = setup_baseline(files, fmt)
        base_setup = time.perf_counter() - t0
        if len(ds) == 0:
            raise LoaderBenchError(f"{label}: no samples")
        lengths = np.fromiter((len(x) for x in ds.input_ids), np.int64, count=len(ds))
        B = max(1, int(round(cfg.options.global_batch_tokens / float(lengths.mean()))))
        dyna_setup = 0.0
        # The first loader's index scan writes the token ids to the token file beside the index
        # cache (the same one tokenization pass as the baselines' pre-tokenization); every later
        # loader reads both back, checked, and maps the token file.
        index_cache = Path(tmp_name) / "index.parquet"
        if any(m.startswith("dynabatch") for m in cfg.methods):
            t0 = time.perf_counter()
            # the planning target (default a100-80gb, whatever this machine is): no device-mismatch warning
            cost = CostModel.preset(cfg.cost_model, cfg.device, num_stages=cfg.options.num_stages)
            # Warm-up (untimed, counted in setup_s): the planner's numba kernels load or compile on
            # their first call; a training job pays that once per process, not per epoch.
            from ..loader.settings import Costing, DataSource, Runtime, Tokenization

            for collate in ("padded", "packed"):
                warm = dynabatch.DataLoader(jsonl_source(files), options=cfg.loader_options(collate),
                                            tokenization=Tokenization(tokenizer=fmt.tokenizer),
                                            source=DataSource(index_cache=index_cache, mode="indexed", cache_tokens=True),
                                            costing=Costing(cost_model=cost), runtime=Runtime(rank=0, world_size=1))
                next(iter(warm.steps()))
                del warm
            dyna_setup = time.perf_counter() - t0
        pad_id = int(fmt.tokenizer.pad_id)

        def make(method: str, workers: int):
            if method.startswith("torch"):
                collate = pad_collate if method == "torch_pad" else PackCollate(cfg.options.max_len, pad_id)
                if method == "torch_pad" and pad_id != 0:
                    from functools import partial

                    collate = partial(pad_collate, pad_id=pad_id)
                g = torch.Generator().manual_seed(cfg.seed)
                return torch.utils.data.DataLoader(ds, batch_size=B, shuffle=True, num_workers=workers,
                                                   collate_fn=collate, generator=g), 0.0
            t0 = time.perf_counter()
            dl = dynabatch.DataLoader(jsonl_source(files),
                                      options=cfg.loader_options("padded" if method == "dynabatch_padded" else "packed"),
                                      num_workers=workers, tokenization=Tokenization(tokenizer=fmt.tokenizer),
                                      source=DataSource(index_cache=index_cache, mode="indexed", cache_tokens=True),
                                      costing=Costing(cost_model=cost), runtime=Runtime(rank=0, world_size=1))
            return dl, time.perf_counter() - t0

        runs = []
        ref_ids = None
        total_samples = len(ds)
        todo = [(m, w) for w in cfg.workers for m in cfg.methods]
        bar = progress_bar(len(todo) * total_samples, "bench loader", "sample", progress, unit_scale=True)
        try:
            for method, workers in todo:
                bar.set_postfix_str(f"{method} w={workers}")
                loader, build_s = make(method, workers)
                gc.collect()
                try:
                    r = _loop(loader)
                except (LoaderBenchError, ValueError, OSError):
                    raise
                except Exception as e:  # a library failing deep inside: say which run
                    raise LoaderBenchError(f"{method} workers={workers} failed: {failure_summary(e)}") from e
                bar.update(r["samples"])
                ids = r.pop("_ids")
                if ref_ids is None:
                    ref_ids = ids
                if r["samples"] != total_samples or not np.array_equal(ids, ref_ids) or \
                        len(np.unique(ids)) != total_samples:
                    raise LoaderBenchError(
                        f"{method} workers={workers} delivered {r['samples']} samples ({len(np.unique(ids))} distinct), "
                        f"expected each of the {total_samples} samples exactly once")
                r = _rates(r)
                runs.append({"method": method, "workers": workers, **r,
                             "setup_s": (base_setup if method.startswith("torch") else dyna_setup) + build_s})
                del loader
        finally:
            bar.close()

    ratios = {}
    for run in runs:
        ref = next((x for x in runs if x["method"] == REFERENCE and x["workers"] == run["workers"]), None)
        x = run["samples_per_s"] / ref["samples_per_s"] if ref and ref["samples_per_s"] else None
        run["samples_per_s_vs_torch_pad"] = x
        if x is not None:
            ratios[f"{run['method']}@{run['workers']}"] = x
    config = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    o = cfg.options
    config.update(options=o.to_dict(), global_batch_tokens=o.global_batch_tokens, max_len=o.max_len,
                  stages=o.num_stages, seed=o.seed, data=list(cfg.data), workers=list(cfg.workers), methods=list(cfg.methods), data_label=label,
                  tokenizer_name=fmt.tokenizer.name, samples=total_samples, baseline_batch_size=B,
                  mean_sample_tokens=float(lengths.mean()), baseline_tokens_per_batch=float(lengths.mean() * B),
                  world_size=1, rank=0, baseline_setup_s=base_setup, dynabatch_index_s=dyna_setup,
                  paths=METHOD_PATHS)
    return {"config": config, "runs": runs, "ratios": ratios}


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"data: {c['data_label']} ({c['samples']} samples), tokenizer {c['tokenizer_name']}, max_len {c['max_len']}",
        f"single rank (world_size 1); dynabatch global_batch_tokens {c['global_batch_tokens']} ({c['cost_model']} on {c['device']}, "
        f"{c['stages']} stage(s)); baselines B={c['baseline_batch_size']} samples x mean "
        f"{c['mean_sample_tokens']:.0f} tokens = {c['baseline_tokens_per_batch']:.0f} tokens/batch",
        f"setup (not timed in the rates): baseline pre-tokenization {c['baseline_setup_s']:.2f} s, "
        f"dynabatch index + token cache {c['dynabatch_index_s']:.2f} s; planning is timed (inside the loop)",
    ]
    head = (f"{'method':<17} {'workers':>7} {'mbatches':>8} {'samples':>8} {'time s':>7} {'mbatch/s':>9} "
            f"{'samples/s':>10} {'real tok/s':>10} {'pad eff':>7} {'x torch_pad':>11}")
    lines += ["", head, "-" * len(head)]
    for r in result["runs"]:
        x = r.get("samples_per_s_vs_torch_pad")
        lines.append(f"{r['method']:<17} {r['workers']:>7} {r['microbatches']:>8} {r['samples']:>8} "
                     f"{r['seconds']:>7.2f} {fmt_rate(r['microbatches_per_s']):>9} "
                     f"{fmt_rate(r['samples_per_s']):>10} {fmt_rate(r['real_tokens_per_s']):>10} "
                     f"{r['padding_efficiency']:>7.3f} {(f'{x:.2f}x' if x is not None else '-'):>11}")
    lines += ["", "every method delivered every sample exactly once per epoch"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line: `dynabatch bench loader` (its parser: `dynabatch.commands.bench_load`)

def _options(args) -> PlanOptions:
    """The bench's `PlanOptions` from its flags; a bad value is a `LoaderBenchError` (one line)."""
    try:
        return PlanOptions(global_batch_tokens=args.global_batch_tokens, max_len=args.max_len,
                           num_stages=args.stages, seed=args.seed)
    except ValueError as e:
        raise LoaderBenchError(str(e)) from None


def bench_loader_command(args) -> int:
    """Run ``dynabatch bench loader`` with its parsed arguments (parser: `dynabatch.commands.bench_load`)."""
    return run_command(
        args, lambda: LoaderBenchConfig(
            data=tuple(args.data or ()), limit=args.limit, workers=tuple(args.workers), options=_options(args),
            tokenizer=args.tokenizer, cost_model=args.cost_model, device=args.device, methods=tuple(args.methods)),
        run_loader_bench, format_table)
