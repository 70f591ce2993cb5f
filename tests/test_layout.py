"""The package layout keeps the data's one-way flow: loaders -> tokenization -> dynabatch, and inside
dynabatch the torch-free planning core at the bottom. Import edges are read from the sources (every
import statement, also inside functions), so a lazy import that runs back up is caught too."""

import ast
import sys
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(name: str, path: Path) -> set[str]:
    """Absolute module names ``name`` imports (relative imports resolved)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[: len(base) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from . import x` may name a module
    return out


def _graph(package: str) -> dict[str, set[str]]:
    mods = dict(_modules(package))
    return {name: {m for m in _imports(name, path) if m in mods} for name, path in mods.items()}


def test_loaders_and_tokenization_never_import_dynabatch():
    for package in ("loaders", "tokenization"):
        for name, path in _modules(package):
            bad = sorted(m for m in _imports(name, path) if m == "dynabatch" or m.startswith("dynabatch."))
            assert not bad, f"{name} imports {bad}"
    assert not any(m.startswith("tokenization") for name, p in _modules("loaders") for m in _imports(name, p))


def test_core_is_torch_free_and_imports_nothing_above_it():
    for name, path in _modules("dynabatch/core"):
        imports = _imports(name, path)
        assert not any(m == "torch" or m.startswith("torch.") for m in imports), f"{name} imports torch"
        up = sorted(m for m in imports if m.startswith("dynabatch.") and not m.startswith("dynabatch.core")
                    and m != "dynabatch")
        assert not up, f"{name} imports {up} from above the core"


def test_no_import_cycle_between_dynabatch_subpackages():
    def pkg(mod: str) -> str:
        parts = mod.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else parts[0]

    edges = defaultdict(set)
    for mod, deps in _graph("dynabatch").items():
        for d in deps:
            if pkg(d) != pkg(mod) and pkg(mod) != "dynabatch" and pkg(d) != "dynabatch":
                edges[pkg(mod)].add(pkg(d))
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack + [node, nxt]))
            if nxt not in state:
                visit(nxt, stack + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def _file_cycles(package: str) -> list[list[str]]:
    """Import circles between the modules (files) of ``package``, as sorted lists of module names: every
    strongly connected component of the import graph with more than one module (a module importing its own
    parent package's ``__init__`` is not a circle of files)."""
    graph = _graph(package)
    for name, deps in graph.items():
        parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {d for d in deps if d != name and d not in parents}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_circle_between_files_of_a_package():
    """No two files import each other, directly or around a circle (type-only and lazy imports count: they
    are what a split along a line cap leaves), in any package."""
    circles = [c for pkg in ("dynabatch", "loaders", "tokenization") for c in _file_cycles(pkg)]
    assert not circles, f"import circles between files: {circles}"


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    """The check above can fail: two files importing each other (one of them lazily) are a circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def x():\n    from .a import y\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _file_cycles("pkg") == [["pkg.a", "pkg.b"]]


def test_modules_stay_readable():
    """Modules are cut where their jobs part, not at a line count: a module over `MAX_LINES` lines is
    reported (a warning, so that a cohesive module may stay whole), never a failure."""
    big = [(str(p.relative_to(ROOT)), n) for pkg in ("dynabatch", "loaders", "tokenization")
           for _, p in _modules(pkg) if (n := len(p.read_text().splitlines())) > MAX_LINES]
    if big:
        warnings.warn(f"modules over {MAX_LINES} lines (split them where their jobs part): {big}", UserWarning)
