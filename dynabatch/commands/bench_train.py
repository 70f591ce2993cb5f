"""``dynabatch bench train`` and ``dynabatch bench multimodel``: their parsers (the work:
`dynabatch.bench.train_command.bench_train_command`, `dynabatch.bench.multimodel.bench_multimodel_command`)."""

from __future__ import annotations

import argparse

from ..bench.train_hf import HF_MODEL
from ..core.options import SCHEDULES
from ..option_flags import parse_bytes
from ..progress import add_progress_option
from . import add_subcommand, lazy_handler
from .choices import LR_FACTORS, TINY_MODELS, TRAIN_METHODS, VLM_METHODS

BENCH_TRAIN_EPILOG = """\
columns:
  tok/s        real (unpadded) tokens / wall seconds of the pipelined training steps (slowest rank),
               warm-up steps excluded
  e2e tok/s    the same, counting the time the loop waited for the DataLoader
  vs pack      tok/s over pack's
  MAPE         per micro-batch: planned vs measured forward+backward seconds on the slowest stage;
               start = before the first refit, end = the last max(3, steps/4) steps (predictions made
               before each step ran: out of sample); noise = median relative spread of identical
               shapes in the run (about the floor a per-micro-batch MAPE can reach on this machine)
  step MAPE    the same on each step's sum over its micro-batches (start -> end): what the step
               time the planner balances sees, with the per-micro-batch timer noise averaged out
  per-stage MAPE  (vlm-tiny, hf-llama) each stage's planned vs measured seconds per micro-batch, stage 0/1/...,
               pooled over every micro-batch; refit: dp's feedback (per_stage: one coefficient row per
               stage; max: the slowest stage). The lines below the table split it: the micro-batches a
               stage runs layers on, and those it passes through (the vision stage on a text-only
               micro-batch runs no layer: its time is sub-millisecond dispatch, a few % of the
               stage's seconds), each with its noise floor (MAPE of predicting identical
               micro-batches by their median time), and the per-step sums: each stage's planned
               vs measured busy seconds per step. With --bypass-idle-stages the vision stage
               never runs text-only micro-batches: "bypassed", no observation
  dp vs X      tok/s ratio; per-step: median and IQR of the paired per-step time ratios (same global
               batches, interleaved): the timer and load noise of the comparison

examples:
  dynabatch bench train --model t5-tiny --num-stages 2 --steps 20
  dynabatch bench train --model gpt-tiny --steps 20 --data ../shared/data/text/niv2_sample.jsonl.gz --json
  dynabatch bench train --model vlm-tiny --num-stages 2 --steps 40 --global-batch-tokens 16384
  dynabatch bench train --model hf-llama --steps 30 --global-batch-tokens 16384 --max-len 1024
"""


def add_bench_train_command(bench_sub) -> None:
    """Register ``dynabatch bench train`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "train",
                       "real training tokens/s of a pipelined tiny model: dp + feedback vs pack/pad/token_budget",
                       "Train the same tiny model on the same global batches with each method, over local pipeline "
                       "stages, and report real tokens/s and the cost model's MAPE.", BENCH_TRAIN_EPILOG)
    p.add_argument("--model", choices=(*TINY_MODELS, HF_MODEL), default="t5-tiny",
                   help="vlm-tiny: ViT -> projector -> GPT on image+text and text-only records (methods dp, "
                        "dp-blind, pack, token_budget by default); hf-llama: a tiny transformers Llama (random "
                        "weights) through from_hf, costed by a profile on this machine, dp refit per stage")
    p.add_argument("--cost-model", metavar="PATH",
                   help="hf-llama: start every method from this cost model (`dynabatch profile --model "
                        "hf:CONFIG.json --num-stages N --out PATH`) instead of profiling the model first")
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="JSONL files with inputs/targets; default the shared FLAN sample when present, else "
                        "generated FLAN-like data (vlm-tiny: image+text records; default the shared COCO/LLaVA "
                        "captions and instructions mixed with FLAN text, else generated ones)")
    p.add_argument("--text-fraction", type=float, default=0.5,
                   help="vlm-tiny: share of text-only (FLAN) records in the default data (default 0.5)")
    p.add_argument("--num-stages", "--stages", dest="stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (default 3)")
    p.add_argument("--methods", nargs="+", default=None,
                   help=f"default {' '.join(TRAIN_METHODS)} (vlm-tiny: {' '.join(VLM_METHODS)})")
    p.add_argument("--global-batch-tokens", type=int, default=32768,
                   help="tokens (inputs + targets) per global batch (default 32768)")
    p.add_argument("--max-len", type=int, default=2048,
                   help="truncate inputs to this many tokens (default 2048: with byte tokens, FLAN inputs run "
                        "to ~1.9k at the 95th percentile and half exceed 512, so a shorter cap would clip the "
                        "very length spread the methods differ on)")
    p.add_argument("--max-target-len", type=int, default=512, help="truncate targets (default 512)")
    p.add_argument("--device-preset", default="cpu", help="analytic cost model preset to start from (default cpu)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule planned, simulated and run (adaptive: memory-bounded order; auto: per "
                        "step the fastest that fits memory)")
    p.add_argument("--memory-limit", type=parse_bytes, default=None, metavar="BYTES",
                   help="activation bytes one micro-batch may use on one stage (17e9, 16GiB, 800MB; default: the "
                        "cost model's)")
    p.add_argument("--device-memory-limit", nargs="+", default=None, metavar="LEVEL",
                   help="compare recomputation instead of methods: at each level (bytes of activations a device "
                        "may hold, e.g. 12MB, or a fraction of dp's predicted peak without recomputation, e.g. "
                        "0.6x) train dp+none, dp+full and dp+adaptive (the planner's per-stage choice) "
                        "interleaved; text models, uniform stages")
    p.add_argument("--flush-free", action="store_true",
                   help="compare dp/sync (a flush per global batch) with flush-free asynchronous 1F1B streams of "
                        "--flush-window steps: dp/stale (stale weights), dp/stash (the forward's weights stashed "
                        "for the backward) and dp/predict (AdamW's update predicted, PipeOptim); no refits")
    p.add_argument("--flush-window", type=int, default=10, metavar="N",
                   help="steps one flush-free stream runs between flushes (default 10)")
    p.add_argument("--partition", choices=("searched", "uniform", "modality"), default=None,
                   help="stage split: searched per method (profile the layers on the method's first global "
                        "batch, simulate every split, keep the fastest; the text models' default) or uniform "
                        "block counts; vlm-tiny: modality (vision on stage 0, language after; its default) or uniform")
    p.add_argument("--bypass-idle-stages", action=argparse.BooleanOptionalAction, default=None,
                   help="every method's runner skips the stages holding only a micro-batch's idle layers "
                        "(RunnerConfig(bypass_idle_stages=True): text-only micro-batches never visit the vision "
                        "stage; per-stage MAPE then covers the micro-batches each stage ran). Default: on for "
                        "vlm-tiny (off with --flush-free), no effect on the text models")
    p.add_argument("--refit-every", type=int, default=2)
    p.add_argument("--save-cost-model", metavar="PATH",
                   help="write dp's refit cost model as JSON; dynabatch.CostModel.load(PATH) reads it back, "
                        "e.g. for DataLoader(costing=Costing(cost_model=...)) to start the next run from the measured costs")
    p.add_argument("--seed", type=int, default=0)
    add_size_arguments(p, "model width (default 256; vlm-tiny 128)")
    p.add_argument("--generated-samples", type=int, default=2000,
                   help="generated samples when no data is found (vlm-tiny: records in its default mix)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="liveness timeout: stop when no rank made progress (a step) for this long (default 900); "
                        "a slow or loaded machine only makes the run slower")
    p.add_argument("--max-wall", type=float, default=None, metavar="SECONDS",
                   help="optional cap on the whole run's wall time (default none)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--out", metavar="PATH",
                   help="also write the JSON document here, updated as the steps go (at most once a second; marked "
                        "\"partial\": true until the run completes); a run stopped early (SIGINT/SIGTERM, a "
                        "timeout) leaves its partial result here and on stdout")
    p.add_argument("--verbose", action="store_true", help="per-step lines on stderr")
    add_progress_option(p, "the steps trained (each: every method's)")
    p.set_defaults(func=lazy_handler("dynabatch.bench.train_command", "bench_train_command"))


def add_size_arguments(p, hidden_help: str) -> None:
    """``--hidden`` and ``--size NAME=INT`` (the model's sizes) of a bench command (read back by
    `dynabatch.bench.train_command.sizes_from_args`)."""
    p.add_argument("--hidden", type=int, default=None, help=hidden_help)
    p.add_argument("--size", action="append", default=[], metavar="NAME=INT",
                   help="override one of the model's sizes (its constructor's keyword; repeatable), e.g. "
                        "--size layers=6, or for vlm-tiny --size vision_hidden=128 --size vision_layers=8 "
                        "(a heavier vision stage)")


BENCH_MULTIMODEL_EPILOG = """\
examples:
  dynabatch bench multimodel                                  # gpt-tiny, K = 2 and 4, 2 gloo stages
  dynabatch bench multimodel --k 2 4 --steps 20 --warmup 3 --json > multimodel.json
  dynabatch bench multimodel --k 3 --budget-shards 1.5       # spill: at most 1.5 shards resident per device
  dynabatch bench multimodel --model t5-tiny --data ../shared/data/text/niv2_sample.jsonl.gz

The data default to the shared FLAN sample when present, else generated FLAN-like records.
"""


def add_bench_multimodel_command(bench_sub) -> None:
    """Register ``dynabatch bench multimodel`` on the ``bench`` subparsers."""
    p = add_subcommand(bench_sub, "multimodel",
                       "K models trained together on one data pass vs K single-model runs (Hydra)",
                       "Train K configurations of a tiny model (a learning-rate sweep) together with "
                       "MultiModelRunner and one after another with PipelineRunner, on the same local gloo stages "
                       "and the same global batches; report wall times, the simulated figures and the data-pass "
                       "time saved.", BENCH_MULTIMODEL_EPILOG)
    p.add_argument("--model", choices=tuple(m for m in TINY_MODELS if m != "vlm-tiny"), default="gpt-tiny",
                   help="the text model trained K times (default gpt-tiny)")
    p.add_argument("--k", nargs="+", type=int, default=[2, 4], metavar="K",
                   help=f"numbers of models to compare (each 1..{len(LR_FACTORS)}; default 2 4)")
    p.add_argument("--data", nargs="+", metavar="PATH", help="JSONL files with inputs/targets (default: the shared "
                   "FLAN sample when present, else generated)")
    p.add_argument("--num-stages", "--stages", dest="stages", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps excluded from timing (default 2)")
    p.add_argument("--global-batch-tokens", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-target-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help=f"base learning rate; model k uses lr x {LR_FACTORS[:4]}...")
    p.add_argument("--budget-shards", type=float, default=None, metavar="X",
                   help="per-device shard budget: X times the stage's largest shard (parameters + gradients + "
                        "AdamW state); shards beyond it are spilled to host memory (default: no budget)")
    p.add_argument("--no-interleave", action="store_true",
                   help="model after model on each stage instead of 1F1B over every model's micro-batches")
    add_size_arguments(p, "model width (default the bench train size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="liveness timeout: stop when no rank made progress for this many seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    add_progress_option(p, "the steps trained")
    p.set_defaults(func=lazy_handler("dynabatch.bench.multimodel", "bench_multimodel_command"))
