"""The code's shape in figures: import cycles among orchestrator's modules, functions over 60
lines, classes that set more than 25 attributes (self.x assignments, or a dataclass's fields),
and the house's goal figures (issue 29): modules at the package root, ``msg["..."]`` reads
outside the wire module, functions taking the whole config (a parameter annotated
``OrchestratorConfig``, outside the schema module that builds it), class names defined twice,
``Any`` on the hot path (fields of the classes in handoff/endpoints, handoff/backends and
handoff/faults annotated ``Any``), dict/Any fields in wire and pipe messages (issue 38: a field
of a class of the wire's or the pipe's modules, or of the objects they carry, annotated dict,
Mapping or Any, or a bare list/tuple/set), the largest endpoint module in lines; and the floors
(issue 38): arrows up (an import from a lower floor to a higher one, floors profile < results <
handoff < job < sweep = preflight < the package root's entry modules) and handoff/'s imports of
profile.config. Also how many functions and classes sit within 10% of each limit (54-60 lines,
23-25 attributes).
Reads the source only (ast), runs nothing.

    python tools/code_figures.py [ROOT]      # ROOT: the repository (default: this one)
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

MAX_LINES, MAX_ATTRS = 60, 25
NEAR = 0.9  # within 10% of a limit: at or above this share of it, rounded up (54 lines, 23 attributes)


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


def _measured(pkg_root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Every function with its lines and every class with its attributes: ("file:line name", n)."""
    fns, classes = [], []
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(pkg_root.parent)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                fns.append((f"{rel}:{node.lineno} {node.name}", (node.end_lineno or node.lineno) - node.lineno + 1))
            elif isinstance(node, ast.ClassDef):
                classes.append((f"{rel}:{node.lineno} {node.name}", len(_attrs(node))))
    return fns, classes


def _between(items: list[tuple[str, int]], low: float, high: float) -> list[tuple[str, int]]:
    return sorted(((name, n) for name, n in items if low <= n <= high), key=lambda x: -x[1])


def shapes(pkg_root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Functions over MAX_LINES lines, classes over MAX_ATTRS attributes (largest first)."""
    fns, classes = _measured(pkg_root)
    return _between(fns, MAX_LINES + 1, float("inf")), _between(classes, MAX_ATTRS + 1, float("inf"))


def near_limits(pkg_root: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Functions and classes within 10% of their limit, the limit included (54-60 lines, 23-25
    attributes): a limit is a warning, not a target."""
    fns, classes = _measured(pkg_root)
    return _between(fns, _near(MAX_LINES), MAX_LINES), _between(classes, _near(MAX_ATTRS), MAX_ATTRS)


def _near(limit: int) -> int:
    return math.ceil(NEAR * limit)


WIRE = Path("handoff/transport/wire.py")  # the one module that may read a control message by key
HOT = (Path("handoff/endpoints"), Path("handoff/backends"), Path("handoff/faults.py"))  # the hot path's classes
ENDPOINTS = Path("handoff/endpoints")
WHOLE_CONFIG = "OrchestratorConfig"
SCHEMA = Path("profile/config.py")  # builds the config: its own functions are not counted as taking it


def _trees(pkg_root: Path) -> list[tuple[Path, ast.Module]]:
    """(path relative to the package, its tree) for every module, sorted."""
    return [(p.relative_to(pkg_root), ast.parse(p.read_text())) for p in sorted(pkg_root.rglob("*.py"))]


def _names(node: ast.AST | None) -> set[str]:
    """The names an annotation mentions (a string annotation is parsed first)."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval")
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def msg_reads(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """msg["key"] reads (a subscript of a name `msg` by a string) outside the wire module."""
    out: list[tuple[str, int, str]] = []
    for rel, tree in trees:
        if rel == WIRE:
            continue
        for n in ast.walk(tree):
            if (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id == "msg"
                    and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)):
                out.append((str(rel), n.lineno, f"msg[{n.slice.value!r}]"))
    return [f"{r}:{line} {what}" for r, line, what in sorted(out)]


def _is_config(node: ast.AST | None) -> bool:
    """An annotation that is the whole config: OrchestratorConfig, alone or in a union or an
    Optional (a Callable returning one is a loader, not the config)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(node, ast.Name):
        return node.id == WHOLE_CONFIG
    if isinstance(node, ast.Attribute):
        return node.attr == WHOLE_CONFIG
    if isinstance(node, ast.BinOp):
        return _is_config(node.left) or _is_config(node.right)
    if isinstance(node, ast.Subscript) and _names(node.value) & {"Optional", "Union"}:
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(_is_config(e) for e in elts)
    return False


def whole_config(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """Functions (and methods) with a parameter annotated OrchestratorConfig, outside the schema."""
    out: list[tuple[str, int, str]] = []
    for rel, tree in trees:
        if rel == SCHEMA:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = n.args
                params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p]
                if any(_is_config(p.annotation) for p in params):
                    out.append((str(rel), n.lineno, n.name))
    return [f"{r}:{line} {name}" for r, line, name in sorted(out)]


def twice_defined(trees: list[tuple[Path, ast.Module]]) -> dict[str, list[str]]:
    """Class names defined more than once in the package -> where."""
    where: dict[str, list[str]] = {}
    for rel, tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                where.setdefault(n.name, []).append(f"{rel}:{n.lineno}")
    return {k: v for k, v in sorted(where.items()) if len(v) > 1}


def hot_any(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """Fields of the hot path's classes annotated with Any (class-level `x: Any` or `self.x: Any`)."""
    out = []
    for rel, tree in trees:
        if not any(rel == h or h in rel.parents for h in HOT):
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in ast.walk(cls):
                if isinstance(n, ast.AnnAssign) and "Any" in _names(n.annotation):
                    t = n.target
                    name = t.id if isinstance(t, ast.Name) else ast.unparse(t)
                    out.append(f"{rel}:{n.lineno} {cls.name}.{name.removeprefix('self.')}")
    return sorted(set(out))


FLOORS = {"profile": 0, "results": 1, "handoff": 2, "job": 3, "sweep": 4, "preflight": 4}
ENTRY = 5  # the package root's modules (__main__, bench, doctor, ...): the top floor
CONFIG_MODULE = "orchestrator.profile.config"


def floor(mod: str) -> int:
    """A module's floor: its folder's (FLOORS), or the entry modules' at the package root."""
    parts = mod.split(".")
    return FLOORS.get(parts[1], ENTRY) if len(parts) > 1 else ENTRY


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower floor to a higher one (imports(): lazy ones and TYPE_CHECKING's too)."""
    return [f"{m} -> {t}" for m in sorted(graph) for t in sorted(graph[m]) if floor(t) > floor(m)]


def config_imports(trees: list[tuple[Path, ast.Module]], under: Path = Path("handoff")) -> list[str]:
    """Import statements of orchestrator.profile.config under `under`: "file:line names"."""
    out: list[tuple[str, int, str]] = []
    for rel, tree in trees:
        if under not in rel.parents:
            continue
        mod = ".".join(("orchestrator",) + rel.with_suffix("").parts)
        for n in ast.walk(tree):
            names: list[str] = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names if a.name == CONFIG_MODULE]
            elif isinstance(n, ast.ImportFrom):
                target = _resolve(mod, rel.name == "__init__.py", n)
                if target == CONFIG_MODULE:
                    names = [a.name for a in n.names]
                elif target == CONFIG_MODULE.rpartition(".")[0]:
                    names = [a.name for a in n.names if a.name == "config"]
            if names:
                out.append((str(rel), n.lineno, ", ".join(names)))
    return [f"{r}:{line} {what}" for r, line, what in sorted(out)]


MESSAGES = (Path("handoff/transport/wire.py"), Path("handoff/transport/advert.py"), Path("job/protocol.py"),
            Path("handoff/endpoints/control.py"),  # the pipe's messages the endpoints send or match
            Path("profile/versions.py"))  # the wire's and the pipe's messages, and what they carry
LOOSE = {"dict", "Dict", "Mapping", "MutableMapping", "Any"}
BARE = {"list", "tuple", "set", "frozenset", "List", "Tuple", "Set"}


def _loose(node: ast.AST) -> bool:
    """An annotation that leaves a message's shape open: it names dict, Mapping or Any, or
    holds a container without its item type."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return True
    if _names(node) & LOOSE:
        return True
    typed = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Subscript)}
    return any(isinstance(n, ast.Name) and n.id in BARE and id(n) not in typed for n in ast.walk(node))


def loose_fields(trees: list[tuple[Path, ast.Module]]) -> list[str]:
    """Fields (class-level annotations, ClassVar aside) of the message modules' classes that
    are typed dict, Mapping or Any, or a bare container."""
    out: list[tuple[str, int, str]] = []
    for rel, tree in trees:
        if rel not in MESSAGES:
            continue
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for n in cls.body:
                if (isinstance(n, ast.AnnAssign) and "ClassVar" not in _names(n.annotation)
                        and _loose(n.annotation)):
                    out.append((str(rel), n.lineno, f"{cls.name}.{ast.unparse(n.target)}: {ast.unparse(n.annotation)}"))
    return [f"{r}:{line} {what}" for r, line, what in sorted(out)]


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
    near_fns, near_classes = near_limits(pkg)
    print(f"functions within 10% of {MAX_LINES} lines ({_near(MAX_LINES)}-{MAX_LINES}): {len(near_fns)}")
    for name, n in near_fns:
        print(f"  {n:4d}  {name}")
    print(f"classes within 10% of {MAX_ATTRS} attributes ({_near(MAX_ATTRS)}-{MAX_ATTRS}): {len(near_classes)}")
    for name, n in near_classes:
        print(f"  {n:4d}  {name}")

    trees = _trees(pkg)
    root_mods = sorted(p.name for p in pkg.glob("*.py"))
    print(f"modules at the package root: {len(root_mods)} ({', '.join(root_mods)})")
    reads = msg_reads(trees)
    print(f'msg["..."] reads outside the wire module: {len(reads)} '
          f"(on {len({r.split(' ')[0] for r in reads})} lines)")
    for r in reads:
        print("  ", r)
    whole = whole_config(trees)
    print(f"functions taking the whole config ({WHOLE_CONFIG}, outside {SCHEMA}): {len(whole)} "
          f"in {len({w.split(':')[0] for w in whole})} files")
    for w in whole:
        print("  ", w)
    twice = twice_defined(trees)
    print(f"class names defined twice: {len(twice)}")
    for name, at in twice.items():
        print(f"   {name}: {', '.join(at)}")
    anys = hot_any(trees)
    print(f"Any on the hot path: {len(anys)}")
    for a in anys:
        print("  ", a)
    loose = loose_fields(trees)
    print(f"dict/Any fields in wire and pipe messages: {len(loose)}")
    for f in loose:
        print("  ", f)
    sizes = sorted(((len(p.read_text().splitlines()), p.relative_to(pkg)) for p in (pkg / ENDPOINTS).rglob("*.py")),
                   reverse=True)
    if sizes:
        print(f"largest endpoint module: {sizes[0][0]} lines ({sizes[0][1]})")
    up = arrows_up(graph)
    print(f"arrows up (a lower floor importing a higher one): {len(up)}")
    for a in up:
        print("  ", a)
    cfg = config_imports(trees)
    names = sorted({n for c in cfg for n in c.split(" ", 1)[1].split(", ")})
    print(f"handoff/ imports of profile.config: {len(cfg)} in {len({c.split(':')[0] for c in cfg})} files "
          f"({len(names)} names: {', '.join(names)})")
    for c in cfg:
        print("  ", c)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
