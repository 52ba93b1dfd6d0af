"""A run split across two "hosts": two network namespaces joined by a veth pair (TEST-NET-1,
192.0.2.1 prefill <-> 192.0.2.2 decode), each side started with its own command line
(`role=decode` / `role=prefill peer=HOST:PORT`) inside its namespace, as an operator would on
two machines. Real processes, real Mooncake (TCP transport) and ZMQ over a real link:

- every handoff verified for the engine route and the tcp route, each with Mooncake's
  P2PHANDSHAKE and with Mooncake's HTTP metadata server; both sides and the merged report
  agree;
- a wrong shared secret gets no endpoints and ends within endpoints.startup_timeout_s;
- a link cut mid-run is declared within transport.timeout_s, and what was verified stays so;
- a non-loopback host without transport.allow_remote=true is refused before anything starts.

Needs root and `ip netns` (skips otherwise). Nothing leaves the two namespaces: their only
non-loopback route is the veth. Run with `-s` to see the measured handoffs/s.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

import pytest

from orchestrator.results.schema import Results

from .conftest import ROOT
from .helpers.bounds import bound
from .helpers.netns import DECODE_IP, PREFILL_IP, NetnsPair, NetnsUnavailable

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.xdist_group("netns")]  # one worker: the module's pairs and cut runs are built once

SECRET_ENV = "PD_AUX_NETNS_TEST_SECRET"
SECRET = "netns-test-shared-secret-4f1c"
TIMEOUT_S = 3.0  # transport.timeout_s: a decode silent this long is declared lost
STARTUP_S = 20.0  # endpoints.startup_timeout_s for the positive runs
FAST = {"transport.timeout_s": TIMEOUT_S, "transport.mooncake.tcp_progress_timeout_s": 2,
        "endpoints.startup_timeout_s": STARTUP_S}
POSITIVE_REQUESTS = 400
PROC_TIMEOUT_S = 60.0  # no side of any run here may live longer than this
# Lost-peer detection: the prefill checks the silence of its decode at least every 50 ms
# (its poll wait), counted from the last control message it read, which is at most the
# time of the cut (handoffs flow every ~1 ms). The margin absorbs that poll, the log write
# and scheduling on a loaded 2-core box; measured detection is within ~0.05 s of timeout_s.
LOST_MARGIN_S = 1.0
_ports = itertools.count(17100)  # fresh namespaces: every port is free; one per use
RATES: dict[str, float] = {}
MEASURED: dict[str, float] = {}


# ---- the namespaces --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair():
    try:
        p = NetnsPair.create()
    except NetnsUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield p
    finally:
        problems = p.destroy()
        if RATES:
            print("\n[netns] handoffs/s per combination: "
                  + ", ".join(f"{k}={v:g}" for k, v in sorted(RATES.items())))
        if MEASURED:
            print("[netns] measured: " + ", ".join(f"{k}={v:.3f}" for k, v in sorted(MEASURED.items())))
        assert not problems, f"namespace clean-up: {problems}"


@pytest.fixture
def netns(pair):
    """The pair, with every process a test left inside killed and the link back up after it."""
    try:
        yield pair
    finally:
        for ns in (pair.prefill_ns, pair.decode_ns):
            pair.kill_all(ns)
        pair.restore()


# ---- one side of a run -----------------------------------------------------------------------
def _overrides(d: dict) -> list[str]:
    return [f"{k}={'null' if v is None else v}" for k, v in d.items()]


@dataclass
class Side:
    """One `python -m orchestrator` command inside a namespace; stdout and stderr go to files
    (a pipe nobody reads could fill up and stall the process)."""

    name: str
    proc: subprocess.Popen
    run_dir: Path
    out: Path
    err: Path
    t_start: float = field(default_factory=time.monotonic)
    t_end: Optional[float] = None

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    @property
    def elapsed(self) -> float:
        return (self.t_end or time.monotonic()) - self.t_start

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            pytest.fail(f"{self.name} still running after {timeout:g} s (killed)\n{self.tail()}")
        if self.t_end is None:
            self.t_end = time.monotonic()
        return rc

    def interrupt(self, timeout: float = 15.0) -> int:
        """Ctrl-C, as an operator would end a decode side whose prefill never said bye."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout)

    def results(self) -> Results:
        return Results.read(self.run_dir)

    def tail(self, n: int = 3000) -> str:
        return f"--- {self.name} stdout ---\n{self.stdout[-n:]}\n--- {self.name} stderr ---\n{self.stderr[-n:]}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start(pair: NetnsPair, ns: str, name: str, base: Path, overrides: dict, secret: str = SECRET,
          module: str = "orchestrator", args: Optional[list[str]] = None) -> Side:
    run_dir = base / name
    env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
    argv = args if args is not None else [*_overrides(overrides), f"hydra.run.dir={run_dir}"]
    out, err = base / f"{name}.stdout", base / f"{name}.stderr"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen(pair.exec_args(ns, [sys.executable, "-m", module, *argv]), cwd=ROOT,
                                env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL)
    return Side(name, proc, run_dir, out, err)


def decode_overrides(port: int, route: str, metadata: Optional[str] = None, **extra) -> dict:
    d = {"role": "decode", "transport.route": route, "transport.host": DECODE_IP,
         "transport.allow_remote": "true", "transport.secret_env": SECRET_ENV,
         "transport.bootstrap_port": port, **FAST}
    if metadata:
        d["transport.mooncake.metadata_server"] = metadata
    return {**d, **extra}


def prefill_overrides(port: int, route: str, requests: int, metadata: Optional[str] = None, **extra) -> dict:
    d = {"role": "prefill", "peer": f"{DECODE_IP}:{port}", "transport.route": route,
         "transport.host": PREFILL_IP, "transport.allow_remote": "true",
         "transport.secret_env": SECRET_ENV, "workload.requests": requests, **FAST}
    if metadata:
        d["transport.mooncake.metadata_server"] = metadata
    return {**d, **extra}


def no_traceback(*sides: Side) -> None:
    for s in sides:
        text = s.stdout + s.stderr
        assert "Traceback" not in text, s.tail()


def log_events(path: Path, event: str) -> list[dict]:
    """The JSON lines of one structured log with this event name."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            found.append(rec)
    return found


def wall(ts: str) -> float:
    """A structlog ISO timestamp (UTC, wall clock) in seconds since the epoch."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def records(run_dir: Path) -> list[dict]:
    """Complete lines of the prefill's requests.jsonl (the last one may be half written)."""
    path = run_dir / "requests.jsonl"
    if not path.exists():
        return []
    data = path.read_text(errors="replace")
    out = []
    for line in data[: data.rfind("\n") + 1].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def verified_rids(run_dir: Path) -> set[int]:
    return {r["rid"] for r in records(run_dir) if r["outcome"] == "verified"}


class MetadataServer:
    """Mooncake's own HTTP metadata server (shipped in the wheel), inside the decode namespace."""

    def __init__(self, pair: NetnsPair, base: Path):
        self.port = next(_ports)
        self.url = f"http://{DECODE_IP}:{self.port}/metadata"
        self.side = start(pair, pair.decode_ns, f"metadata-{self.port}", base, {},
                          module="mooncake.http_metadata_server",
                          args=["--host", DECODE_IP, "--port", str(self.port)])
        deadline = time.monotonic() + bound(start=True)  # one process start (Python, Mooncake's wheel)
        while f"started on {DECODE_IP}:{self.port}" not in self.side.stdout + self.side.stderr:
            if self.side.proc.poll() is not None or time.monotonic() > deadline:
                self.side.kill()
                pytest.fail(f"metadata server did not come up\n{self.side.tail()}")
            time.sleep(0.05)

    @property
    def log(self) -> str:
        return self.side.stdout + self.side.stderr

    def stop(self) -> None:
        if self.side.proc.poll() is None:
            self.side.proc.terminate()
            try:
                self.side.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.side.kill()


# ---- the namespaces themselves -----------------------------------------------------------------
def test_namespaces_reach_nothing_but_each_other(netns):
    """The only non-loopback route of either namespace is the veth's 192.0.2.0/24: no default
    route, so no packet of these tests can go anywhere else."""
    for ns, dev, addr in ((netns.prefill_ns, netns.prefill_dev, PREFILL_IP),
                          (netns.decode_ns, netns.decode_dev, DECODE_IP)):
        routes = netns.routes(ns)
        assert not [r for r in routes if r.startswith("default")], routes
        for r in routes:
            assert f"dev {dev}" in r or "dev lo" in r, routes
        main = [r for r in routes if "table" not in r]
        assert main == [f"192.0.2.0/24 dev {dev} proto kernel scope link src {addr}"], routes
        assert not [r for r in netns.routes(ns, "-6") if r.startswith("default")]


# ---- every handoff verified across the link ---------------------------------------------------
COMBOS = [("engine", "p2p"), ("engine", "http"), ("tcp", "p2p"), ("tcp", "http")]


@pytest.mark.parametrize("route,metadata", COMBOS, ids=[f"{r}-{m}" for r, m in COMBOS])
def test_every_handoff_verified_across_namespaces(netns, tmp_path, route, metadata):
    n = POSITIVE_REQUESTS
    port = next(_ports)
    meta = MetadataServer(netns, tmp_path) if metadata == "http" else None
    url = meta.url if meta else None
    decode = prefill = None
    try:
        decode = start(netns, netns.decode_ns, "decode", tmp_path, decode_overrides(port, route, url))
        # the prefill side asks the bootstrap address every second until it answers
        prefill = start(netns, netns.prefill_ns, "prefill", tmp_path,
                        prefill_overrides(port, route, n, url))
        prc = prefill.wait(PROC_TIMEOUT_S)
        drc = decode.wait(20)  # it ends by itself once the prefill rank said bye
    finally:
        for s in (prefill, decode):
            if s is not None:
                s.kill()
        if meta is not None:
            meta.stop()
    assert prc == 0, prefill.tail()
    assert drc == 0, decode.tail()
    no_traceback(prefill, decode)

    p, d = prefill.results(), decode.results()
    assert p.role == "prefill" and d.role == "decode"
    assert p.requests == n and p.verified == n, p
    assert p.corrupted == 0 and p.failed == 0 and p.failure_reasons == {}
    assert p.error is None and p.ending.lost == {}
    assert p.routes == {route: n}
    assert p.transports.effective_transport == ("mooncake-tcp" if route == "engine" else "zmq-tcp")
    assert p.latency_clock == "one_way"  # one kernel, one monotonic clock
    assert p.timing.handoffs_per_s and p.timing.handoffs_per_s > 0
    assert d.requests == n and d.verified == p.verified, d
    assert d.corrupted == 0 and d.failed == 0 and d.prefills_seen == [0]

    address = f"{DECODE_IP}:{port}"
    assert d.bootstrap == address
    assert json.loads((decode.run_dir / "bootstrap.json").read_text()) == {"address": address}
    assert f"decode side up: bootstrap address {address}" in decode.stdout

    if meta is not None and route == "engine":
        # both engines registered with the metadata server over the link, not peer to peer
        # (the tcp route starts no Mooncake engine: there the server sees no request at all)
        log = meta.log
        for ip in (PREFILL_IP, DECODE_IP):
            assert f"{ip} [" in log and "PUT /metadata?key=mooncake" in log, log[-2000:]

    rep = subprocess.run([sys.executable, "-m", "orchestrator.report", str(prefill.run_dir),
                          str(decode.run_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "both sides agree" in rep.stdout, rep.stdout
    assert f"judged {n}: verified {n}" in rep.stdout, rep.stdout

    key = f"{route}-{metadata}"
    RATES[key] = p.timing.handoffs_per_s
    print(f"\n[netns] {key}: {n} handoffs verified, {p.timing.handoffs_per_s} handoffs/s, "
          f"handoff p50 {p.latency_us.handoff.p50} us, startup {p.timing.startup_s} s, "
          f"prefill command {prefill.elapsed:.1f} s")


# ---- a wrong secret ------------------------------------------------------------------------------
WRONG_SECRET_STARTUP_S = 30.0


@pytest.fixture(scope="module")
def wrong_secret_run(pair, tmp_path_factory):
    """The decode side with the right secret, the prefill side with the same variable holding
    another value: the prefill side ends by itself after bootstrap.MAC_FAILURES refusals it
    cannot open, long before the start-up window; the decode side, which cannot tell it from
    anyone else reaching its port, serves on (drc: None while it still ran)."""
    base = tmp_path_factory.mktemp("wrong_secret")
    port = next(_ports)
    decode = prefill = None
    try:
        decode = start(pair, pair.decode_ns, "decode", base, decode_overrides(port, "engine"))
        prefill = start(pair, pair.prefill_ns, "prefill", base,
                        prefill_overrides(port, "engine", 100,
                                          **{"endpoints.startup_timeout_s": WRONG_SECRET_STARTUP_S}),
                        secret="not-the-shared-secret")
        prc = prefill.wait(PROC_TIMEOUT_S)
        drc = (decode.proc.poll() is None, decode.interrupt())  # (still serving, its exit on Ctrl-C)
    finally:
        for s in (prefill, decode):
            if s is not None:
                s.kill()
        for ns in (pair.prefill_ns, pair.decode_ns):
            pair.kill_all(ns)
    return prefill, prc, decode, drc


def test_wrong_secret_ends_the_prefill_side_and_never_the_decode_side(wrong_secret_run):
    prefill, prc, decode, (serving, drc) = wrong_secret_run
    assert prc == 3, prefill.tail() + decode.tail()
    assert serving and drc == 130, decode.tail()  # no anonymous frame ends it (issue 31): Ctrl-C did
    p = prefill.results()
    assert p.verified == 0 and p.failed == 100 and p.corrupted == 0
    assert not [r for r in records(prefill.run_dir) if r["outcome"] == "verified"]
    line = "the peer's MAC did not match: the two sides have different secrets in $"
    assert line in p.error, p.error
    d = decode.results()
    assert d.requests == 0 and d.verified == 0 and line not in (d.error or ""), d
    # from the prefill's engine up (the lookup starts then) to the runner giving up: a few
    # lookups (bootstrap.MAC_FAILURES), not the start-up window
    up = log_events(prefill.run_dir / "prefill.log", "engine_up")
    failed = log_events(prefill.run_dir / "orchestrator.log", "run_failed")
    assert up and failed, prefill.tail()
    window = wall(failed[0]["timestamp"]) - wall(up[0]["timestamp"])
    MEASURED["wrong_secret_lookup_window_s"] = window
    MEASURED["wrong_secret_prefill_command_s"] = prefill.elapsed
    print(f"\n[netns] wrong secret: prefill gave up {window:.2f} s after its engine was up "
          f"(startup_timeout_s={WRONG_SECRET_STARTUP_S:g}), command {prefill.elapsed:.1f} s, exit {prc}")
    assert window < WRONG_SECRET_STARTUP_S - 0.5
    errors = [x for x in prefill.stdout.splitlines() if x.startswith("ERROR:")]
    assert len(errors) == 1 and line in errors[0], prefill.tail()
    assert "engine said" not in prefill.stdout
    assert (decode.stdout + decode.stderr).count("bootstrap_rejected") <= 1, decode.tail()
    no_traceback(decode)
    assert "Traceback" not in prefill.stdout + prefill.stderr, prefill.tail()


def test_wrong_secret_prefill_rank_ends_without_error(wrong_secret_run):
    prefill, _, _, _ = wrong_secret_run
    text = prefill.stdout + prefill.stderr + (prefill.run_dir / "prefill.log").read_text(errors="replace")
    assert "prefill_failed" not in text and "Traceback" not in text, prefill.tail()


# ---- a peer that becomes unreachable mid-run -------------------------------------------------
# far more than can finish before the cut (about 20 s of handoffs on the 2-core box): the run
# is still going when the link goes; every request left is failed and written after the loss
CUT_REQUESTS = 30_000
CUT_AFTER_VERIFIED = 300


@dataclass
class CutRun:
    route: str
    prefill: Side
    prc: int
    decode: Side
    drc: int
    before: set[int]  # rids verified when the link went down
    t_cut: tuple[float, float]  # wall clock just before and just after `ip link set down`
    t_exit: float  # wall clock when the prefill command had exited


@pytest.fixture(scope="module", params=["engine", "tcp"])
def cut_run(request, pair, tmp_path_factory):
    route = request.param
    base = tmp_path_factory.mktemp(f"cut_{route}")
    port = next(_ports)
    decode = prefill = None
    try:
        decode = start(pair, pair.decode_ns, "decode", base, decode_overrides(port, route))
        prefill = start(pair, pair.prefill_ns, "prefill", base,
                        prefill_overrides(port, route, CUT_REQUESTS))
        # the prefill's start-up (it fails by itself past STARTUP_S without progress), then
        # the first handoffs: a bound from the configured timeout, not a guess
        deadline = time.monotonic() + bound(STARTUP_S, start=True)
        while len(before := verified_rids(prefill.run_dir)) < CUT_AFTER_VERIFIED:
            if prefill.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"handoffs never flowed\n{prefill.tail()}\n{decode.tail()}")
            time.sleep(0.05)
        t0 = time.time()
        pair.cut()
        t1 = time.time()
        before = verified_rids(prefill.run_dir) | before  # all verified by the cut, at least
        prc = prefill.wait(PROC_TIMEOUT_S)
        t_exit = time.time()
        # no bye can reach the decode side: it ends on its own once the prefill has been
        # silent for transport.timeout_s (held slots or not: its keepalives stop too)
        drc = decode.wait(bound(TIMEOUT_S, LOST_MARGIN_S, finish=True))
    finally:
        for s in (prefill, decode):
            if s is not None:
                s.kill()
        for ns in (pair.prefill_ns, pair.decode_ns):
            pair.kill_all(ns)
        pair.restore()
    return CutRun(route, prefill, prc, decode, drc, before, (t0, t1), t_exit)


def test_unreachable_decode_is_declared_lost_within_timeout(cut_run):
    c = cut_run
    p = c.prefill.results()
    lost = log_events(c.prefill.run_dir / "prefill.log", "peer_lost")
    assert len(lost) == 1, c.prefill.tail()
    assert lost[0]["detail"] == f"decode silent for transport.timeout_s={TIMEOUT_S:g}"
    t_lost = wall(lost[0]["timestamp"])
    detect = t_lost - c.t_cut[0]
    MEASURED[f"lost_detect_s_{c.route}"] = detect
    MEASURED[f"lost_exit_after_cut_s_{c.route}"] = c.t_exit - c.t_cut[0]
    print(f"\n[netns] link cut ({c.route} route) after {len(c.before)} verified: declared lost "
          f"{detect:.3f} s after the cut (transport.timeout_s={TIMEOUT_S:g}), prefill command "
          f"exited {c.t_exit - c.t_cut[0]:.1f} s after the cut with {c.prc}; verified "
          f"{p.verified}, failure_reasons {p.failure_reasons}")
    assert TIMEOUT_S - 0.5 <= t_lost - c.t_cut[1] and detect <= TIMEOUT_S + LOST_MARGIN_S

    assert c.prc == 3, c.prefill.tail()  # a side was lost
    assert p.requests == CUT_REQUESTS and p.corrupted == 0
    assert p.verified + p.failed == CUT_REQUESTS
    reasons = p.failure_reasons
    assert reasons and set(reasons) <= {"peer_lost", "not_sent_peer_lost"}, reasons
    assert sum(reasons.values()) == p.failed
    # everything verified before the cut is still verified, exactly once
    recs = records(c.prefill.run_dir)
    assert len(recs) == CUT_REQUESTS and len({r["rid"] for r in recs}) == CUT_REQUESTS
    after = {r["rid"] for r in recs if r["outcome"] == "verified"}
    assert c.before <= after and len(after) == p.verified
    no_traceback(c.prefill)

    # the decode side ended itself (no bye could reach it): its prefill lost, exit 3; it
    # judged at least what the prefill heard back as verified, and nothing it judged was wrong
    assert c.drc == 3, c.decode.tail()
    d = c.decode.results()
    assert d.verified >= p.verified and d.corrupted == 0, d
    assert "prefill" in d.ending.lost, d.ending.lost
    no_traceback(c.decode)


def test_unreachable_decode_exits_3(cut_run):
    assert cut_run.prc == 3 and cut_run.prefill.results().exit_code == 3


def test_unreachable_decode_command_ends_within_bound(cut_run):
    """The prefill command ends on its own once the decode is declared lost: requests still in
    a write that Mooncake holds (it gives up on an unreachable host only after about 13 s) are
    failed at once, and the transfer thread is not waited for past transport.timeout_s. The
    waits on that path: the loss (timeout_s and its detection margin) and the transfer
    thread's join (timeout_s); the rest is a loaded box's slack (helpers.bounds), so a hang
    still fails."""
    c = cut_run
    assert c.t_exit - c.t_cut[0] <= bound(TIMEOUT_S, LOST_MARGIN_S, TIMEOUT_S, finish=True), c.prefill.tail()


# ---- refused before start ------------------------------------------------------------------------
REFUSALS = [("prefill", None), ("decode", None), ("prefill", "false"), ("decode", "false")]


def test_non_loopback_host_without_allow_remote_is_refused(netns, tmp_path):
    """transport.allow_remote left at its default (false) or set false, with the namespace's
    own non-loopback address: exit 2 before anything starts, one `error:` line naming
    transport.host. The four commands run at once (each only composes and checks a config)."""
    sides = []
    for role, allow in REFUSALS:
        ns, host = (netns.prefill_ns, PREFILL_IP) if role == "prefill" else (netns.decode_ns, DECODE_IP)
        d = {"role": role, "transport.host": host, "transport.secret_env": SECRET_ENV, **FAST}
        if role == "prefill":
            d["peer"] = f"{DECODE_IP}:{next(_ports)}"
        if allow is not None:
            d["transport.allow_remote"] = allow
        sides.append((ns, start(netns, ns, f"{role}-allow_remote-{allow or 'default'}", tmp_path, d)))
    try:
        rcs = [side.wait(PROC_TIMEOUT_S) for _, side in sides]
    finally:
        for _, side in sides:
            side.kill()
    for (_, side), rc in zip(sides, rcs):
        assert rc == 2, side.tail()
        errors = [ln for ln in side.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, side.tail()
        assert "transport.host" in errors[0] and "transport.allow_remote=true" in errors[0], errors
        assert side.stderr.strip() == errors[0], side.tail()  # that line and nothing else
        no_traceback(side)
        # nothing started: no endpoint wrote anything
        for name in ("fingerprint.json", "orchestrator.log", "bootstrap.json", "requests.jsonl"):
            assert not (side.run_dir / name).exists(), f"{side.name}: {name}"
        if (side.run_dir / "results.json").exists():
            assert side.results().exit_code == 2
    for ns in (netns.prefill_ns, netns.decode_ns):
        assert netns.pids(ns) == []  # nothing left listening
