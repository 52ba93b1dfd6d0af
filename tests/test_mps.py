"""endpoints.mps: which processes share a GPU, when the run starts, joins or refuses CUDA MPS,
and the run-owned daemon's life (started, reused, stopped, and reaped when the runner is
SIGKILLed). The daemon here is a stand-in control program on PATH
(tests/helpers/fake_mps/nvidia-cuda-mps-control) that detaches a process as the real one does;
the GPU tests run the real one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import structlog

from orchestrator.job import mps
from orchestrator.job.check import check_profile
from orchestrator.job.mps import OwnDaemon, mps_for
from orchestrator.profile.config import ConfigError, MpsMode
from orchestrator.profile.plan import Platform
from orchestrator.profile.sharing import (
    MpsDaemon,
    processes_on_gpus,
    running_daemon,
    sharing_line,
    sharing_rule,
    sharing_warning,
)

ROOT = Path(__file__).resolve().parent.parent
FAKE_DIR = Path(__file__).resolve().parent / "helpers" / "fake_mps"
FAKE = str(FAKE_DIR / "nvidia-cuda-mps-control")
ONE_GPU = processes_on_gpus((0,), (0,), 1, 1)
TWO_GPUS = processes_on_gpus((0,), (1,), 1, 1)
LOG = structlog.get_logger("test")


def _planned(sharing):
    """mps_for's first two arguments: the decision and its record (a job's specs hold it)."""
    return sharing, sharing.as_dict()


def gone(pid: int) -> bool:
    """The process ended (a zombie no one reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_gone(pid: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def daemon_pid(run_dir: Path) -> int:
    """The (stand-in) daemon's pid, from its control.log as the real daemon writes it."""
    line = (run_dir / "mps" / "log" / "control.log").read_text().splitlines()[0]
    return int(line.split("Control")[1].split("]")[0])


def env_here(**more) -> dict:
    """This environment, with the checkout first on PYTHONPATH (for a child Python)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            **more}


def test_processes_on_gpus_names_them_as_the_run_does():
    assert ONE_GPU == ((0, ("prefill", "decode")),)
    assert TWO_GPUS == ((0, ("prefill",)), (1, ("decode",)))
    assert processes_on_gpus((0, 1), (0, 1, 0, 1), 2, 2) == (
        (0, ("prefill0", "decode0.0", "decode1.0")), (1, ("prefill1", "decode0.1", "decode1.1")))


@pytest.mark.parametrize("mode, gpus, control, user, daemon", [
    (MpsMode.auto, ONE_GPU, FAKE, None, MpsDaemon.own),
    (MpsMode.auto, ONE_GPU, FAKE, "/tmp/u", MpsDaemon.user),  # the user's daemon wins
    (MpsMode.auto, ONE_GPU, None, None, MpsDaemon.none),  # not on PATH: a warning, no refusal
    (MpsMode.auto, TWO_GPUS, FAKE, None, MpsDaemon.none),  # nothing shared
    (MpsMode.auto, (), FAKE, None, MpsDaemon.none),  # host buffers
    (MpsMode.on, TWO_GPUS, FAKE, None, MpsDaemon.own),
    (MpsMode.on, ONE_GPU, None, "/tmp/u", MpsDaemon.user),
    (MpsMode.off, ONE_GPU, FAKE, None, MpsDaemon.none),
    (MpsMode.off, ONE_GPU, FAKE, "/tmp/u", MpsDaemon.user),  # CUDA joins it anyway: recorded so
])
def test_sharing_rule(mode, gpus, control, user, daemon):
    s = sharing_rule(mode, gpus, control, user)
    assert s.daemon is daemon
    warn = sharing_warning(s.as_dict())
    if s.shared and daemon is MpsDaemon.none:  # one line, naming the key and the cost
        assert warn is not None and "\n" not in warn and "endpoints.mps" in warn and "time-slice" in warn
        assert sharing_line(s.as_dict()) is None
    else:
        assert warn is None
        assert (sharing_line(s.as_dict()) is not None) == (daemon is not MpsDaemon.none)


@pytest.mark.parametrize("gpus, control", [((), FAKE), (ONE_GPU, None)])
def test_on_is_refused_where_mps_cannot_be_had(gpus, control):
    with pytest.raises(ConfigError) as exc:
        sharing_rule(MpsMode.on, gpus, control, None)
    assert exc.value.key == "endpoints.mps" and "auto or off" in str(exc.value)


def test_the_rule_book_refuses_on_for_host_buffers_and_plans_auto_unchanged(cfg_factory):
    for mode in ("auto", "off"):
        plan = check_profile(cfg_factory(f"endpoints.mps={mode}"), Platform(mps_control=FAKE))
        assert plan.sharing.daemon is MpsDaemon.none and plan.as_dict()["gpu_sharing"]["gpus"] == {}
    with pytest.raises(ConfigError, match="endpoints.mps='on' is not allowed"):
        check_profile(cfg_factory("endpoints.mps=on"), Platform(mps_control=FAKE))


def test_a_running_daemon_is_found_by_its_control_pipe(tmp_path):
    assert running_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, os.path.exists) is None
    (tmp_path / "control").touch()
    assert running_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, os.path.exists) == str(tmp_path)


def test_own_daemon_starts_in_the_run_dir_and_stops(tmp_path):
    before = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    sharing = sharing_rule(MpsMode.auto, ONE_GPU, FAKE, None)
    with mps_for(sharing, sharing.as_dict(), tmp_path, LOG) as record:
        pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.resolve() == (tmp_path / "mps" / "pipe").resolve()
        assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "mps" / "log")
        pid = daemon_pid(tmp_path)
        assert record["daemon_pid"] == pid and not gone(pid) and record["mps"] and record["daemon"] == "own"
    assert wait_gone(pid)
    assert {k: os.environ.get(k) for k in before} == before  # the children's variables go again
    assert (tmp_path / "mps" / "log" / "commands").read_text().split() == ["-d", "quit"]


def test_a_long_run_dir_gets_a_short_pipe_path(tmp_path):
    deep = tmp_path / ("d" * 80)
    own = OwnDaemon(FAKE, deep)
    own.start()
    try:
        assert len(str(own.pipe_dir)) < 64 and own.pipe_dir.resolve() == (deep / "mps" / "pipe").resolve()
        pid = daemon_pid(deep)
        assert own.pid == pid
    finally:
        assert own.stop() is None
    assert wait_gone(pid) and not own.pipe_dir.exists()


def test_a_daemon_that_ignores_quit_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_STUCK", "1")
    monkeypatch.setattr(mps, "STOP_S", 0.5)
    with mps_for(*_planned(sharing_rule(MpsMode.auto, ONE_GPU, FAKE, None)), tmp_path, LOG):
        pid = daemon_pid(tmp_path)
    assert wait_gone(pid)
    assert "killed" in (tmp_path / "mps" / "log" / "reaper.log").read_text()


def test_own_daemon_stops_when_the_run_raises(tmp_path):
    sharing = sharing_rule(MpsMode.on, ONE_GPU, FAKE, None)
    with pytest.raises(KeyboardInterrupt):
        with mps_for(sharing, sharing.as_dict(), tmp_path, LOG):
            pid = daemon_pid(tmp_path)
            raise KeyboardInterrupt
    assert wait_gone(pid)


def test_a_users_daemon_is_joined_never_started_or_stopped(tmp_path):
    (tmp_path / "control").touch()
    sharing = sharing_rule(MpsMode.auto, ONE_GPU, FAKE, running_daemon(
        {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}, os.path.exists))
    with mps_for(sharing, sharing.as_dict(), tmp_path / "run", LOG) as record:
        assert record["daemon"] == "user" and record["pipe_dir"] == str(tmp_path)
    assert not (tmp_path / "run" / "mps").exists() and (tmp_path / "control").exists()


def test_off_never_starts_one(tmp_path):
    with mps_for(*_planned(sharing_rule(MpsMode.off, ONE_GPU, FAKE, None)), tmp_path, LOG) as record:
        assert not record["mps"] and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert not (tmp_path / "mps").exists()


def test_a_daemon_that_does_not_start_leaves_no_mps_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with mps_for(*_planned(sharing_rule(MpsMode.auto, ONE_GPU, FAKE, None)), tmp_path, LOG) as record:
        assert not record["mps"] and "cannot start the daemon" in record["error"]
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    warn = sharing_warning(record)
    assert warn is not None and "cannot start the daemon" in warn


RUNNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import structlog
    from orchestrator.job.mps import mps_for
    from orchestrator.profile.config import MpsMode
    from orchestrator.profile.sharing import processes_on_gpus, sharing_rule
    sharing = sharing_rule(MpsMode.auto, processes_on_gpus((0,), (0,), 1, 1), sys.argv[1], None)
    with mps_for(sharing, sharing.as_dict(), Path(sys.argv[2]), structlog.get_logger()):
        print("up", flush=True)
        time.sleep(600)
""")


def test_no_daemon_outlives_a_sigkilled_runner(tmp_path):
    """The runner holds its reaper's stdin; SIGKILL closes it, and the reaper quits the daemon."""
    runner = subprocess.Popen([sys.executable, "-c", RUNNER, FAKE, str(tmp_path)], stdout=subprocess.PIPE,
                              env=env_here(), cwd=ROOT, start_new_session=True)
    try:
        assert runner.stdout is not None
        while runner.stdout.readline() not in (b"up\n", b""):  # (after its log lines)
            pass
        pid = daemon_pid(tmp_path)
        assert not gone(pid)
        runner.send_signal(signal.SIGKILL)
        runner.wait(30)
        assert wait_gone(pid), "the MPS daemon outlived its runner"
        assert (tmp_path / "mps" / "log" / "commands").read_text().split() == ["-d", "quit"]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()


def test_a_cpu_run_refuses_on_in_one_line_and_runs_auto_unchanged(tmp_path):
    env = env_here(PATH=f"{FAKE_DIR}{os.pathsep}{os.environ['PATH']}")
    refused = subprocess.run([sys.executable, "-m", "orchestrator", "endpoints.mps=on",
                              f"hydra.run.dir={tmp_path / 'on'}"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: endpoints.mps='on' is not allowed: auto or off here (no process of this run is on a GPU: "
        "its buffers live on the host)."]
    assert not (tmp_path / "on" / "mps").exists()
    ran = subprocess.run([sys.executable, "-m", "orchestrator", "workload.requests=50",
                          f"hydra.run.dir={tmp_path / 'auto'}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    results = json.loads((tmp_path / "auto" / "results.json").read_text())
    assert results["gpu_sharing"]["mps"] is False and results["gpu_sharing"]["gpus"] == {}
    assert not results["warnings"] and "MPS" not in ran.stdout + ran.stderr
    fp = json.loads((tmp_path / "auto" / "fingerprint.json").read_text())
    assert fp["gpu_sharing"]["daemon"] == "none"
    assert not (tmp_path / "auto" / "mps").exists()
