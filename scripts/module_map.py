"""The package's import structure, read from the code: which subpackage imports which, and any import circle.

    .venv/bin/python scripts/module_map.py            # the Mermaid graph of subpackages (docs/architecture.md)
    .venv/bin/python scripts/module_map.py --cycles   # every circle of modules (imports inside functions count too)

Every ``import``/``from ... import`` of a ``ragen`` module counts, at module level or inside a function: a function
that imports lazily still ties the two modules together. ``TYPE_CHECKING`` blocks do not count (they never run).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ragen"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The ``ragen`` modules ``path`` imports (resolved to modules that exist)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` imports the submodule; `from mod import name` the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.startswith("ragen") and name != me:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): imports_of(f, modules) for f in files}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "(top)"


def mermaid(edges: dict[str, set[str]]) -> str:
    """Subpackages as nodes, an arrow where any module of one imports a module of the other."""
    links: set[tuple[str, str]] = set()
    for src, targets in edges.items():
        for dst in targets:
            a, b = subpackage(src), subpackage(dst)
            if a != b and "(top)" not in (a, b):
                links.add((a, b))
    lines = ["```mermaid", "graph LR"]
    lines += [f"    {a} --> {b}" for a, b in sorted(links)]
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", action="store_true", help="list import circles (exit 1 if any)")
    args = ap.parse_args(argv)
    edges = graph()
    if args.cycles:
        found = cycles(edges)
        for component in found:
            print(" <-> ".join(component))
        print(f"{len(found)} import circle(s) among {len(edges)} modules")
        return 1 if found else 0
    print(mermaid(edges))
    return 0


if __name__ == "__main__":
    sys.exit(main())
