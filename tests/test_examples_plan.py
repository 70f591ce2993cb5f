"""examples/compare_methods.py runs and ranks the DP first among padded methods."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "compare_methods.py"


def test_compare_methods_example(capsys):
    spec = importlib.util.spec_from_file_location("compare_methods", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = mod.main(model="t5", ranks=4, stages=4, batches=2)
    padded = ("pad", "group_by_length", "token_budget", "rebalance", "pack")
    assert results["dp"][0] < min(results[m][0] for m in padded)
    assert "obj/LB" in capsys.readouterr().out
