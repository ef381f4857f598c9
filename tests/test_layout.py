"""The package's shape: a pure core, no import cycles, small modules, documented public names.

These are the rules of the layout (see docs/concepts.md, "Where the code lives"); each test
reads the source, so a rule broken anywhere fails here with the module and line that break it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "omniload_dask"
PURE = ("plan", "core", "batching")  # the data plane and what it is made of
NOT_IN_PURE = ("dask", "distributed", "torch", "fsspec")
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every omniload_dask module that ``name`` imports, wherever the import statement is
    (module level, under ``TYPE_CHECKING``, or inside a function)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES and m != name}


def test_the_pure_core_imports_none_of_dask_distributed_torch_or_fsspec():
    pure = sorted(m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] in PURE)
    assert len(pure) > 10, pure
    code = (
        "import importlib, sys\n"
        f"for m in {pure!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(NOT_IN_PURE)!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]", f"the pure core ({', '.join(PURE)}) imported {out}"


def test_there_are_no_import_cycles_not_even_type_only_ones():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package(module: str) -> str:
    """The package a module belongs to: ``omniload_dask.cluster.plugin`` -> ``cluster`` (a
    top-level module such as ``errors`` is a package of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_packages_depend_one_way_no_package_imports_one_that_imports_it():
    """Package-level cycles, of any length (a -> b -> a, a -> b -> c -> a), each named with the
    module imports that make its edges: a package one imports must not import it back."""
    edges: dict[tuple[str, str], set[str]] = {}
    for name, path in MODULES.items():
        deps = _imports(name, path)
        for dep in deps:
            if any(d.startswith(dep + ".") for d in deps):
                continue  # ``from pkg import module``: the module names the edge
            a, b = _package(name), _package(dep)
            if a != b and name != "omniload_dask":  # the root's lazy public API re-exports all
                edges.setdefault((a, b), set()).add(f"{name} -> {dep}")
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    # strongly connected components (Tarjan): every package in one with another is in a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = [
        f"{a} -> {b}: " + ", ".join(sorted(edges[a, b]))
        for group in groups
        for a, b in sorted(edges)
        if a in group and b in group
    ]
    assert not found, "packages that import each other:\n" + "\n".join(found)


def test_no_module_is_over_500_lines_and_no_class_over_300():
    big = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    big.append(f"{name}.{node.name}: {size} lines")
    assert not big, big


def _public(name: str) -> bool:
    return not name.startswith("_")


def test_every_public_module_class_and_function_has_a_docstring():
    missing = []
    for name, path in MODULES.items():
        if any(part.startswith("_") and part != "__init__" for part in name.split(".")):
            continue
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            missing.append(f"{name} (module)")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _public(node.name) and not ast.get_docstring(node):
                    missing.append(f"{name}.{node.name} (line {node.lineno})")
                if isinstance(node, ast.ClassDef) and _public(node.name):
                    for item in node.body:
                        if (
                            isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and _public(item.name)
                            and not ast.get_docstring(item)
                        ):
                            missing.append(f"{name}.{node.name}.{item.name} (line {item.lineno})")
    assert not missing, f"{len(missing)} without a docstring:\n" + "\n".join(missing)


def test_every_subpackage_says_what_it_owns():
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc.split()) >= 8, f"{name}/__init__.py: say what the subpackage owns"
