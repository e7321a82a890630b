"""The shape of the packages, read from their source alone (nothing here imports them).

  * imports flow one way: pallas_kernels (bottom) -> sharding -> k3jax (top); a package imports
    itself, packages below it and third-party code, never a package above it;
  * no import cycles between modules;
  * no project import inside a function (the usual way to hide a cycle or an upward import);
  * no package file over MAX_LINES lines;
  * no measurements or dates in package code (numbers live in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "sharding", "k3jax")  # bottom to top
RANK = {name: rank for rank, name in enumerate(PACKAGES)}
MAX_LINES = 400
MEASUREMENT = re.compile(r"20\d\d-\d\d-\d\d|TFLOP/s|[TG]B/s|\b\d+(\.\d+)? ?ms\b")


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module (the longest module prefix of the imported name)
    line: int
    in_function: bool

    @property
    def where(self) -> str:
        return f"{module_path(self.source)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the three packages, by dotted name."""
    return {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def module_path(name: str) -> str:
    return str(modules()[name].relative_to(ROOT))


def project_module(name: str) -> str | None:
    """The project module an imported dotted name lands in, or None for stdlib / third-party."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def imported_modules(source: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules one import statement of `source` loads (not counting parent packages,
    which every import of a submodule loads too): `from a import b` is a.b if b is a module, else a."""
    if isinstance(node, ast.Import):
        found = {project_module(alias.name) for alias in node.names}
    else:
        base = node.module or ""
        if node.level:  # relative: from the importing module's package, one level up per extra dot
            package = source.split(".")
            if modules()[source].name != "__init__.py":
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        found = set()
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules() else project_module(base))
    return found - {None, source}


class _ImportFinder(ast.NodeVisitor):
    """The project imports of one module, each marked whether it sits inside a function."""

    def __init__(self, source: str) -> None:
        self.source, self.depth, self.found = source, 0, []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for target in sorted(imported_modules(self.source, node)):
            self.found.append(Import(self.source, target, node.lineno, self.depth > 0))

    visit_Import = visit_ImportFrom = _import


@functools.cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for name, path in modules().items():
        finder = _ImportFinder(name)
        finder.visit(ast.parse(path.read_text(), str(path)))
        found += finder.found
    return tuple(found)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def report(what: str, offenders: list[str]) -> str:
    return f"{len(offenders)} {what}:\n  " + "\n  ".join(offenders)


# ---- the checks ----------------------------------------------------------------------------------


def test_the_packages_are_found():
    assert all(any(m == p or m.startswith(p + ".") for m in modules()) for p in PACKAGES)
    assert any(i.target.startswith("pallas_kernels") for i in imports() if i.source.startswith("k3jax"))


def test_imports_flow_one_way():
    upward = [
        f"{i.where}: {i.source} imports {i.target}"
        for i in imports()
        if RANK[i.target.split(".")[0]] > RANK[i.source.split(".")[0]]
    ]
    assert not upward, report(f"upward imports (the order is {' -> '.join(PACKAGES)})", upward)


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for i in imports():
        edges.setdefault(i.source, set()).add(i.target)
    found = cycles(edges)
    assert not found, report("import cycles (modules that import each other, directly or not)",
                             [" <-> ".join(c) for c in found])


def test_no_project_import_inside_a_function():
    local = [f"{i.where}: {i.source} imports {i.target}" for i in imports() if i.in_function]
    assert not local, report("imports of project modules inside a function (import at the top)", local)


def test_package_files_are_short():
    long = [
        f"{module_path(name)}: {lines} lines"
        for name, path in modules().items()
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, report(f"package files over {MAX_LINES} lines (split by job)", long)


def test_no_measurements_or_dates_in_package_code():
    prose = [
        f"{module_path(name)}:{number}: {line.strip()}"
        for name, path in modules().items()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if MEASUREMENT.search(line)
    ]
    assert not prose, report("lines with measurements or dates (they belong in benchmarks/RESULTS.md)", prose)
