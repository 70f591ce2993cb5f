"""The pipeline runtime: one interpreter of a stage's program and the three ways to run on it.

* `schedule`: per-stage op orders and the NCCL-safe communication program of every stage.
* `interpreter`: `run_program`, the one loop that runs a program, with explicit `Hooks`.
* `runner`: `PipelineRunner` (flushed steps; `hooks.OneModel`), `stream`: flush-free streams
  (`RunnerConfig(flush=False)`, weight versions from `weight_prediction`), `multimodel`:
  `MultiModelRunner` (K models, shards resident per `residency` and spilled per `shards`).
* `update`: the step's end written once (update, timing gather; the loss all-reduce: `nonfinite`);
  `tied`: parameters shared between stages; `bypass`: stages a micro-batch skips; `reference`: the
  one-process step.
* `comm`: process groups and transfers; `failure`, `waits`, `guard`, `setup_guard`: no hang when a rank
  fails (in a step or in set-up); `nonfinite`: NaN/inf steps raised or skipped alike on every rank;
  `replicas`: each pipeline replica's data loader (`loader_runtime`);
  `launch`: run N local ranks (`run_ranks`: the same script alone or under torchrun).
"""

from .bypass import Bypass
from .comm import CommEvent, CommRecorder, DistContext, P2P, ShapeMismatch, check_peer_sequences, init_pipeline
from .config import RunnerConfig
from .failure import PipelineAborted
from .interpreter import Hooks, StageRun, run_program
from .launch import ProcResult, free_port, launch_local, run_ranks
from .multimodel import MultiModelRunner, MultiStepResult
from .nonfinite import NonFiniteStep
from .reference import sequential_step
from .replicas import loader_runtime
from .runner import PipelineRunner
from .schedule import (SCHEDULES, Compute, Message, Post, ProgramError, build_programs, check_programs,
                       quantize_times, stage_orders)
from .shards import ShardStore, shard_bytes
from .tied import Ties, tie_stages
from .weight_prediction import WeightPredictor

__all__ = [
    "Bypass", "CommEvent", "CommRecorder", "DistContext", "P2P", "ShapeMismatch", "check_peer_sequences",
    "init_pipeline", "RunnerConfig", "PipelineAborted", "Hooks", "StageRun", "run_program", "ProcResult",
    "free_port", "launch_local", "run_ranks", "MultiModelRunner", "MultiStepResult", "sequential_step", "PipelineRunner",
    "SCHEDULES", "Compute", "Message", "Post", "ProgramError", "build_programs", "check_programs",
    "quantize_times", "stage_orders", "ShardStore", "shard_bytes", "Ties", "tie_stages", "WeightPredictor",
]
__all__ += ["NonFiniteStep", "loader_runtime"]
