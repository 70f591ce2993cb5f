"""The README's Python example runs as printed and its claims hold."""

import re
from pathlib import Path

import pytest


def test_readme_example_runs(capsys):
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    assert len(code.strip().splitlines()) <= 20
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    speedup = float(re.search(r"dp is ([0-9.]+)x faster", out).group(1))
    assert speedup > 1.0


def test_ci_runs_the_readme_test_command():
    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    ci = (root / ".ci" / "run").read_text()
    command = [line for line in ci.splitlines() if "pytest" in line][0].strip()
    assert command in readme
    assert "--durations=25" in command.split()  # the run ends with its 25 slowest tests


def _readme_commands() -> list[str]:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"## Command line\n\n```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


# Long runs (minutes of training or timing): checked for their inputs, not run here.
_LONG = ("dynabatch bench train", "dynabatch bench load", "dynabatch bench loader", "dynabatch profile")


@pytest.mark.slow
def test_readme_commands_run_in_a_fresh_directory(tmp_path, monkeypatch, capsys):
    """Every command of the README's command block runs in an empty directory in order (data made by
    ``dynabatch datagen`` there), and the long ones read only files an earlier command made. They run
    through the console script's own entry point (`dynabatch.cli.main`) in this process: what a command
    does does not depend on a fresh interpreter, and ten interpreter starts were most of this test's time."""
    import shlex

    from dynabatch.cli import main

    commands = _readme_commands()
    assert commands[0] == "dynabatch --help" and any(c.startswith("dynabatch datagen") for c in commands)
    made: set[str] = set()
    for cmd in commands:
        args = shlex.split(cmd)
        assert args[0] == "dynabatch", cmd
        for i, a in enumerate(args[1:], 1):
            path_like = "/" in a or a.endswith((".parquet", ".json", ".png", ".gz"))
            is_output = args[i - 1] in ("--out", "--plot")
            if path_like and not is_output:
                assert a.split("/")[0] in made, f"{cmd!r} reads {a!r}, which no earlier README command makes"
            if is_output:
                made.add(a.split("/")[0])
        if cmd.startswith(_LONG):
            continue
        monkeypatch.chdir(tmp_path)
        try:
            code = main(args[1:])
        except SystemExit as e:  # --help exits 0
            code = e.code
        out, err = capsys.readouterr()
        assert code == 0, f"{cmd}\n{out[-2000:]}\n{err[-2000:]}"
    assert (tmp_path / "plan.parquet").exists() and (tmp_path / "plan.png").exists()
