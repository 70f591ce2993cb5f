"""A fresh clone's first commands: `dynabatch --help` starts from data `dynabatch datagen` makes (the
project's shared/ folder is optional), and what the README's commands write stays out of `git status`."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dynabatch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _help() -> str:
    return build_parser().format_help()


def _start_here(text: str) -> list[str]:
    lines = text.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("Start here"))
    block = []
    for line in lines[i + 1:]:
        if not line.strip():
            break
        block.append(line.strip())
    return block


def test_start_here_reads_only_what_datagen_writes():
    block = _start_here(_help())
    assert block and not any("../shared" in line or "/shared/" in line for line in block), block
    gen = next(k for k, line in enumerate(block) if line.startswith("dynabatch datagen "))
    toks = shlex.split(block[gen])
    out = toks[toks.index("--out") + 1]
    # the commands that read data read what datagen wrote, after it
    readers = [k for k, line in enumerate(block) if k != gen and f" {out}/" in line]
    assert readers and min(readers) > gen, block


def test_shared_data_is_only_mentioned_as_optional(capsys):
    """Every ../shared path in `dynabatch --help` and `dynabatch bench plan --help` comes with a
    line (it or one of the 3 before it) that says it is optional."""
    texts = [_help()]
    with pytest.raises(SystemExit):
        main(["bench", "plan", "--help"])
    texts.append(capsys.readouterr().out)
    for text in texts:
        lines = text.splitlines()
        shared = [k for k, line in enumerate(lines) if "../shared" in line]
        assert shared
        for k in shared:
            assert "optional" in " ".join(lines[max(0, k - 3):k + 1]).lower(), lines[k]


def _readme_outputs() -> list[str]:
    """The files and folders the README's ``dynabatch`` commands write (--out, --plot, > FILE)."""
    text = (ROOT / "README.md").read_text()
    outs = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            cmd = line.split("#", 1)[0]
            for part in cmd.split("&&"):
                toks = shlex.split(part)
                if not toks or toks[0] != "dynabatch":
                    continue
                outs += [toks[k + 1] for k, t in enumerate(toks[:-1]) if t in ("--out", "--plot", ">")]
    return outs


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_readme_command_outputs_are_ignored_by_git():
    outs = _readme_outputs()
    assert {"data", "index.parquet", "plan.parquet", "pack.parquet", "plan.png", "costs.json"} <= set(outs), outs
    for path in outs:
        probe = path.rstrip("/") + ("/shard-000000.jsonl" if "." not in Path(path).name else "")
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT)
        assert r.returncode == 0, f"{path} (written by a README command) is not in .gitignore"
