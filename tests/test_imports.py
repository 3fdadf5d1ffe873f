"""The package's import graph, read from the sources (every ``import`` statement, those inside functions included):
no circle, the core free of Horovod and of the frameworks' adapters, and the benchmarks (the evidence) reached by
nothing the library imports for training."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hvd_sparse"


def _module(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, name, modules):
    """The modules of the package ``path`` (module ``name``) imports, and the other top-level names it imports."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    inside, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            (inside if target in modules else outside).add(target if target in modules else target.split(".")[0])
    return inside - {name}, outside


def graph():
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, paths) for name, path in paths.items()}


def _cycles(edges):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    assert _cycles({name: inside for name, (inside, _) in graph().items()}) == []


def test_the_core_imports_no_horovod_and_no_adapter():
    for name, (inside, outside) in graph().items():
        if name.startswith("hvd_sparse.core"):
            assert "horovod" not in outside, name
            assert not [m for m in inside if not m.startswith("hvd_sparse.core")], name


def test_nothing_outside_the_benchmarks_imports_them():
    for name, (inside, _) in graph().items():
        if not name.startswith("hvd_sparse.bench"):
            assert not [m for m in inside if m.startswith("hvd_sparse.bench")], name
