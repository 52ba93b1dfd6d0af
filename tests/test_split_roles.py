"""A run split into role=decode and role=prefill on one host (loopback): a layout mismatch
ends both sides with one line naming the field, and a decode side whose prefill dies mid-run
ends on its own (the runner on its host cannot see the prefill's process), busy or idle. With a
hand-written prefill: the decode's watch loses a silent prefill that holds nothing of it, and
never one that keeps alive."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from orchestrator.handoff.transport import wire
from orchestrator.job import protocol
from orchestrator.results.schema import Results

from .conftest import ROOT, typed_cfg
from .helpers.bounds import bound, startup_timeout_s
from .helpers.peers import PrefillPeer
from .helpers.procs import process_tree, reap

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ENV = {**os.environ, "PD_SPLIT_TEST_SECRET": "split-test-secret-7c1e", "PYTHONUNBUFFERED": "1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _reap():
    """Whatever a test started and left running (a bound that failed) is killed, tree and all."""
    yield
    reap(STARTED)


def _popen(argv: list[str], env=ENV) -> subprocess.Popen:
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED.append(proc)
    return proc


def _side(role: str, run_dir, *overrides: str) -> subprocess.Popen:
    return _popen([sys.executable, "-m", "orchestrator", f"role={role}", "transport.secret_env=PD_SPLIT_TEST_SECRET",
                   "transport.timeout_s=2", *overrides, f"hydra.run.dir={run_dir}"])


def test_layout_mismatch_ends_both_sides_with_one_line(tmp_path):
    port = _port()
    decode = _side("decode", tmp_path / "d", "buffers.enable_sampling_mask=true",
                   f"transport.bootstrap_port={port}")
    prefill = _side("prefill", tmp_path / "p", f"peer=127.0.0.1:{port}", "layout=sglang_pre_0_5_23")
    p_out, p_err = prefill.communicate(timeout=120)
    d_out, d_err = decode.communicate(timeout=60)
    assert prefill.returncode == 3 and decode.returncode == 3, (p_out, p_err, d_out, d_err)
    for out in (p_out, d_out):
        errors = [line for line in out.splitlines() if line.startswith("ERROR:")]
        assert len(errors) == 1 and "field 6" in errors[0] and "output_token_sampling_mask_len" in errors[0]
        assert "engine said" not in out and "Traceback" not in out
    assert Results.read(tmp_path / "p").verified == 0


def test_wrong_secret_ends_the_prefill_side_and_never_the_decode_side(tmp_path):
    """The decode side answers a lookup whose MAC fails with a sealed refusal: the prefill
    side, which cannot open it, ends after bootstrap.MAC_FAILURES such answers from the peer
    it named (exit 3, one line naming the variable), not at endpoints.startup_timeout_s. The
    decode side cannot tell that prefill from anyone else who reaches its port: it counts the
    frames and serves on (issue 31: one frame without a valid MAC ended it), until stopped."""
    port = _port()
    decode = _side("decode", tmp_path / "d", f"transport.bootstrap_port={port}",
                   "endpoints.startup_timeout_s=300")
    env = {**ENV, "PD_SPLIT_TEST_SECRET": "another-secret"}
    prefill = _popen([sys.executable, "-m", "orchestrator", "role=prefill", f"peer=127.0.0.1:{port}",
                      "transport.secret_env=PD_SPLIT_TEST_SECRET", "endpoints.startup_timeout_s=120",
                      f"hydra.run.dir={tmp_path / 'p'}"], env=env)
    p_out, p_err = prefill.communicate(timeout=100)  # far inside the 120 s window
    assert prefill.returncode == 3, (p_out, p_err)
    errors = [line for line in p_out.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1, p_out
    assert "the peer's MAC did not match: the two sides have different secrets in $PD_SPLIT_TEST_SECRET" \
        in errors[0] and "3 answers in a row failed the MAC" in errors[0]
    assert "engine said" not in p_out and "Traceback" not in p_out + p_err
    assert decode.poll() is None, decode.communicate()  # still serving
    decode.send_signal(signal.SIGTERM)
    d_out, d_err = decode.communicate(timeout=60)
    assert decode.returncode == 143 and "Traceback" not in d_out + d_err, (d_out, d_err)
    rejected = (tmp_path / "d" / "orchestrator.log").read_text().count("bootstrap_rejected")
    assert rejected <= 1  # rate-limited


@pytest.mark.parametrize("load", ["workload.requests=200000", "workload.rate=4"], ids=["busy", "idle"])
def test_decode_side_ends_when_its_prefill_dies(tmp_path, load):
    """Killed mid-run, the prefill sends no bye. Busy (closed loop): the decode holds its
    slots when it dies. Idle (4 arrivals/s): it mostly holds nothing, and its keepalives
    stopping is all the decode can go by."""
    port = _port()
    decode = _side("decode", tmp_path / "d", f"transport.bootstrap_port={port}")
    prefill = _side("prefill", tmp_path / "p", f"peer=127.0.0.1:{port}", "workload.requests=200000", load)
    deadline = time.monotonic() + bound(startup_timeout_s(), start=True)  # both sides' start-up, bounded
    log = tmp_path / "p" / "prefill.log"  # its loop has started: then 2 s of handoffs (8 expected, idle)
    while not (log.exists() and "prefill_loop" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)
    for pid in process_tree(prefill.pid):  # the whole prefill side at once: no bye can reach the decode
        os.kill(pid, signal.SIGKILL)
    prefill.communicate(timeout=30)
    t0 = time.monotonic()
    d_out, d_err = decode.communicate(timeout=60)
    assert time.monotonic() - t0 < bound(2.0, finish=True), d_out  # transport.timeout_s=2 (_side)
    assert decode.returncode == 3, d_out + d_err
    res = Results.read(tmp_path / "d")
    assert "prefill" in res.ending.lost and res.corrupted == 0 and res.verified > 0, res




def test_each_side_sends_its_pid_namespace_at_bootstrap(tmp_path):
    """The decode side in a PID namespace of its own (`unshare --pid --fork`, as a container
    without --pid=host): the prefill learns the peer's namespace at bootstrap. Over Mooncake's
    TCP the run goes on (only nvlink_intra needs one namespace: tests/test_plan.py)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    port = _port()
    decode = _popen(["unshare", "--pid", "--fork", sys.executable, "-m", "orchestrator", "role=decode",
                     "transport.secret_env=PD_SPLIT_TEST_SECRET", "transport.timeout_s=2",
                     f"transport.bootstrap_port={port}", f"hydra.run.dir={tmp_path / 'd'}"])
    prefill = _side("prefill", tmp_path / "p", f"peer=127.0.0.1:{port}", "workload.requests=50")
    p_out, p_err = prefill.communicate(timeout=120)
    d_out, d_err = decode.communicate(timeout=60)
    assert prefill.returncode == 0 and decode.returncode == 0, (p_out, p_err, d_out, d_err)
    line = next(json.loads(x) for x in (tmp_path / "p" / "prefill.log").read_text().splitlines()
                if '"bootstrapped"' in x)
    mine = os.readlink("/proc/self/ns/pid")
    assert line["pid_ns"] == mine and line["peer_pid_ns"].startswith("pid:[") and line["peer_pid_ns"] != mine


# ---- the decode side's watch of its prefills, with a hand-written prefill ----------------------
def _lost_within(decode, seconds: float):
    """The first PrefillLost the decode tells its runner within `seconds`, else None."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if decode.conn.poll(left):
            msg = decode.conn.recv()
            if isinstance(msg, protocol.PrefillLost):
                return msg
    return None


@pytest.mark.parametrize("started", [False, True], ids=["bound_only", "loop_started"])
def test_a_silent_prefill_is_lost_holding_nothing(tmp_path, started):
    """role=decode, a prefill bound at hello that holds no slot: silent past
    endpoints.startup_timeout_s before its loop starts, or past transport.timeout_s after
    its first (empty) arrive, it is lost, and the decode tells its runner why."""
    cfg = typed_cfg("role=decode", "transport.timeout_s=1", "endpoints.startup_timeout_s=3")
    peer = PrefillPeer(cfg, tmp_path)
    try:
        t0 = time.monotonic()
        if started:
            peer.send_control(wire.encode("arrive", reqs=[], contiguous=False))  # a keepalive
        lost = _lost_within(peer.decode, 30)
        waited = time.monotonic() - t0
        assert lost is not None and lost.rank == 0
        if started:
            assert lost.why == "prefill rank 0 silent for transport.timeout_s=1", lost
            assert waited >= 1 - 0.5, waited
        else:
            assert lost.why == ("prefill rank 0 bound at hello, its loop not started within "
                                "endpoints.startup_timeout_s=3"), lost
            assert waited >= 3 - 0.5, waited
    finally:
        peer.close()  # (stops the decode too)


def test_a_prefill_that_keeps_alive_is_never_lost(tmp_path):
    """Empty arrives every 0.25 s for three times transport.timeout_s: never lost; silent
    after them, it is."""
    cfg = typed_cfg("role=decode", "transport.timeout_s=1", "endpoints.startup_timeout_s=3")
    peer = PrefillPeer(cfg, tmp_path)
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            peer.send_control(wire.encode("arrive", reqs=[], contiguous=False))
            assert _lost_within(peer.decode, 0.25) is None
        lost = _lost_within(peer.decode, 10)
        assert lost is not None and lost.why == "prefill rank 0 silent for transport.timeout_s=1", lost
    finally:
        peer.close()  # (stops the decode too)
