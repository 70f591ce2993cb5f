"""Each planning kernel compiles once per real argument type, not once per caller's constants or flags.

Numba compiles a dispatcher (and everything it calls) again for every new argument type, and it types a
constant int or bool that njit code passes as a *literal* (``Literal[int](0)``), a read-only array apart
from a writable one. So a helper called with constant columns compiled one specialization per mix of
constants (``op_tables._put``: 24 on a fresh clone) and every wrapper that handed a kernel a broadcast view
or a frozen `StepOps` table compiled the whole simulator twice: CPU spent on every fresh clone (CI). Here
a fresh interpreter runs the main entry points once (planning with every schedule, every registered
schedule's ops, the simulators, the ordering search, plan orders, flush-free), then each dispatcher of the
op-table, schedule, simulator and objective kernels must hold one signature, none of them literal or
read-only. A fresh interpreter: a test process that ran other tests first holds their calls' signatures
too (the kernel tests call kernels with read-only arrays on purpose). A kernel loaded from numba's cache
compiles nothing it calls, so the helpers' check runs the kernels that pass them constants on an empty
cache (about 20 CPU seconds); the entry points' check uses the repository's cache (warm: a few seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: Kernel modules under the rule (`dynabatch.core.kernels.<name>`).
MODULES = ("op_tables", "schedules", "objective", "simulate", "inflight", "times", "flushfree")

#: Kernels with more than one real argument type, and why. ``objective_kernel`` is called from Python on
#: scalars (`BatchPlan.objective_s`) and on arrays (`dynabatch.core.plan.bounds`); numba code inlines it.
REAL_TYPES = {"objective.objective_kernel": 2}

#: Prints ``{module.kernel: [signature, ...]}`` of every dispatcher of `MODULES`.
DUMP = """
import importlib
from numba.core.registry import CPUDispatcher
out = {}
for short in MODULES:
    mod = importlib.import_module("dynabatch.core.kernels." + short)
    for name, obj in vars(mod).items():
        if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == mod.__name__:
            out[short + "." + name] = [str(sig) for sig in obj.signatures]
json.dump(out, sys.stdout)
"""

#: The public entry points, as the planner, inspect, the simulators and the runtime call them.
ENTRY_POINTS = """
import json, sys
import numpy as np
from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.cost.model import device_preset, model_preset
from dynabatch.core.schedule.build import adaptive_order, multimodel_ops, step_ops, stream_ops
from dynabatch.core.schedule.ops import StepOps
from dynabatch.core.schedule.orders import plan_orders
from dynabatch.core.schedule.registry import REGISTRY
from dynabatch.core.plan.bounds import objective_lower_bound
from dynabatch.core.schedule.search import compare_orders, order_step, run_choice
from dynabatch.core.simulate.flushfree import flushfree_report, simulate_flushfree, update_lag
from dynabatch.core.simulate.pipeline import makespan, pipeline_schedule, simulate_pipeline

rng = np.random.default_rng(0)
cost = CostModel(model_preset("gpt"), device_preset("a100-80gb"))
shapes = Shapes.from_lengths(input_tokens=rng.integers(16, 2048, 120))
plans = [plan_microbatches(shapes, cost, num_stages=4, num_ranks=2, method="dp", max_len=2048, schedule=name)
         for name in REGISTRY]
plans.append(plan_microbatches(shapes, cost, num_stages=4, num_ranks=2, method="dp", max_len=2048, flush=False))
for p in plans:
    for r in range(p.num_ranks):
        plan_orders(p, r, cost)
    compare_orders(p, cost)
    p.objective_s
for collation in (None, "padded"):
    objective_lower_bound(shapes, cost, num_stages=4, num_ranks=2, max_len=2048, collation=collation)
run_choice(plans[:2], cost)
flushfree_report(plans[:2], cost)
S, M = 3, 5
st = rng.uniform(0.5, 2.0, (S, M))
mem = rng.uniform(1.0, 2.0, M)
for per_stage in (True, False):
    order_step("auto", st, np.full(M, 0.1), mem, np.arange(M) % 2, 2, 1 / 3, 4.0, True, per_stage)
for name, info in REGISTRY.items():
    if info.concrete:
        ops = step_ops(name, S, M, stage_times=st, p2p_s=0.1, mem_bytes=mem, memory_limit=3.0)
        makespan(st / 3, 2 * st / 3, ops, np.full(M, 0.1))
    simulate_pipeline(st / 3, 2 * st / 3, schedule=name, p2p_s=0.1, mem_bytes=mem, memory_limit=4.0)
codes = pipeline_schedule(S, M, "1f1b")
simulate_pipeline(st / 3, 2 * st / 3, schedule=codes, p2p_s=0.1, mem_bytes=mem)
simulate_pipeline(st / 3, 2 * st / 3, schedule=StepOps.from_codes(codes), p2p_s=0.1)
makespan(st / 3, 2 * st / 3, codes, np.zeros(M))
StepOps.from_codes(codes).codes()
adaptive_order(st[0] / 3, 2 * st[0] / 3, mem, 4.0, num_stages=S)
stream_ops(S, [2, 5])
update_lag([2, 5], S)
multimodel_ops(S, 2, M)
simulate_flushfree(np.ones((S, 6)), np.full((S, 6), 2.0), [[2, 1], [1, 2]], p2p_s=0.1, update_s=0.5)
"""

#: The kernels whose helpers take constants (op columns, slots, flags, chunk counts), each reached once; run
#: on an empty cache, so that every helper is compiled (a kernel loaded from the cache types nothing it calls).
HELPER_CALLERS = """
import json, sys
import numpy as np
from dynabatch.core.kernels.assign import assign_ranks
from dynabatch.core.kernels.inflight import inflight_kernel
from dynabatch.core.schedule.build import multimodel_ops, step_ops, stream_ops
from dynabatch.core.schedule.registry import REGISTRY
from dynabatch.core.simulate.flushfree import simulate_flushfree
from dynabatch.core.simulate.pipeline import pipeline_schedule, simulate_pipeline

S, M = 3, 5
st = np.linspace(0.5, 2.0, S * M).reshape(S, M)
for name, info in REGISTRY.items():
    if info.concrete:
        step_ops(name, S, M, stage_times=st, mem_bytes=np.ones(M), memory_limit=2.0)
stream_ops(S, [2, 5])
multimodel_ops(S, 2, M)
simulate_pipeline(st / 3, 2 * st / 3, schedule="zb-h1", p2p_s=0.1)
inflight_kernel(pipeline_schedule(S, M, "1f1b"), np.ones(M), np.empty(S, np.int64), np.empty(S))
simulate_flushfree(np.ones((S, 6)), np.full((S, 6), 2.0), [[2, 1], [1, 2]], p2p_s=0.1, update_s=0.5)
assign_ranks(st[0], 2, 1, True)
"""


def _signatures(script: str, **env) -> dict[str, list[str]]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))), **env)
    code = f"MODULES = {MODULES!r}\n" + script + DUMP
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert run.returncode == 0, f"the entry points failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def entry_signatures() -> dict[str, list[str]]:
    """After the public entry points ran once in a fresh interpreter (the repository's kernel cache)."""
    return _signatures(ENTRY_POINTS)


@pytest.fixture(scope="module")
def helper_signatures(tmp_path_factory) -> dict[str, list[str]]:
    """After `HELPER_CALLERS` ran in a fresh interpreter on an empty kernel cache (each kernel compiled)."""
    return _signatures(HELPER_CALLERS, NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp("numba-cache")))


def _check(signatures: dict[str, list[str]]) -> None:
    many = {k: v for k, v in signatures.items() if len(v) > REAL_TYPES.get(k, 1)}
    odd = {k: [s for s in v if "Literal[" in s or "readonly" in s] for k, v in signatures.items()}
    odd = {k: v for k, v in odd.items() if v}
    assert not many and not odd, (
        "kernels compiled more than once per real argument type, or for a literal / read-only argument (pass "
        "np.int64 / np.bool_, inline a helper that takes constants, pass arrays through kernel_array):\n"
        + "\n".join(f"{k}: {len(v)}\n    " + "\n    ".join(v) for k, v in {**many, **odd}.items()))


def test_the_runs_reach_the_kernels(entry_signatures, helper_signatures):
    """Both runs compiled (or loaded) the kernels they should, so the checks below do not hold vacuously."""
    for kernel in ("op_tables.codes_table", "op_tables.table_codes", "schedules._order_ranks",
                   "schedules.record_slots_kernel", "schedules.rank_ops_kernel",
                   "schedules.adaptive_kernel", "simulate.simulate_table_kernel", "simulate.makespan_table_kernel",
                   "simulate.makespan_kernel", "simulate.schedule_kernel", "inflight.inflight_table_kernel",
                   "inflight.held_table_kernel", "times.split_kernel", "times.chunk_times",
                   "flushfree.flushfree_kernel", "flushfree.stage_loads", "objective.objective_kernel"):
        assert entry_signatures.get(kernel), f"the entry points did not reach {kernel}"
    for kernel in ("op_tables.static_table", "op_tables._zb_row", "op_tables._interleaved_rows",
                   "op_tables.stream_row", "op_tables.multimodel_table", "schedules.adaptive_kernel",
                   "simulate.run_table", "simulate.op_ready", "simulate.table_lengths", "simulate._no_copies",
                   "inflight.inflight_table_kernel", "inflight.held_table_kernel", "flushfree.flushfree_kernel"):
        assert helper_signatures.get(kernel), f"the helper callers did not compile {kernel}"


def test_the_entry_points_hand_each_kernel_one_type(entry_signatures):
    """The wrappers normalize dtypes, layouts and flags (a broadcast view, a frozen `StepOps` table, a plan
    column read from a file are read-only) before they call a kernel."""
    _check(entry_signatures)


def test_kernels_call_their_helpers_with_typed_arguments(helper_signatures):
    """Numba code passes no constant a helper would be compiled for as a literal (``_put`` was compiled 24
    times, ``objective_kernel`` once per caller's mix of ``1`` and ``int64``)."""
    _check(helper_signatures)
    for helper in ("op_tables._put", "op_tables.one_f_one_b_row", "objective.objective_kernel"):
        assert helper_signatures.get(helper) == [], f"{helper} is inlined into its callers, not dispatched"
