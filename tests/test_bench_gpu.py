"""`dynabatch bench gpu` on a machine without CUDA: the tiny CPU form runs every section, the JSON has the
documented structure, GPU-only rows say "skipped: no CUDA"; and `import dynabatch` (and the bench) work
without the optional `datasets`/`webdataset` packages, which a feature needing them names clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = "skipped: no CUDA"
#: block the optional packages as the GPU image lacks them (an import of either raises ImportError)
BLOCK = "import sys; sys.modules['datasets'] = None; sys.modules['webdataset'] = None; "


def _python(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


MARK = "--- end of the import checks"  # on stdout: the checks' lines before it, the bench's JSON after it
#: the import checks of `test_import_without_datasets_and_webdataset`: each feature's error, one line each
IMPORT_CHECKS = (
    "import dynabatch, loaders, tokenization, dynabatch.cli, dynabatch.pipeline\n"
    "from loaders import MissingDependencyError, open_source\n"
    "from loaders._webdataset import _split\n"
    "for call in (lambda: open_source([{'text': 'a'}]), lambda: _split('a.txt')):\n"
    "    try:\n"
    "        call()\n"
    "    except MissingDependencyError as e:\n"
    "        print(e)\n"
    "    else:\n"
    "        raise SystemExit('no error without the package')\n"
    f"print({MARK!r}, flush=True)\n")


def _failed_sections(stdout: str) -> str:
    """The failed sections of the bench's JSON on ``stdout`` (status and traceback), or its last lines."""
    from dynabatch.bench.gpu import failed_sections

    try:
        res = json.loads(stdout.split(MARK + "\n", 1)[1])
        names = failed_sections(res)
    except (IndexError, ValueError, KeyError, TypeError, AttributeError):  # no bench JSON: show the output
        return stdout[-3000:]
    return "\n".join(f"{n}: {res['sections'][n]['status']}\n{res['sections'][n].get('traceback', '')}" for n in names)


@pytest.fixture(scope="module")
def blocked(request, tmp_path_factory):
    """One interpreter without ``datasets`` and ``webdataset`` for this file: the import checks, then, when
    `test_bench_gpu_cpu_form` is selected, the bench's CPU form (``--json`` to stdout, ``--out`` a folder).
    One fresh interpreter instead of two (its start is most of the import test's cost); the checks run
    before the bench, so the imports they see are an untouched interpreter's. ``(process, out folder)``."""
    out = tmp_path_factory.mktemp("gpu") / "out"
    bench = any(item.name == "test_bench_gpu_cpu_form" for item in request.session.items)
    code = BLOCK + IMPORT_CHECKS
    if bench:
        code += ("from dynabatch.cli import main\n"
                 f"raise SystemExit(main(['bench', 'gpu', '--quick', '--json', '--out', {str(out)!r}]))\n")
    return _python(code, timeout=900), out  # liveness: the CPU form takes about a minute on a busy 2-core machine


def test_import_without_datasets_and_webdataset(blocked):
    p, _ = blocked
    assert MARK in p.stdout, p.stderr[-3000:]
    lines = p.stdout.split(MARK)[0].strip().splitlines()
    assert len(lines) == 2
    assert "a list of records" in lines[0] and "pip install 'datasets>=2.16'" in lines[0]
    assert "webdataset tar shards" in lines[1] and "pip install 'webdataset>=0.2.86'" in lines[1]


@pytest.mark.slow
def test_bench_gpu_cpu_form(blocked):
    p, out = blocked
    # --json prints a failed section's status and traceback on stdout: show them with stderr
    assert p.returncode == 0, _failed_sections(p.stdout) + p.stderr[-4000:]
    res = json.loads(p.stdout.split(MARK + "\n", 1)[1])  # --json: the JSON alone on stdout (after the checks')
    assert res == json.loads((out / "result.json").read_text())
    s = res["sections"]
    assert list(s) == ["environment", "cost_model", "training", "recompute", "multimodel"]
    assert all(sec["status"] == "ok" for sec in s.values()), {n: sec["status"] for n, sec in s.items()}
    assert res["wall_budget_s"] == SKIP and res["within_budget"] == SKIP
    assert res["config"]["device"] == "cpu" and res["config"]["parameters"] > 0

    env = s["environment"]
    assert env["gpu"] == SKIP and env["cuda"] is None
    kernels = env["attention"]
    assert set(kernels) == {"sdpa_math", "sdpa_flash_attention", "sdpa_efficient_attention", "sdpa_cudnn_attention",
                            "flex_attention", "varlen_attn"}
    assert kernels["sdpa_math"]["status"] == "works"  # the math backend runs everywhere
    for k in kernels.values():
        assert k["status"] == "works" or k["status"].startswith("fails: ")
        assert (k["seconds"] is None) == (k["status"] != "works")

    cm = s["cost_model"]
    from dynabatch.core.cost import CostModel

    saved = CostModel.load(cm["cost_model_path"])
    assert os.path.dirname(cm["cost_model_path"]) == str(out) and saved.table is not None
    assert cm["microbatches"] == len(cm["per_microbatch"]) > 0
    assert all(r["measured_s"] > 0 and r["preset_s"] > 0 and r["profiled_s"] > 0 for r in cm["per_microbatch"])
    assert [r["kind"] for r in cm["per_layer"]] == ["embedding", "block", "block", "head"]
    assert 0 <= cm["mape_profiled"] < float("inf") and 0 <= cm["mape_preset"] < float("inf")

    tr = s["training"]["methods"]
    assert list(tr) == ["dp", "dp_varlen", "pack", "token_budget", "pad"]
    assert tr["pack"]["ratio_to_pack"] == 1.0
    assert tr["dp_varlen"]["collation"] == tr["pack"]["collation"] == "packed"
    assert tr["dp"]["collation"] == "padded"
    steps = {m: [r["real_tokens"] for r in r_["per_step"]] for m, r_ in tr.items()}
    assert len({tuple(v) for v in steps.values()}) == 1  # the same global batches for every method
    for r in tr.values():
        assert r["tokens_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1
        assert r["peak_bytes"] == SKIP and r["activation_bytes"] == SKIP

    rc = s["recompute"]
    assert rc["max_memory_allocated"] == SKIP and rc["fits"] == SKIP and rc["device_limit_bytes"] == SKIP
    # whether the plan keeps to the limit is what the bench measures (plans follow the profiled timings,
    # so they differ between runs): here only that the row states it consistently
    assert rc["saved_within_limit"] == (rc["measured_saved_bytes"] <= rc["activation_limit_bytes"])
    assert rc["planned_activation_bytes"] <= rc["activation_limit_bytes"]  # the planner kept to the limit
    assert rc["variants"]["full"]["mean_recompute_layers"] > 0 and rc["step_time_vs_full"] > 0

    mm = s["multimodel"]
    assert mm["bit_identical_to_alone"] == {"spilling": True, "resident": True}
    assert mm["spills"] > 0 and mm["moved_bytes"] > 0 and mm["budget_bytes"] < 2 * mm["shard_bytes"]
    assert mm["hidden_copy_share"] == SKIP and mm["pinned_host_copies"] == SKIP
