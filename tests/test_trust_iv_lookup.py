"""Trust IV (issue 36), item 5 and the console part of item 6: a bootstrap lookup recorded in
one split run opens in no later run, and never sets the address verdict; an over-long field is
named as over-long, not as a wrong secret; peer strings reach the console escaped.

Real processes and real ZMQ sockets between them (the split-run harness of test_trust_iii).
The attacker is the test process, with what a user who can write the shared bootstrap dir has:
a relay that a prefill side was pointed at (its address in transport.bootstrap_file, or peer=),
which forwards to the real decode side and records every frame the prefill side sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import MAC_BYTES, Authenticator, new_nonce
from orchestrator.results.schema import Results

from .conftest import ROOT, typed_cfg
from .helpers.procs import reap

pytestmark = pytest.mark.integration
SECRET_VAR = "TRUST4_LOOKUP_SECRET"
SECRET = "trust-four-lookup-secret-93b1"
# both sides advertise loopback (SGLang's step 1): the real prefill's address is reachable
ENV = {**os.environ, SECRET_VAR: SECRET, "PYTHONUNBUFFERED": "1", "SGLANG_HOST_IP": "127.0.0.1"}
ENV.pop("ORCHESTRATOR_TEST_VERSIONS", None)
STARTED: list[subprocess.Popen] = []
REQUESTS = 20


@pytest.fixture(autouse=True)
def _reap():
    """What a test started and left running (a bound that failed) is killed with its tree."""
    yield
    reap(STARTED)


def _popen(*args: str, env=None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", f"transport.secret_env={SECRET_VAR}", *args],
                            cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    return proc


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(pred, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not pred():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.1)


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
    port = _port()
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
def test_a_recorded_lookup_replayed_into_a_later_run_is_refused_and_never_judged(recorded, tmp_path, mode):
    """issue 36's attack: the lookups a real prefill side sent in run 1 (recorded by a relay it
    was pointed at, the decode side's challenge answered through it), and an old-format lookup
    advertising 192.0.2.2:39679, are replayed into run 2's decode side (same secret) before its
    real prefill side comes. At 3a078eb the first was judged as that prefill: with
    transport.address_check=fail it ended run 2 (`refused before any handoff: ... no answer
    from tcp://...`), with warn it planted a false warning and the real prefill's address was
    never probed. Now each is refused and counted (never the endpoints, never judged), run 2
    verifies everything, and its address verdict is the real prefill's: probed and reached."""
    port = _port()
    d_dir, p_dir = tmp_path / "d", tmp_path / "p"
    decode = _popen("role=decode", f"transport.bootstrap_port={port}", f"transport.address_check={mode}",
                    "endpoints.startup_timeout_s=300", f"hydra.run.dir={d_dir}")
    log = d_dir / "orchestrator.log"
    _wait_for(lambda: _logged(log, "bootstrap_listening") or decode.poll() is not None, 120, "the decode side")
    answers = [a for frame in [*recorded, _old_format_lookup()] for a in _ask(port, frame)]
    # the replays were looked at (refused now; judged, at 3a078eb)
    _wait_for(lambda: _logged(log, "bootstrap_rejected", reason=_stale()) or decode.poll() is not None
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
    from orchestrator.handoff import bootstrap

    return getattr(bootstrap, "STALE", "")


def test_a_lookup_outside_the_time_window_is_refused_and_never_judged(tmp_path, monkeypatch):
    """The second guard: a lookup that answers this run's challenge but was sent more than
    bootstrap.LOOKUP_WINDOW_S from this side's clock is refused with a line naming the window
    (to the prefill side that sent it), counted, and not judged (its advertised address is
    never probed); the decode side serves on, and a fresh lookup gets the endpoints. The
    decode side's bootstrap serves in a thread here, over real sockets."""
    from orchestrator.handoff import bootstrap
    from orchestrator.handoff.lifecycle import Signals
    from orchestrator.results.records import RunResult

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    cfg = typed_cfg("transport.address_check=fail", "endpoints.startup_timeout_s=60")
    secret = SECRET.encode()
    out = RunResult(run_dir=str(tmp_path))
    infos = [[{"control_endpoint": "tcp://127.0.0.1:1", "data_endpoint": "tcp://127.0.0.1:2",
               "transport": "tcp", "session_id": None}]]
    import structlog

    side = bootstrap._Bootstrap(cfg.transport, cfg.endpoints, cfg.layout.name, secret, infos, [], out,
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
        _wait_for(lambda: out.bootstrap is not None or failed, 30, "the bootstrap address")
        port = int(out.bootstrap.rsplit(":", 1)[1])
        auth, nonce = Authenticator(secret), new_nonce()
        dead = {"address": "127.0.0.1", "step": "SGLANG_HOST_IP", "interface": "lo", "port": _port(),
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


def test_a_recorded_answer_is_never_taken_by_a_prefill_side(monkeypatch):
    """The other direction: whoever the prefill side was pointed at answers each of its
    lookups with a sealed endpoints answer recorded from another run (without a nonce, as at
    3a078eb, or echoing that run's), advertising 192.0.2.2:39679. At 3a078eb the prefill side
    took the first (and probed 192.0.2.2). Now it takes none of them, judges none (the address
    in them is never probed), and ends at its window saying how many answers were another
    run's. The peer is a ROUTER in a thread here, over real sockets."""
    from orchestrator.handoff.bootstrap import lookup
    from orchestrator.handoff.lifecycle import RunFailed, Signals

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
            lookup(cfg.transport, cfg.endpoints, cfg.layout.name, f"127.0.0.1:{port}", secret, signals)
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


def test_an_over_long_version_is_named_as_over_long_on_both_sides_not_the_secret(tmp_path):
    """A prefill side whose version string is 300 chars (the wire's limit is 256). At 3a078eb
    its lookup was counted as "not an authentic lookup" and never answered: the prefill side
    timed out asking about transport.secret_env, and the decode side too. Now the decode side
    refuses it as over-long, tells the prefill side, which ends with that line at once, and
    ends its own wait with the same line; neither blames the secret. (The prefill side starts
    first and is asking before the decode side listens: the decode side's 20 s window holds
    on a loaded box.)"""
    port = _port()
    long_env = {**ENV, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=" + "7" * 300}
    prefill = _popen("role=prefill", f"peer=127.0.0.1:{port}", "endpoints.startup_timeout_s=120",
                     f"hydra.run.dir={tmp_path / 'p'}", env=long_env)
    _wait_for(lambda: _logged(tmp_path / "p" / "orchestrator.log", "address_advertised") or prefill.poll() is not None,
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
def test_the_console_helper_escapes_what_a_terminal_acts_on():
    from orchestrator.results import escape

    assert escape.printable("a\x1b[2Jb\r\nfake: verified 200\x07\u2028\u202e é") == \
        "a\\x1b[2Jb\\r\\nfake: verified 200\\x07\\u2028\\u202e é"
    line = "requests 20: verified 20, corrupted 0, failed 0   routes: engine=20"
    assert escape.printable(line) is line  # this tool's own lines stay as they are


def test_peer_strings_reach_the_console_escaped(tmp_path):
    """The prefill side's SGLANG_HOST_IP carries CR/LF and ESC (a forged summary line and a
    terminal sequence), both sides' version strings ESC sequences. At 3a078eb the peer's
    strings were printed as they were: the decode side's console showed a line `fake: verified
    200, corrupted 0` of the prefill's making. Now every console line (the summary's warnings,
    the console log lines) shows them escaped, as results.json keeps them (JSON-escaped)."""
    port = _port()
    forged = "127.0.0.1\r\nfake: verified 200, corrupted 0\x1b[2K"
    decode = _popen("role=decode", f"transport.bootstrap_port={port}", "endpoints.startup_timeout_s=300",
                    f"hydra.run.dir={tmp_path / 'd'}",
                    env={**ENV, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=7.7\x1b[31mred"})
    hostile = {**ENV, "SGLANG_HOST_IP": forged, "ORCHESTRATOR_TEST_VERSIONS": "orchestrator=6.6\x1b]0;t\x07"}
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
