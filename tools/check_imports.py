#!/usr/bin/env python3
"""Report import cycles inside a Python package (default: ``pagedllm``).

Every module of the package is parsed with ``ast`` (nothing is imported, so
optional dependencies need not be installed). Each import of the package's own
modules becomes an edge of a module graph:

- imports anywhere in the file count: module level, inside functions and
  methods, inside ``try`` blocks. A lazy import that leads back up a chain is
  still a circle, only one that bites later.
- imports under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) are left
  out: they never run, so they cannot take part in a circle at run time.
- ``from pkg.x import y`` is an edge to ``pkg.x.y`` when ``y`` is a submodule
  (or subpackage), else to ``pkg.x``. Importing a package is an edge to its
  ``__init__.py``. The parent packages that Python also initialises on the way
  (``pkg``, ``pkg.x``) are not counted: every module would then hang off the
  top-level ``__init__`` and the graph would say nothing.

Every strongly connected component with more than one module is printed with
the edges that hold it together (file:line), and the script exits 1 if there
is any, 0 otherwise.

Usage: python tools/check_imports.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# (importer, imported) -> line numbers of the import statements
Edges = dict[tuple[str, str], list[int]]


def discover(package_dir: Path) -> dict[str, Path]:
    """Map dotted module name -> file for every .py file under the package."""
    package_dir = package_dir.resolve()
    root = package_dir.parent
    modules: dict[str, Path] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(tree: ast.AST):
    """Yield every Import/ImportFrom node, skipping ``if TYPE_CHECKING:`` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def build_graph(modules: dict[str, Path]) -> Edges:
    edges: Edges = {}
    pkg = next(iter(sorted(modules, key=len))).split(".")[0]

    def add(src: str, dst: str, line: int) -> None:
        # An import of a name not among our files (a typo, or another package
        # sharing the prefix) is not our business here; the import itself fails.
        while dst not in modules and "." in dst:
            dst = dst.rsplit(".", 1)[0]
        if dst in modules and dst != src:
            edges.setdefault((src, dst), []).append(line)

    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == pkg or alias.name.startswith(pkg + "."):
                        add(name, alias.name, node.lineno)
                continue
            target = _resolve_from(name, is_package, node)
            if not target or not (target == pkg or target.startswith(pkg + ".")):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                add(name, sub if sub in modules else target, node.lineno)
    return edges


def strongly_connected(nodes: list[str], edges: Edges) -> list[list[str]]:
    """Tarjan's algorithm (iterative); returns the components with > 1 module."""
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for src, dst in edges:
        succ[src].append(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(succ[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp.append(member)
                    if member == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def find_cycles(package_dir: Path) -> list[tuple[list[str], list[tuple[str, str, list[int]]]]]:
    """Each import cycle as (modules, [(importer, imported, lines), ...])."""
    modules = discover(package_dir)
    edges = build_graph(modules)
    result = []
    for comp in strongly_connected(sorted(modules), edges):
        members = set(comp)
        inner = sorted((s, d, lines) for (s, d), lines in edges.items() if s in members and d in members)
        result.append((comp, inner))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    package_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "pagedllm"
    modules = discover(package_dir)
    cycles = find_cycles(package_dir)
    for i, (comp, inner) in enumerate(cycles, 1):
        print(f"cycle {i}: {len(comp)} modules")
        for src, dst, lines in inner:
            where = ", ".join(str(n) for n in lines)
            print(f"  {src} -> {dst}  ({modules[src].relative_to(package_dir.parent)}:{where})")
    if cycles:
        print(f"{len(cycles)} import cycle(s) in {package_dir.name}")
        return 1
    print(f"no import cycles in {package_dir.name} ({len(modules)} modules)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
