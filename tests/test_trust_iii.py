"""Trust III (issue 31): the split run's front door, the files it shares, and the last
tracebacks after start. Real processes, real sockets, real Mooncake engines; races are forced
by hooks (a lock held by the test, a patched pre-check), never by timing."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.results.rundir import NotARegularFile, read_shared, write_atomic
from orchestrator.results.schema import Results

from .conftest import ROOT
from .helpers.procs import free_port, reap, wait_for

pytestmark = pytest.mark.integration
SECRET_VAR = "TRUST3_TEST_SECRET"
ENV = {**os.environ, SECRET_VAR: "trust-three-secret-5d2a", "PYTHONUNBUFFERED": "1"}
STARTED: list[subprocess.Popen] = []




@pytest.fixture(autouse=True)
def _reap():
    """What a test started and left running (a bound that failed) is killed with its tree."""
    yield
    reap(STARTED)


def _popen(*args: str, env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=env or ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    return proc


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)



def _logged(path: Path, event: str) -> bool:
    try:
        return event in path.read_text()
    except OSError:
        return False


def _one_error(text: str, prefix: str = "error: ") -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    return lines[0]


# ---- 2. shared files handled as hostile ------------------------------------------------------
def test_write_atomic_never_follows_a_link_planted_in_a_shared_dir(tmp_path):
    """A 0777 directory without the sticky bit (a shared filesystem): links planted at every
    name a writer could have used before (`.NAME.tmp`) and at the target itself."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (shared / ".bootstrap.json.tmp").symlink_to(victim)
    target = shared / "bootstrap.json"
    target.symlink_to(victim)
    write_atomic(target, '{"address": "127.0.0.1:1"}\n')
    assert victim.read_text() == "precious\n"
    assert not target.is_symlink() and json.loads(target.read_text()) == {"address": "127.0.0.1:1"}
    assert sorted(p.name for p in shared.iterdir()) == [".bootstrap.json.tmp", "bootstrap.json"]


def test_a_fifo_or_device_is_never_read_as_a_shared_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    for path in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises((NotARegularFile, IsADirectoryError)):
            read_shared(path)
    assert time.monotonic() - t0 < 5  # nothing waited on a writer
    big = tmp_path / "big"
    big.write_bytes(b"x" * (1 << 17))
    with pytest.raises(NotARegularFile):
        read_shared(big)


def test_prefill_refuses_a_fifo_as_its_bootstrap_file(tmp_path):
    """issue 31's trial: the prefill blocked in open() for ever, deaf to SIGINT/SIGTERM."""
    fifo = tmp_path / "bootstrap"
    os.mkfifo(fifo)
    proc = _cli("role=prefill", f"transport.secret_env={SECRET_VAR}", f"transport.bootstrap_file={fifo}",
                "endpoints.startup_timeout_s=120", f"hydra.run.dir={tmp_path / 'p'}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = _one_error(proc.stdout + proc.stderr, "ERROR:")
    assert "transport.bootstrap_file" in line and "not a regular file" in line
    assert stat.S_ISFIFO(fifo.stat().st_mode)  # left as it was


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_prefill_waiting_for_its_bootstrap_file(tmp_path, sig):
    """The prefill waits for a bootstrap file no decode side wrote (startup_timeout_s 300): a
    signal in that phase ends it at once (the log line marks the phase: no timing)."""
    run_dir = tmp_path / "p"
    proc = _popen("role=prefill", f"transport.secret_env={SECRET_VAR}",
                  f"transport.bootstrap_file={tmp_path / 'none-yet'}", "endpoints.startup_timeout_s=300",
                  f"hydra.run.dir={run_dir}")
    wait_for(lambda: _logged(run_dir / "orchestrator.log", "bootstrap_waiting"), 120, "the wait")
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out + err
    assert time.monotonic() - t0 < 30 and "Traceback" not in out + err
    assert Results.read(run_dir).ending.interrupted


def test_decode_side_stops_with_a_fifo_planted_at_its_bootstrap_file(tmp_path):
    """Its address written, the file is swapped for a FIFO: SIGTERM still ends the decode
    side (it checks the file before removing it: issue 31's trial hung in that read)."""
    shared = tmp_path / "bootstrap"
    run_dir = tmp_path / "d"
    proc = _popen("role=decode", f"transport.secret_env={SECRET_VAR}", f"transport.bootstrap_file={shared}",
                  "endpoints.startup_timeout_s=300", f"hydra.run.dir={run_dir}")
    wait_for(lambda: _logged(run_dir / "orchestrator.log", "bootstrap_listening"), 120, "the decode side")
    shared.unlink()
    os.mkfifo(shared)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    assert "Traceback" not in out + err
    assert stat.S_ISFIFO(shared.stat().st_mode)  # not ours: left alone


# ---- 3. the disk is full wherever it fills ---------------------------------------------------
def _tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")


@pytest.mark.parametrize("size,where", [("8k", ".hydra/"), ("64k", ""), ("700k", "")],
                         ids=["hydra-save", "mid-run", "records"])
def test_a_full_disk_is_exit_3_and_one_line_naming_the_file(tmp_path, size, where):
    """8k: Hydra's own .hydra/ save cannot fit; 64k, 700k: the per-request files fill mid-run.
    issue 31's trial: a traceback and exit 2 at both (recovery._append, hydra _save_config)."""
    disk = tmp_path / "small"
    _tmpfs(disk, size)
    try:
        proc = _cli("workload.requests=1000", f"hydra.run.dir={disk / 'run'}")
        records = [p for p in (disk / "run").glob("requests*.jsonl")]
        torn = [p.name for p in records if p.read_bytes() and not p.read_bytes().endswith(b"\n")]
        leftovers = [p.name for p in (disk / "run").rglob("*.tmp")]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line.startswith("error: no space left writing ") and f"run/{where}" in line, line
    assert "a file of the run dir" not in line  # the file is named
    assert torn == [] and leftovers == []


# ---- 4. one run per run dir, decided before anything is written ----------------------------
_NO_PRECHECK = ("import sys, orchestrator.preflight.compose as c; c.precheck = lambda argv: None; "
                "sys.argv = ['orchestrator', *sys.argv[1:]]; from orchestrator.__main__ import entry; entry()")


def test_a_run_that_loses_the_run_dir_writes_nothing_there(tmp_path):
    """The race of issue 31 (both pre-checks pass, then both Hydras run), forced: the test
    holds the dir's lock as the winner would, and the loser's pre-check is patched out."""
    from orchestrator.results.rundir import lock_run_dir

    run_dir = tmp_path / "run"
    lock = lock_run_dir(run_dir)
    try:
        before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
        proc = subprocess.run([sys.executable, "-c", _NO_PRECHECK, "workload.requests=500", "workload.seed=222",
                               f"hydra.run.dir={run_dir}"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                              timeout=120)
        after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    finally:
        lock.close()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "in use by another run" in _one_error(proc.stderr)
    assert after == before == {".run.lock": before[".run.lock"]}


# ---- 6. no traceback after start ------------------------------------------------------------
def test_a_taken_bootstrap_port_is_exit_3_and_one_line(tmp_path):
    """issue 31's trial: a 30-line ZMQError traceback, exit 2, no results.json."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _cli("role=decode", f"transport.secret_env={SECRET_VAR}", f"transport.bootstrap_port={port}",
                    f"hydra.run.dir={tmp_path / 'd'}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = _one_error(proc.stdout + proc.stderr, "ERROR:")
    assert f"transport.bootstrap_port={port}" in line and "Address already in use" in line
    assert Results.read(tmp_path / "d").exit_code == 3


@pytest.mark.parametrize("overrides,key", [
    (["endpoints.prefill_ranks=2", "workload.requests=18446744073709551615"], "workload.requests"),
    (["workload.requests=9223372036854775807", "endpoints.prefill_ranks=2"], "workload.requests"),
    (["workload.rate=1e-300"], "workload.rate"),
    (["workload.rate=0.0001", "transport.timeout_s=10"], "workload.rate"),
    (["workload.rate=5", "workload.requests=1000000000"], "workload.requests"),
], ids=["ids-past-2^64", "ids-past-2^63", "rate-1e-300", "rate-below-100-timeouts", "open-loop-too-many"])
def test_request_ids_and_absurd_rates_are_refused_before_start(overrides, key):
    """issue 31's trial: rank 1 failed at start, then SIGINT gave a struct.error traceback;
    workload.rate=1e-300 ran and never saw an arrival. The entry's pre-check refuses them."""
    from orchestrator.preflight.compose import precheck

    problem = precheck(overrides)
    assert problem is not None and problem.startswith(f"{key}="), problem


def test_an_absurd_rate_on_the_command_line_is_exit_2_and_no_run_dir(tmp_path):
    proc = _cli("endpoints.prefill_ranks=2", "workload.rate=1e-300", f"hydra.run.dir={tmp_path / 'run'}",
                timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith("error: workload.rate=1e-300 is not allowed")
    assert not (tmp_path / "run").exists()


def test_a_sane_open_loop_rate_is_allowed():
    from orchestrator.job.check import check_profile
    from orchestrator.profile.platform import detect

    from .conftest import typed_cfg

    cfg = typed_cfg("workload.rate=0.01", "transport.timeout_s=10")  # one arrival expected in 100 s
    check_profile(cfg, detect())


# ---- 9. config-dir errors like command-line errors ------------------------------------------
def _config_dir(root: Path) -> Path:
    files = {
        "badkey": "workload:\n  requestz: 10\n",
        "badtype": "workload:\n  requests: lots\n",
        "range": "buffers:\n  size: 100000000\n",
        "broken": "workload:\n  requests: 10\n  concurrency: [1, 2\n",
        "good": "workload:\n  requests: 50\n",
    }
    conf = root / "conf"
    (conf / "experiment").mkdir(parents=True)
    for name, body in files.items():
        (conf / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\n{body}")
    return conf


@pytest.mark.parametrize("name,says", [
    ("badkey", "workload.requestz: Key 'requestz' not in 'WorkloadConfig'"),
    ("badtype", "workload.requests: Value 'lots' of type 'str' could not be converted to Integer"),
    ("range", "buffers.size=100000000 is not allowed"),
    ("broken", ":5: not valid YAML"),
])
def test_a_config_dir_mistake_is_one_line_naming_file_and_key(tmp_path, name, says):
    """issue 31's trial: Hydra's 6-line message with no `error:` line (unknown key, wrong
    type), and an out-of-range value refused only after the run dir was made."""
    from orchestrator.preflight.compose import precheck

    conf = _config_dir(tmp_path)
    problem = precheck(["--config-dir", str(conf), f"experiment={name}"])
    assert problem is not None and "\n" not in problem, problem
    assert problem.startswith(str(conf / "experiment" / f"{name}.yaml")) and says in problem, problem


def test_a_config_dir_mistake_on_the_command_line_is_exit_2_and_no_run_dir(tmp_path):
    conf = _config_dir(tmp_path)
    proc = _cli(f"--config-dir={conf}", "experiment=range", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = _one_error(proc.stderr)
    assert line.startswith(f"error: {conf / 'experiment' / 'range.yaml'}: buffers.size=100000000"), line
    assert not (tmp_path / "run").exists()


def test_a_bad_file_fails_only_the_runs_that_use_it(tmp_path):
    """The dir holds four bad experiments; the run that picks the good one runs; a value
    given on the command line is not blamed on a file."""
    from orchestrator.preflight.compose import precheck

    conf = _config_dir(tmp_path)
    assert precheck(["--config-dir", str(conf), "experiment=good"]) is None
    assert precheck(["--config-dir", str(conf), "experiment=good", "workload.requests=0"]).startswith(
        "workload.requests=0 is not allowed")
    proc = _cli("--config-dir", str(conf), "experiment=good", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Results.read(tmp_path / "run").verified == 50


def test_a_sweep_over_bad_files_runs_the_good_jobs_and_refuses_the_others_as_rows(tmp_path):
    """A sweep over the dir's experiments: the good one runs; each job that picks a bad file is
    a refused row naming the file (not YAML, unknown key, out of range), exit 2, no traceback."""
    from orchestrator.sweep.sweep import collect

    conf, sweep = _config_dir(tmp_path), tmp_path / "sweep"
    proc = _cli("-m", f"--config-dir={conf}", "experiment=broken,good,badkey,range",
                f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    rows = {r["experiment"]: r for r in collect(sweep)[1]}
    assert sorted(rows) == ["badkey", "broken", "good", "range"]
    assert rows["good"]["status"].value == "ok" and rows["good"]["verified"] == 50
    for name, says in (("broken", ":5: not valid YAML"), ("badkey", "Key 'requestz' not in 'WorkloadConfig'"),
                       ("range", "buffers.size=100000000 is not allowed")):
        row = rows[name]
        assert row["status"].value == "error" and row["exit_code"] == 2, row
        assert row["error"].startswith(str(conf / "experiment" / f"{name}.yaml")) and says in row["error"], row
    assert "sweep: 4 combinations: 1 ok, 3 error" in proc.stdout


def test_a_sweep_whose_every_value_is_a_bad_file_is_refused_whole(tmp_path):
    """Nothing would run: one error line before start, as for a single run, and no sweep dir."""
    from orchestrator.sweep.bad_files import split_sweep

    conf, sweep = _config_dir(tmp_path), tmp_path / "sweep"
    argv = ["-m", f"--config-dir={conf}", "experiment=broken,badkey", f"hydra.sweep.dir={sweep}"]
    assert split_sweep(argv) == (argv, [])
    proc = _cli(*argv, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert _one_error(proc.stderr).startswith(f"error: {conf / 'experiment' / 'broken.yaml'}:5")
    assert not sweep.exists()


def test_split_sweep_takes_the_bad_values_out_and_numbers_their_jobs_after_the_rest(tmp_path):
    from orchestrator.sweep.bad_files import split_sweep

    conf = _config_dir(tmp_path)
    argv = ["-m", "--config-dir", str(conf), "experiment=badkey,good", "workload.seed=1,2", "workload.rate=50"]
    kept, jobs = split_sweep(argv)
    assert kept == ["-m", "--config-dir", str(conf), "experiment=good", "workload.seed=1,2", "workload.rate=50"]
    assert [(j.num, j.overrides) for j in jobs] == [
        (2, ("experiment=badkey", "workload.seed=1", "workload.rate=50")),
        (3, ("experiment=badkey", "workload.seed=2", "workload.rate=50"))]
    assert all(j.error.startswith(str(conf / "experiment" / "badkey.yaml")) for j in jobs)
    assert split_sweep(argv[1:]) == (argv[1:], [])  # not a sweep: precheck's business


# ---- 7. one truth per run ------------------------------------------------------------------
def test_a_verdict_after_the_prefill_gave_up_is_named(tmp_path):
    """The files of issue 31's trial, in their real format: the decode's verdicts file says
    verified for 3 requests the prefill's requests file failed as peer_lost."""
    from orchestrator.results.outcomes import Detail, Outcome
    from orchestrator.results.records import Record
    from orchestrator.results.reporting import verified_after_lost

    def rec(rid: int, ok: bool) -> str:
        return Record(rid, rid + 1, 0, rid % 4, "engine", 1.0, 1.0, 1.0, 1.0,
                      Outcome.verified if ok else Outcome.failed, Detail.none if ok else Detail.peer_lost,
                      "").line()

    (tmp_path / "requests.jsonl").write_text("".join(rec(i, i < 5) + "\n" for i in range(10)))
    (tmp_path / "verdicts-decode.jsonl").write_text("".join(
        json.dumps({"prefill": 0, "rid": i, "outcome": "verified", "detail": "none"}) + "\n" for i in range(8)))
    assert verified_after_lost(tmp_path) == [5, 6, 7]


def test_results_agree_with_the_decode_after_a_decode_stopped_for_good(tmp_path):
    """The decode is stopped (SIGSTOP) for 8 s, past transport.timeout_s=2: its prefill
    gives up on it, the runner resumes it at the end. Whatever it verified after its prefill
    gave up on it is named, so
    verified + verified_after_lost = decode_verified, and the ids are those the files differ on."""
    run_dir = tmp_path / "run"
    proc = _cli("faults=decode_stopped", "faults.at_request=200", "faults.duration_s=8", "transport.timeout_s=2",
                "workload.requests=600", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    res = Results.read(run_dir)
    raw = json.loads((run_dir / "results.json").read_text())
    verdicts = {json.loads(ln)["rid"]: json.loads(ln)["outcome"]
                for ln in (run_dir / "verdicts-decode.jsonl").read_text().splitlines()}
    records = {json.loads(ln)["rid"]: json.loads(ln)["outcome"]
               for ln in (run_dir / "requests.jsonl").read_text().splitlines()}
    differ = sorted(r for r, o in verdicts.items() if o == "verified" and records.get(r) != "verified")
    assert raw["verified"] + raw["verified_after_lost"] == raw["decode_verified"] == \
        raw["decode"]["decode"]["outcomes"].get("verified", 0)
    assert raw["verified_after_lost_ids"] == differ and res.verified >= 200


# ---- 8. the dead decode is named -------------------------------------------------------------
def _decode_killed_after_ready(spec, run_dir, secret, conn, *args) -> None:
    """A decode that reports ready (a control listener that takes the prefill's hello and
    never answers) and is SIGKILLed at once: the window of issue 31's case 10."""
    import zmq

    from orchestrator.handoff.transport.advert import DecodeAdvert
    from orchestrator.job import protocol

    ctx = zmq.Context()
    control, data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    cport = control.bind_to_random_port("tcp://127.0.0.1")
    dport = data.bind_to_random_port("tcp://127.0.0.1")
    protocol.Channel(conn).send(protocol.Ready(DecodeAdvert(
        control_endpoint=f"tcp://127.0.0.1:{cport}", data_endpoint=f"tcp://127.0.0.1:{dport}",
        transport="zmq-tcp", session_id=None, engine_exposed=())))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_decode_dead_between_ready_and_hello_is_named_not_the_prefill(tmp_path, monkeypatch):
    """issue 31's trial: "prefill endpoint failed: TimeoutError: decode did not answer hello
    within transport.timeout_s=10", lost: {}, 12.4 s after the kill. The runner watches the
    decodes while the prefills bootstrap: the decode is lost, within transport.timeout_s."""
    from orchestrator.job import runner
    from orchestrator.job.specs import build_specs
    from orchestrator.profile.platform import detect

    from .conftest import plan_of, typed_cfg

    monkeypatch.setattr(runner, "decode_main", _decode_killed_after_ready)
    cfg = typed_cfg("transport.route=tcp", "workload.requests=20", "transport.timeout_s=10",
                    "endpoints.startup_timeout_s=120")
    out = runner.Job(build_specs(cfg, plan_of(cfg, detect())), tmp_path, secret=b"s" * 32).run()
    assert out.error is not None and out.error.startswith("decode exited with code -9"), out.error
    assert list(out.lost) == ["decode"] and "prefill" not in (out.error or "")
    assert "did not answer hello" not in out.error  # named before the prefill's hello timed out


def test_a_refusal_after_a_slow_probe_reaches_the_prefill_that_asked_meanwhile(monkeypatch):
    """The decode side judges the first lookup (its address probe takes seconds) while the
    prefill side asks again every second; it then answers the asks queued meanwhile in order,
    ends after two refusals (bootstrap._Bootstrap._refused) and closes. Those answers reach the prefill
    side, even when they land while it is not reading and the connection is gone before it
    reads: it ends on the refusal, not at endpoints.startup_timeout_s (seen under load in
    test_address_netns). Hooks order it: the peer answers once 4 asks arrived and the prefill
    side is held before its 5th ask; it reads only after the peer closed."""
    import threading

    import zmq

    from orchestrator.handoff.transport import peercheck, wire
    from orchestrator.handoff.transport.auth import Authenticator
    from orchestrator.handoff.transport.bootstrap import REFUSAL_LINGER_MS, lookup
    from orchestrator.job.lifecycle import RunFailed, Signals
    from orchestrator.job.specs import bootstrap_spec

    from .conftest import typed_cfg

    secret = b"refusal-after-probe-secret-1f3a"
    auth = Authenticator(secret)
    fctx = zmq.Context()  # the peer's own: its term() returns once its socket is closed
    router = fctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, REFUSAL_LINGER_MS)  # as the decode side closes after refusing
    port = router.bind_to_random_port("tcp://127.0.0.1")
    asks: list[list[bytes]] = []
    held, closed = threading.Event(), threading.Event()
    fields, calls = peercheck.PeerCheck.fields, [0]

    def fields_hook(self):  # before each ask: the 5th waits until the peer answered and closed
        calls[0] += 1
        if calls[0] == 5:
            held.set()
            closed.wait(60)
        return fields(self)

    def decode_side() -> None:
        try:
            while len(asks) < 4 and router.poll(60_000):  # the first judged, three asked meanwhile
                asks.append(router.recv_multipart())
            if not held.wait(60):
                return
            refusal = auth.seal(wire.encode(wire.ErrorMsg(detail="the prefill side would advertise X")))
            for frames in asks[:2]:  # answered in order; two refusals end the decode side
                router.send_multipart([frames[0], refusal])
        finally:
            router.close()
            fctx.term()
            closed.set()

    monkeypatch.setattr(peercheck.PeerCheck, "fields", fields_hook)
    peer = threading.Thread(target=decode_side, daemon=True)
    peer.start()
    cfg = typed_cfg("endpoints.startup_timeout_s=60", "transport.address_check=off")
    t0 = time.monotonic()
    try:
        with Signals() as signals, pytest.raises(RunFailed) as failed:
            lookup(bootstrap_spec(cfg.transport, cfg.endpoints, cfg.layout.name, f"127.0.0.1:{port}"), secret,
                   signals)
    finally:
        closed.set()
        peer.join(70)
    assert len(asks) == 4 and calls[0] >= 5
    assert str(failed.value) == (f"the decode side at 127.0.0.1:{port} refused: "
                                 "the prefill side would advertise X"), failed.value
    assert time.monotonic() - t0 < 60  # on the refusal, not at endpoints.startup_timeout_s


# ---- 1. an unauthenticated frame never changes a run's fate ----------------------------------
def test_forged_frames_at_the_bootstrap_port_never_end_the_decode_side(tmp_path):
    """issue 31's attack: before the real prefill's first lookup, a lookup-shaped frame with
    16 random bytes as its MAC (from a DEALER) ended the decode side (exit 3, "different
    secrets"). Now it, a lookup sealed with another secret and garbage are counted and
    dropped; the real prefill then connects and every handoff verifies."""
    import zmq

    from orchestrator.handoff.transport.auth import Authenticator

    port = free_port()
    decode = _popen("role=decode", f"transport.secret_env={SECRET_VAR}", f"transport.bootstrap_port={port}",
                    "endpoints.startup_timeout_s=300", f"hydra.run.dir={tmp_path / 'd'}")
    wait_for(lambda: _logged(tmp_path / "d" / "orchestrator.log", "bootstrap_listening"), 120, "the decode side")
    lookup = json.dumps({"type": "lookup", "rank": 0, "prefill_ranks": 1}).encode()
    ctx = zmq.Context()
    try:
        for frames in ([lookup + os.urandom(16)], [Authenticator(b"another secret" * 3).seal(lookup)],
                       [b"\x00" * 40], [b"garbage", b"two frames"], [lookup]):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(frames)
            sock.poll(500)  # a lookup-shaped one gets a sealed refusal; nothing else an answer
            sock.close(0)
    finally:
        ctx.term()
    wait_for(lambda: _logged(tmp_path / "d" / "orchestrator.log", "bootstrap_rejected") or decode.poll() is not None,
              60, "the rejections")
    assert decode.poll() is None, decode.communicate()
    prefill = _popen("role=prefill", f"transport.secret_env={SECRET_VAR}", f"peer=127.0.0.1:{port}",
                     "workload.requests=50", f"hydra.run.dir={tmp_path / 'p'}")
    p_out, p_err = prefill.communicate(timeout=300)
    d_out, d_err = decode.communicate(timeout=120)
    assert prefill.returncode == 0 and decode.returncode == 0, (p_out, p_err, d_out, d_err)
    assert Results.read(tmp_path / "p").verified == 50
    assert "Traceback" not in p_out + p_err + d_out + d_err


# ---- 5. slots held by failed rows say so ------------------------------------------------------
def _held_run(tmp_path, name: str, *overrides: str):
    run_dir = tmp_path / name
    proc = _cli("transport.timeout_s=2", f"hydra.run.dir={run_dir}", *overrides)
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc, json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize("hold", [None, 0.5], ids=["default", "never_landed_s=0.5"])
def test_rows_that_never_land_say_how_long_they_held_their_slots(tmp_path, hold):
    """faults=aux_lost (from request 10, every 10th: "done" delivered, the row never): the 5
    rows fail room_never_landed, the summary and results.json say how long their slots were
    held: at least the hold (transport.timeout_s=2 by default, gate.never_landed_s when set)
    and, with generous margins for a loaded box, not much longer."""
    extra = [f"gate.never_landed_s={hold}"] if hold else []
    proc, res = _held_run(tmp_path, "run", "faults=aux_lost", "workload.requests=60", *extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert res["failure_reasons"] == {"room_never_landed": 5}
    held, limit = res["slots_held_by_failed_s"]["room_never_landed"], hold or 2.0
    assert 5 * limit <= held < 5 * (limit + 5.0), held
    assert "slots held by 5 room_never_landed rows" in proc.stdout


def test_a_slow_write_is_never_failed_at_the_default_hold(tmp_path):
    """faults=status_first holds every 5th request's row 1 s behind its "done" (a slow write):
    at the default (gate.never_landed_s=null: transport.timeout_s=2) all verify; the shorter
    hold is the trade it names (0.3 s fails them as room_never_landed)."""
    common = ("faults=status_first", "faults.rank=0", "faults.margin_us=1000000", "faults.at_request=5",
              "faults.every=5", "workload.requests=30", "workload.concurrency=2")
    proc, res = _held_run(tmp_path, "default", *common)
    assert proc.returncode == 0 and res["verified"] == 30, proc.stdout + proc.stderr
    proc, res = _held_run(tmp_path, "short", *common, "gate.never_landed_s=0.3")
    assert res["failure_reasons"].get("room_never_landed", 0) > 0, res["failure_reasons"]
