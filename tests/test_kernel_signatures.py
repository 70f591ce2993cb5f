"""Each planning kernel compiles once per real argument type, not once per caller's constants or flags.

Numba compiles a dispatcher (and everything it calls) again for every new argument type, and it types a
constant int or bool that njit code passes as a *literal* (``Literal[int](0)``), a read-only array apart
from a writable one. So a helper called with constant columns compiled one specialization per mix of
constants (``op_tables._put``: 24 on a fresh clone) and every wrapper that handed a kernel a broadcast view
or a frozen `StepOps` table compiled the whole simulator twice: CPU spent on every fresh clone (CI).

Two checks. The entry points (planning with every schedule, every registered schedule's ops, the
simulators, the ordering search, plan orders, flush-free) run once in a fresh interpreter, then each
dispatcher of the op-table, schedule, simulator and objective kernels holds one signature, none literal
or read-only (a fresh interpreter: a test process that ran other tests first holds their calls' signatures
too; the kernel tests call kernels with read-only arrays on purpose). A kernel loaded from numba's cache
types nothing it calls, so what numba code passes its helpers is read from the source instead: no call
from these kernels to another (not inlined) kernel passes a constant int or bool, literally or by a
module constant's name. (Compiling them on an empty cache instead would prove the same at ~30 CPU s a run.)
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys

import pytest
from numba.core.registry import CPUDispatcher

#: Kernel modules under the rule (`dynabatch.core.kernels.<name>`).
MODULES = ("op_tables", "schedules", "objective", "simulate", "inflight", "times", "flushfree", "dp", "segments",
           "cost", "assign", "global_batches", "packing", "caps", "rows")

#: Every kernel module: the source check's, and the signature dumps' of `WARM`/`DUMP`.
ALL_MODULES = tuple(m.name for m in pkgutil.iter_modules(importlib.import_module("dynabatch.core.kernels").__path__))

#: Kernels with more than one real argument type, and why. ``objective_kernel`` is called from Python on
#: scalars (`BatchPlan.objective_s`) and on arrays (`dynabatch.core.plan.bounds`); numba code inlines it.
REAL_TYPES = {"objective.objective_kernel": 2}

#: ``signatures(shorts)``: ``{module.kernel: [signature, ...]}`` of every dispatcher of those kernel modules;
#: then `dynabatch.core.plan.warm.warm_planner` runs (as in the fork server) and its signatures are kept.
WARM = """
import importlib, json, sys
from numba.core.registry import CPUDispatcher
def signatures(shorts):
    out = {}
    for short in shorts:
        mod = importlib.import_module("dynabatch.core.kernels." + short)
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == mod.__name__:
                out[short + "." + name] = [str(sig) for sig in obj.signatures]
    return out
from dynabatch.core.plan.warm import warm_planner
warm_planner()
warm = signatures(ALL_MODULES)
"""

#: Prints the signatures of `MODULES` after the entry points, and of every kernel module after warm_planner
#: and after the entry points.
DUMP = """
json.dump({"entry": signatures(MODULES), "warm": warm, "after": signatures(ALL_MODULES)}, sys.stdout)
"""

#: The public entry points, as the planner, inspect, the simulators and the runtime call them.
ENTRY_POINTS = """
import json, sys
import numpy as np
from dynabatch import CostModel, Shapes, plan_microbatches
from dynabatch.core.cost.model import device_preset, model_preset
from dynabatch.core.methods import BASELINES
from dynabatch.core.plan.planner import split_global_batches
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
for method in ("dp_varlen", "pack") + BASELINES:  # every method, for the warm-up check
    plan_microbatches(shapes, cost, num_stages=3, num_ranks=4, method=method, max_len=1024, schedule="1f1b")
split_global_batches(shapes, 8192, seed=3)
# The records as Ray's object store hands them to a part (`--engine ray`): pickle 5 with out-of-band buffers,
# so every array is read-only. The planner takes them as they are and its kernels get writable arrays.
import pickle
def zero_copy(x):
    buffers = []
    data = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
    return pickle.loads(data, buffers=[memoryview(b.raw()).toreadonly() for b in buffers])
ro_shapes, ro_cost = zero_copy(shapes), zero_copy(cost)
assert not ro_cost.mem_coef.flags.writeable
for method in ("dp", "dp_varlen"):
    plan_microbatches(ro_shapes, ro_cost, num_stages=4, num_ranks=2, method=method, max_len=2048)
split_global_batches(ro_shapes, 8192, seed=3)
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


@pytest.fixture(scope="module")
def dumped() -> dict[str, dict[str, list[str]]]:
    """``{"entry"|"warm"|"after": {module.kernel: [signature, ...]}}`` (see `WARM`, `DUMP`) from one fresh
    interpreter that ran `warm_planner` and then the entry points (the repository's kernel cache: a few CPU
    seconds warm; on a fresh clone it compiles what later tests load)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    code = f"MODULES = {MODULES!r}\nALL_MODULES = {ALL_MODULES!r}\n" + WARM + ENTRY_POINTS + DUMP
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert run.returncode == 0, f"the entry points failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def entry_signatures(dumped) -> dict[str, list[str]]:
    """``{module.kernel: [signature, ...]}`` of `MODULES` after the entry points."""
    return dumped["entry"]


def test_warm_planner_loads_the_types_real_plans_use(dumped):
    """`warm_planner` (the fork server's, so forked ranks plan without loading kernels) reaches the planner's
    kernels with the argument types real plans pass: planning every method on other sizes, stage and rank
    counts afterwards adds no signature to a kernel it loaded (a second type would be a second load or
    compile in every rank, and the warm-up wasted)."""
    warm, after = dumped["warm"], dumped["after"]
    for kernel in ("dp._dp_entry", "assign.assign_ranks", "global_batches.greedy_cuts", "schedules._order_ranks",
                   "simulate.makespan_table_kernel", "simulate.schedule_kernel"):
        assert warm.get(kernel), f"warm_planner did not reach {kernel}"
    grown = {k: sorted(set(after[k]) - set(v)) for k, v in warm.items() if v and set(after[k]) - set(v)}
    assert not grown, "warm_planner loaded these kernels for other types than real plans use:\n" + "\n".join(
        f"{k}: {v}" for k, v in grown.items())


def _check(signatures: dict[str, list[str]]) -> None:
    many = {k: v for k, v in signatures.items() if len(v) > REAL_TYPES.get(k, 1)}
    odd = {k: [s for s in v if "Literal[" in s or "readonly" in s] for k, v in signatures.items()}
    odd = {k: v for k, v in odd.items() if v}
    assert not many and not odd, (
        "kernels compiled more than once per real argument type, or for a literal / read-only argument (pass "
        "np.int64 / np.bool_, inline a helper that takes constants, pass arrays through kernel_array):\n"
        + "\n".join(f"{k}: {len(v)}\n    " + "\n    ".join(v) for k, v in {**many, **odd}.items()))


def test_the_entry_points_reach_the_kernels(entry_signatures):
    """The run compiled (or loaded) the kernels it should, so the check below does not hold vacuously."""
    for kernel in ("op_tables.codes_table", "op_tables.table_codes", "schedules._order_ranks",
                   "schedules.record_slots_kernel", "schedules.rank_ops_kernel",
                   "schedules.adaptive_kernel", "simulate.simulate_table_kernel", "simulate.makespan_table_kernel",
                   "simulate.makespan_kernel", "simulate.schedule_kernel", "inflight.inflight_table_kernel",
                   "inflight.held_table_kernel", "times.split_kernel", "times.chunk_times",
                   "flushfree.flushfree_kernel", "flushfree.stage_loads", "objective.objective_kernel"):
        assert entry_signatures.get(kernel), f"the entry points did not reach {kernel}"


def test_the_entry_points_hand_each_kernel_one_type(entry_signatures):
    """The wrappers normalize dtypes, layouts and flags (a broadcast view, a frozen `StepOps` table, a plan
    column read from a file are read-only) before they call a kernel."""
    _check(entry_signatures)


def _constant_arguments(module) -> list[str]:
    """``kernel -> callee arg i: source`` for each call from a kernel of ``module`` to another kernel that
    numba does not inline, with an int or bool constant (or a module constant's name) as an argument."""
    names = vars(module)
    found = []
    for fn in ast.walk(ast.parse(inspect.getsource(module))):
        if not (isinstance(fn, ast.FunctionDef) and isinstance(names.get(fn.name), CPUDispatcher)):
            continue
        for call in ast.walk(fn):
            callee = names.get(call.func.id) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                else None
            if not isinstance(callee, CPUDispatcher) or callee.targetoptions.get("inline") == "always":
                continue
            for i, arg in enumerate(call.args):
                v = arg.operand if isinstance(arg, ast.UnaryOp) else arg
                value = v.value if isinstance(v, ast.Constant) else names.get(v.id) if isinstance(v, ast.Name) \
                    else None
                if isinstance(value, (bool, int)):
                    found.append(f"{fn.name} -> {call.func.id} arg {i}: {ast.unparse(arg)}")
    return found


@pytest.mark.parametrize("short", ALL_MODULES)
def test_kernels_pass_their_helpers_no_constants(short):
    """Numba code hands a called kernel typed values (``np.int64(0)``, ``np.bool_(True)``, a comparison),
    or the helper is inlined (``inline="always"``: `_put`, `one_f_one_b_row`, `objective_kernel`), so no
    helper compiles once per constant (``_put`` was compiled 24 times, ``objective_kernel`` per caller)."""
    found = _constant_arguments(importlib.import_module("dynabatch.core.kernels." + short))
    assert not found, "constants that numba types as literals (one compile each):\n" + "\n".join(found)


def test_a_step_order_stays_frozen_and_hands_kernels_its_memory_writable():
    """`StepOps.table` stays read-only (also pickled or copied); `kernel_table` is the same memory, typed
    writable for the kernels."""
    import copy
    import pickle

    import numpy as np

    from dynabatch.core.schedule.build import step_ops

    ops = step_ops("zb-h1", 3, 4)
    for x in (ops, pickle.loads(pickle.dumps(ops)), copy.deepcopy(ops)):
        assert x == ops and not x.table.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            x.table[0, 0, 0] = 1
        assert x.kernel_table.flags.writeable and np.shares_memory(x.table, x.kernel_table)
