"""Re-runs issue 27's eight cases on generated data and prints what a user now sees: one line per
edit, ``refused -> <error type or exit status>: <message>`` or ``accepted (exit 0) <what happened>``.
Not a test (no ``test_`` prefix): the closing note's evidence. Exit status 1 when any edit was
accepted silently, a checkpoint kill left a broken run, or an unedited control run failed.

    PYTHONPATH=$PWD python tests/probe_issue27.py [--out DIR] [--memory FILE.jsonl] [--cases 1 3 ...]

Data (300 ``dynabatch datagen`` samples as JSONL, Parquet and JSONL.gz; a character-level tokenizer.json
built with ``tokenizers``) is made in a temporary folder (inside ``--out``) and removed at the end. Case 7
is measured by ``tests/exit_soak.py`` (its command is printed); case 8 is one epoch's peak RSS (VmHWM) of
the indexed mode with the token cache and of the streaming mode, each in its own process, on ``--memory
FILE.jsonl`` (else a generated ~20 MB file)."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cached_property
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the regression tests' helpers (imported where used: the memory child stays light)

TOKENS, MAX_LEN = 8192, 512  # global batch and cap in tokens (a longer sample is over the CPU preset's memory)
PLAN_FLAGS = ["--model", "gpt", "--device", "cpu", "--ranks", "1", "--stages", "2", "--global-batch-tokens",
              str(TOKENS), "--max-len", str(MAX_LEN), "--tokenizer", "bytes", "--workers", "1", "--no-progress"]
MEMORY_OPTIONS = dict(global_batch_tokens=65536, max_len=2048)  # the case 8 settings (workers 0)
MEMORY_SAMPLES = 12_700  # ~20 MB of generated JSONL (~1.6 kB per sample)
SOAK = "PYTHONPATH=$PWD python tests/exit_soak.py --runs 100"


class CommandRefused(Exception):
    """A ``dynabatch`` command's non-zero exit: ``args`` = (exit status, its stderr)."""


def flat(text: str, limit: int = 200) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    return " ".join(str(text).split())[:limit]


class Report:
    """Prints one line per case and remembers the silent acceptances and failed controls."""

    def __init__(self):
        self.bad: list[str] = []

    def case(self, name: str, run) -> None:
        """``run()`` does the edited thing as a user would; it returns what happened when accepted."""
        try:
            seen = run()
        except CommandRefused as e:
            line = f"refused -> exit {e.args[0]}: {flat(e.args[1])}"
        except Exception as e:  # noqa: BLE001  (any refusal is what is reported)
            line = f"refused -> {type(e).__name__}: {flat(e)}"
        else:
            line = f"accepted (exit 0) {seen}"
            self.bad.append(name)
        print(f"case {name}: {line}", flush=True)

    def outcome(self, name: str, ok: bool, text: str) -> None:
        """A case whose right answer is not a refusal (a control run, a checkpoint kill)."""
        if not ok:
            self.bad.append(name)
        print(f"{'case ' + name if name[0].isdigit() else '  ' + name}: {'ok' if ok else 'BROKEN'} -> {text}",
              flush=True)

    def control(self, name: str, run) -> None:
        """The same run on the unedited file, which must work (else the refusals prove nothing)."""
        try:
            text, ok = run(), True
        except Exception as e:  # noqa: BLE001
            text, ok = f"{type(e).__name__}: {flat(e)}", False
        self.outcome(f"control {name}", ok, text)


def cli(argv: list[str]) -> str:
    """``dynabatch ARGV`` (in this process); raises `CommandRefused` on a non-zero exit."""
    from dynabatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    if code:
        raise CommandRefused(code, err.getvalue().strip() or "(no message)")
    lines = out.getvalue().strip().splitlines()
    return f"`dynabatch {argv[0]}` printed {len(lines)} lines, e.g. {flat(lines[0] if lines else '', 80)!r}"


def loader(data, tokenizer="bytes", **source):
    """The DataLoader a user writes for these files: ``source`` fields of `DataSource`."""
    from dynabatch import Costing, DataLoader, DataSource, PlanOptions, Tokenization

    return DataLoader(data, options=PlanOptions(global_batch_tokens=TOKENS, max_len=MAX_LEN, num_stages=2),
                      tokenization=Tokenization(tokenizer=tokenizer), source=DataSource(progress=False, **source),
                      costing=Costing(cost_model="gpt", device="cpu"))


def rest(dl) -> str:
    """What the loader yields for the rest of its epoch (then closed)."""
    steps = list(dl)
    dl.close()
    samples = sum(len(mb["sample_ids"]) for s in steps for mb in s)
    return f"{len(steps)} steps, {samples} samples, {sum(s.target_tokens for s in steps)} target tokens"


def resumed(dl, state) -> str:
    """``dl`` resumed from ``state``: what it yields for the rest of the epoch."""
    dl.load_state_dict(state)
    return "resumed: " + rest(dl)


class Work:
    """The probe's files under ``root``, made on first use: ``jsonl`` (300 generated samples), its length
    ``index`` (bytes tokenizer, ``MAX_LEN``) and ``plan`` (``dynabatch plan`` of the index)."""

    def __init__(self, root: Path, memory: str | None = None):
        self.root, self.memory = root, memory  # memory: case 8's file (None: a generated one)

    def generated(self, name: str, samples: int, fmt: str = "jsonl") -> str:
        """A ``dynabatch datagen`` text shard of ``samples`` samples in ``fmt`` (one file), its path."""
        from dynabatch.datagen import write_text_shards

        return str(write_text_shards(self.root / name, samples, num_shards=1, format=fmt)[0])

    @cached_property
    def jsonl(self) -> str:
        return self.generated("jsonl", 300)

    @cached_property
    def index(self) -> str:
        from dynabatch import build_index

        build_index(self.jsonl, max_len=MAX_LEN, path=self.root / "index.parquet")
        return str(self.root / "index.parquet")

    @cached_property
    def plan(self) -> str:
        cli(["plan", self.index, "--out", str(self.root / "plan.parquet"), *PLAN_FLAGS])
        return str(self.root / "plan.parquet")

    def edited(self, src: str, name: str, edit) -> str:
        """``src`` (Parquet) rewritten with ``edit(table)``, its metadata (integrity record) kept."""
        from test_length_index import tampered

        tampered(src, self.root / name, edit)
        return str(self.root / name)


def case1(w: Work, r: Report) -> None:
    """Loader state edited, truncated or emptied between save and resume."""
    from dynabatch.loader import load_loader_state, save_loader_state

    dl, path = loader(w.jsonl, mode="indexed"), w.root / "loader_state.json"
    it = iter(dl)
    next(it), next(it)
    save_loader_state(dl.state_dict(), path)
    upcoming = [int(i) for mb in next(it) for i in mb["sample_ids"]][:5]  # samples the resumed run must train
    dl.close()
    r.control("1 state as saved", lambda: resumed(loader(w.jsonl, mode="indexed"), load_loader_state(path)))

    def edit(fn):
        def run():
            state, edited = json.loads(path.read_text()), w.root / "edited_state.json"
            fn(state["indexed"])
            edited.write_text(json.dumps(state))
            return resumed(loader(w.jsonl, mode="indexed"), load_loader_state(edited))
        return run

    r.case("1a step_in_epoch +2", edit(lambda s: s.update(step_in_epoch=s["step_in_epoch"] + 2)))
    r.case("1b epoch 0 -> 1", edit(lambda s: s.update(epoch=s["epoch"] + 1)))
    r.case(f"1c ids {upcoming} added to exclude", edit(lambda s: s["exclude"].extend(upcoming)))
    r.case(f"1d ids {upcoming} added to consumed", edit(lambda s: s["consumed"].extend(upcoming)))
    raw, damaged = path.read_bytes(), w.root / "damaged_state.json"
    for label, content in (("1e truncated", raw[: len(raw) // 2]), ("1f empty", b"")):
        damaged.write_bytes(content)
        r.case(f"{label} loader-state file", lambda: resumed(loader(w.jsonl, mode="indexed"),
                                                    load_loader_state(damaged)))


def case2(w: Work, r: Report) -> None:
    """Length index columns edited: read by a DataLoader and by ``dynabatch plan``."""
    from test_integrity_index import EDITS

    r.control("2 index as written", lambda: "ran: " + rest(loader(w.jsonl, index=w.index)))
    for label, key in (("2a", "input_tokens x2"), ("2b", "label_tokens x2"), ("2c", "one sample 2**31-1")):
        bad = w.edited(w.index, f"index_{label}.parquet", EDITS[key][1])
        r.case(f"{label} index {key}, DataLoader", lambda: "ran: " + rest(loader(w.jsonl, index=bad)))
        r.case(f"{label} index {key}, dynabatch plan",
               lambda: cli(["plan", bad, "--out", str(w.root / "plan_2.parquet"), *PLAN_FLAGS]))


def case3(w: Work, r: Report) -> None:
    """Plan file columns edited: replayed by a DataLoader and read by ``dynabatch inspect``."""
    from test_integrity_plan import EDITS

    r.control("3 plan as written, replay", lambda: "replayed: " + rest(loader(w.jsonl, plan=w.plan, index=w.index)))
    r.control("3 plan as written, dynabatch inspect", lambda: cli(["inspect", w.plan]))
    said = {"input_len": "input_len x2 (first micro-batch)", "time_s": "time_s = NaN", "rows": "rows +1",
            "tokens": "tokens +1", "sample_tokens": "sample_tokens +100 (one row)", "memory_bytes": "memory_bytes x0.5",
            "target_len": "target_len +8", "row": "row shuffled (one micro-batch)"}
    for letter, column in zip("abcdefgh", said):
        bad = w.edited(w.plan, f"plan_3{letter}.parquet", EDITS[column])
        r.case(f"3{letter} plan {said[column]}, replay",
               lambda: "replayed: " + rest(loader(w.jsonl, plan=bad, index=w.index)))
        r.case(f"3{letter} plan {said[column]}, dynabatch inspect", lambda: cli(["inspect", bad]))


def rewrite_same_counts(path: str) -> None:
    """``path`` (Parquet or JSONL.gz) rewritten in place with other text of the same token counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_integrity_data import _same_counts

    if path.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(_same_counts(pq.read_table(path).to_pylist())), path)
        return
    rows = [json.loads(line) for line in gzip.decompress(Path(path).read_bytes()).splitlines()]
    Path(path).write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in _same_counts(rows)).encode(), mtime=0))


def case4(w: Work, r: Report) -> None:
    """Data replaced between save and resume: Parquet locally and on S3 (when moto, s3fs and boto3 are
    installed: a moto server on 127.0.0.1), JSONL.gz in the streaming mode."""
    import importlib.util

    from dynabatch import build_index
    from test_integrity_data import _state_after as state_after  # the state after 2 steps, through JSON

    data = w.generated("parquet", 300, "parquet")
    s3_copy = str(shutil.copy(data, w.root / "part_s3.parquet"))  # the text as it was, for the S3 object
    index = str(w.root / "index_4.parquet")
    build_index(data, max_len=MAX_LEN, path=index)
    state = state_after(loader(data, index=index))
    rewrite_same_counts(data)
    r.case("4a Parquet rewritten (same token counts), DataLoader(index=)",
           lambda: "ran: " + rest(loader(data, index=index)))
    r.case("4b Parquet rewritten (same token counts), state resumed", lambda: resumed(loader(data), state))
    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"case 4c/4d S3: not run ({', '.join(missing)} not installed)")
    else:
        from test_loaders_remote import moto_s3

        with moto_s3(str(w.root / "s3")) as s3:
            url, opts = s3.upload("probe/part.parquet", s3_copy), {"storage_options": s3.opts}
            build_index(url, max_len=MAX_LEN, path=index, source_options=opts)
            state = state_after(loader(url, index=index, source_options=opts))
            rewrite_same_counts(s3_copy)
            s3.upload("probe/part.parquet", s3_copy)  # another ETag
            r.case("4c S3 object rewritten (same token counts), DataLoader(index=)",
                   lambda: "ran: " + rest(loader(url, index=index, source_options=opts)))
            r.case("4d S3 object rewritten (same token counts), state resumed",
                   lambda: resumed(loader(url, source_options=opts), state))
    gz = w.generated("gz", 300, "jsonl.gz")
    state = state_after(loader(gz, mode="streaming"))
    rewrite_same_counts(gz)
    r.case("4e JSONL.gz changed (same token counts), streaming state resumed",
           lambda: resumed(loader(gz, mode="streaming"), state))


def case5(w: Work, r: Report) -> None:
    """Another tokenizer than the one an index, a plan or a state was made with."""
    import loaders
    from dynabatch import build_index
    from test_integrity_data import _state_after as state_after
    from test_integrity_tokenizer import _char_tokenizer
    from tokenization import load_tokenizer

    tok = _char_tokenizer(w.root / "tokenizer.json")
    index = str(w.root / "index_5.parquet")
    build_index(w.jsonl, tokenizer=tok, max_len=MAX_LEN, cache_tokens=True, path=index)  # token-cached
    state = state_after(loader(w.jsonl, tok, index=index, cache_tokens=True), steps=1)
    _char_tokenizer(w.root / "tokenizer.json", reverse=True)  # same path and vocabulary size, other ids

    def token_cached():
        dl = loader(w.jsonl, tok, index=index, cache_tokens=True)
        mb = next(iter(dl))[0]
        text = loaders.open_source(w.jsonl).read([int(mb["sample_ids"][0])])[0]["inputs"]
        new = load_tokenizer(tok).encode_batch([text])[0]
        ids = mb["input_ids"][0].tolist()[: len(new)]
        return f"first row {'carries' if ids == list(new) else 'does NOT carry'} the new tokenizer's ids; " + rest(dl)

    r.case("5a tokenizer.json replaced at the same path, token-cached index", token_cached)
    r.case("5b tokenizer.json replaced at the same path, state resumed",
           lambda: resumed(loader(w.jsonl, tok, mode="indexed", cache_tokens=True), state))
    r.case("5c plan made with bytes, replayed with another tokenizer",
           lambda: "replayed: " + rest(loader(w.jsonl, tok, plan=w.plan, index=w.index)))
    r.case("5d index made with bytes, read with another tokenizer",
           lambda: "ran: " + rest(loader(w.jsonl, tok, index=w.index)))


def case6(w: Work, r: Report) -> None:
    """SIGKILL before a few of the file-system writes of the step-4 save (the test's counting child)."""
    import test_hf_trainer as t
    from transformers.trainer_utils import get_last_checkpoint

    script = w.root / "kill_child.py"
    script.write_text(t.KILL_CHILD)

    def child(out: Path, kill_at: int):
        return subprocess.run([sys.executable, str(script), w.jsonl, str(out), str(kill_at), str(HERE)], text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=600)

    count_dir = w.root / "kill_count"
    count = child(count_dir, 0)
    if count.returncode:
        return r.outcome("6 counting run", False, f"exit {count.returncode}: {flat(count.stderr[-400:])}")
    events = json.loads((count_dir / "events.json").read_text())
    for letter, k in zip("abcd", sorted({2, len(events) // 2, len(events) - 1, len(events)})):
        out = w.root / f"kill{k}"
        run = child(out, k)
        call, target = events[k - 1].split(" ", 1)
        where = f"SIGKILL before write {k}/{len(events)} of the save ({call} {os.path.relpath(target, count_dir)})"
        last = get_last_checkpoint(str(out))
        held = sorted(os.listdir(last)) if last else []
        complete = {"model.safetensors", "trainer_state.json", t.LOADER_STATE_NAME.format(rank=0)} <= set(held)
        text = f"exit {run.returncode}; get_last_checkpoint: {os.path.basename(last or 'none')} " \
               f"({'complete' if complete else 'INCOMPLETE: ' + ', '.join(held)})"
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its logs
                rest_run = t.train(w.jsonl, out, t.tiny_llama(seed=1), resume=last, max_steps=6,
                                   save_strategy="steps", save_steps=2)
            trained = [s for s, _ in rest_run.seen]
            ok = complete and trained == list(range(int(last.rsplit("-", 1)[1]), 6))
            text += f"; resumed, trained steps {trained[0]}-{trained[-1]}, global step {rest_run.state.global_step}"
        except Exception as e:  # noqa: BLE001
            ok, text = False, text + f"; resume failed: {type(e).__name__}: {flat(e)}"
        r.outcome(f"6{letter} {where}", ok, text)


def epoch_peak(mode: str, path: str) -> None:
    """In a child process: one epoch of ``path`` in ``mode`` (default token cache, no workers); prints
    ``{"samples", "peak_mb"}`` (VmHWM, MB) and ``cache_mb``, the token files in ``$DYNABATCH_CACHE_DIR`` (MB)."""
    from dynabatch import DataLoader, DataSource, PlanOptions

    dl = DataLoader(path, options=PlanOptions(**MEMORY_OPTIONS), source=DataSource(mode=mode, progress=False))
    samples = sum(len(mb["sample_ids"]) for mb in dl.microbatches())
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]
    cache = sum(f.stat().st_size for f in Path(os.environ["DYNABATCH_CACHE_DIR"]).glob("*")) / 1e6
    print(json.dumps({"samples": samples, "peak_mb": int(hwm) / 1024, "cache_mb": cache}))


def case8(w: Work, r: Report) -> None:
    """One epoch's peak RSS, indexed (default token cache) vs streaming, each in a fresh process."""
    path, what = w.memory, "the given file"
    if path is None:
        path, what = w.generated("memory", MEMORY_SAMPLES), "a generated file (not the issue's 200 MB one)"
    peaks = {}
    for mode in ("indexed", "streaming"):
        code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import probe_issue27; " \
               f"probe_issue27.epoch_peak({mode!r}, {path!r})"
        env = {**os.environ, "DYNABATCH_CACHE_DIR": str(w.root / f"token_cache_{mode}")}  # removed after
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
        if run.returncode:
            return r.outcome(f"8 memory, {mode}", False, f"exit {run.returncode}: {flat(run.stderr[-400:])}")
        peaks[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    i, s = peaks["indexed"], peaks["streaming"]
    print(f"case 8 memory on {what}, {os.path.getsize(path) / 1e6:.1f} MB, one epoch "
          f"(global_batch_tokens={MEMORY_OPTIONS['global_batch_tokens']}, max_len={MEMORY_OPTIONS['max_len']}, "
          f"workers 0): peak RSS (VmHWM) indexed with token cache {i['peak_mb']:.0f} MB ({i['samples']} samples, "
          f"token file {i['cache_mb']:.0f} MB on disk), "
          f"streaming {s['peak_mb']:.0f} MB ({s['samples']} samples), ratio {i['peak_mb'] / s['peak_mb']:.2f} "
          f"(issue 27's target: at most 1.5)", flush=True)


CASES = {1: case1, 2: case2, 3: case3, 4: case4, 5: case5, 6: case6, 8: case8,
         7: lambda w, r: print(f"case 7 clean exits: measured by tests/exit_soak.py, not re-run here: {SOAK}")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="make the probe's files in a new folder inside DIR (default: the system's "
                                  "temporary folder); removed at the end", metavar="DIR")
    ap.add_argument("--memory", metavar="FILE.jsonl", help="case 8's file (default: a generated ~20 MB JSONL)")
    ap.add_argument("--cases", nargs="+", type=int, choices=range(1, 9), default=list(range(1, 9)), metavar="N",
                    help="the cases to run, 1-8 (default all)")
    a = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="probe_issue27-", dir=a.out))
    w, r = Work(root, a.memory), Report()
    try:
        for n in sorted(set(a.cases)):
            CASES[n](w, r)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{len(r.bad)} silently accepted or broken: {r.bad}" if r.bad else "nothing accepted silently")
    return 1 if r.bad else 0


if __name__ == "__main__":
    sys.exit(main())
