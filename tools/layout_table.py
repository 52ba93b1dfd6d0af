"""The package layout table of CONTRIBUTING.md, generated from the tree: one row per folder of
orchestrator/ (in data-path order: profile -> handoff -> results, preflight and sweep beside),
what its package docstring says it holds, and every module in it. A module added or removed
changes the table; tests/test_docs.py fails until it is regenerated:

    python tools/layout_table.py           (rewrites the table in CONTRIBUTING.md)
    python tools/layout_table.py --check   (exit 1 when it is not current)

The table sits between `<!-- generated: layout -->` and `<!-- end generated -->`, the markers
tools/doc_samples.py regenerates too.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "orchestrator"
DOC = ROOT / "CONTRIBUTING.md"
NAME = "layout"
ORDER = ["", "profile", "handoff", "handoff/transport", "handoff/backends", "handoff/backends/mooncake",
         "handoff/backends/zmq", "handoff/endpoints", "results", "preflight", "sweep"]


def _summary(init: Path) -> str:
    """The first sentence of a package's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    end = text.find(". ")
    return (text[:end + 1] if end >= 0 else text).replace("|", "\\|")


def _folders() -> list[Path]:
    found = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)
    rel = {str(p.relative_to(PACKAGE)).replace(".", ""): p for p in found}
    known = [rel[k] for k in ORDER if k in rel]
    return known + [p for k, p in sorted(rel.items()) if k not in ORDER]  # a new folder: last


def table() -> str:
    rows = ["| folder | what it holds | modules |", "|---|---|---|"]
    for folder in _folders():
        name = "orchestrator/" + (f"{folder.relative_to(PACKAGE)}/" if folder != PACKAGE else "")
        modules = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
        rows.append(f"| `{name}` | {_summary(folder / '__init__.py')} | "
                    + ", ".join(f"`{m}`" for m in modules) + " |")
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the table is not current")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tools.doc_samples import _tables

    problems: list[str] = []
    text = DOC.read_text()
    new = _tables(DOC, text, {NAME: table}, problems)
    if f"<!-- generated: {NAME} -->" not in text:
        print(f"{DOC.name}: no <!-- generated: {NAME} --> marker", file=sys.stderr)
        return 1
    if args.check:
        for p in problems:
            print(p)
        return 1 if problems else 0
    if new != text:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
