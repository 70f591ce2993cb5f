"""``dynabatch bench train --model hf-llama``: what a Hugging Face model adds to `dynabatch.bench.train`.

* Model (`hf_llama`): a tiny ``transformers`` `LlamaForCausalLM` built from a `LlamaConfig` (random
  weights from the run's seed, nothing downloaded; SDPA attention, grouped-query heads, untied
  head) through `dynabatch.pipeline.from_hf`: ``[embedding, decoder layer x n, head]``, split over
  the stages by the same partition search as the tiny models.
* Costs (`profile_costs`): the model is profiled on this machine before the stages start
  (`dynabatch.pipeline.measure.profile.profile_cost_model`, what ``dynabatch profile --model hf:...``
  writes: per-layer forward+backward seconds of a grid of padded shapes, its longer half again
  with a padded row for the padding mask's cost ``q_pad``, the slowest of ``num_stages`` balanced
  stages), or the cost-model file given with ``--cost-model`` (made by
  ``dynabatch profile --model hf:config.json``). Every method starts from it; ``dp``'s feedback then
  refits one coefficient row per stage (``FeedbackLoop(stage_reduce="per_stage")``), and the
  result carries the per-stage MAPE (`dynabatch.bench.train_vlm.vlm_stats`: each micro-batch's
  planned seconds on each stage against that stage's measured ones).
* Methods: ``dp`` (padded) and ``token_budget`` as for the tiny models; ``pack`` packs rows of
  ``max_len`` tokens (``rows=2`` per micro-batch, the planner's default) as ``pack_varlen``: one
  varlen row per micro-batch (``collate='packed'``, restarting ``position_ids``), the packed form
  the Hugging Face adapter takes (a row of several samples without it would attend across
  samples). The model's own SDPA attention then builds a boolean mask of the whole packed row and,
  on the CPU, computes attention over all of it: quadratic in the row's length, not per sample.
  The profile also times packed rows (`dynabatch.pipeline.measure.profile_model`) and prices packed
  shapes from them, so ``pack``'s planned seconds include that; its MAPE shows how well.

Times are seconds, lengths tokens.
"""

from __future__ import annotations

import os

HF_MODEL = "hf-llama"
HF_SIZES = dict(vocab=512, hidden=64, layers=4, heads=4, kv_heads=2, ffn=176)
PLAN_METHODS = {"pack": "pack_varlen"}  # a bench method -> the planning method it runs with on this model
PROFILE_ROWS = (1, 4, 16)  # the profile grid (rows x lengths up to max_len); outside it: linear extrapolation
PROFILE_MIN_LEN = 32


def llama_config(*, vocab: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 176, max_positions: int = 8192):
    """The `transformers.LlamaConfig` of the bench's model (sizes in units; SDPA attention)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def hf_llama(*, seed: int = 0, vocab: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4,
             kv_heads: int = 2, ffn: int = 176):
    """The bench's tiny Llama as an `HFLayeredModel` (random weights from ``seed``, same on every rank)."""
    from ..pipeline.models.hf import from_hf

    return from_hf(llama_config(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn),
                   seed=seed)


def profile_lengths(max_len: int) -> tuple[int, ...]:
    """The profile's main lengths: x4 steps from `PROFILE_MIN_LEN` up to ``max_len`` (always included)."""
    out, L = [], PROFILE_MIN_LEN
    while L < max_len:
        out.append(L)
        L *= 4
    return (*out, int(max_len))


def profile_costs(model, num_stages: int, max_len: int, path: str, *, seed: int = 0, threads: int = 1) -> str:
    """Profile ``model`` (one stage's padded and packed micro-batch costs on this machine, ``threads`` torch threads
    as each stage runs with) and save the cost model to ``path`` (JSON); returns ``path``."""
    import torch

    from ..pipeline.measure.profile import profile_cost_model

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cost = profile_cost_model(model, num_stages=num_stages, rows=PROFILE_ROWS, lengths=profile_lengths(max_len),
                                  repeats=2, seed=seed)
    finally:
        torch.set_num_threads(old)
    cost.save(path)
    return path


def load_costs(path: str):
    """The cost model of a profile file (`profile_costs`, ``dynabatch profile``), its table extrapolating
    linearly beyond its grid: a plan may ask for more rows or tokens than were timed."""
    import dataclasses

    from ..core.cost.model import CostModel

    cost = CostModel.load(path)
    if cost.table is not None:
        cost.table = dataclasses.replace(cost.table, extrapolate=True)
    return cost


def setup(method: str) -> dict:
    """What an hf-llama method run needs (the keys `dynabatch.bench.train_vlm.setup` gives for vlm-tiny):
    its planning method and the feedback keywords (``dp``: per-stage refits)."""
    per_stage = method == "dp"
    return {"plan_method": PLAN_METHODS.get(method, method), "feedback": {"stage_reduce": "per_stage"} if per_stage
            else {}, "feedback_mode": "per_stage" if per_stage else None}


def check_cost_model(path: str | None) -> None:
    """A ``--cost-model`` file that does not exist is a clear error before any stage starts."""
    if path is not None and not os.path.isfile(path):
        raise ValueError(f"--cost-model {path}: no such file (write one with `dynabatch profile --model "
                         "hf:CONFIG.json --num-stages 2 --out PATH`)")


__all__ = ["HF_MODEL", "HF_SIZES", "llama_config", "hf_llama", "profile_costs", "profile_lengths", "load_costs", "setup", "prepare_costs",
           "check_cost_model"]


def prepare_costs(cfg, model, tmp: str, announce: bool = False) -> tuple:
    """(``cfg`` with ``cost_model`` set, the result's cost fields): the given ``--cost-model`` file, or a
    profile of ``model`` written under ``tmp`` (``announce``: a line on stderr first, the profile takes
    a while on a loaded machine)."""
    import sys
    import time
    from dataclasses import replace

    if cfg.cost_model is not None:
        return cfg, {"cost_source": f"given: {cfg.cost_model}", "profile_s": None}
    lengths = profile_lengths(cfg.options.max_len)
    if announce:
        print(f"bench train: profiling {cfg.model} ({len(PROFILE_ROWS)} x {len(lengths)} padded shapes, "
              f"{cfg.options.num_stages} stages) ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    path = profile_costs(model, cfg.options.num_stages, cfg.options.max_len, os.path.join(tmp, "profile.json"),
                         seed=cfg.options.seed, threads=cfg.threads_per_proc)
    info = {"cost_source": f"profiled: rows {list(PROFILE_ROWS)} x lengths {list(lengths)}, slowest of "
                           f"{cfg.options.num_stages} balanced stages", "profile_s": time.perf_counter() - t0,
            "cost_model": None,  # a temporary file
            "packed_attention": load_costs(path).packed_attention}  # what the profile found (CostModel)
    return replace(cfg, cost_model=path), info
