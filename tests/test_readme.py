"""The README's Python example runs as printed and its claims hold."""

import re
from pathlib import Path


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
