"""``dynabatch bench spindle`` on generated data, small: every row holds its baselines and bounds."""

import math

from dynabatch.bench.spindle import MIX, format_spindle, generated_pools, run_spindle_bench
from dynabatch.commands.bench_spindle import bench_spindle_command


def test_bench_rows_are_consistent():
    pools = generated_pools(0, n=2000)
    rows = run_spindle_bench(pools, dict(MIX), (8, 16), 1, 16384, 2048, "a100-80gb", 0)
    for r in rows:
        assert r.allocation_s >= r.bound_s == max(r.lower_bound_s, r.chain_bound_s) and r.chain_bound_s > 0
        assert r.allocation_s <= r.whole_s  # splitting the ViT's tiles is kept only where it is shorter
        fits = {k: v for k, v in r.baselines_s.items() if not math.isnan(v)}
        for k, v in fits.items():
            assert v >= r.bound_s
        if fits:
            assert r.speedup == min(fits.values()) / r.allocation_s
    assert "allocation at 16" in format_spindle(rows)


def test_command_says_when_the_data_is_generated(capsys, tmp_path):
    class Args:
        measure = False
        generated = False
        shared = str(tmp_path)  # empty: no shared data here
        weights = [0.4, 0.4, 0.2]
        max_len, seed, devices, steps, step_tokens, microbatch_tokens = 4096, 0, [16], 1, 8192, 2048
        device, json, progress = "a100-80gb", False, False

    assert bench_spindle_command(Args()) == 0
    out = capsys.readouterr().out
    assert "GENERATED data" in out and "best/alloc" in out and "chain bound" in out and "whole-mb s" in out
    assert "overlap-grad-reduce" in out  # what each side overlaps is said
