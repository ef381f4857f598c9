"""The package's shape: a pure core, no import cycles, small modules, documented public names.

These are the rules of the layout (see docs/concepts.md, "Where the code lives"); each test
reads the source, so a rule broken anywhere fails here with the module and line that break it.
"""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterable, Iterator
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


# ------------------------------------------------------------------ names in the prose
BACKTICKED = re.compile(r"``([^`\s]+)``")
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?([^`<>\s]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
FILE = re.compile(r"[\w.-]+(?:/[\w.-]+)+\.(?:py|md|yaml|sh|toml)")


def _prose(path: Path) -> Iterator[tuple[int, str]]:
    """Each docstring and comment of a module, with its line."""
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _defined(name: str, tree: ast.Module) -> Iterator[str]:
    """The dotted names a module defines: itself, its top-level names (definitions,
    assignments, imports) and its classes' members (methods, fields, class attributes and
    attributes set on ``self``)."""
    yield name
    for node in tree.body:
        yield from (f"{name}.{n}" for n in _bound(node))
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                inner = _bound(item) if item in node.body else ()
                if (
                    isinstance(item, ast.Attribute)
                    and isinstance(item.ctx, ast.Store)
                    and isinstance(item.value, ast.Name)
                    and item.value.id in ("self", "cls")
                ):
                    inner = (item.attr,)
                yield from (f"{name}.{node.name}.{n}" for n in inner)


def _reexported(name: str, tree: ast.Module) -> Iterator[tuple[str, str]]:
    """``(here, there)`` for each name a module takes from another of the package: the
    members of ``there`` are reachable as members of ``here``."""
    package = name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("omniload_dask"):
                for a in node.names:
                    yield f"{name}.{a.asname or a.name}", f"{base}.{a.name}"


def _bound(node: ast.AST) -> tuple[str, ...]:
    """The names a statement binds at its own level."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return tuple((a.asname or a.name).split(".")[0] for a in node.names)
    targets = node.targets if isinstance(node, ast.Assign) else []
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    return tuple(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))


def _suffixes(names: Iterable[str]) -> set[str]:
    """Every name and each of its tails at a dot (``a.b.c``: ``b.c`` and ``c`` too)."""
    out = set()
    for full in names:
        parts = full.split(".")
        out.update(".".join(parts[i:]) for i in range(len(parts)))
    return out


def _plan_fields() -> set[str]:
    """Every plan field path (``scripts/docs_plan_meanings.py``, which tests/test_docs.py
    holds to the parser), without list marks, and each tail at a dot."""
    spec = importlib.util.spec_from_file_location(
        "docs_plan_meanings", PACKAGE.parent / "scripts" / "docs_plan_meanings.py"
    )
    assert spec and spec.loader
    meanings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(meanings)
    return _suffixes(key.replace("[]", "") for key in meanings.MEANINGS if key)


def _package_names() -> tuple[set[str], set[str]]:
    """Every dotted name the package defines, re-exports included, and the first parts that
    mark a name as the package's: its modules' names and its classes' (not other libraries'
    top-level names that it imports, though a module be named after one)."""
    trees = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}
    defined = {n for name, tree in trees.items() for n in _defined(name, tree)}
    links = [pair for name, tree in trees.items() for pair in _reexported(name, tree)]
    for _ in range(3):  # (a re-export of a re-export)
        members: dict[str, set[str]] = {}
        for n in defined:
            parent, _, last = n.rpartition(".")
            members.setdefault(parent, set()).add(last)
        defined |= {f"{here}.{m}" for here, there in links for m in members.get(there, ())}
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    outside = {
        a.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
        for t in trees.values() for node in ast.walk(t) if isinstance(node, (ast.Import, ast.ImportFrom))
        and not getattr(node, "level", 0) for a in node.names
    } - {"omniload_dask"}  # fmt: skip
    return defined, ({n.split(".")[-1] for n in MODULES} | classes) - outside


FILE_SUFFIXES = {"json", "jsonl", "yaml", "md", "py", "txt", "zst", "gz", "tar", "parquet", "bin"}


def test_names_in_docstrings_and_comments_resolve():
    """A module, object or file that the prose names in double backticks or a Sphinx role
    exists, so the prose cannot outlive a rename. A dotted name is the package's when it
    starts with ``omniload_dask``, with a dot (a relative role), or with the name of one of
    its modules, classes or plan sections; it resolves when some name the package defines
    ends with it (``refine.CUT_FROM``, ``Assignment.bound``) or it is a plan field path
    (``loader.prefetch``, ``plan.batch``). Other libraries' names and local variables
    (``np.minimum.at``, ``p.bin``) are not checked; a file path (``core/keys.py``) is found
    from the repository, the package or the module's own folder up."""
    defined, ours = _package_names()
    known = _suffixes(defined)
    fields = _plan_fields()
    fields |= {f"plan.{f}" for f in fields}
    ours |= {f.split(".")[0] for f in fields if "." in f}
    bad = []
    for path in MODULES.values():
        where = path.relative_to(PACKAGE.parent)
        for line, text in _prose(path):
            refs = [r.rstrip("()") for r in ROLE.findall(text)]
            refs += [r for r in (b.rstrip("()") for b in BACKTICKED.findall(text))
                     if DOTTED.fullmatch(r) and r.rsplit(".", 1)[1] not in FILE_SUFFIXES]  # fmt: skip
            for ref in refs:
                head = ref.lstrip(".").split(".")[0]
                if not (ref.startswith(".") or head == "omniload_dask" or head in ours):
                    continue
                if ref.lstrip(".") not in known and ref not in fields:
                    bad.append(f"{where}:{line}: {ref}")
            for file in filter(FILE.fullmatch, BACKTICKED.findall(text)):
                roots = [PACKAGE.parent, *path.parents[: len(path.relative_to(PACKAGE).parts)]]
                if not any((root / file).exists() for root in roots):
                    bad.append(f"{where}:{line}: {file}")
    assert not bad, f"{len(bad)} names that resolve to nothing:\n" + "\n".join(bad)
