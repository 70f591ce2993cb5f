"""The baseline batching methods by name: their collation and benchmark knob (a record at the bottom
of `dynabatch.core`, beside `options`; the methods themselves are `dynabatch.core.plan.baselines`)."""

from __future__ import annotations

BASELINES = ("pad", "group_by_length", "token_budget", "pack", "pack_varlen", "rebalance", "kk")

#: Collation each baseline's micro-batches are costed with.
BASELINE_COLLATION = {
    "pad": "padded", "group_by_length": "padded", "token_budget": "padded", "rebalance": "padded",
    "pack": "packed_rows", "pack_varlen": "packed", "kk": "packed",
}

#: The knob each baseline is tuned over in benchmarks, with its candidate values.
BASELINE_KNOBS = {
    "pad": ("rows", (1, 2, 4, 8, 16, 32, 64)),
    "group_by_length": ("rows", (1, 2, 4, 8, 16, 32, 64)),
    "token_budget": ("max_tokens", (1024, 2048, 4096, 8192, 16384, 32768)),
    "pack": ("rows", (1, 2, 4, 8)),
    "pack_varlen": ("rows", (1, 2, 4, 8)),
    "rebalance": ("microbatches_per_rank", (1, 2, 4, 8, 16, 32)),
    "kk": ("max_tokens", (1024, 2048, 4096, 8192, 16384, 32768)),
}
