"""Plans stay byte-identical across refactors of the planning core: every method, model preset,
stage layout, schedule, flush-free and recompute policy is planned on fixed seeded samples and the
hash of every array and option the plan holds is compared with the hashes recorded before the
refactor (``GOLDEN``). A change of any planned field (placement, order, times, memory, rank times,
options) fails here. Regenerate only for an intended planning change:
``PYTHONPATH=$PWD python tests/test_plan_golden.py`` prints the new table."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from dynabatch import Shapes
from dynabatch.core.cost.model import CostModel
from dynabatch.core.options import METHODS
from dynabatch.core.plan.planner import plan_microbatches

#: BatchPlan fields a refactor may add (records derived from the fields hashed here, or from the placement and
#: the samples' own lengths: ``mb_target_tokens``, pinned by `test_pipeline_hf_packed_seq2seq`).
_NEW_FIELDS = ("op_slots", "mb_target_tokens")


def _shapes(seed: int, n: int = 83) -> Shapes:
    rng = np.random.default_rng(seed)
    inp = np.clip(rng.lognormal(5.0, 1.0, n), 1, 3000).astype(np.int32)
    tgt = np.clip(rng.lognormal(3.5, 1.0, n), 1, 600).astype(np.int32)
    vis = rng.integers(0, 4, n) * 256
    return Shapes.from_lengths(inp, tgt, vis, sample_id=rng.permutation(n) + 10)


def _cases():
    """(name, preset, layout, plan keywords) of every case."""
    out = []
    for preset in ("gpt", "t5", "vlm"):
        for method in METHODS:
            kw = {"max_len": 4096, "max_target_len": 1024 if preset == "t5" else None} \
                if method in ("pack", "pack_varlen") else {}
            out.append((f"{preset}-{method}", preset, "uniform", dict(method=method, num_stages=4, num_ranks=2, **kw)))
    for preset, layout in (("gpt", "uniform"), ("t5", "uniform"), ("vlm", "uniform"), ("vlm", "contiguous"),
                           ("t5", "contiguous")):
        for method in ("dp", "dp_varlen", "token_budget"):
            for schedule in ("gpipe", "1f1b", "adaptive", "auto"):
                out.append((f"{preset}-{layout}-{method}-{schedule}", preset, layout,
                            dict(method=method, schedule=schedule, num_stages=3, num_ranks=3)))
    for preset, layout in (("gpt", "uniform"), ("vlm", "contiguous")):
        out.append((f"{preset}-{layout}-flushfree", preset, layout,
                    dict(method="dp", schedule="1f1b", num_stages=4, num_ranks=2, flush=False)))
        out.append((f"{preset}-{layout}-stages6", preset, layout,
                    dict(method="dp", schedule="auto", num_stages=6, num_ranks=1)))
        for policy, device_limit in (("full", None), ("adaptive", 1.2e10)):
            out.append((f"{preset}-{layout}-recompute-{policy}", preset, layout,
                        dict(method="dp", schedule="auto", num_stages=4, num_ranks=2, recompute=policy,
                             device_memory_limit=device_limit)))
    return out


CASES = _cases()


def _plan(preset, layout, kw):
    stages = kw["num_stages"]
    cost = CostModel.preset(preset, num_stages=stages, layout=layout)
    if kw.get("recompute", "none") != "none":  # per-stage recompute starts from a model without it
        cost = cost.with_model(recompute=False)
    return plan_microbatches(_shapes(len(preset) * 7 + stages), cost, step=2, **kw)


def plan_hash(plan) -> str:
    """sha256 (16 hex) of every field of ``plan`` (arrays by dtype, shape and bytes; options as JSON)."""
    h = hashlib.sha256()
    for f in dataclasses.fields(plan):
        if f.name in _NEW_FIELDS:
            continue
        v = getattr(plan, f.name)
        if isinstance(v, np.ndarray):
            h.update(f"{f.name}:{v.dtype}:{v.shape}".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif f.name == "options":
            h.update(json.dumps(v, sort_keys=True, default=repr).encode())
        else:
            h.update(f"{f.name}={v!r}".encode())
    return h.hexdigest()[:16]


#: Hashes recorded on fdbcfd4, before the planning-core refactor.
GOLDEN = {
    'gpt-dp': 'acd67654cef2f739',
    'gpt-dp_varlen': '9f12614056d11177',
    'gpt-pad': 'ebafa35cc3ec0b2c',
    'gpt-group_by_length': 'c75916009ea06d76',
    'gpt-token_budget': 'ce166c89ae33051c',
    'gpt-pack': '293470dd9281c93e',
    'gpt-pack_varlen': 'e271d72e0b14fc04',
    'gpt-rebalance': '1ad378576a032353',
    'gpt-kk': '670c6900c67fac9c',
    't5-dp': '7fcdf77bc9ace494',
    't5-dp_varlen': 'a9cc3331bc2c4bf7',
    't5-pad': 'd8a6003c183c4883',
    't5-group_by_length': '5b9f10fb3db7a2a4',
    't5-token_budget': '4f964e44b0645af7',
    't5-pack': '951058cccbe82a27',
    't5-pack_varlen': '3d2fa22ab2ec6512',
    't5-rebalance': '81429b4ad94873eb',
    't5-kk': '6238de85ebd602bd',
    'vlm-dp': 'fe2b3540d7e35576',
    'vlm-dp_varlen': '5fa82e061d49cd8a',
    'vlm-pad': '04c10bb30d9ddee2',
    'vlm-group_by_length': '094d415de59e28f5',
    'vlm-token_budget': 'fc13660878dbafcc',
    'vlm-pack': '66fa597f0299606d',
    'vlm-pack_varlen': 'acdf8f4666b4b6da',
    'vlm-rebalance': '0eac1105ac0044eb',
    'vlm-kk': '3da37dbba9baf8fb',
    'gpt-uniform-dp-gpipe': '4f1c93a703ab4c40',
    'gpt-uniform-dp-1f1b': '95b5b550d81c7dad',
    'gpt-uniform-dp-adaptive': '5adac904cc795a29',
    'gpt-uniform-dp-auto': '929a194440c0c7f3',
    'gpt-uniform-dp_varlen-gpipe': '987695f313acae97',
    'gpt-uniform-dp_varlen-1f1b': '3e3e143b828535f9',
    'gpt-uniform-dp_varlen-adaptive': '1fc221651e57fd91',
    'gpt-uniform-dp_varlen-auto': 'eecc7918d531d36c',
    'gpt-uniform-token_budget-gpipe': '5a2118b996946ac6',
    'gpt-uniform-token_budget-1f1b': '0e035b7de1198d6d',
    'gpt-uniform-token_budget-adaptive': 'bd1dc507c8b367e8',
    'gpt-uniform-token_budget-auto': '8c1d5129deee4621',
    't5-uniform-dp-gpipe': '0f76a5179673df1b',
    't5-uniform-dp-1f1b': '890e81a677d46a6c',
    't5-uniform-dp-adaptive': '30261a115047f868',
    't5-uniform-dp-auto': 'a860c1261b83f46a',
    't5-uniform-dp_varlen-gpipe': 'd44fa58759c3d8c6',
    't5-uniform-dp_varlen-1f1b': '1a4eab5763e7515e',
    't5-uniform-dp_varlen-adaptive': '56edf37e37db2857',
    't5-uniform-dp_varlen-auto': 'd0b8a8673e9b350e',
    't5-uniform-token_budget-gpipe': '76cc78e954ef83ac',
    't5-uniform-token_budget-1f1b': 'b06845cfe64e0025',
    't5-uniform-token_budget-adaptive': 'bbdc2ebe968c010e',
    't5-uniform-token_budget-auto': '337bb1b2dfa3813d',
    'vlm-uniform-dp-gpipe': 'f6955b783942bd94',
    'vlm-uniform-dp-1f1b': '23f6046690b55737',
    'vlm-uniform-dp-adaptive': '3ade92bed4d9f6ec',
    'vlm-uniform-dp-auto': '879919c459408346',
    'vlm-uniform-dp_varlen-gpipe': '7a99c256ef1da991',
    'vlm-uniform-dp_varlen-1f1b': '582ca26fc8a0ed4b',
    'vlm-uniform-dp_varlen-adaptive': '065d06c4b5404dd4',
    'vlm-uniform-dp_varlen-auto': '3625bf93ee7c99a4',
    'vlm-uniform-token_budget-gpipe': '3c3da6835fd69668',
    'vlm-uniform-token_budget-1f1b': 'a8f69594627edd9d',
    'vlm-uniform-token_budget-adaptive': '5529ea655fbd8198',
    'vlm-uniform-token_budget-auto': '6b5c79741976fa27',
    'vlm-contiguous-dp-gpipe': 'c27d05ee702419f9',
    'vlm-contiguous-dp-1f1b': '3cd8e79eee8d2304',
    'vlm-contiguous-dp-adaptive': '0847719c8ad09669',
    'vlm-contiguous-dp-auto': '7449a27932e7a1e8',
    'vlm-contiguous-dp_varlen-gpipe': '053601e4bf15a971',
    'vlm-contiguous-dp_varlen-1f1b': 'dbbdaf54e622d6da',
    'vlm-contiguous-dp_varlen-adaptive': 'ac4ddcbe6547d687',
    'vlm-contiguous-dp_varlen-auto': '1561756d4235efa2',
    'vlm-contiguous-token_budget-gpipe': '6f958a14ccd7e6cd',
    'vlm-contiguous-token_budget-1f1b': '78f0f77630e7ad2a',
    'vlm-contiguous-token_budget-adaptive': '390249e57db8d73f',
    'vlm-contiguous-token_budget-auto': 'dfe5c000738745b1',
    't5-contiguous-dp-gpipe': 'dd28d422864b6a6b',
    't5-contiguous-dp-1f1b': 'f9a4e7aa6478e007',
    't5-contiguous-dp-adaptive': '57073b8709582bc3',
    't5-contiguous-dp-auto': 'c25ef728ece4b470',
    't5-contiguous-dp_varlen-gpipe': 'fa6265dbb561dfb2',
    't5-contiguous-dp_varlen-1f1b': '65d1fd009073dbef',
    't5-contiguous-dp_varlen-adaptive': '67a4967ccbc576dd',
    't5-contiguous-dp_varlen-auto': '03726b4f9af1c391',
    't5-contiguous-token_budget-gpipe': '5c804fc9f5448ad9',
    't5-contiguous-token_budget-1f1b': '96071b81086c657d',
    't5-contiguous-token_budget-adaptive': '9323033f2a89dff1',
    't5-contiguous-token_budget-auto': '38cfebd51eddce9a',
    'gpt-uniform-flushfree': 'ade4c20c87f04347',
    'gpt-uniform-stages6': '64cfb13f6d3d7525',
    'vlm-contiguous-flushfree': '85fb0f2e217a1770',
    'vlm-contiguous-stages6': '94c5166dd1c1a7fb',
    'gpt-uniform-recompute-full': 'c5f7fe3e7c070549',
    'gpt-uniform-recompute-adaptive': 'e2bbe0a8a12170e6',
    'vlm-contiguous-recompute-full': '91644099c52d5833',
    'vlm-contiguous-recompute-adaptive': '1461f68aa2ecf081',
}


@pytest.mark.parametrize("name,preset,layout,kw", CASES, ids=[c[0] for c in CASES])
def test_plan_is_byte_identical_to_the_recorded_one(name, preset, layout, kw):
    assert plan_hash(_plan(preset, layout, kw)) == GOLDEN[name]


if __name__ == "__main__":
    import sys

    for name, preset, layout, kw in CASES:
        if len(sys.argv) > 1 and sys.argv[1] not in name:
            continue
        print(f"    {name!r}: {plan_hash(_plan(preset, layout, kw))!r},")
