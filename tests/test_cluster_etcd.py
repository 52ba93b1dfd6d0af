"""Mooncake's metadata through a real etcd (transport.mooncake.metadata_server=etcd://H:P),
started by the tests (tests/helpers/etcd.py):

- a single-host run: every handoff verified, and etcd's revision moved (Mooncake wrote its
  segment and RPC records there, then removed them);
- the split run across two network namespaces (192.0.2.1 prefill, 192.0.2.2 decode, etcd in
  the decode namespace): every handoff verified, both sides agree;
- etcd stopped mid-run, once both engines hold each other's descriptors: Mooncake does not go
  back to etcd for a running transfer, so the run finishes with every handoff verified;
- etcd stopped before a side starts: that side's engine cannot register, it fails within the
  bound, exit 3, with one `ERROR:` line naming the metadata server.

Needs etcd (Debian: etcd-server, `make cluster-deps`); the split runs also need root and
`ip netns`. Skips otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.results.schema import Results

from .conftest import ROOT
from .helpers import etcd as etcd_helper
from .helpers.bounds import bound
from .helpers.etcd import Etcd
from .helpers.netns import DECODE_IP, PREFILL_IP, NetnsPair, NetnsUnavailable

pytestmark = [pytest.mark.cluster, pytest.mark.integration, pytest.mark.slow]

SECRET_ENV = "PD_AUX_ETCD_TEST_SECRET"
ETCD_PORT = 2379  # inside a fresh namespace: free
BOOTSTRAP_PORT = 17300
RUN_TIMEOUT_S = 180.0  # no command here may live longer; the ones that pass take seconds
ETCD_DEADLINE_S = 5.0  # etcd calls of Mooncake's client give up after 5 s ("context deadline exceeded")
# a side whose engine cannot register ends within a few of those (34.1 s from its start to its
# exit at load 11, start-up included)
FAIL_BOUND_S = bound(3 * ETCD_DEADLINE_S, start=True, finish=True)


@pytest.fixture(autouse=True)
def _needs_etcd():
    why = etcd_helper.missing()
    if why:
        pytest.skip(why)


@pytest.fixture
def pair():
    try:
        p = NetnsPair.create()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield p
    finally:
        problems = p.destroy()
        assert not problems, problems


def results(run_dir: Path) -> Results:
    return Results.read(run_dir)


def command(run_dir: Path, overrides: list[str], prefix: list[str] = ()) -> list[str]:
    return [*prefix, sys.executable, "-m", "orchestrator", *overrides, f"hydra.run.dir={run_dir}"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            SECRET_ENV: "etcd-test-shared-secret-77a1"}


def side_overrides(role: str, url: str, **extra) -> list[str]:
    common = {"transport.allow_remote": "true", "transport.secret_env": SECRET_ENV,
              "transport.mooncake.metadata_server": url, "endpoints.startup_timeout_s": 30}
    if role == "decode":
        d = {"role": "decode", "transport.host": DECODE_IP, "transport.bootstrap_port": BOOTSTRAP_PORT}
    else:
        d = {"role": "prefill", "peer": f"{DECODE_IP}:{BOOTSTRAP_PORT}", "transport.host": PREFILL_IP}
    return [f"{k}={v}" for k, v in {**common, **d, **extra}.items()]


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def verified_lines(run_dir: Path) -> int:
    try:
        data = (run_dir / "requests.jsonl").read_text(errors="replace")
    except OSError:
        return 0
    return data[: data.rfind("\n") + 1].count('"outcome": "verified"')


# ---- one host --------------------------------------------------------------------------------
def test_single_host_run_through_etcd(tmp_path):
    with Etcd.start(tmp_path) as etcd:
        proc = subprocess.run(command(tmp_path / "run", [f"transport.mooncake.metadata_server={etcd.url}",
                                                         "workload.requests=500"]),
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        revision = etcd.revision()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = results(tmp_path / "run")
    assert (r.requests, r.verified, r.corrupted, r.failed) == (500, 500, 0, 0), r
    assert r.transports.effective_transport == "mooncake-tcp" and r.routes == {"engine": 500}
    # two engines, each put its segment and RPC records and removed them at the end
    assert revision > 4, revision
    print(f"\n[etcd] single host: 500 verified, {r.timing.handoffs_per_s} handoffs/s, "
          f"start-up {r.timing.startup_s} s, etcd revision {revision}")


# ---- two namespaces --------------------------------------------------------------------------
def etcd_in_decode_ns(pair: NetnsPair, base: Path) -> Etcd:
    return Etcd.start(base, host=DECODE_IP, port=ETCD_PORT, exec_prefix=pair.exec_args(pair.decode_ns, []))


def test_split_run_across_namespaces_through_etcd(pair, tmp_path):
    etcd = etcd_in_decode_ns(pair, tmp_path)
    try:
        decode = start(command(tmp_path / "decode", side_overrides("decode", etcd.url),
                               pair.exec_args(pair.decode_ns, [])), tmp_path / "decode.out")
        prefill = subprocess.run(command(tmp_path / "prefill", side_overrides("prefill", etcd.url) +
                                         ["workload.requests=400"], pair.exec_args(pair.prefill_ns, [])),
                                 cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        drc = decode.wait(60)
        revision = etcd.revision()
    finally:
        for p in (locals().get("decode"),):
            if p is not None and p.poll() is None:
                p.kill()
        etcd.stop()
    assert prefill.returncode == 0, prefill.stdout + prefill.stderr
    assert drc == 0, (tmp_path / "decode.out").read_text()
    p, d = results(tmp_path / "prefill"), results(tmp_path / "decode")
    assert (p.requests, p.verified, p.corrupted, p.failed) == (400, 400, 0, 0), p
    assert (d.requests, d.verified) == (400, 400) and d.bootstrap == f"{DECODE_IP}:{BOOTSTRAP_PORT}"
    assert p.transports.effective_transport == "mooncake-tcp"
    assert revision > 4, revision  # both engines registered with etcd, across the link
    rep = subprocess.run([sys.executable, "-m", "orchestrator.report", str(tmp_path / "prefill"),
                          str(tmp_path / "decode")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "both sides agree" in rep.stdout, rep.stdout + rep.stderr
    print(f"\n[etcd] across namespaces: 400 verified, {p.timing.handoffs_per_s} handoffs/s, "
          f"etcd revision {revision}\n{rep.stdout}")


def test_etcd_stopped_mid_run_does_not_stop_the_transfers(pair, tmp_path):
    """Measured: Mooncake reads a peer's descriptor from etcd once, when it opens the segment;
    a running transfer does not go back to etcd. Both sides end as they would with etcd up."""
    requests = 2000
    etcd = etcd_in_decode_ns(pair, tmp_path)
    stopped = False
    try:
        decode = start(command(tmp_path / "decode", side_overrides("decode", etcd.url),
                               pair.exec_args(pair.decode_ns, [])), tmp_path / "decode.out")
        prefill = start(command(tmp_path / "prefill", side_overrides("prefill", etcd.url) +
                                [f"workload.requests={requests}", "workload.rate=500"],
                                pair.exec_args(pair.prefill_ns, [])), tmp_path / "prefill.out")
        deadline = time.monotonic() + 120
        while verified_lines(tmp_path / "prefill") < 200:
            assert prefill.poll() is None, (tmp_path / "prefill.out").read_text()
            assert time.monotonic() < deadline, "nothing verified within 120 s"
            time.sleep(0.2)
        assert etcd.stop() is None
        stopped = True
        at = verified_lines(tmp_path / "prefill")
        t0 = time.monotonic()
        prc = prefill.wait(RUN_TIMEOUT_S)
        drc = decode.wait(60)
        after_s = time.monotonic() - t0
    finally:
        for p in (locals().get("prefill"), locals().get("decode")):
            if p is not None and p.poll() is None:
                p.kill()
        if not stopped:
            etcd.stop()
    out = (tmp_path / "prefill.out").read_text()
    assert at < requests
    assert prc == 0, out
    assert drc == 0, (tmp_path / "decode.out").read_text()
    p, d = results(tmp_path / "prefill"), results(tmp_path / "decode")
    assert (p.verified, p.corrupted, p.failed) == (requests, 0, 0), p
    assert d.verified == requests
    assert "Traceback" not in out
    print(f"\n[etcd] stopped after {at} of {requests} verified: all {requests} verified, prefill "
          f"exit {prc}, decode exit {drc}, {after_s:.1f} s from the stop to both sides' end")


def test_etcd_gone_before_the_prefill_side_starts_is_bounded_exit_3(pair, tmp_path):
    """The decode side registered, then etcd stopped: the prefill side's engine cannot
    register and the side ends with exit 3 and one ERROR line naming the metadata server."""
    etcd = etcd_in_decode_ns(pair, tmp_path)
    try:
        decode = start(command(tmp_path / "decode", side_overrides("decode", etcd.url,
                                                                   **{"endpoints.startup_timeout_s": 20}),
                               pair.exec_args(pair.decode_ns, [])), tmp_path / "decode.out")
        deadline = time.monotonic() + 120
        while "decode side up" not in (tmp_path / "decode.out").read_text(errors="replace"):
            assert decode.poll() is None, (tmp_path / "decode.out").read_text()
            assert time.monotonic() < deadline, "the decode side did not come up within 120 s"
            time.sleep(0.2)
        assert etcd.stop() is None
        t0 = time.monotonic()
        prefill = subprocess.run(command(tmp_path / "prefill", side_overrides("prefill", etcd.url) +
                                         ["workload.requests=100"], pair.exec_args(pair.prefill_ns, [])),
                                 cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        elapsed = time.monotonic() - t0
    finally:
        if locals().get("decode") is not None and decode.poll() is None:
            decode.kill()
    console = prefill.stdout + prefill.stderr
    assert prefill.returncode == 3, console
    assert elapsed < FAIL_BOUND_S, elapsed
    assert "Traceback" not in console
    errors = [ln for ln in console.splitlines() if ln.startswith("ERROR:")]
    assert len(errors) == 1 and f"metadata_server={etcd.url}" in errors[0], console
    assert "reason=metadata server not answering: EtcdStoragePlugin: unable to set" in errors[0]
    p = results(tmp_path / "prefill")
    assert p.exit_code == 3 and p.verified == 0 and "mooncake initialize returned -1" in p.error
    print(f"\n[etcd] gone before the prefill side: exit {prefill.returncode} in {elapsed:.1f} s\n{console}")
