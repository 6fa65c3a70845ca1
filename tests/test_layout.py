"""The code's layout (docs/architecture.md, "How the code is laid out"): which packages import which, read
statically from every `import` in `pdcli/`, those inside functions included; and no import
circles, read from the imports that run at import time."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Iterator

PKG = Path(__file__).resolve().parents[1] / "pdcli"
PURE = ("pdcli.schedule", "pdcli.planner")
"""Packages that import no torch, directly or through another pdcli module."""


def module_of(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=1)
def graph() -> dict[str, set[str]]:
    """module -> every module it imports (pdcli modules by their full name, others by their top package)."""
    modules = {module_of(p): p for p in PKG.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names
                          if f"{node.module}.{alias.name}" in modules}
        out[name] = {m if m.startswith("pdcli") else m.split(".")[0] for m in found}
    return out


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        for dep in graph().get(module, ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_planner_and_runtime_do_not_import_each_other() -> None:
    for a, b in (("pdcli.planner", "pdcli.runtime"), ("pdcli.runtime", "pdcli.planner")):
        wrong = sorted(f"{m} -> {d}" for m, deps in graph().items() if in_package(m, a)
                       for d in deps if in_package(d, b))
        assert not wrong, wrong


def test_the_schedule_package_stands_on_nothing_but_itself() -> None:
    wrong = sorted(f"{m} -> {d}" for m, deps in graph().items() if in_package(m, "pdcli.schedule")
                   for d in deps if d.startswith("pdcli") and not in_package(d, "pdcli.schedule") and d != "pdcli.errors")
    assert not wrong, wrong


def test_pure_packages_import_no_torch() -> None:
    for module in graph():
        if any(in_package(module, p) for p in PURE):
            assert "torch" not in reachable(module), module


def module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs as it is imported: its top-level ones and those under a
    top-level `if` or `try`, except in `if TYPE_CHECKING:` blocks."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            type_checking = ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            yield from module_level_imports(node.orelse if type_checking else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from module_level_imports(
                node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)


@lru_cache(maxsize=1)
def import_time_graph() -> dict[str, set[str]]:
    """pdcli module -> the pdcli modules importing it runs: those its module-level imports name
    and their packages (importing `a.b.c` runs `a` and `a.b` first), not its own packages."""
    modules = {module_of(p): p for p in PKG.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in modules.items():
        named: set[str] = set()
        for node in module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif node.module and node.level == 0:
                named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        runs = {".".join(m.split(".")[:i]) for m in named for i in range(1, m.count(".") + 2)}
        out[name] = {m for m in runs if m in modules and m != name and not name.startswith(m + ".")}
    return out


def assert_no_circle(edges: dict[str, set[str]]) -> None:
    """Fails naming the first circle of `edges` (module -> the modules it imports)."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module not in done:
            for dep in sorted(edges.get(module, ())):
                visit(dep, [*path, module])
            done.add(module)

    for module in sorted(edges):
        visit(module, [])


def test_no_import_circles() -> None:
    """No pdcli module, while it is imported, imports one that imports it back. Counted: the
    module-level imports (`import_time_graph`); not those in `if TYPE_CHECKING:` blocks nor
    those inside functions, which run after every module is loaded and cannot form a circle."""
    assert any(import_time_graph().values())  # it did read the imports
    assert_no_circle(import_time_graph())


def test_no_circles_even_through_lazy_and_type_only_imports() -> None:
    """Stricter: every import counts (inside functions and under `if TYPE_CHECKING:` too), so
    no two files depend on each other in any way."""
    assert_no_circle({m: {d for d in deps if d in graph()} for m, deps in graph().items()})


LAYERS = (
    ("pdcli.entry",),
    ("pdcli.cli",),
    ("pdcli.commands",),
    ("pdcli.steps",),
    ("pdcli.probe",),
    ("pdcli.report", "pdcli.testing"),
    ("pdcli.runtime",),
    ("pdcli.planner", "pdcli.compiler"),
    ("pdcli.profiler", "pdcli.data"),
    ("pdcli.torchutil", "pdcli.models", "pdcli.share"),
    ("pdcli.config",),
    ("pdcli.schedule",),
    ("pdcli.rundir",),
    ("pdcli.errors", "pdcli.host", "pdcli.markers", "pdcli.progress"),
)
"""docs/architecture.md's "How the code is laid out", top to bottom; packages of one layer do not import
each other."""


def layer_of(module: str) -> int:
    """The index in LAYERS of `module`'s package; -1 when LAYERS does not place it."""
    return next((i for i, packages in enumerate(LAYERS) if any(in_package(module, p) for p in packages)), -1)


def test_packages_import_only_the_layers_below_them() -> None:
    modules = [m for m in graph() if m != "pdcli"]
    unplaced = sorted(m for m in modules if layer_of(m) < 0)
    assert not unplaced, f"place these in LAYERS and docs/architecture.md: {unplaced}"
    wrong = sorted(f"{m} -> {d}" for m in modules for d in graph()[m] if d.startswith("pdcli.") and (
        layer_of(d) < layer_of(m) or layer_of(d) == layer_of(m) and d.split(".")[1] != m.split(".")[1]))
    assert not wrong, wrong
