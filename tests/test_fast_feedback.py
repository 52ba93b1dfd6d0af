"""Fast feedback (issue 37): --help, --cfg, every kind of refusal and doctor's config check
answer before torch, Mooncake or matplotlib are imported. Each command runs in a fresh
interpreter (its entry point through runpy, as `python -m` runs it); the modules loaded when
it exits are printed by an atexit hook and read back. No timing: what is imported is the
cause of the seconds (`import torch` alone is 3 s on a loaded box)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.profile.platform import no_gpu_possible

from .conftest import ROOT

HEAVY = ("torch", "mooncake", "matplotlib", "numpy")

_WRAPPER = """
import atexit, json, os, runpy, sys
mod, out = sys.argv[1], os.environ["FF_MODULES_OUT"]
def _dump():
    with open(out, "w") as f:
        json.dump(sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r}), f)
atexit.register(_dump)
sys.argv = [mod] + sys.argv[2:]
runpy.run_module(mod, run_name="__main__", alter_sys=True)
""".format(heavy=set(HEAVY))


def _run(tmp_path: Path, module: str, *args: str) -> tuple[int, str, set[str]]:
    """(exit code, stderr, the heavy top-level packages loaded at exit)."""
    out = tmp_path / "modules.json"
    env = {**os.environ, "FF_MODULES_OUT": str(out), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, module, *args, f"hydra.run.dir={tmp_path}/run"]
                          if module == "orchestrator" and "--help" not in args
                          else [sys.executable, "-c", _WRAPPER, module, *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    loaded = {m.split(".")[0] for m in json.loads(out.read_text())}
    return proc.returncode, proc.stderr, loaded


# (arguments, exit code, a word of the one line it prints on stderr, or None)
CASES = {
    "help": (("--help",), 0, None),
    "cfg-job": (("--cfg", "job"), 0, None),
    "unknown-key": (("workload.requets=10",), 2, "did you mean workload.requests"),
    "out-of-range": (("workload.requests=0",), 2, "workload.requests=0 is not allowed"),
    "bad-enum": (("transport.route=zmq",), 2, "transport.route=zmq"),
    "ambiguous": (("endpoints.prefill_ranks=1,2",), 2, "is ambiguous"),
    "bad-config-dir": (("--config-dir", "/nonexistent-ff"), 2, "not a directory"),
    "rule-book": (("faults.kind=silent_peer", "transport.route=tcp"), 2, "need the engine route"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_entry_point_answers_without_heavy_imports(tmp_path: Path, case: str) -> None:
    args, code, says = CASES[case]
    rc, err, loaded = _run(tmp_path, "orchestrator", *args)
    assert rc == code, err
    if says is not None:
        assert says in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not loaded & set(HEAVY), f"{case} imported {sorted(loaded & set(HEAVY))}"
    assert not (tmp_path / "run").exists(), "a refusal or --help wrote a run dir"


def test_rule_book_on_this_platform_without_torch(tmp_path: Path) -> None:
    """A refusal that depends on the platform (no CUDA device here): torch is not needed to
    know there is none, where no GPU is possible (a CPU build of torch, or no NVIDIA device)."""
    if not no_gpu_possible():
        pytest.skip("a GPU may be visible: the rule book asks torch how many")
    rc, err, loaded = _run(tmp_path, "orchestrator", "mem_pool=INTRA_NODE_NVLINK")
    assert rc == 2 and "no CUDA device is visible" in err, err
    assert not loaded & set(HEAVY), sorted(loaded)


def test_doctor_config_checks_without_heavy_imports(tmp_path: Path) -> None:
    rc, err, loaded = _run(tmp_path, "orchestrator.doctor", "workload.requets=1")
    assert rc == 2 and "did you mean workload.requests" in err, err
    assert not loaded & set(HEAVY), sorted(loaded)
    rc, err, loaded = _run(tmp_path, "orchestrator.doctor", "--json")
    assert rc in (0, 1), err  # 1: a FAIL on this machine, still a full report
    # doctor checks `import mooncake.engine` in a child process, never in itself
    assert not loaded & {"mooncake", "matplotlib"}, sorted(loaded)
    if no_gpu_possible():
        assert "torch" not in loaded
