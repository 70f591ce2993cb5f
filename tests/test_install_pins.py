"""The ``test`` extra resolves without backtracking: the packages pip backtracked over for 25+ minutes
(ray, the s3fs / aiobotocore / botocore / boto3 chain, moto) have bounded ranges, the library's own
dependencies stay open, and the environment the suite runs in satisfies the pins."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
from packaging.requirements import Requirement  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BOUNDED = ("ray", "s3fs", "aiobotocore", "botocore", "boto3", "moto")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _reqs(items) -> dict[str, Requirement]:
    return {r.name.lower(): r for r in map(Requirement, items)}


def test_backtracked_packages_have_bounded_ranges_and_the_library_stays_open():
    test = _reqs(_project()["optional-dependencies"]["test"])
    for name in BOUNDED:
        ops = {s.operator for s in test[name].specifier}
        assert ops & {"<", "<=", "==", "~=", "==="}, f"{name}: {test[name]} has no upper bound"
    for r in _reqs(_project()["dependencies"]).values():  # the library itself: lower bounds only
        assert not {s.operator for s in r.specifier} & {"<", "<=", "==", "~="}, str(r)


def test_the_pins_form_one_consistent_set():
    """Each bounded package's own requirements on the others (e.g. aiobotocore's botocore range)
    admit the versions the extra allows: the installed ones satisfy the extra and each other."""
    test = _reqs(_project()["optional-dependencies"]["test"])
    try:
        installed = {n: version(n) for n in BOUNDED}
    except PackageNotFoundError as e:
        pytest.skip(f"the test extra is not installed here: {e}")
    for name, v in installed.items():
        assert test[name].specifier.contains(v, prereleases=True), f"installed {name} {v} is outside {test[name]}"
    for name in BOUNDED:
        for dep in map(Requirement, requires(name) or ()):
            other = dep.name.lower()
            if other in installed and (dep.marker is None or dep.marker.evaluate({"extra": ""})):
                assert dep.specifier.contains(installed[other], prereleases=True), (name, str(dep))
