"""Bench configurations cross to their worker processes as JSON (`dynabatch.bench.payload`): every
field comes back equal, the `PlanOptions` as a `PlanOptions` and tuple fields as tuples."""

from __future__ import annotations

import json

from dynabatch.bench.multimodel import MultiBenchConfig
from dynabatch.bench.train import TrainBenchConfig
from dynabatch.core.options import PlanOptions


def _through_json(cfg):
    return json.loads(json.dumps(cfg.to_payload()))


def test_train_config_round_trip():
    opts = PlanOptions(global_batch_tokens=4096, max_len=300, num_stages=3, method="pack", method_options={"rows": 2})
    cfg = TrainBenchConfig(model="gpt-tiny", data=("a.jsonl", "b.jsonl"), options=opts, methods=("dp", "pack"),
                           model_sizes={"hidden": 32}, index="idx.parquet", flush_window=4)
    payload = _through_json(cfg)
    assert payload["options"] == opts.to_dict() and payload["methods"] == ["dp", "pack"]
    back = TrainBenchConfig.from_payload({**payload, "_verbose": True, "_partial": "p.json"})  # launcher keys
    assert back == cfg
    assert isinstance(back.options, PlanOptions) and back.options.method_options == {"rows": 2}
    assert isinstance(back.data, tuple) and isinstance(back.methods, tuple)


def test_multimodel_config_round_trip():
    cfg = MultiBenchConfig(ks=(3,), data=("x.jsonl",), options=PlanOptions(global_batch_size=16, seed=7),
                           budget_shards=1.5, interleave=False)
    back = MultiBenchConfig.from_payload(_through_json(cfg))
    assert back == cfg and back.ks == (3,) and back.options.seed == 7 and back.options.global_batch_size == 16
