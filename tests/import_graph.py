"""The import graph of our own code (pipelines/, stages/), read from the source with `ast`, not by importing.

Every `import` counts, at module level or inside a function: a lazy import still runs when that code does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGES = ("pipelines", "stages")


def module_file(module: str) -> Path | None:
    """The file of a module of ours (`pipelines.params` -> pipelines/params/__init__.py), else None."""
    base = REPO_ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_name(path: Path) -> str:
    """`pipelines/params/__init__.py` -> `pipelines.params`."""
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> list[str]:
    """Every module of ours."""
    return sorted(module_name(p) for package in PACKAGES for p in (REPO_ROOT / package).rglob("*.py"))


@cache
def parsed(module: str) -> ast.Module:
    """The syntax tree of one of our modules."""
    path = module_file(module)
    assert path is not None, module
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, except those under `if TYPE_CHECKING:` (imports for type hints only never run)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", "")) == "TYPE_CHECKING":
            yield from (n for stmt in child.orelse for n in ast.walk(stmt))
            continue
        yield child
        yield from _runtime_nodes(child)


@cache
def imports_of(module: str) -> frozenset[str]:
    """The modules of ours that `module` names in an import statement (`from a import b`: a.b if a module)."""
    found: set[str] = set()
    is_package = module_file(module).name == "__init__.py"
    for node in _runtime_nodes(parsed(module)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if _ours(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            if not _ours(base):
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if module_file(child) else base)
    if module == "pipelines.tasks":  # get_task imports the registry's modules by name (importlib)
        from pipelines.task_registry import TASKS

        found.update(target.partition(":")[0] for target in TASKS.values())
    return frozenset(m for m in found if module_file(m) and m != module)


def _with_parents(module: str) -> Iterator[str]:
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def closure(roots: Iterable[str]) -> set[str]:
    """Every module of ours that running `roots` can import, the packages' __init__ files included."""
    seen: set[str] = set()
    todo = [parent for root in roots for parent in _with_parents(root)]
    while todo:
        module = todo.pop()
        if module in seen or not module_file(module):
            continue
        seen.add(module)
        todo += [parent for m in imports_of(module) for parent in _with_parents(m)]
    return seen


def cycles() -> list[list[str]]:
    """The import circles among our modules (strongly connected components of more than one module)."""
    graph = {m: sorted(imports_of(m)) for m in all_modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return found
