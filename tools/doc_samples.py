"""Regenerate (or check) what README.md and docs/*.md show of the tools' output:

- every console sample: a fenced block of `$ COMMAND` lines, each followed by what it
  printed. The command runs here (in a scratch dir where `docs/` is this checkout's, with
  `python` this interpreter) and its output replaces the old one. A sample holding a `...`
  line is an excerpt: each line shown is replaced by the new line of the same shape, in
  order. A block right under `<!-- sample: not regenerated (why) -->` is left alone (another
  machine's output, a file that is not in the repo);
- every generated table: the text between `<!-- generated: NAME -->` and
  `<!-- end generated -->` (NAME: summary columns, docs/sweeps.md, from
  orchestrator/sweep/columns.py; layout, CONTRIBUTING.md, from the tree: tools/layout_table.py).

`--check` writes nothing and exits 1 where a sample's shape (its lines, their words and
keys; numbers, paths and times aside) or a table differs from what the tools give now.

    python tools/doc_samples.py [--check] [FILE.md ...]   (default: README.md CONTRIBUTING.md docs/*.md)
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
SKIP = "<!-- sample: not regenerated"
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = re.compile(r"<!-- generated: (.+?) -->\n(.*?)\n<!-- end generated -->", re.S)


def tables() -> dict[str, Callable[[], str]]:
    from orchestrator.sweep.columns import column_table

    if str(ROOT) not in sys.path:  # run as a script: tools/ is on the path, the checkout is not
        sys.path.insert(0, str(ROOT))
    from tools.layout_table import table as layout_table

    return {"summary columns": column_table, "layout": layout_table}


_MASKS = [
    (re.compile(r"(?<![\w.])(\.venv|/[\w.+-]+)(/[\w.+-]+)+"), "<path>"),  # a machine's own paths
    (re.compile(r"outputs/[\w./-]+|\br\d+\b"), "<dir>"),
    (re.compile(r"\b\d{4}-\d\d-\d\d[T ]?[\d:.-]*Z?"), "<time>"),
    (re.compile(r"pid:\[\d+\]"), "pid:[#]"),
    (re.compile(r"\b[0-9a-f]{7,40}\b"), "<hex>"),
    # a number: digits, thousands grouped by commas (1,234), a fraction, an exponent; the comma
    # after a whole number is text (`prefill 8, decode 9`), not part of it
    (re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?"), "#"),
]


def shape(line: str) -> str:
    """A line without what changes from run to run: numbers, paths, times, hashes."""
    for pattern, repl in _MASKS:
        line = pattern.sub(repl, line)
    return " ".join(line.split())


@dataclass
class Sample:
    path: Path
    command: str  # after "$ "
    start: int  # index of the "$" line in the file's lines
    end: int  # index after its last output line
    output: list[str]  # as the doc shows it (an "(exit N)" line included)
    skip: bool

    @property
    def excerpt(self) -> bool:
        return any(hidden(x) is not None for x in self.output)


_HIDDEN = re.compile(r"\.\.\.(?: (\d+) lines? \.\.\.)?")


def hidden(line: str) -> Optional[int]:
    """A sample's line that stands for lines left out: `... 19 lines ...` (how many), or a
    bare `...` (-1: not said; regenerating says it); None for any other line."""
    m = _HIDDEN.fullmatch(line.strip())
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else -1


def _indented(old: str, new: str) -> str:
    return old[:_indent(old)] + new


def hidden_line(n: int) -> str:
    return f"... {n} line{'' if n == 1 else 's'} ..."


def samples(path: Path, text: Optional[str] = None) -> list[Sample]:
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[Sample] = []
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    for i, end in zip(fences[::2], fences[1::2]):
        if lines[i].strip() != "```":
            continue  # a block with a language: code, not a console
        skip = any(lines[k].startswith(SKIP) for k in range(max(0, i - 2), i))
        prompts = [k for k in range(i + 1, end) if lines[k].startswith("$ ")]
        for n, k in enumerate(prompts):
            stop = prompts[n + 1] if n + 1 < len(prompts) else end
            out.append(Sample(path, lines[k][2:], k, stop, lines[k + 1:stop], skip))
    return out


def run(command: str) -> tuple[list[str], int]:
    """The command's output (stdout and stderr as a terminal shows them) and exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "docs").symlink_to(ROOT / "docs")
        bin_dir = work / ".bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "python"  # a script, not a link: a venv's python finds its venv by its path
        wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        wrapper.chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
               "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":")}
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600)
    venv = str(Path(sys.prefix))  # this machine's paths are not the docs' business
    return [x.replace(venv, ".venv").replace(str(ROOT), ".") for x in proc.stdout.splitlines()], proc.returncode


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def regenerate(sample: Sample, fresh: list[str], code: int) -> list[str]:
    """The sample's new output lines (the blank lines that end it kept: a separator before
    the block's next command)."""
    body = list(sample.output)
    trail = []
    while body and not body[-1].strip():
        trail.append(body.pop())
    return _regenerate(sample, body, fresh, code) + trail


def _regenerate(sample: Sample, shown: list[str], fresh: list[str], code: int) -> list[str]:
    if sample.excerpt:
        out, at, gap = [], 0, None  # gap: the index in `out` of a hidden-lines line after the last hit
        for line in shown:
            if hidden(line) is not None:
                out.append(line)
                gap = (len(out) - 1, at)
                continue
            hit = next((j for j in range(at, len(fresh)) if _indent(fresh[j]) == _indent(line)
                        and shape(fresh[j]) == shape(line)), None)
            if hit is None:  # nearest by its first words
                key = " ".join(line.split()[:2])
                hit = next((j for j in range(at, len(fresh)) if " ".join(fresh[j].split()[:2]) == key), None)
            if hit is None:
                out.append(line)
                continue
            if gap is not None:  # the lines it hides: from the last hit to this one
                out[gap[0]] = _indented(out[gap[0]], hidden_line(hit - gap[1]))
                gap = None
            out.append(fresh[hit])
            at = hit + 1
        if gap is not None:
            out[gap[0]] = _indented(out[gap[0]], hidden_line(len(fresh) - gap[1]))
        return out
    exit_line = [f"(exit {code})"] if any(x.startswith("(exit ") for x in shown) else []
    return fresh + exit_line


def differences(sample: Sample, fresh: list[str], code: int) -> list[str]:
    """Where the doc's sample and the fresh output differ in shape."""
    want = [shape(x) for x in regenerate(sample, fresh, code)]
    have = [shape(x) for x in sample.output]
    if want == have:
        return []
    return [f"{sample.path.relative_to(ROOT)}:{sample.start + 1}: $ {sample.command}"] + [
        f"  doc: {h}\n  now: {w}" for h, w in zip(have + [""] * len(want), want + [""] * len(have))
        if h != w][:6]


def _tables(path: Path, text: str, gen: dict[str, Callable[[], str]], problems: list[str]) -> str:
    """The text with every generated table as the code gives it now (a difference noted)."""

    def table(m: re.Match) -> str:
        name = m.group(1)
        if name not in gen:
            problems.append(f"{path.relative_to(ROOT)}: no generator for table {name!r}")
            return m.group(0)
        body = gen[name]()
        if body != m.group(2):
            problems.append(f"{path.relative_to(ROOT)}: table {name!r} differs from what the code writes")
        return f"<!-- generated: {name} -->\n{body}\n<!-- end generated -->"

    return GENERATED.sub(table, text)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 on a difference")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args(argv)
    files = [f.resolve() for f in args.files] or DOCS
    problems: list[str] = []
    gen = tables()
    for path in files:
        text = _tables(path, path.read_text(), gen, problems)
        lines = text.splitlines()
        for sample in reversed(samples(path, text)):
            if sample.skip:
                continue
            print(f"$ {sample.command}", file=sys.stderr, flush=True)
            fresh, code = run(sample.command)
            problems += differences(sample, fresh, code)
            lines[sample.start + 1:sample.end] = regenerate(sample, fresh, code)
        if not args.check:
            path.write_text("\n".join(lines) + "\n")
    for p in problems:
        print(p)
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
