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
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "FF_MODULES_OUT": str(out), "PYTHONPATH": path}
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
    "bad-config-dir": (("--config-dir", "/nonexistent-ff"), 2, "/nonexistent-ff"),
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
    from orchestrator.profile.platform import no_gpu_possible

    if not no_gpu_possible():
        pytest.skip("a GPU may be visible: the rule book asks torch how many")
    rc, err, loaded = _run(tmp_path, "orchestrator", "mem_pool=INTRA_NODE_NVLINK")
    assert rc == 2 and "no CUDA device is visible" in err, err
    assert not loaded & set(HEAVY), sorted(loaded)


def test_doctor_config_checks_without_heavy_imports(tmp_path: Path) -> None:
    from orchestrator.profile.platform import no_gpu_possible

    rc, err, loaded = _run(tmp_path, "orchestrator.doctor", "workload.requets=1")
    assert rc == 2 and "did you mean workload.requests" in err, err
    assert not loaded & set(HEAVY), sorted(loaded)
    rc, err, loaded = _run(tmp_path, "orchestrator.doctor", "--json")
    assert rc in (0, 1), err  # 1: a FAIL on this machine, still a full report
    # doctor checks `import mooncake.engine` in a child process, never in itself
    assert not loaded & {"mooncake", "matplotlib"}, sorted(loaded)
    if no_gpu_possible():
        assert "torch" not in loaded


# ---- start-up deadlines that measure progress (runner._await) --------------------------------
class _Clock:
    """The runner's clock, moved on by `step` seconds at every reading."""

    def __init__(self, step: float) -> None:
        self.t, self.step = 1000.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


class _Pipe:
    """A child's end as the runner reads it: `msgs` in order, one at every `every`-th look,
    then nothing."""

    def __init__(self, msgs: list, every: int = 1) -> None:
        self.msgs, self.every, self.looks = list(msgs), every, 0

    def poll(self, _timeout: float = 0.0) -> bool:
        self.looks += 1
        return bool(self.msgs) and self.looks % self.every == 0

    def recv(self):
        return self.msgs.pop(0)


class _Child:
    def __init__(self, alive: bool = True, exitcode=None) -> None:
        self.alive, self.exitcode, self.pid = alive, exitcode, None

    def is_alive(self) -> bool:
        return self.alive

    def join(self, _timeout: float = 0.0) -> None:
        pass


def _job(tmp_path: Path):
    from orchestrator.job.runner import Job
    from orchestrator.job.specs import build_specs
    from orchestrator.profile.plan import Platform

    from .conftest import plan_of, typed_cfg

    cfg = typed_cfg()
    return Job(build_specs(cfg, plan_of(cfg, Platform())), tmp_path, secret=b"s" * 32)


def _proc(msgs: list, alive: bool = True, exitcode=None, every: int = 1):
    from orchestrator.job import protocol
    from orchestrator.job.runner import _Proc

    return _Proc("prefill", _Child(alive, exitcode), protocol.Channel(_Pipe(msgs, every)), "prefill", 0)


def test_startup_timeout_bounds_a_phase_without_progress_not_their_sum(tmp_path, monkeypatch):
    """Seven phases of about 0.5 s each (3 s and more in all) with endpoints.startup_timeout_s=1:
    the child is not dead, the run goes on. The clock is the runner's own, moved on 0.1 s at
    every reading; a phase ends at every 5th look at the pipe."""
    from orchestrator.job import protocol, runner

    job = _job(tmp_path)
    clock = _Clock(0.1)
    monkeypatch.setattr(runner, "_clock", clock)
    phases = ["interpreter", "imports", "buffers", "engine", "warm-up", "waiting", "bootstrap"]
    p = _proc([protocol.Started(phase=ph, at=float(i)) for i, ph in enumerate(phases)] + [protocol.Up("zmq-tcp")],
              every=5)
    got = []
    job._await([p], 1.0, "while starting", "did not start", lambda proc, msg: got.append(msg))
    assert clock.t - 1000.0 > 3.0  # three times the timeout went by in all
    assert got == [protocol.Up("zmq-tcp")] and list(p.phases) == phases


def test_a_child_without_progress_is_late_and_a_dead_one_is_found_at_once(tmp_path, monkeypatch):
    from orchestrator.job import protocol, runner
    from orchestrator.job.lifecycle import RunFailed

    job = _job(tmp_path)
    clock = _Clock(0.05)
    monkeypatch.setattr(runner, "_clock", clock)
    silent = _proc([protocol.Started(phase="interpreter", at=0.0)])  # then nothing
    with pytest.raises(RunFailed, match="prefill did not start"):
        job._await([silent], 1.0, "while starting", "did not start", lambda proc, msg: None)
    assert 1.0 < clock.t - 1000.0 < 1.5  # a phase's bound after its last progress, not later
    clock.t = 1000.0
    dead = _proc([], alive=False, exitcode=-9)
    with pytest.raises(RunFailed, match="prefill exited with code -9 while starting"):
        job._await([dead], 60.0, "while starting", "did not start", lambda proc, msg: None)
    assert clock.t - 1000.0 < 1.0  # found at the first look, not at the timeout


_SIGNAL_IN_THE_WINDOW = '''
import os, signal, sys
from orchestrator.job import warmstart

launch = warmstart._ensure_running


def hooked(forkserver):  # the Ctrl-C lands while the forkserver is being forked and exec'd
    os.kill(os.getpid(), signal.SIGINT)
    launch(forkserver)


warmstart._ensure_running = hooked
try:
    warmstart.start_early()
    outcome = "lost"
except KeyboardInterrupt:
    outcome = "interrupted"
from multiprocessing import forkserver

pid = forkserver._forkserver._forkserver_pid
warmstart.wait_ready(120)
status = {line.split(":")[0]: int(line.split()[1], 16) for line in open(f"/proc/{pid}/status")
          if line.startswith(("SigBlk:", "SigIgn:"))}
both = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
print(outcome, status["SigBlk"] & both, status["SigIgn"] & both == both)
'''


def test_a_ctrl_c_while_the_forkserver_starts_is_not_lost(tmp_path: Path) -> None:
    """A SIGINT that arrives while the forkserver is forked reaches the command once it is up
    (blocked there, never ignored: it stays pending), and the forkserver does not keep the mask
    (its children could not be stopped) but ignores both, as before. The signal is sent by a hook inside the
    window, never by timing (issue 37's loaded suite lost one: a run went on and exited 0)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_IN_THE_WINDOW], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["interrupted", "0", "True"], proc.stdout + proc.stderr
