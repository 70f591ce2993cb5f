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


# The private names one module may import from another, each with why (a name made public or moved to where
# it is used needs no entry; an entry no import needs any more fails the test below, so the list stays short).
PRIVATE_IMPORTS = {
    ("dynabatch.pipeline.runtime.tied", "_flatten_dense_tensors"):
        "torch's own flattening of a tensor list into one buffer (DDP's bucketing); torch has no public one",
    ("dynabatch.pipeline.runtime.update", "_flatten_dense_tensors"):
        "torch's own flattening of a tensor list into one buffer (DDP's bucketing); torch has no public one",
    ("dynabatch.pipeline.runtime.update", "_unflatten_dense_tensors"):
        "the inverse of _flatten_dense_tensors (views of the buffer shaped as the tensors); torch has no public one",
}


def _private_imports(package: str) -> set[tuple[str, str]]:
    """``(importing module, name)`` of every private name (one leading underscore, not a dunder) that a module
    of ``package`` imports from another module with ``from m import _name`` (also inside functions); a
    private submodule (``from . import _x``) is a module, not a name, and ``import x as _x`` is not counted."""
    mods = dict(_modules(package))
    out = set()
    for name, path in mods.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            stem = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(stem + ([node.module] if node.module else []))
            out.update((name, a.name) for a in node.names
                       if a.name.startswith("_") and not a.name.startswith("__") and f"{mod}.{a.name}" not in mods)
    return out


def test_private_names_cross_modules_only_where_allowed():
    """A private name stays in its module: one another module needs is public (with a docstring) or lives where
    it is used; the few exceptions are `PRIVATE_IMPORTS`, each with its reason."""
    found = set().union(*(_private_imports(pkg) for pkg in ("dynabatch", "loaders", "tokenization")))
    new = sorted(found - PRIVATE_IMPORTS.keys())
    assert not new, f"private names imported from another module (make them public or move them where used): {new}"
    stale = sorted(PRIVATE_IMPORTS.keys() - found)
    assert not stale, f"allowed but no longer imported (drop them from PRIVATE_IMPORTS): {stale}"
    assert all(len(why) > 20 for why in PRIVATE_IMPORTS.values())


def test_the_private_import_finder_finds_one(tmp_path, monkeypatch):
    """The check above can fail: ``from .b import _x`` (also inside a function) is found, a private submodule,
    a public name and an ``as _alias`` of one are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import _impl\n")
    (pkg / "_impl.py").write_text("_x = 1\ny = 2\n")
    (pkg / "a.py").write_text("from ._impl import y as _y\n\ndef f():\n    from pkg._impl import _x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _private_imports("pkg") == {("pkg.a", "_x")}


JIT_DECORATORS = {"njit", "jit", "vectorize", "guvectorize", "cfunc", "stencil"}
# where numba kernels live: every planning kernel in dynabatch/core/kernels/ (beside its reference); the token
# cache's file-read kernel in dynabatch/index/reads.py (reading files is the loader's job, not planning)
KERNEL_HOMES = ("dynabatch/core/kernels/", "dynabatch/index/reads.py")


def _jit_uses(path: Path) -> list[int]:
    """Lines of ``path`` that compile a function with numba: a decorator ``@njit``/``@numba.njit(...)`` (or
    another of `JIT_DECORATORS`) or a call of one (``njit(f)``)."""
    def jit(node) -> bool:
        node = node.func if isinstance(node, ast.Call) else node
        return (isinstance(node, ast.Name) and node.id in JIT_DECORATORS) or \
            (isinstance(node, ast.Attribute) and node.attr in JIT_DECORATORS)

    tree = ast.parse(path.read_text())
    lines = {d.lineno for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             for d in n.decorator_list if jit(d)}
    lines.update(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and jit(n.func))
    return sorted(lines)


def test_numba_kernels_live_in_kernels():
    """Every numba kernel of dynabatch is in `dynabatch.core.kernels` (the token-cache read kernel in
    `dynabatch.index.reads`); a kernel elsewhere is moved there, beside its plain-Python reference."""
    stray = [f"{p.relative_to(ROOT)}:{n}" for _, p in _modules("dynabatch")
             if not str(p.relative_to(ROOT)).startswith(KERNEL_HOMES) for n in _jit_uses(p)]
    assert not stray, f"numba kernels outside dynabatch/core/kernels/ (move them there): {stray}"
    assert _jit_uses(ROOT / "dynabatch/index/reads.py")  # the finder sees a kernel where one is


def test_the_kernel_finder_finds_each_form(tmp_path):
    """``@njit``, ``@numba.njit(cache=True)`` and ``njit(f)`` are found; a function named ``jitter`` is not."""
    f = tmp_path / "m.py"
    f.write_text("import numba\nfrom numba import njit\n\n@njit\ndef a(): pass\n\n@numba.njit(cache=True)\n"
                 "def b(): pass\n\nc = njit(a)\n\ndef jitter(): pass\n")
    assert _jit_uses(f) == [4, 7, 10]


def test_modules_stay_readable():
    """Modules are cut where their jobs part, not at a line count: a module over `MAX_LINES` lines is
    reported (a warning, so that a cohesive module may stay whole), never a failure."""
    big = [(str(p.relative_to(ROOT)), n) for pkg in ("dynabatch", "loaders", "tokenization")
           for _, p in _modules(pkg) if (n := len(p.read_text().splitlines())) > MAX_LINES]
    if big:
        warnings.warn(f"modules over {MAX_LINES} lines (split them where their jobs part): {big}", UserWarning)
