"""Simulators of a pipeline: one step of op orders (`pipeline`: `simulate_pipeline`), a flush-free
stream of steps (`flushfree`), and several models sharing the stages with their weight shards spilled
to host memory (`multimodel`, `spill`). Times are seconds, memory bytes.
"""

from .flushfree import (FlushFreeReport, FlushFreeSim, flushfree_bound, flushfree_objective, flushfree_report,
                        rank_streams, simulate_flushfree, update_lag)
from .multimodel import MultiModelSim, simulate_multimodel
from .pipeline import PipelineDeadlock, SimResult, makespan, pipeline_schedule, simulate_pipeline
from .spill import SpillTiming, spill_timing

__all__ = ["FlushFreeReport", "FlushFreeSim", "MultiModelSim", "PipelineDeadlock", "SimResult", "SpillTiming",
           "flushfree_bound", "flushfree_objective", "flushfree_report", "makespan", "pipeline_schedule",
           "rank_streams", "simulate_flushfree", "simulate_multimodel", "simulate_pipeline", "spill_timing",
           "update_lag"]
