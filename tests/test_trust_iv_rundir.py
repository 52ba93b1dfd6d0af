"""Trust IV (issue 36), the run dir: a reused run dir never becomes evidence (a run or sweep
into a dir holding another run's files is refused; every records, verdicts and decisions line
carries its run's id and readers count only their dir's run), every file a run opens is
opened as the bootstrap file is (no link followed, no FIFO blocking, regular files only),
a full disk ends a sweep in one line with its summary, and MPS dirs are checked for links
and ownership. Real processes where a run is the subject; races forced by hooks."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.results import rundir
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import Record, read_jsonl, read_records
from orchestrator.results.rundir import RunDirBusy, RunFile, lock_run_dir, unlock_run_dir

from .conftest import ROOT

RUN_ID_NAME, SWEEP_ID_NAME = ".run.id", ".sweep.id"  # rundir's names (spelled here: the file the run claims)

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
# The loser's pre-check patched out: the run itself (app.run_job) must refuse
_NO_PRECHECK = ("import sys, orchestrator.preflight.compose as c; c.precheck = lambda argv: None; "
                "sys.argv = ['orchestrator', *sys.argv[1:]]; from orchestrator.__main__ import entry; entry()")


def _cli(*args: str, timeout: float = 300, precheck: bool = True) -> subprocess.CompletedProcess:
    head = ["-m", "orchestrator"] if precheck else ["-c", _NO_PRECHECK]
    return subprocess.run([sys.executable, *head, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _one_error(text: str, prefix: str = "error: ") -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


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
    from orchestrator.handoff.recovery import reconstruct
    from orchestrator.results.reporting import verified_after_lost

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
    res = reconstruct(cfg, tmp_path, 0, "prefill", Detail.prefill_lost)
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

    from orchestrator.handoff import mps
    from orchestrator.handoff.mps import mps_for
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
    with mps_for(sharing, tmp_path / "run", structlog.get_logger("test")) as record:
        pass
    assert victim.read_text() == "precious\n"
    assert not record["mps"] and "reaper.log" in record["error"]


def test_a_linked_mps_dir_is_refused(tmp_path):
    """run_dir/mps a link to a dir elsewhere: refused (the daemon's pipe and logs never land
    in the victim dir)."""
    from orchestrator.handoff.mps import OwnDaemon

    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mps").symlink_to(victim)
    with pytest.raises(UNSAFE):
        OwnDaemon(FAKE, tmp_path / "run")
    assert list(victim.iterdir()) == []
    assert stat.S_ISLNK((tmp_path / "run" / "mps").lstat().st_mode)
