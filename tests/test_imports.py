"""No import circles between the package's modules, not even through ``if TYPE_CHECKING:`` or function-level imports.

Every module is parsed with ``ast`` (nothing is imported); each ``import`` statement anywhere in it is an edge to the
package module it names: relative imports resolved against the module's package, ``from pkg import name`` to the
module ``pkg.name`` when there is one, else to ``pkg``. A package's ``__init__`` is an edge only where a module
names it: the root package's ``__init__`` loads its exports on first use (PEP 562) and would otherwise sit in every
circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_datastates

PACKAGE_DIR = Path(lightning_datastates.__file__).resolve().parent


def package_modules(package_dir: Path) -> dict[str, Path]:
    """Every module of the package in ``package_dir``, by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package_dir.name, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module ``name`` (at ``path``) imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {module for module in found if module in modules and module != name}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module name -> the package modules it imports."""
    modules = package_modules(package_dir)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``; None when there is none."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            target = next(stack[-1], None)
            if target is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target in done:
                continue
            path.append(target)
            on_path.add(target)
            stack.append(iter(sorted(graph.get(target, ()))))
    return None


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph(PACKAGE_DIR)
    assert "lightning_datastates.plugin" in graph and "lightning_datastates.compat.torch" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_a_circle_through_type_checking_and_relative_imports_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")  # `from package import module`: an edge to the module
    (package / "sub" / "b.py").write_text("from . import c\n")  # relative
    (package / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import Thing\n"
    )
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (package / "sub" / "c.py").write_text("import pkg.sub.b\n")
    assert find_cycle(import_graph(package)) == ["pkg.sub.b", "pkg.sub.c", "pkg.sub.b"]
    (package / "sub" / "c.py").write_text("def late():\n    import json\n")
    assert find_cycle(import_graph(package)) is None
