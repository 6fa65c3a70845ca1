"""The code's layout (README "How the code is laid out"): which packages import which, read
statically from every `import` in `pdcli/`, those inside functions included."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

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
