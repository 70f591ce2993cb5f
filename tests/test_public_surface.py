"""The public surface (issue 42): the top levels of `dynabatch` and `dynabatch.pipeline` hold the entry points,
every former top-level name still resolves there for one release with a DeprecationWarning naming its module,
and the signatures that spell out the planning options name exactly the `PlanOptions` fields."""

import dataclasses
import importlib
import inspect

import pytest

import dynabatch
import dynabatch.pipeline
from dynabatch.core.options import DEPRECATED_NAMES, PlanOptions


@pytest.mark.parametrize("package", [dynabatch, dynabatch.pipeline], ids=lambda p: p.__name__)
def test_every_entry_point_resolves_and_none_is_also_moved(package):
    assert len(package.__all__) <= 25 and len(set(package.__all__)) == len(package.__all__)
    assert not set(package.__all__) & set(package.MOVED)
    for name in package.__all__:
        assert getattr(package, name) is not None, name


@pytest.mark.parametrize("package", [dynabatch, dynabatch.pipeline], ids=lambda p: p.__name__)
def test_a_moved_name_warns_with_its_module_and_is_that_module_s_object(package):
    for name, module in sorted(package.MOVED.items()):
        with pytest.warns(DeprecationWarning, match=rf"{package.__name__}\.{name} is no longer a top-level name: "
                                                      rf"import it from {module}"):
            found = getattr(package, name)
        assert found is getattr(importlib.import_module(module), name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(package, "no_such_name")


def _keywords(fn, leave_out) -> set:
    return {p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY} - set(leave_out)


def test_the_spelled_out_planning_keywords_are_the_plan_options_fields():
    from dynabatch.core.methods import BASELINE_KNOBS
    from dynabatch.core.plan.feedback import FeedbackLoop
    from dynabatch.core.plan.planner import plan_microbatches
    from dynabatch.offline.runplan import RunPlanConfig

    fields = {f.name for f in dataclasses.fields(PlanOptions)}
    knobs = {knob for knob, _ in BASELINE_KNOBS.values()}
    assert _keywords(plan_microbatches, ["step"]) == fields | set(DEPRECATED_NAMES) | knobs
    assert _keywords(FeedbackLoop.plan, ["step"]) == fields
    assert _keywords(RunPlanConfig.__init__, ["epochs", "tokenizer", "family", "loader_differences"]) == fields


def test_the_data_loader_shows_its_own_signature_and_still_names_an_old_keyword_s_record():
    from dynabatch.loader.dataloader import DataLoader

    params = inspect.signature(DataLoader.__init__).parameters
    assert "options" in params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    with pytest.raises(TypeError, match=r"tokenizer= -> tokenization=Tokenization\(tokenizer=\.\.\.\)"):
        DataLoader([], tokenizer="bytes")


def _moved_imports(root: str, package) -> list[str]:
    """Every ``from <package> import <moved name>`` (absolute or relative) in the .py files under ``root``."""
    import ast
    from pathlib import Path

    found = []
    repo = Path(__file__).resolve().parent.parent
    for path in sorted((repo / root).rglob("*.py")):
        here = ".".join(path.relative_to(repo).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if module == package.__name__:
                found += [f"{path.relative_to(repo)}:{node.lineno} {a.name}" for a in node.names if a.name in package.MOVED]
    return found


@pytest.mark.parametrize("package", [dynabatch, dynabatch.pipeline], ids=lambda p: p.__name__)
@pytest.mark.parametrize("root", ["dynabatch", "examples", "tests"])
def test_the_project_imports_no_moved_name_from_a_top_level(package, root):
    """The project's own code, examples and tests import a moved name from its module: a user running them sees no
    DeprecationWarning that the project caused (the bench train runs warned before)."""
    assert _moved_imports(root, package) == []


def test_every_loaders_source_shows_its_options_by_name(tmp_path):
    """The sources and `loaders.open_source` hand their options to `Source.__init__`, where they are declared once; each
    one's signature names every option (no ``**options`` a reader must chase), and an unknown one is refused by name."""
    import loaders

    source_options = {p.name for p in inspect.signature(loaders.Source.__init__).parameters.values()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"shuffle", "seed", "on_error", "rank", "world_size"} <= source_options
    for name in ("JsonlSource", "JsonSource", "ParquetSource", "ArrowSource", "WebDatasetSource", "HFSource",
                 "HFIterableSource", "open_source"):
        params = inspect.signature(getattr(loaders, name)).parameters
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), name
        assert source_options <= set(params), (name, source_options - set(params))
    for name in loaders.__all__:
        obj = getattr(loaders, name)
        if callable(obj) and not isinstance(obj, type(inspect)):
            try:
                params = inspect.signature(obj).parameters.values()
            except (TypeError, ValueError):
                continue
            assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params), name
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(TypeError, match="shuffel"):
        loaders.JsonlSource([str(path)], shuffel=True)
