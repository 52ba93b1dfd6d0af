"""The code's shape in figures: import cycles among orchestrator's modules, functions over 60
lines, classes that set more than 25 attributes (self.x assignments, or a dataclass's fields).
Reads the source only (ast), runs nothing.

    python tools/code_figures.py [ROOT]      # ROOT: the repository (default: this one)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES, MAX_ATTRS = 60, 25


def _module(path: Path, pkg_root: Path) -> str:
    parts = list(path.relative_to(pkg_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(pkg_root: Path) -> dict[str, set[str]]:
    """module -> the orchestrator modules it imports (at any depth of the file)."""
    files = {_module(p, pkg_root): p for p in pkg_root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                names = [f"{target}.{a.name}" for a in node.names] + [target]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod and not (is_pkg and name.startswith(mod + ".")) \
                        and not files[name].name == "__init__.py":
                    graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _attrs(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for t in targets:  # self.x = ..., self.x, self.y = ...: not self.x[i] = ... (an item)
            for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    is_dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    if is_dataclass:
        names |= {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return names


def shapes(pkg_root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    long_fns, big_classes = [], []
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(pkg_root.parent)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long_fns.append((f"{rel}:{node.lineno} {node.name}", n))
            elif isinstance(node, ast.ClassDef):
                n = len(_attrs(node))
                if n > MAX_ATTRS:
                    big_classes.append((f"{rel}:{node.lineno} {node.name}", n))
    return sorted(long_fns, key=lambda x: -x[1]), sorted(big_classes, key=lambda x: -x[1])


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent
    pkg = root / "orchestrator"
    graph = imports(pkg)
    loops = cycles(graph)
    long_fns, big_classes = shapes(pkg)
    print(f"modules {len(graph)}, import edges {sum(map(len, graph.values()))}, cycles {len(loops)}")
    for c in loops:
        print("  cycle:", " <-> ".join(c))
    print(f"functions over {MAX_LINES} lines: {len(long_fns)}")
    for name, n in long_fns:
        print(f"  {n:4d}  {name}")
    print(f"classes setting over {MAX_ATTRS} attributes: {len(big_classes)}")
    for name, n in big_classes:
        print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
