"""The issue-27 probe (``tests/probe_issue27.py``) on its cases 1 (loader state) and 3 (plan file):
every edit is refused naming the edited file, the unedited controls run, nothing it made is left
behind; and an acceptance is printed as one and fails the probe."""

from __future__ import annotations

import probe_issue27


def test_cases_1_and_3_refuse_every_edit_naming_the_file(tmp_path, capsys):
    assert probe_issue27.main(["--cases", "1", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    cases = {line.split(" ", 2)[1]: line for line in out if line.startswith("case ")}
    assert sorted(cases) == [f"1{c}" for c in "abcdef"] + [f"3{c}" for c in "abcdefgh"], out
    assert len([line for line in out if line.startswith("case ")]) == 6 + 2 * 8  # 3x: replay and inspect
    for line in out:
        if line.startswith("case "):
            assert ": refused -> " in line and "accepted" not in line, line
        if line.startswith("case 1"):
            assert line.split(": refused -> ")[1].startswith("LoaderStateError: ") and "_state.json" in line, line
        elif line.startswith("case 3"):
            assert f"plan_{line.split(' ')[1]}.parquet" in line, line
            assert ("refused -> exit 1: dynabatch: error: " if "inspect" in line else
                    "refused -> PlanMismatchError: ") in line, line
    controls = [line.strip() for line in out if line.strip().startswith("control ")]
    assert len(controls) == 3 and all(": ok -> " in c for c in controls), controls
    assert out[-1] == "nothing accepted silently"
    assert list(tmp_path.iterdir()) == []  # the probe's folder is removed


def test_an_acceptance_is_printed_and_counted(capsys):
    r = probe_issue27.Report()
    r.case("9a edit", lambda: "ran: 3 steps")
    r.case("9b edit", lambda: probe_issue27.cli(["inspect", "/nonexistent/plan.parquet"]))
    r.control("9 unedited", lambda: 1 / 0)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "case 9a edit: accepted (exit 0) ran: 3 steps"
    assert out[1].startswith("case 9b edit: refused -> ") and "/nonexistent/plan.parquet" in out[1], out[1]
    assert out[2] == "  control 9 unedited: BROKEN -> ZeroDivisionError: division by zero"
    assert r.bad == ["9a edit", "control 9 unedited"]
