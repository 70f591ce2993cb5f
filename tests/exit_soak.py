"""Exit codes of clean runs of every pipeline mode (issue 27.7: 1 of 12 fault-free 2-rank
flush-free runs ended with SIGABRT after its ranks left ``init_pipeline``'s block). Runs each mode
``--runs`` times on 2 local gloo ranks and prints, per mode, how many launches had every rank
return 0, and the exit codes and last stderr lines of the others.

    PYTHONPATH=$PWD python tests/exit_soak.py --runs 100 [--modes flushed flush-free many-models]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: mode -> (launch target, its arguments): a few steps, then a normal exit.
FLUSH = f"{HERE / 'test_pipeline_flushfree.py'}:run_worker"
MODES = {
    "flushed": (FLUSH, (2, [0, 3, 6], [[3, 3, "sync", "sgd", False, 1]])),
    "flush-free": (FLUSH, (2, [0, 3, 6], [[3, 3, "none", "sgd", False, 1]])),
    "many-models": (f"{HERE / 'test_multimodel.py'}:budget_worker", ([1.0, 1.0], False)),
}


def soak(runs: int, modes=tuple(MODES)) -> dict:
    """``{mode: {"ok": launches whose ranks all returned 0, "runs": runs, "bad": [(codes, stderr tail)]}}``."""
    sys.path.insert(0, str(HERE))
    from dynabatch.pipeline import launch_local

    out = {}
    for mode in modes:
        target, args = MODES[mode]
        ok, bad = 0, []
        for k in range(runs):
            # spawn: the point is a fresh interpreter's teardown (a forked rank leaves by os._exit)
            res = launch_local(target, 2, args=args, idle_timeout_s=120, start_method="spawn")
            codes = [r.returncode for r in res]
            if all(c == 0 for c in codes):
                ok += 1
            else:
                bad.append((codes, [r.stderr[-400:] for r in res]))
            print(f"{mode} run {k + 1}/{runs}: exit codes {codes}", file=sys.stderr, flush=True)  # a partial count
        out[mode] = {"ok": ok, "runs": runs, "bad": bad}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    a = ap.parse_args(argv)
    res = soak(a.runs, a.modes)
    for mode, r in res.items():
        print(f"{mode}: {r['ok']}/{r['runs']} clean exits (every rank 0)"
              + (f"; others: {Counter(tuple(c) for c, _ in r['bad'])}" if r["bad"] else ""))
        for codes, tails in r["bad"][:3]:
            print(json.dumps({"codes": codes, "stderr": tails}))
    return 0 if all(r["ok"] == r["runs"] for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
