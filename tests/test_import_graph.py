"""The package's import graph, read with ``ast``: no cycles, and no torch in the control plane
(``core/``, the KV backend registry and protocol, and each backend's manager side).

Every import counts, those inside functions included (they run at call time, and a cycle
through one is still a cycle of the design); imports under ``if TYPE_CHECKING:`` do not
(they never run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module, else to ``pkg``; importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``,
so those are edges too, except the importer's own ancestor packages (already running when
the importer is imported, the usual re-export of a package's ``__init__``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "pagedllm"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, skipping the bodies of ``if TYPE_CHECKING:`` (not their else)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The module a ``from ... import`` names, relative levels resolved against ``importer``."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]  # a module's level 1 is its package
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, every imported top-level name per module)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(paths)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    externals: dict[str, set[str]] = {m: set() for m in modules}

    def add(importer: str, target: str) -> None:
        externals[importer].add(target.split(".")[0])
        parts = target.split(".")
        own_ancestors = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in modules and name != importer and name not in own_ancestors:
                edges[importer].add(name)

    for importer, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(importer, alias.name)
                continue
            base = _absolute(node, importer, is_package)
            add(importer, base)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    add(importer, f"{base}.{alias.name}")
    return edges, externals


def cyclic_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components that hold a cycle (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:  # recursion depth is bounded by the package's module count
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(components)


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per cyclic component."""
    return [cycle_through(component, edges) for component in cyclic_components(edges)]


def cycle_through(component: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself (BFS inside it)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {component}")


def test_graph_reader_sees_function_level_and_relative_imports(tmp_path):
    """The reader itself: a cycle through a function-level import is found, a
    TYPE_CHECKING-guarded edge is not, relative and ``from pkg import module`` resolve."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pagedllm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import c\n")
    (pkg / "c.py").write_text("from .sub.b import x\nimport torch\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedllm import a\nelse:\n    import os\n"
    )
    edges, externals = import_graph(pkg)
    assert edges["pagedllm.a"] == {"pagedllm.sub", "pagedllm.sub.b"}
    assert edges["pagedllm.sub.b"] == {"pagedllm.c"}
    assert edges["pagedllm.c"] == {"pagedllm.sub", "pagedllm.sub.b"}
    assert edges["pagedllm.d"] == set() and "os" in externals["pagedllm.d"]
    assert "torch" in externals["pagedllm.c"]
    assert find_cycles(edges) == [["pagedllm.c", "pagedllm.sub.b", "pagedllm.c"]]


def test_no_import_cycles():
    edges, _ = import_graph()
    assert sum(len(v) for v in edges.values()) > 100, "the reader found almost no imports"
    components = cyclic_components(edges)
    if components:
        lines = [
            f"  {' -> '.join(cycle_through(c, edges))}" + (f"\n    (all of: {', '.join(c)})" if len(c) > 2 else "")
            for c in components
        ]
        pytest.fail(f"{len(components)} import cycle(s) in {PACKAGE}/:\n" + "\n".join(lines))


def test_core_never_imports_torch():
    _, externals = import_graph()
    offenders = sorted(m for m, names in externals.items() if m.startswith(f"{PACKAGE}.core") and "torch" in names)
    assert not offenders, f"{PACKAGE}/core/ must stay torch-free; torch is imported by {offenders}"


# The control plane's modules outside core/: the backend registry and its ABC, and each KV
# backend's manager side (its package ``__init__``, manager, view; the paged block pool and
# prefix hashing). A backend's worker side (worker.py) is the one place it may use torch.
TORCH_FREE_OUTSIDE_CORE = (
    f"{PACKAGE}.kv_backends",
    f"{PACKAGE}.kv_backends.base",
    f"{PACKAGE}.kv_backends.paged",
    f"{PACKAGE}.kv_backends.paged.block_pool",
    f"{PACKAGE}.kv_backends.paged.kv_cache_utils",
    f"{PACKAGE}.kv_backends.paged.manager",
    f"{PACKAGE}.kv_backends.paged.view",
    f"{PACKAGE}.kv_backends.vattention",
    f"{PACKAGE}.kv_backends.vattention.manager",
    f"{PACKAGE}.kv_backends.vattention.view",
)


def test_kv_manager_side_never_imports_torch():
    """No direct torch import in the manager side of a KV backend (function-level ones
    included, as in ``test_core_never_imports_torch``)."""
    edges, externals = import_graph()
    missing = sorted(set(TORCH_FREE_OUTSIDE_CORE) - set(edges))
    assert not missing, f"modules named here no longer exist: {missing}"
    offenders = sorted(m for m in TORCH_FREE_OUTSIDE_CORE if "torch" in externals[m])
    assert not offenders, f"the KV control plane must stay torch-free; torch is imported by {offenders}"


def test_control_plane_imports_run_without_torch():
    """Importing the control plane (the scheduler and every backend's manager side) does not
    load torch through any chain of module-level imports (checked in a fresh interpreter)."""
    core = sorted(
        module_name(p, ROOT) for p in (ROOT / "core").rglob("*.py") if p.name != "__init__.py"
    )
    modules = [*core, *TORCH_FREE_OUTSIDE_CORE]
    code = f"import sys\nfor m in {modules!r}:\n    __import__(m)\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", f"importing {modules} loads torch"


def test_server_front_end_imports_run_without_torch_or_transformers():
    """`pagedllm serve`'s own process (the CLI, the core's spawner, the OpenAI server, the
    tokenizer snapshot it unpickles) loads neither torch nor transformers: both cost seconds
    of a start, and only the engine core needs torch (docs/architecture.md)."""
    modules = ["pagedllm.entrypoints.cli", "pagedllm.engine.core_client", "pagedllm.models.sources",
               "pagedllm.entrypoints.openai.api_server", "pagedllm.models.tokenizer_snapshot"]
    code = (f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False False", f"importing {modules}: torch, transformers loaded: {result.stdout}"
