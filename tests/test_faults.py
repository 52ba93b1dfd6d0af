"""Faults injected by configuration (fast variants): every run ends within its timeouts, the
affected requests are failed or corrupted, the rest verified, and no slot that carries an
injected fault is ever accepted. Real processes, real Mooncake and ZMQ on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.job.check import check_profile
from orchestrator.profile.plan import Platform

from .helpers.bounds import bound

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CPU = Platform()
TIMEOUT_S = 2.0  # transport.timeout_s of the fast variants
FAST = (f"transport.timeout_s={TIMEOUT_S:g}", "transport.mooncake.tcp_progress_timeout_s=2")


def _checked(res, run_dir: Path) -> list[dict]:
    """The run's request records, once the invariants behind every fault hold: a request that
    carried an injected fault is never verified, and every request has a verdict."""
    records = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["fault"] and r["outcome"] == "verified"]
    assert res.verified + res.corrupted + res.failed == res.requests
    return records


def _hits(records):
    return [r for r in records if r["fault"]]


@pytest.mark.parametrize("route", ["engine", "tcp"])
def test_corrupt_byte_is_caught(run_job, tmp_path, route):
    res = run_job(tmp_path, *FAST, f"transport.route={route}", "faults=corrupt_byte",
                  "workload.requests=100")
    records = _checked(res, tmp_path)
    hits = _hits(records)
    assert len(hits) == 9 and {r["detail"] for r in hits} == {"checksum_mismatch"}
    assert res.corrupted == 9 and res.verified == 91 and res.failed == 0


def test_bad_destination_partial_batch_never_accepted(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=bad_destination", "faults.every=20", "workload.requests=60")
    records = _checked(res, tmp_path)
    hits = _hits(records)
    assert len(hits) == 3 and {r["detail"] for r in hits} == {"sender_error"}
    assert res.verified == 57 and res.corrupted == 0


def test_wrong_session(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=wrong_session", "faults.every=20", "workload.requests=60")
    records = _checked(res, tmp_path)
    assert {r["detail"] for r in _hits(records)} == {"sender_error"} and res.verified == 57


def test_stale_room_in_reused_slot_never_passes_the_gate(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=stale_room", "faults.every=15", "workload.requests=60",
                  "buffers.size=8", "workload.concurrency=4")
    records = _checked(res, tmp_path)
    hits = _hits(records)
    assert len(hits) == 4
    assert {r["detail"] for r in hits} == {"room_mismatch"}  # a previous tenant's room was there
    assert res.verified == 56


def test_decode_killed_mid_run(run_job, tmp_path):
    timeout_s = 5.0
    res = run_job(tmp_path, *FAST, "faults=decode_killed", "faults.at_request=50", "workload.requests=3000",
                  f"transport.timeout_s={timeout_s:g}")
    _checked(res, tmp_path)
    wall = run_job.wall_s
    assert res.ending.faults_applied and res.ending.faults_applied[0]["fault"] == "decode_killed"
    assert res.verified == 50 and res.corrupted == 0  # exactly at its request
    # the runner saw the process exit: the wait ends at once, not after transport.timeout_s
    assert set(res.failure_reasons) == {"decode_lost", "not_sent_peer_lost"}
    assert res.failure_reasons["decode_lost"] == 8  # the next window: announced, never granted
    assert res.ending.lost == {"decode": "exited with code -9"}
    assert res.exit_code == 3 and wall < bound(timeout_s, start=True)
    # the rate is over the phase that ran: first arrival to the last verdict before the fault
    assert res.timing.wall_s < timeout_s  # (a wait for the timeout would be in it)


def test_decode_stopped_shorter_than_timeout_is_ridden_out(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=decode_stopped", "faults.at_request=50", "faults.duration_s=0.5",
                  "transport.timeout_s=4", "workload.requests=1500")
    _checked(res, tmp_path)
    assert res.ending.faults_applied and res.verified == 1500


def test_decode_stopped_longer_than_timeout_is_declared_lost(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=decode_stopped", "faults.at_request=50", "faults.duration_s=6",
                  "workload.requests=3000")
    _checked(res, tmp_path)
    wall = run_job.wall_s
    assert res.ending.faults_applied and res.verified == 50 and res.corrupted == 0
    assert "peer_lost" in res.failure_reasons or "not_sent_peer_lost" in res.failure_reasons
    assert wall < bound(TIMEOUT_S, start=True)


def test_silent_control_peer(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=silent_control", "workload.requests=50")
    _checked(res, tmp_path)
    wall = run_job.wall_s
    assert res.verified == 0 and res.failed == 50
    assert "did not answer hello" in res.error + str(res.ending.lost)
    assert wall < bound(TIMEOUT_S, start=True)


def test_silent_mooncake_peer_is_bounded_by_our_watchdog(run_job, tmp_path):
    res = run_job(tmp_path, *FAST, "faults=silent_peer", "workload.requests=50")
    _checked(res, tmp_path)
    wall = run_job.wall_s
    assert res.verified == 0 and res.failed == 50
    assert "did not finish within transport.timeout_s=2" in res.error + str(res.ending.lost)
    assert wall < bound(TIMEOUT_S, start=True) < 60  # Mooncake's own handshake would block for 60 s


def test_engine_only_fault_refused_on_tcp_route(cfg_factory):
    from orchestrator.profile.config import ConfigError

    cfg = cfg_factory("faults=bad_destination", "mem_pool=NVLINK")
    with pytest.raises(ConfigError, match="faults.kind"):
        check_profile(cfg, CPU)


def test_a_prefill_ended_after_an_interrupt_is_counted_not_lost(cfg_factory, tmp_path):
    """reconstruct() after an interrupt: what the prefill recorded counts, what a decode judged
    keeps its verdict (and its route), the requests in flight fail as interrupted, and those
    past the last trace never arrived: not_started, with no line."""
    from orchestrator.handoff.workload import room_of
    from orchestrator.job.runner import reconstruct
    from orchestrator.results.outcomes import Detail, Outcome
    from orchestrator.results.records import Record, read_records

    from .conftest import report_spec

    cfg = cfg_factory("workload.requests=1000")
    w = cfg.workload
    with open(tmp_path / "requests.jsonl", "w") as fh:
        for rid in range(40):  # recorded by the prefill itself
            fh.write(Record(rid, room_of(w, rid), 0, rid % 8, "engine", 1.0, 2.0, 3.0, 4.0,
                            Outcome.verified, Detail.none, "c").line() + "\n")
        fh.write('{"rid": 40, "roo')  # torn by the kill
    with open(tmp_path / "verdicts-decode.jsonl", "w") as fh:
        for rid in range(40, 50):  # judged by the decode, never recorded by the prefill
            fh.write(json.dumps({"prefill": 0, "rid": rid, "outcome": "verified", "detail": ""}) + "\n")
    res = reconstruct(report_spec(cfg), tmp_path, 0, "prefill", Detail.interrupted, route="engine", ran=True,
                      phase=(100.0, 102.0))
    assert res.verified == 50 and res.not_started == 950 and res.finished == 50
    assert res.routes["engine"] == 50  # never more verified than routed
    assert res.wall_s is not None
    records = list(read_records(tmp_path / "requests.jsonl"))
    assert len(records) == 50 and {r.rid for r in records} == set(range(50))
    # one that never reached its handoff phase started nothing
    never = tmp_path / "never"
    never.mkdir()
    res = reconstruct(report_spec(cfg), never, 0, "prefill", Detail.interrupted, ran=False)
    assert res.not_started == 1000 and res.finished == 0
    assert not (never / "requests.jsonl").exists() or (never / "requests.jsonl").read_text() == ""
