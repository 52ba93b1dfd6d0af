"""Trust IV (issue 36): a reused run dir never becomes evidence, replay never runs a stranger's
config, every run file is opened without following links or trusting special files, configs are
bounded, bootstrap lookups are fresh, and the smaller holes of the same trial. One section per
group of items; each test failed at 3a078eb and passes now (RELIABILITY.md, Trust IV)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import MAC_BYTES, Authenticator, new_nonce
from orchestrator.results import rundir
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import Record, read_jsonl, read_records
from orchestrator.results.rundir import RunDirBusy, RunFile, lock_run_dir, unlock_run_dir
from orchestrator.results.schema import Results

from .conftest import ROOT, typed_cfg
from .helpers.procs import free_port, reap, wait_for

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _one_error(text: str, prefix: str = "error: ") -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


# ==============================================================================================
# Items 1, 3 and 6 in part: a run owns its dir; every run file opened without following links; a full disk; MPS dirs
# ==============================================================================================
# Trust IV (issue 36), the run dir: a reused run dir never becomes evidence (a run or sweep
# into a dir holding another run's files is refused; every records, verdicts and decisions line
# carries its run's id and readers count only their dir's run), every file a run opens is
# opened as the bootstrap file is (no link followed, no FIFO blocking, regular files only),
# a full disk ends a sweep in one line with its summary, and MPS dirs are checked for links
# and ownership. Real processes where a run is the subject; races forced by hooks.

RUN_ID_NAME, SWEEP_ID_NAME = ".run.id", ".sweep.id"  # rundir's names (spelled here: the file the run claims)

# The loser's pre-check patched out: the run itself (app.run_job) must refuse
_NO_PRECHECK = ("import sys, orchestrator.preflight.compose as c; c.precheck = lambda argv: None; "
                "sys.argv = ['orchestrator', *sys.argv[1:]]; from orchestrator.__main__ import entry; entry()")


def _cli(*args: str, timeout: float = 300, precheck: bool = True) -> subprocess.CompletedProcess:
    head = ["-m", "orchestrator"] if precheck else ["-c", _NO_PRECHECK]
    return subprocess.run([sys.executable, *head, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _snapshot(d: Path) -> dict[str, tuple[int, int]]:
    """Every path under `d` (links not followed): its size and mtime."""
    out = {}
    for p in sorted(d.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(d))] = (st.st_size, st.st_mtime_ns)
    return out


def _rec(rid: int, ok: bool, tag: str = "") -> str:
    """A requests.jsonl line as a run writes it, ending with its run's tag."""
    line = Record(rid, rid + 1, rid % 2, rid % 4, "engine", 1.0, 1.0, 1.0, 1.0,
                  Outcome.verified if ok else Outcome.failed, Detail.none if ok else Detail.prefill_lost,
                  "").line()
    return line[:-1] + tag + "}"


UNSAFE = getattr(rundir, "UnsafePath", RunDirBusy)  # (at 3a078eb: none)


def _claim(d: Path, run: str, sweep=None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / RUN_ID_NAME).write_text(json.dumps({"run": run, "sweep": sweep}) + "\n")


# ---- 1. a run owns its dir, or refuses it --------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("precheck", [True, False], ids=["precheck", "run-itself"])
def test_a_reused_run_dir_is_refused_and_the_other_runs_files_stay(tmp_path, precheck):
    """issue 36's case: run A (2 decodes), then run B into the same dir with the prefill
    killed at request 300. At 3a078eb B ran and reported A's verdicts as its own (verified
    2000, a made-up rate). Now B is refused before it starts: one line, exit 2, nothing of
    A's touched (also with the command's pre-check patched out: the run itself refuses)."""
    run_dir = tmp_path / "D"
    a = _cli("endpoints.decode_ranks=2", "workload.requests=200", f"hydra.run.dir={run_dir}")
    assert a.returncode == 0, a.stdout + a.stderr
    before = _snapshot(run_dir)
    b = _cli("endpoints.decode_ranks=2", "faults=prefill_killed", "faults.at_request=300",
             f"hydra.run.dir={run_dir}", precheck=precheck, timeout=120)
    assert b.returncode == 2, b.stdout + b.stderr
    line = _one_error(b.stderr)
    assert line.startswith(f"error: hydra.run.dir={run_dir} holds another run's files (results.json"), line
    assert line.endswith("choose a new dir or remove them"), line
    after = _snapshot(run_dir)
    after.pop("orchestrator.log", None), before.pop("orchestrator.log", None)  # Hydra's own log, opened first
    assert after == before


def test_a_stale_verdicts_file_of_another_run_is_ignored_by_recovery(tmp_path, cfg_factory):
    """A verdicts file of run A planted in run B's dir (B has its own id): recovery's judged
    set and verified_after_lost count only B's lines. At 3a078eb A's verdicts made B's lost
    requests verified."""
    from orchestrator.job.recovery import reconstruct
    from orchestrator.results.reporting import verified_after_lost

    from .conftest import report_spec

    _claim(tmp_path, "bbbb")
    tag_b, tag_a = ', "run": "bbbb"', ', "run": "aaaa"'
    (tmp_path / "requests.jsonl").write_text("".join(_rec(i, True, tag_b) + "\n" for i in range(4)))
    (tmp_path / "verdicts-decode0.jsonl").write_text("".join(json.dumps(
        {"prefill": 0, "rid": i, "outcome": "verified", "detail": "", "run": "bbbb"}) + "\n" for i in range(5)))
    (tmp_path / "verdicts-decode1.jsonl").write_text("".join(json.dumps(   # run A's, stale
        {"prefill": 0, "rid": i, "outcome": "verified", "detail": "", "run": "aaaa"}) + "\n" for i in range(10)))
    with open(tmp_path / "requests.jsonl", "a") as fh:  # and a line of A's in B's requests file
        fh.write(_rec(7, False, tag_a) + "\n")
    cfg = cfg_factory("workload.requests=10", "endpoints.decode_ranks=2")
    res = reconstruct(report_spec(cfg), tmp_path, 0, "prefill", Detail.prefill_lost)
    assert res.verified == 5 and res.outcomes[Outcome.failed] == 5  # 0-3 recorded, 4 judged by B's decode
    assert verified_after_lost(tmp_path) == []  # A's verified 7 is not B's
    assert [r.rid for r in read_records(tmp_path / "requests.jsonl")][:4] == [0, 1, 2, 3]
    tail = (tmp_path / "requests.jsonl").read_text().splitlines()[-1]
    assert json.loads(tail)["run"] == "bbbb"  # what recovery appended is B's too


def test_readers_skip_the_lines_of_another_run(tmp_path):
    """replay's readers (strict) and the report's: a claimed dir's files count only the lines
    of its run; an unclaimed dir's only untagged lines."""
    _claim(tmp_path, "bbbb")
    path = tmp_path / "decisions.jsonl"
    path.write_text('{"event": "route_decision", "rid": 1, "run": "bbbb"}\n'
                    '{"event": "route_decision", "rid": 2, "run": "aaaa"}\n'
                    '{"event": "route_decision", "rid": 3}\n')
    assert [d["rid"] for d in read_jsonl(path, strict=True)] == [1]
    assert [d["rid"] for d in read_jsonl(path, run=None)] == [3]


@pytest.mark.integration
@pytest.mark.slow
def test_a_reused_sweep_dir_is_refused(tmp_path):
    """A two-job sweep, then a one-job sweep into the same dir. At 3a078eb the second ran
    and its summary counted the first sweep's jobs (`2 combinations`). Now it is refused
    before any job: one line, exit 2, the first sweep's files as they were."""
    sweep = tmp_path / "S"
    first = _cli("-m", "workload.requests=30,40", f"hydra.sweep.dir={sweep}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "sweep: 2 combinations: 2 ok" in first.stdout
    before = _snapshot(sweep)
    second = _cli("-m", "workload.requests=50", f"hydra.sweep.dir={sweep}", timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr
    line = _one_error(second.stderr)
    assert line.startswith(f"error: hydra.sweep.dir={sweep} holds another sweep's files (0, 1,"), line
    assert "sweep:" not in second.stdout
    assert _snapshot(sweep) == before


def test_a_sweep_summary_counts_only_its_own_jobs(tmp_path):
    """A job dir of another sweep (its .run.id names another sweep) is not a row; a job of
    this sweep that crashed before claiming its dir still is (missing)."""
    from orchestrator.results.reporting import write
    from orchestrator.results.schema import NotRun
    from orchestrator.sweep.sweep import collect

    (tmp_path / SWEEP_ID_NAME).write_text('{"sweep": "mine"}\n')
    for num, sweep in ((0, "mine"), (1, "theirs"), (2, None)):
        job = tmp_path / str(num)
        if sweep is not None:
            _claim(job, f"run{num}", sweep)
            write(job, NotRun(2, "refused", refused="refused"))
        else:
            job.mkdir()
    rows = collect(tmp_path)[1]
    assert [(r["job"], r["status"].value) for r in rows] == [(0, "error"), (2, "missing")]


# ---- 3. every file a run opens: no link followed, no FIFO blocking -----------------------
def _plant(path: Path, kind: str, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["symlink", "loop", "fifo", "dir"])
@pytest.mark.parametrize("precheck", [True, False], ids=["precheck", "run-itself"])
def test_a_planted_run_lock_is_refused_in_one_line(tmp_path, kind, precheck):
    """issue 36: a .run.lock symlink truncated its victim to the pid, a FIFO hung the command
    with no output, a loop gave a traceback, a dir said `pid ? holds`. Now each is refused:
    one line naming what it is, exit 2, no hang (bounded here), the victim untouched."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    victim.write_text("precious\n")
    _plant(run_dir / ".run.lock", kind, victim)
    proc = _cli("workload.requests=20", f"hydra.run.dir={run_dir}", precheck=precheck, timeout=90)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    want = {"symlink": "a symbolic link", "loop": "a symbolic link", "fifo": "a FIFO", "dir": "a directory"}[kind]
    assert f".run.lock is {want}: refused" in line, line
    assert victim.read_text() == "precious\n"


@pytest.mark.integration
@pytest.mark.parametrize("name", ["requests.jsonl", "decisions.jsonl", "verdicts-decode.jsonl", "prefill.log",
                                  ".hydra"])
def test_a_planted_link_in_the_run_dir_is_refused_never_followed(tmp_path, name):
    """requests, decisions and verdicts links overwrote their victims at 3a078eb, log links
    appended to them, a .hydra link put the config in the victim dir. Now: refused before
    start (with the pre-check patched out too: the run itself refuses), victims untouched."""
    run_dir, victim = tmp_path / "run", tmp_path / ("victim_dir" if name == ".hydra" else "victim")
    run_dir.mkdir()
    if name == ".hydra":
        victim.mkdir()
    else:
        victim.write_text("precious\n")
    (run_dir / name).symlink_to(victim)
    proc = _cli("workload.requests=20", f"hydra.run.dir={run_dir}", precheck=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert name in line, line
    if name == ".hydra":
        assert list(victim.iterdir()) == []
    else:
        assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("mode", ["w", "a"])
@pytest.mark.parametrize("kind", ["symlink", "loop", "fifo", "dir"])
def test_a_run_file_refuses_links_and_special_files_without_blocking(tmp_path, mode, kind):
    """RunFile (records, verdicts, decisions) and the lock, where a stranger plants their
    path after the run's check: refused (UnsafePath, exit 2 at the command), never followed;
    a FIFO never blocks the open (bounded by a thread here)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "verdicts-decode.jsonl"
    _plant(path, kind, victim)
    caught: list[BaseException] = []

    def attempt() -> None:
        try:
            RunFile(path, mode).close()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            caught.append(exc)
    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the FIFO's open so the thread ends
        os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
        pytest.fail("RunFile blocked on a FIFO")
    assert caught and isinstance(caught[0], UNSAFE), caught
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_plot_replaces_a_planted_link_never_writes_through_it(tmp_path, kind):
    """latency.png (and its aside file, the bench's and the sweep's outputs) are written as
    every run file is: rendered in memory, then a private temporary file renamed over the
    path. A link planted there is replaced, its target untouched; a FIFO never blocks."""
    from orchestrator.results import plots

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / ".latency.png.partial.png"
    _plant(path, kind, victim)
    fig = plots.pyplot().figure()
    done = threading.Event()
    t = threading.Thread(target=lambda: (plots.save_png(fig, path), done.set()), daemon=True)
    t.start()
    t.join(60)
    assert done.is_set(), "save_png blocked or failed"
    assert victim.read_text() == "precious\n"
    assert stat.S_ISREG(path.lstat().st_mode) and path.read_bytes().startswith(b"\x89PNG")


def test_the_metadata_servers_log_refuses_a_planted_link(tmp_path):
    """metadata_server.log (transport.metadata_server=http://...) is created as the run's
    other files: a link planted there is refused before the server starts, never appended to."""
    from orchestrator.job import bootstrap

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "metadata_server.log").symlink_to(victim)
    with pytest.raises(UNSAFE):
        bootstrap.start_metadata_server("http://127.0.0.1:1/metadata", tmp_path)
    assert victim.read_text() == "precious\n"


def test_the_lock_is_taken_before_its_pid_is_written_and_never_through_a_link(tmp_path):
    """A .run.lock link to a victim: refused, the victim keeps its content (3a078eb
    truncated it to the pid). A lock held by another: its pid file is not truncated."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".run.lock").symlink_to(victim)
    with pytest.raises(UNSAFE):
        lock_run_dir(run_dir)
    assert victim.read_text() == "precious\n"
    (run_dir / ".run.lock").unlink()
    held = lock_run_dir(run_dir)
    try:
        pid = (run_dir / ".run.lock").read_text()
        with pytest.raises(RunDirBusy):
            lock_run_dir(run_dir)
        assert (run_dir / ".run.lock").read_text() == pid == f"{os.getpid()}\n"
    finally:
        unlock_run_dir(held)


# ---- 6. a full disk: one line, exit 3, what the sweep had; no torn line -------------------
def _tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("size", ["400k", "1m"])
def test_a_sweep_that_fills_the_disk_full_disk_ends_in_one_line_with_its_summary(tmp_path, size):
    """issue 36: at 400k a traceback ending NoSpace (exit 1, no summary); at 1m a
    UserWarning that SweepSummary.on_multirun_end raised OSError. Now: the sweep's status
    line, then one line naming the file, exit 3."""
    disk = tmp_path / "small"
    _tmpfs(disk, size)
    try:
        proc = _cli("-m", "workload.requests=1000,1001", f"hydra.sweep.dir={disk / 'S'}", timeout=400)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "Traceback" not in out and "UserWarning" not in out, out
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors and all(ln.startswith("error: no space left writing ") for ln in errors), out  # a line a job
    assert "sweep: 2 combinations:" in proc.stdout, out  # what the sweep had, then its one line
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no space left writing ") and "orchestrator.report" in last, out


@pytest.mark.integration
def test_no_torn_decisions_line_at_a_full_disk(tmp_path):
    """issue 36: at 64k decisions.jsonl ended in half a line. Now every run file ends in a
    whole line (the part of a line that did not fit is cut back)."""
    disk = tmp_path / "small"
    _tmpfs(disk, "64k")
    try:
        proc = _cli("workload.requests=1000", f"hydra.run.dir={disk / 'run'}")
        files = [p for pat in ("decisions*.jsonl", "requests*.jsonl", "verdicts-*.jsonl")
                 for p in (disk / "run").glob(pat)]
        torn = [p.name for p in files if p.read_bytes() and not p.read_bytes().endswith(b"\n")]
        decisions = [p for p in files if p.name.startswith("decisions") and p.stat().st_size]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert decisions and torn == [], (torn, proc.stderr)


def test_a_torn_line_is_cut_back_when_the_disk_fills(tmp_path):
    """RunFile at a full disk, forced by a hook (its file object's flush writes half a line,
    then fails with ENOSPC): the half line is cut back, and what stays buffered never lands
    later (close writes nowhere)."""
    import errno

    from orchestrator.results.rundir import NoSpace

    path = tmp_path / "decisions.jsonl"
    f = RunFile(path, "w", buffering=1 << 16)
    f.write('{"a": 1}\n')
    f.flush()
    f.write('{"b": 2}\n{"c": 3}\n')  # buffered
    real = f.fh

    class HalfThenFull:
        def flush(self) -> None:
            os.write(real.fileno(), b'{"b": 2}\n{"c"')
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(real, name)
    f.fh = HalfThenFull()
    with pytest.raises(NoSpace):
        f.flush()
    f.fh = real
    try:
        f.close()
    except NoSpace:
        pass
    assert path.read_text() == '{"a": 1}\n{"b": 2}\n'


# ---- 6. MPS dirs: ownership and links ------------------------------------------------------
FAKE = str(Path(__file__).resolve().parent / "helpers" / "fake_mps" / "nvidia-cuda-mps-control")


def test_a_pipe_dir_of_another_user_is_never_joined(tmp_path):
    """A control pipe in a pipe dir another user owns (the default /tmp/nvidia-mps is
    anyone's to plant) or behind a link: not a daemon of ours; auto starts its own."""
    from orchestrator.profile.config import MpsMode
    from orchestrator.profile.sharing import MpsDaemon, processes_on_gpus, running_daemon, sharing_rule

    if os.geteuid() != 0:
        pytest.skip("needs root to give a dir to another user")
    planted = tmp_path / "nvidia-mps"
    planted.mkdir()
    (planted / "control").touch()
    os.chown(planted / "control", 65534, 65534)
    os.chown(planted, 65534, 65534)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(planted)}
    assert running_daemon(env, os.path.exists) is None
    sharing = sharing_rule(MpsMode.auto, processes_on_gpus((0,), (0,), 1, 1), FAKE, running_daemon(env, os.path.exists))
    assert sharing.daemon is MpsDaemon.own
    link = tmp_path / "link"
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "control").touch()
    link.symlink_to(ours)
    assert running_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(link)}, os.path.exists) is None
    assert running_daemon({"CUDA_MPS_PIPE_DIRECTORY": str(ours)}, os.path.exists) == str(ours)


def test_a_planted_reaper_log_link_is_not_followed(tmp_path, monkeypatch):
    """mps/log/reaper.log a link to a victim: 3a078eb's reaper appended to the victim (here:
    the line it writes when it kills a daemon that ignored quit). Now the reaper refuses it
    and the run has no MPS, saying why; the victim is untouched."""
    import structlog

    from orchestrator.job import mps
    from orchestrator.job.mps import mps_for
    from orchestrator.profile.config import MpsMode
    from orchestrator.profile.sharing import processes_on_gpus, sharing_rule

    monkeypatch.setenv("FAKE_MPS_STUCK", "1")
    monkeypatch.setattr(mps, "STOP_S", 0.5)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    logs = tmp_path / "run" / "mps" / "log"
    logs.mkdir(parents=True)
    (logs / "reaper.log").symlink_to(victim)
    sharing = sharing_rule(MpsMode.auto, processes_on_gpus((0,), (0,), 1, 1), FAKE, None)
    with mps_for(sharing, sharing.as_dict(), tmp_path / "run", structlog.get_logger("test")) as record:
        pass
    assert victim.read_text() == "precious\n"
    assert not record["mps"] and "reaper.log" in record["error"]


def test_a_linked_mps_dir_is_refused(tmp_path):
    """run_dir/mps a link to a dir elsewhere: refused (the daemon's pipe and logs never land
    in the victim dir)."""
    from orchestrator.job.mps import OwnDaemon

    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mps").symlink_to(victim)
    with pytest.raises(UNSAFE):
        OwnDaemon(FAKE, tmp_path / "run")
    assert list(victim.iterdir()) == []
    assert stat.S_ISLNK((tmp_path / "run" / "mps").lstat().st_mode)


# ==============================================================================================
# Items 2, 4 and 6 in part: replay runs data, not code; bounded configs; signals while composing;
# real causes; nothing handed off
# ==============================================================================================
# Issue 36 (Trust IV), items 2, 4 and part of 6: replay runs data, not code; config-dir YAML is
# bounded before anything composes it and a signal ends the command while it composes; errors
# name their real cause; a run that hands off nothing does not exit 0. (To be merged into
# tests/test_trust_iv.py.)

HANG_GUARD_S = 180  # a wall limit only against a hang: a refusal here takes about a second
RSS_LIMIT_KB = 200 * 1024


def _measured(args: list[str], timeout: float = HANG_GUARD_S) -> tuple[int, str, str, int]:
    """Run `args` as the only child of a fresh interpreter: exit code, stdout, stderr and the
    command's peak RSS in KB (its ru_maxrss, RUSAGE_CHILDREN of that interpreter; pytest's own
    earlier children are not counted)."""
    probe = ("import json, resource, subprocess, sys\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(json.dumps([p.returncode, p.stdout, p.stderr,"
             " resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    import json

    proc = subprocess.Popen([sys.executable, "-c", probe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=ENV, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command too, not only the probe
        proc.communicate()
        raise AssertionError(f"still running after {timeout} s: {args}") from None
    assert proc.returncode == 0, stderr
    code, out, err, rss = json.loads(stdout)
    return code, out, err, rss


# ---- 2. replay runs data, not code ----------------------------------------------------------
# the tests of `run_dir` run on one pytest-xdist worker (make test: --dist loadgroup), which
# makes the run once; spread over the workers, each would make its own
RUN_DIR_GROUP = pytest.mark.xdist_group("trust_iv_run_dir")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run (the CPU smoke profile) whose dir the replay tests copy and tamper with."""
    path = tmp_path_factory.mktemp("trust4") / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "experiment=cpu_smoke", "workload.requests=20",
                           f"hydra.run.dir={path}"], capture_output=True, text=True, cwd=ROOT, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


def _tampered(run_dir: Path, tmp_path: Path, extra: str) -> Path:
    copy = tmp_path / "attached"
    shutil.copytree(run_dir, copy)
    with open(copy / ".hydra" / "config.yaml", "a") as f:
        f.write(extra)
    return copy


def _replay(run_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m orchestrator.replay RUN_DIR`; past `timeout` its whole session is killed (the
    job it started too) and the test fails."""
    args = [sys.executable, "-m", "orchestrator.replay", str(run_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"the replay still ran after {timeout} s") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.integration
@RUN_DIR_GROUP
def test_replay_never_runs_a_hydra_callback_from_the_run_dir(run_dir, tmp_path):
    """issue 36's attack: a hydra.callbacks entry in the attached dir's config.yaml whose
    _target_ is pathlib.Path.write_text. At 3a078eb the replay wrote the victim, printed
    `deterministic outputs: IDENTICAL` and exited 0."""
    victim = tmp_path / "victim.pth"
    attached = _tampered(run_dir, tmp_path, (
        "hydra:\n"
        "  callbacks:\n"
        "    evil:\n"
        "      _target_: pathlib.Path.write_text\n"
        "      self:\n"
        "        _target_: pathlib.Path\n"
        f"        _args_: [{victim}]\n"
        "      data: import os\n"))
    proc = _replay(attached)
    assert not victim.exists(), "the replay ran the run dir's callback"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line == (f"error: {attached / '.hydra' / 'config.yaml'}: hydra.callbacks is not replayable: a replay "
                    "takes the task config only (no hydra node, no _target_)"), line
    assert "IDENTICAL" not in proc.stdout
    assert not (attached / "replays").exists()  # refused before anything ran


def _hydra_searchpath(cfg: dict) -> None:
    cfg["hydra"] = {"searchpath": ["file:///tmp"]}


def _defaults(cfg: dict) -> None:
    cfg["defaults"] = [{"override hydra/launcher": "basic"}]


def _target_in_section(cfg: dict) -> None:
    cfg["workload"]["_target_"] = "shutil.rmtree"


def _target_in_list(cfg: dict) -> None:
    cfg["layout"]["fields"][0]["_target_"] = "builtins.open"


@pytest.mark.integration
@RUN_DIR_GROUP
@pytest.mark.parametrize("tamper,key", [
    (_hydra_searchpath, "hydra.searchpath"),
    (_defaults, "defaults"),
    (_target_in_section, "workload._target_"),
    (_target_in_list, "layout.fields[0]._target_"),
])
def test_replay_refuses_anything_hydra_would_run_naming_the_key(run_dir, tmp_path, tamper, key):
    import yaml

    attached = tmp_path / "attached"
    shutil.copytree(run_dir, attached)
    path = attached / ".hydra" / "config.yaml"
    cfg = yaml.safe_load(path.read_text())
    tamper(cfg)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    proc = _replay(attached)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(f"error: {path}: {key} is not replayable"), proc.stderr
    assert not (attached / "replays").exists()


@pytest.mark.integration
@RUN_DIR_GROUP
def test_replay_validates_the_saved_config_as_data_before_running_it(run_dir, tmp_path):
    """An unknown key or a wrong value is refused with one line, exit 2, before a replay runs
    (at 3a078eb the replay ran, its job was refused, and compare() ended in a traceback)."""
    attached = tmp_path / "attached"
    shutil.copytree(run_dir, attached)
    path = attached / ".hydra" / "config.yaml"
    path.write_text(path.read_text().replace("workload:\n", "workload:\n  requestz: 5\n", 1))
    proc = _replay(attached)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line.startswith(f"error: {path}: workload.requestz=") and "no such key" in line, line
    assert not (attached / "replays").exists()


@pytest.mark.integration
@RUN_DIR_GROUP
def test_replay_bounds_the_saved_config_before_parsing_it(run_dir, tmp_path):
    """A billion-laughs config.yaml in an attached run dir: one line naming it, exit 2, at once
    (at 3a078eb the replay's job composed it: minutes and gigabytes)."""
    attached = _tampered(run_dir, tmp_path, LAUGHS.split("\n", 1)[1])
    proc = _replay(attached, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(
        f"error: {attached / '.hydra' / 'config.yaml'}: its 37 YAML aliases expand to more than"), proc.stderr


# ---- 4. bounded configs ---------------------------------------------------------------------
LAUGHS = "".join([
    "# @package _global_\n",
    "a: &a [l,l,l,l,l,l,l,l,l]\n",
    *[f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi")],
])


def _bomb_dir(root: Path, kind: str) -> tuple[Path, Path]:
    """A config dir with a good experiment and a hostile one: `laughs` (about 300 bytes of 9
    levels of nested aliases, as the issue's 362-byte file: 9^9 nodes once expanded), 50 MB of
    comments, or 50 MB of data."""
    conf = root / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "good.yaml").write_text("# @package _global_\nworkload:\n  requests: 50\n")
    bad = conf / "experiment" / "bad.yaml"
    if kind == "laughs":
        bad.write_text(LAUGHS)
    else:
        line = "# " + "x" * 97 + "\n" if kind == "comments" else None
        with open(bad, "w") as f:
            f.write("# @package _global_\n")
            for i in range(500_000):
                f.write(line or f"k{i:07d}: {'v' * 88}\n")
    return conf, bad


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["laughs", "comments", "data"])
def test_a_hostile_config_dir_file_is_refused_before_composing(tmp_path, kind):
    """A sweep over a --config-dir holding a billion-laughs file, or 50 MB of comments or data:
    one line naming the file, exit 2, no sweep dir, quickly and small. At 3a078eb the first
    grew to 2.4 GB with no output (killed at 600 s), the 50 MB files held the sweep for
    minutes and grew to 2.5 GB."""
    conf, bad = _bomb_dir(tmp_path, kind)
    sweep = tmp_path / "sweep"
    start = time.monotonic()
    code, out, err, rss = _measured([sys.executable, "-m", "orchestrator", "-m", f"--config-dir={conf}",
                                     "experiment=bad,good", f"hydra.sweep.dir={sweep}"])
    took = time.monotonic() - start
    assert code == 2, out + err
    line = _one_error(err)
    assert line.startswith(f"error: {bad}: "), line
    assert ("YAML aliases expand to more than" in line if kind == "laughs"
            else "bytes, over the 1,048,576 (1 MiB) a config file may have" in line), line
    assert not sweep.exists()
    # the bound: what the file adds to the command (its imports are another issue's)
    _, _, _, base = _measured([sys.executable, "-m", "orchestrator", "workload.requests=0"])
    assert rss - base < 64 * 1024, f"the refusal peaked at {rss} KB, a plain refusal at {base} KB ({took:.1f} s)"


@pytest.mark.parametrize("kind", ["laughs", "comments", "data"])
def test_the_bounds_check_stays_under_200_mb(tmp_path, kind):
    """The check itself, in a fresh interpreter: the refusal, and the peak RSS under 200 MB."""
    conf, bad = _bomb_dir(tmp_path, kind)
    code = ("import sys\nfrom orchestrator.preflight.compose import precheck\n"
            f"print(precheck(['-m', '--config-dir={conf}', 'experiment=good,bad']))\n")
    rc, out, err, rss = _measured([sys.executable, "-c", code])
    assert rc == 0, err
    assert out.startswith(f"{bad}: "), out
    assert rss < RSS_LIMIT_KB, f"{rss} KB"


@pytest.mark.integration
def test_a_config_name_that_scans_the_dir_is_refused_quickly(tmp_path):
    """-cn with --config-dir reads every file of the dir before Hydra does (killed at 400 s at
    3a078eb with a 50 MB file there)."""
    conf, bad = _bomb_dir(tmp_path, "comments")
    (conf / "good.yaml").write_text("workload:\n  requests: 5\n")
    code, out, err, _ = _measured([sys.executable, "-m", "orchestrator", f"--config-dir={conf}", "-cn", "good",
                                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 2, out + err
    assert _one_error(err).startswith(f"error: {bad}: 50,"), err
    assert not (tmp_path / "run").exists()


def test_aliases_within_the_budget_still_compose(tmp_path):
    """A few anchors and merge keys are ordinary YAML: the bound does not refuse them."""
    from orchestrator.preflight.compose import precheck

    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "anchors.yaml").write_text(
        "# @package _global_\nbase: &base {requests: 40}\nworkload:\n  <<: *base\n")
    problem = precheck(["--config-dir", str(conf), "experiment=anchors"], rules=False)
    assert problem is None or "YAML aliases" not in problem, problem


SLOW_COMPOSE = '''
import pathlib, runpy, sys
from omegaconf import OmegaConf
import orchestrator.preflight.compose as compose

marker = pathlib.Path(sys.argv[1])


def slow_compose(*args, **kwargs):
    """A compose that takes for ever, in OmegaConf's own code (a big config with shared lists,
    as a file of nested aliases builds): where a signal handler's raise lands."""
    marker.write_text("composing")
    leaf = ["x"] * 9
    for _ in range(3):
        leaf = [leaf] * 9
    while True:
        OmegaConf.create({"a": leaf})


compose.load_profile = slow_compose
sys.argv = ["orchestrator", *sys.argv[2:]]
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
'''


@pytest.mark.integration
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_command_while_it_composes(tmp_path, sig, code):
    """`timeout 60` sends TERM during a long compose: at 3a078eb the handler's raise landed in
    OmegaConf, whose clean-up turned it into a config error that compose caught, and the command
    went on (until SIGKILL). Now the signal ends it: 130/143 and one line. The slow compose is
    forced by a wrapper (a hook in the test only)."""
    wrapper, marker = tmp_path / "slow_compose.py", tmp_path / "composing"
    wrapper.write_text(SLOW_COMPOSE)
    proc = subprocess.Popen([sys.executable, str(wrapper), str(marker), "workload.requests=10",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the compose never started"
            time.sleep(0.05)
        time.sleep(0.5)  # inside OmegaConf's loop by now
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == code, out + err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"interrupted ({sig.name}) while composing the config: no job was running"], err
    assert not (tmp_path / "run").exists()


# ---- 6. errors name their real cause; nothing handed off is not a success --------------------
def test_buffers_that_do_not_fit_are_blamed_on_the_row_key_with_the_product():
    """At 3a078eb buffers.hidden_size=... was refused as `buffers.size=64 is not allowed`."""
    from orchestrator.preflight.compose import precheck

    problem = precheck(["buffers.hidden_size=100000000000"])
    assert problem is not None and problem.startswith("buffers.hidden_size=100000000000 is not allowed: "), problem
    assert "buffers.size=64 slots of" in problem and "(buffers.hidden_size=100,000,000,000)" in problem, problem
    problem = precheck(["buffers.size=100000000000"])
    assert problem is not None and problem.startswith("buffers.size=100000000000 is not allowed: fewer slots"), problem


def test_a_long_value_is_not_echoed_back_in_full():
    """A 1,999-value report.percentiles was printed back whole (13,894 characters)."""
    from orchestrator.preflight.compose import precheck

    values = [round(0.01 + i * 0.05, 2) for i in range(1999)]
    problem = precheck([f"report.percentiles=[{','.join(map(str, values))}]"])
    assert problem is not None and problem.startswith(
        "report.percentiles=[0.01, 0.06, 0.11, 0.16, 0.21, 0.26, 0.31, 0.36, ... (1,999 values)] is not allowed: "
        "1 to 12 percentiles"), problem
    assert len(problem) < 300, problem


def test_a_duration_no_request_can_arrive_in_is_refused_before_start(tmp_path):
    """workload.duration_s=1e-9 handed off nothing and exited 0 at 3a078eb."""
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "workload.duration_s=1e-9",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
                          env=ENV, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr) == (
        "error: workload.duration_s=1e-09 is not allowed: at least 0.1 s (a shorter phase can end before its "
        "first request arrives), or null to run workload.requests."), proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_a_run_that_hands_off_nothing_exits_1_and_says_why(tmp_path):
    """An open loop whose seeded schedule has no arrival inside workload.duration_s (seed 1 at
    0.01/s: the first arrives at 37.7 s) ran, handed off nothing and exited 0 at 3a078eb."""
    from orchestrator.handoff.workload import arrival_offsets
    from orchestrator.results.schema import Results

    assert len(arrival_offsets(0.01, 1, 100, 0, 1.0, 0.1)) == 0  # the premise
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "experiment=cpu_smoke", "workload.duration_s=0.1",
                           "workload.rate=0.01", "workload.seed=1", f"hydra.run.dir={run}"],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("ERROR: no request was handed off (workload.duration_s=0.1 s at workload.rate=0.01/s: no arrival "
            "of the seeded schedule fell inside it" in proc.stdout + proc.stderr), proc.stdout + proc.stderr
    res = Results.read(run)
    assert res.requests == 0 and res.exit_code == 1


class _WritesVictim:
    """A pickle whose loading writes a file (as a stranger's config.pickle can)."""

    def __init__(self, victim: Path):
        self.victim = victim

    def __reduce__(self):
        return (Path.write_text, (self.victim, "import os\n"))


def test_hydra_experimental_rerun_is_refused_not_unpickled(tmp_path):
    """`--experimental-rerun FILE` makes Hydra pickle.load the file: at 3a078eb the command
    loaded it (the victim written) before anything else; now one line, exit 2."""
    import pickle

    victim, rerun = tmp_path / "victim.pth", tmp_path / "config.pickle"
    rerun.write_bytes(pickle.dumps(_WritesVictim(victim)))
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "--experimental-rerun", str(rerun)],
                          capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=HANG_GUARD_S)
    assert not victim.exists(), "the command unpickled the file"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(f"error: --experimental-rerun {rerun} is not supported"), proc.stderr


# ==============================================================================================
# Item 5 and the console part of item 6: fresh lookups; over-long fields; peer strings escaped
# ==============================================================================================
# Trust IV (issue 36), item 5 and the console part of item 6: a bootstrap lookup recorded in
# one split run opens in no later run, and never sets the address verdict; an over-long field is
# named as over-long, not as a wrong secret; peer strings reach the console escaped.
#
# Real processes and real ZMQ sockets between them (the split-run harness of test_trust_iii).
# The attacker is the test process, with what a user who can write the shared bootstrap dir has:
# a relay that a prefill side was pointed at (its address in transport.bootstrap_file, or peer=),
# which forwards to the real decode side and records every frame the prefill side sent.

SECRET_VAR = "TRUST4_LOOKUP_SECRET"
SECRET = "trust-four-lookup-secret-93b1"
# both sides advertise loopback (SGLang's step 1): the real prefill's address is reachable
LOOKUP_ENV = {**os.environ, SECRET_VAR: SECRET, "PYTHONUNBUFFERED": "1", "SGLANG_HOST_IP": "127.0.0.1"}
LOOKUP_ENV.pop("ORCHESTRATOR_TEST_VERSIONS", None)
STARTED: list[subprocess.Popen] = []
REQUESTS = 20


@pytest.fixture(autouse=True)
def _reap():
    """What a test started and left running (a bound that failed) is killed with its tree."""
    yield
    reap(STARTED)


def _popen(*args: str, env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", f"transport.secret_env={SECRET_VAR}", *args],
                            cwd=ROOT, env=env or LOOKUP_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    return proc



def _events(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _logged(path: Path, event: str, **fields) -> bool:
    return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items()) for e in _events(path))


def _error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("ERROR:")]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


class Relay:
    """A ROUTER that a prefill side was pointed at: every frame it sends goes on to the real
    decode side (and every answer back), and is recorded. In a thread."""

    def __init__(self, to_port: int):
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(f"tcp://127.0.0.1:{to_port}")
        self.frames: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        ident = None
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self.front in ready:
                ident, *frames = self.front.recv_multipart()
                self.frames.extend(frames)
                self.back.send_multipart(frames)
            if self.back in ready:
                answer = self.back.recv_multipart()
                if ident is not None:
                    self.front.send_multipart([ident, *answer])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)
        self.back.close(0)
        self.ctx.term()


def _ask(port: int, frame: bytes, wait_ms: int = 2000) -> list[dict]:
    """`frame` sent to the bootstrap address from a fresh DEALER, as anyone can; the answers
    opened with the secret (the test knows it: the attacker does not)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    auth, answers = Authenticator(SECRET.encode()), []
    try:
        sock.send(frame)
        while sock.poll(wait_ms):
            body = auth.unseal(sock.recv())
            answers.append(json.loads(body) if body is not None else {"type": "(not authentic)"})
            wait_ms = 200
    finally:
        sock.close(0)
        ctx.term()
    return answers


# ---- the lookup recorded in one run, replayed into a later one -------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> list[bytes]:
    """Run 1: a real split run whose prefill side was pointed at the relay; the frames its
    prefill side sent (its lookups), as the relay recorded them."""
    tmp = tmp_path_factory.mktemp("run1")
    port = free_port()
    started: list[subprocess.Popen] = []
    try:
        decode = _popen("role=decode", f"transport.bootstrap_port={port}", "endpoints.startup_timeout_s=300",
                        f"hydra.run.dir={tmp / 'd'}")
        started.append(decode)
        relay = Relay(port)
        try:
            prefill = _popen("role=prefill", f"peer=127.0.0.1:{relay.port}", f"workload.requests={REQUESTS}",
                             f"hydra.run.dir={tmp / 'p'}")
            started.append(prefill)
            p_out, p_err = prefill.communicate(timeout=300)
            d_out, d_err = decode.communicate(timeout=120)
        finally:
            relay.close()
    finally:
        reap(started)
    assert prefill.returncode == 0 and decode.returncode == 0, (p_out, p_err, d_out, d_err)
    assert Results.read(tmp / "p").verified == REQUESTS and relay.frames
    return list(relay.frames)


def _old_format_lookup() -> bytes:
    """What a prefill side before fresh lookups sent, built with the real encoder: no nonce,
    no challenge, no time; its advertised address the issue's (nobody answers there)."""
    from orchestrator.profile import versions

    adv = {"address": "192.0.2.2", "step": "SGLANG_HOST_IP", "interface": "", "port": 39679,
           "fix": "SGLANG_HOST_IP=127.0.0.1", "error": ""}
    msg = wire.LookupMsg(rank=0, prefill_ranks=1, versions=versions.local("sglang_0_5_23"), advertised=adv)
    return Authenticator(SECRET.encode()).seal(wire.encode(msg))


@pytest.mark.parametrize("mode", ["fail", "warn"])
@pytest.mark.integration
@pytest.mark.xdist_group("trust_iv_recorded")  # one worker: `recorded` (a split run) is made once
def test_a_recorded_lookup_replayed_into_a_later_run_is_refused_and_never_judged(recorded, tmp_path, mode):
    """issue 36's attack: the lookups a real prefill side sent in run 1 (recorded by a relay it
    was pointed at, the decode side's challenge answered through it), and an old-format lookup
    advertising 192.0.2.2:39679, are replayed into run 2's decode side (same secret) before its
    real prefill side comes. At 3a078eb the first was judged as that prefill: with
    transport.address_check=fail it ended run 2 (`refused before any handoff: ... no answer
    from tcp://...`), with warn it planted a false warning and the real prefill's address was
    never probed. Now each is refused and counted (never the endpoints, never judged), run 2
    verifies everything, and its address verdict is the real prefill's: probed and reached."""
    port = free_port()
    d_dir, p_dir = tmp_path / "d", tmp_path / "p"
    decode = _popen("role=decode", f"transport.bootstrap_port={port}", f"transport.address_check={mode}",
                    "endpoints.startup_timeout_s=300", f"hydra.run.dir={d_dir}")
    log = d_dir / "orchestrator.log"
    wait_for(lambda: _logged(log, "bootstrap_listening") or decode.poll() is not None, 120, "the decode side")
    answers = [a for frame in [*recorded, _old_format_lookup()] for a in _ask(port, frame)]
    # the replays were looked at (refused now; judged, at 3a078eb)
    wait_for(lambda: _logged(log, "bootstrap_rejected", reason=_stale()) or decode.poll() is not None
              or _logged(log, "peer_address_unreachable"), 60, "the decode side's verdict on the replays")
    prefill = _popen("role=prefill", f"peer=127.0.0.1:{port}", f"transport.address_check={mode}",
                     f"workload.requests={REQUESTS}", f"hydra.run.dir={p_dir}")
    p_out, p_err = prefill.communicate(timeout=300)
    d_out, d_err = decode.communicate(timeout=120)
    assert prefill.returncode == 0 and decode.returncode == 0, (p_out, p_err, d_out, d_err)
    assert Results.read(p_dir).verified == REQUESTS
    decode_results = Results.read(d_dir)
    assert decode_results.verified == REQUESTS
    assert not [w for w in decode_results.ending.warnings if "would advertise" in w], decode_results.ending.warnings
    assert "192.0.2.2" not in d_out + d_err and "Traceback" not in d_out + d_err + p_out + p_err
    # the address judged is the real prefill's: the port its echo listened on in run 2
    advertised = [e for e in _events(p_dir / "orchestrator.log") if e.get("event") == "address_advertised"]
    assert advertised, p_out
    reached = [e for e in _events(log) if e.get("event") == "peer_address_reached"]
    assert [e.get("port") for e in reached] == [advertised[0]["port"]], reached
    assert not _logged(log, "peer_address_unreachable")
    # what the replayer got back: never the endpoints; a challenge, or a refusal saying why
    types = [a["type"] for a in answers]
    assert "decodes" not in types and set(types) <= {"challenge", "error"}, answers
    assert any(a["type"] == "error" and "without a nonce" in a["detail"] for a in answers), answers
    # (the recording holds a lookup that answered run 1's challenge: the strongest replay)
    assert any(b'"challenge":"' in f[:-MAC_BYTES] for f in recorded)


def _stale() -> str:
    from orchestrator.handoff.transport import bootstrap

    return getattr(bootstrap, "STALE", "")


@pytest.mark.integration
def test_a_lookup_outside_the_time_window_is_refused_and_never_judged(tmp_path, monkeypatch):
    """The second guard: a lookup that answers this run's challenge but was sent more than
    bootstrap.LOOKUP_WINDOW_S from this side's clock is refused with a line naming the window
    (to the prefill side that sent it), counted, and not judged (its advertised address is
    never probed); the decode side serves on, and a fresh lookup gets the endpoints. The
    decode side's bootstrap serves in a thread here, over real sockets."""
    from orchestrator.handoff.transport import bootstrap
    from orchestrator.handoff.transport.advert import DecodeAdvert
    from orchestrator.job.lifecycle import Signals
    from orchestrator.job.specs import bootstrap_spec
    from orchestrator.results.records import RunResult

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    cfg = typed_cfg("transport.address_check=fail", "endpoints.startup_timeout_s=60")
    secret = SECRET.encode()
    out = RunResult(run_dir=str(tmp_path))
    infos = [[{"control_endpoint": "tcp://127.0.0.1:1", "data_endpoint": "tcp://127.0.0.1:2",
               "transport": "tcp", "session_id": None}]]
    import structlog

    side = bootstrap._Bootstrap(bootstrap_spec(cfg.transport, cfg.endpoints, cfg.layout.name, None), secret,
                                [[DecodeAdvert(**i) for i in inst] for inst in infos], out,
                                structlog.get_logger("test"))
    signals = Signals()  # not entered: the test ends the loop by setting caught
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            side.serve(signals)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        wait_for(lambda: out.bootstrap is not None or failed, 30, "the bootstrap address")
        port = int(out.bootstrap.rsplit(":", 1)[1])
        auth, nonce = Authenticator(secret), new_nonce()
        dead = {"address": "127.0.0.1", "step": "SGLANG_HOST_IP", "interface": "lo", "port": free_port(),
                "fix": "SGLANG_HOST_IP=127.0.0.1", "error": ""}

        def lookup(**fields) -> bytes:
            return auth.seal(wire.encode("lookup", rank=0, prefill_ranks=1, nonce=nonce, **fields))

        now_ms = time.time_ns() // 1_000_000
        first = _ask(port, lookup(sent_ms=now_ms))
        assert [a["type"] for a in first] == ["challenge"] and first[0]["answer_to"] == nonce, first
        challenge = first[0]["challenge"]
        late = _ask(port, lookup(challenge=challenge, sent_ms=now_ms - 3_600_000, advertised=dead))
        assert [a["type"] for a in late] == ["error"], late
        assert "outside the 120 s lookup window" in late[0]["detail"] and late[0]["answer_to"] == nonce
        assert side.judged == {} and side.stale == 1 and thread.is_alive() and not failed
        fresh = _ask(port, lookup(challenge=challenge, sent_ms=time.time_ns() // 1_000_000))
        assert [a["type"] for a in fresh] == ["decodes"] and fresh[0]["answer_to"] == nonce, fresh
        assert fresh[0]["infos"] == infos
    finally:
        signals.caught = "SIGTERM"
        thread.join(30)
    assert not failed, failed


@pytest.mark.integration
def test_a_recorded_answer_is_never_taken_by_a_prefill_side(monkeypatch):
    """The other direction: whoever the prefill side was pointed at answers each of its
    lookups with a sealed endpoints answer recorded from another run (without a nonce, as at
    3a078eb, or echoing that run's), advertising 192.0.2.2:39679. At 3a078eb the prefill side
    took the first (and probed 192.0.2.2). Now it takes none of them, judges none (the address
    in them is never probed), and ends at its window saying how many answers were another
    run's. The peer is a ROUTER in a thread here, over real sockets."""
    from orchestrator.handoff.transport.bootstrap import lookup
    from orchestrator.job.lifecycle import RunFailed, Signals
    from orchestrator.job.specs import bootstrap_spec

    secret = SECRET.encode()
    auth = Authenticator(secret)
    dead = {"address": "192.0.2.2", "step": "SGLANG_HOST_IP", "interface": "", "port": 39679,
            "fix": "SGLANG_HOST_IP=127.0.0.1", "error": ""}
    infos = [[{"control_endpoint": "tcp://127.0.0.1:1", "data_endpoint": "tcp://127.0.0.1:2",
               "transport": "tcp", "session_id": None}]]
    recorded = [auth.seal(wire.encode("decodes", infos=infos, prefill_ranks=1, advertised=dead, **to))
                for to in ({}, {"answer_to": new_nonce()})]  # as 3a078eb answered, and as now
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    asks: list[bytes] = []
    stop = threading.Event()

    def peer() -> None:
        while not stop.is_set():
            if router.poll(50):
                ident, frame = router.recv_multipart()
                asks.append(frame)
                router.send_multipart([ident, recorded[len(asks) % 2 - 1]])

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    cfg = typed_cfg("endpoints.startup_timeout_s=4", "transport.address_check=warn")
    try:
        with Signals() as signals, pytest.raises(RunFailed) as failed:
            lookup(bootstrap_spec(cfg.transport, cfg.endpoints, cfg.layout.name, f"127.0.0.1:{port}"), secret,
                   signals)
    finally:
        stop.set()
        thread.join(5)
        router.close(0)
        ctx.term()
    assert len(asks) >= 2 and str(failed.value).startswith(f"no decode side answered at 127.0.0.1:{port} within "
                                                 "endpoints.startup_timeout_s=4"), failed.value
    assert "authentic answers were to another run's lookup" in str(failed.value)
    assert "192.0.2.2" not in str(failed.value)


# ---- an over-long field is named as that, by both sides ---------------------------------------
@pytest.mark.integration
def test_an_over_long_string_is_told_apart_from_a_malformed_message():
    """wire.decode names a string over its field's limit (TooLong: the field's path, its
    length, the limit); any other fault stays a plain WireError."""
    versions = {"orchestrator": "7" * 300}
    with pytest.raises(wire.WireError) as long:
        wire.decode(wire.encode("lookup", rank=0, prefill_ranks=1, versions=versions))
    assert type(long.value).__name__ == "TooLong"
    assert str(long.value) == "lookup field 'versions.orchestrator' is 300 chars, over 256"
    with pytest.raises(wire.WireError) as long:
        wire.decode(wire.encode("error", detail="x" * 5000))
    assert str(long.value) == "error field 'detail' is 5000 chars, over 4096"
    with pytest.raises(wire.WireError) as bad:
        wire.decode(wire.encode("lookup", rank=-1, prefill_ranks=1, versions={"orchestrator": "1"}))
    assert type(bad.value) is wire.WireError


@pytest.mark.integration
def test_an_over_long_version_is_named_as_over_long_on_both_sides_not_the_secret(tmp_path):
    """A prefill side whose version string is 300 chars (the wire's limit is 256). At 3a078eb
    its lookup was counted as "not an authentic lookup" and never answered: the prefill side
    timed out asking about transport.secret_env, and the decode side too. Now the decode side
    refuses it as over-long, tells the prefill side, which ends with that line at once, and
    ends its own wait with the same line; neither blames the secret. (The prefill side starts
    first and is asking before the decode side listens: the decode side's 20 s window holds
    on a loaded box.)"""
    port = free_port()
    long_env = {**LOOKUP_ENV, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=" + "7" * 300}
    prefill = _popen("role=prefill", f"peer=127.0.0.1:{port}", "endpoints.startup_timeout_s=120",
                     f"hydra.run.dir={tmp_path / 'p'}", env=long_env)
    wait_for(lambda: _logged(tmp_path / "p" / "orchestrator.log", "address_advertised") or prefill.poll() is not None,
              120, "the prefill side's lookup")
    decode = _popen("role=decode", f"transport.bootstrap_port={port}", "endpoints.startup_timeout_s=20",
                    f"hydra.run.dir={tmp_path / 'd'}")
    p_out, p_err = prefill.communicate(timeout=200)
    d_out, d_err = decode.communicate(timeout=200)
    said = "lookup field 'versions.orchestrator' is 300 chars, over 256"
    p_line, d_line = _error_line(p_out), _error_line(d_out)
    assert prefill.returncode == 3 and said in p_line and "secret" not in p_line, (p_out, p_err)
    assert decode.returncode == 3 and said in d_line and "secret" not in d_line, (d_out, d_err)
    assert _logged(tmp_path / "d" / "orchestrator.log", "bootstrap_rejected", reason=said)
    assert not _logged(tmp_path / "d" / "orchestrator.log", "bootstrap_rejected", reason="not an authentic lookup")


# ---- peer strings on the console ---------------------------------------------------------------
@pytest.mark.integration
def test_the_console_helper_escapes_what_a_terminal_acts_on():
    from orchestrator.results import escape

    assert escape.printable("a\x1b[2Jb\r\nfake: verified 200\x07\u2028\u202e é") == \
        "a\\x1b[2Jb\\r\\nfake: verified 200\\x07\\u2028\\u202e é"
    line = "requests 20: verified 20, corrupted 0, failed 0   routes: engine=20"
    assert escape.printable(line) is line  # this tool's own lines stay as they are


@pytest.mark.integration
def test_peer_strings_reach_the_console_escaped(tmp_path):
    """The prefill side's SGLANG_HOST_IP carries CR/LF and ESC (a forged summary line and a
    terminal sequence), both sides' version strings ESC sequences. At 3a078eb the peer's
    strings were printed as they were: the decode side's console showed a line `fake: verified
    200, corrupted 0` of the prefill's making. Now every console line (the summary's warnings,
    the console log lines) shows them escaped, as results.json keeps them (JSON-escaped)."""
    port = free_port()
    forged = "127.0.0.1\r\nfake: verified 200, corrupted 0\x1b[2K"
    decode = _popen("role=decode", f"transport.bootstrap_port={port}", "endpoints.startup_timeout_s=300",
                    f"hydra.run.dir={tmp_path / 'd'}",
                    env={**LOOKUP_ENV, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=7.7\x1b[31mred"})
    hostile = {**LOOKUP_ENV, "SGLANG_HOST_IP": forged, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=6.6\x1b]0;t\x07"}
    prefill = _popen("role=prefill", f"peer=127.0.0.1:{port}", f"workload.requests={REQUESTS}",
                     f"hydra.run.dir={tmp_path / 'p'}", env=hostile)
    p_out, p_err = prefill.communicate(timeout=300)
    d_out, d_err = decode.communicate(timeout=120)
    assert prefill.returncode == 0 and decode.returncode == 0, (p_out, p_err, d_out, d_err)
    for text in (p_out + p_err, d_out + d_err):
        assert "\x1b" not in text and "\r" not in text and "\x07" not in text, text
        assert not [ln for ln in text.splitlines() if ln.startswith("fake:")], text
    # the decode side's summary names the prefill's address, escaped; the prefill's, the version
    assert "\\r\\nfake: verified 200, corrupted 0\\x1b[2K" in d_out, d_out
    assert "6.6\\x1b]0;t\\x07" in d_out and "7.7\\x1b[31mred" in p_out, (p_out, d_out)
    # results.json keeps the peer's string as it came (JSON escapes it)
    assert any(forged in w for w in Results.read(tmp_path / "d").ending.warnings)
