"""tools/call_trace.py: the functions of a spec are wrapped in every process the command
starts (a forked child, one that leaves by os._exit, included), each call recorded once, and
the report reads them back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "call_trace.py"

SCRIPT = """
import os, sys
sys.path.insert(0, {here!r})
import traced_mod
a = traced_mod.A()
for _ in range(5):
    a.f()
traced_mod.g()
pid = os.fork()
if pid == 0:
    for _ in range(3):
        a.f()
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_calls_are_recorded_in_parent_and_forked_child(tmp_path: Path) -> None:
    (tmp_path / "traced_mod.py").write_text(
        "class A:\n    def f(self):\n        return 1\n\ndef g():\n    return 2\n\ndef untouched():\n    return 3\n")
    (tmp_path / "script.py").write_text(SCRIPT.format(here=str(tmp_path)))
    out = tmp_path / "trace"
    rc = subprocess.call([sys.executable, str(TOOL), "run", str(out), "--spec", "traced_mod:A.f,traced_mod:g", "--",
                          sys.executable, str(tmp_path / "script.py")])
    assert rc == 0
    files = [json.loads(p.read_text()) for p in out.glob("*.json")]
    counts = sorted(len(f["calls"]) for f in files)
    assert counts == [3, 6], counts  # the child's 3 calls of f; the parent's 5 and g's one
    parent = next(f for f in files if len(f["calls"]) == 6)
    assert parent["names"] == ["traced_mod:A.f", "traced_mod:g"]
    assert all(t1 >= t0 for _, _, t0, t1 in parent["calls"])
    report = subprocess.run([sys.executable, str(TOOL), "report", str(out), "--anchor", "traced_mod:A.f",
                             "--skip", "0"], capture_output=True, text=True, check=True).stdout
    assert "A.f" in report and "the median handoff" in report


def test_a_bad_command_line_says_how() -> None:
    done = subprocess.run([sys.executable, str(TOOL), "run", "x"], capture_output=True, text=True)
    assert done.returncode == 2 and "call_trace.py run OUT" in done.stdout
