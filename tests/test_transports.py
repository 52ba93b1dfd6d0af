"""Real bytes between real processes: Mooncake's TCP transport and the ZMQ route.

No mocks: every test here starts endpoint processes (multiprocessing spawn), opens real
sockets on loopback and, for the engine route, real Mooncake engines with registered memory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator.handoff.backends.mooncake.engine import EngineError, MooncakeEngine
from orchestrator.handoff.transport import wire
from orchestrator.job.runner import run_handoffs
from orchestrator.job.specs import build_specs
from orchestrator.profile.plan import Platform
from orchestrator.results.outcomes import Detail, KVPoll, Outcome
from orchestrator.results.reporting import build_results

from .conftest import ROOT, plan_of
from .helpers.bounds import bound
from .helpers.peers import PrefillPeer

pytestmark = pytest.mark.integration
CPU = Platform(cuda_devices=0)


def _decisions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(run_dir.glob("decisions*.jsonl"))
            for line in f.read_text().splitlines()]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(run_dir.glob("requests*.jsonl"))
            for line in f.read_text().splitlines()]


def test_engine_route_over_mooncake_tcp(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "mem_pool=NONE")
    assert (res.verified, res.failed, res.corrupted) == (200, 0, 0), res
    assert res.routes == {"engine": 200} and res.exit_code == 0
    assert res.transports.effective_transport == "mooncake-tcp"
    assert res.timing.startup_s > 0 and res.timing.wall_s > 0 and res.timing.handoffs_per_s > 0
    assert res.latency_us.handoff.p50 > 0 and res.latency_clock == "one_way"
    decisions = _decisions(tmp_path)
    assert len(decisions) == 200
    required = {"event", "room", "rid", "slot", "dst_slot", "mem_pool", "buffer_device", "route",
                "reason", "transport", "send", "row_bytes", "latency_us", "outcome"}
    for d in decisions:
        assert required <= set(d) and d["fallback"] is None
        assert (d["event"], d["route"], d["transport"], d["row_bytes"], d["outcome"]) == \
            ("route_decision", "engine", "mooncake-tcp", 1600, "ok")
        assert d["send"] == {"requests": 1, "blocks": 10, "bytes": 1600}
    assert "MC_FORCE_TCP is set" in (tmp_path / "decode.mooncake.log").read_text()
    records = _records(tmp_path)
    assert sorted(r["rid"] for r in records) == list(range(200))
    assert all(r["set_buf_us"] > 0 and r["handoff_us"] > 0 for r in records)
    # the engine's first write to the decode (its connection) was paid at start-up
    boots = [json.loads(line) for line in (tmp_path / "prefill.log").read_text().splitlines()
             if '"bootstrapped"' in line]
    assert len(boots) == 1 and boots[0]["first_write_us"] > 0
    # the wheel exports the engine's batch status: the loop asks it, never waits in the engine,
    # and where the loops block (under 8 usable cores, as on CI) drives overlapping steps itself
    from orchestrator.profile.platform import usable_cores

    loop = [json.loads(line) for line in (tmp_path / "prefill.log").read_text().splitlines()
            if '"prefill_loop"' in line]
    overlapping = "transfer_thread" if usable_cores() >= 8 else "inline"
    assert [(e["completion"], e["overlapping"]) for e in loop] == [("polled", overlapping)]


def test_nvlink_pool_goes_over_zmq(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "mem_pool=NVLINK")
    assert (res.verified, res.failed) == (200, 0), res
    assert res.routes == {"tcp": 200} and res.transports.effective_transport == "zmq-tcp"
    assert {d["reason"] for d in _decisions(tmp_path)} == {"pool_nvlink_sends_over_tcp"}


def test_forced_tcp_route_deepseek_rows(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "transport.route=tcp", "buffers.hidden_size=7168",
                  "buffers.hidden_states_dtype=bfloat16", "workload.concurrency=32")
    assert (res.verified, res.failed) == (200, 0), res
    assert {d["reason"] for d in _decisions(tmp_path)} == {"route_forced_tcp"}
    assert res.timing.bytes_per_request == 15872  # DeepSeek-V3-class hidden 7168 bf16 (the notes)


@pytest.mark.parametrize("route", ["engine", "tcp"])
def test_steps_coalesced_sends_and_step_statuses(run_job, tmp_path, route):
    res = run_job(tmp_path, "workload.requests=640", f"transport.route={route}", "workload.batch_size=16",
                  "workload.concurrency=64", "buffers.size=128", "transport.coalesce=true",
                  "transport.status=per_step", "workload.fill=ahead")
    assert (res.verified, res.failed, res.corrupted) == (640, 0, 0), res
    sends = {(d["rank"], d["dst_slot"]): d["send"]["requests"] for d in _decisions(tmp_path)}
    assert max(sends.values()) > 1 and res.timing.sends < 640  # runs of slots went as one send
    assert all(d["send"]["blocks"] == 10 for d in _decisions(tmp_path))  # one block per field


@pytest.mark.slow
def test_open_loop_arrivals_measure_from_arrival(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "workload.rate=400")
    assert res.verified == 200, res
    e2e, hand = res.latency_us.e2e, res.latency_us.handoff
    assert e2e.p50 >= hand.p50  # from arrival: includes the wait for a grant and a step
    assert 0.35 < res.timing.wall_s < bound(200 / 400)  # 200 arrivals at 400/s take about half a second


@pytest.mark.slow
def test_degraded_intra_node_nvlink_runs_on_host_over_engine_tcp(run_job, tmp_path):
    res = run_job(tmp_path, "workload.requests=200", "mem_pool=INTRA_NODE_NVLINK",
                  "transport.fallback=degrade")
    assert res.verified == 200 and res.transports.effective_transport == "mooncake-tcp"
    assert res.plan.events[0]["event"] == "fallback"
    assert {(d["mem_pool"], d["buffer_device"], d["fallback"]) for d in _decisions(tmp_path)} == {
        ("INTRA_NODE_NVLINK", "cpu", "degraded_no_cuda")}


# ---- the Mooncake wrapper between two processes ---------------------------------------------
def _engine_target(conn):
    buf = torch.zeros(4096, dtype=torch.uint8)
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env={"MC_FORCE_TCP": "1"})
    eng.register(buf.data_ptr(), buf.numel())
    conn.send((eng.session_id, buf.data_ptr()))
    conn.recv()
    conn.send(bytes(buf[:512].tolist()))


def test_mooncake_wrapper_moves_bytes_and_raises_on_bad_destination():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_target, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        session, dst = parent.recv()
        src = torch.arange(512, dtype=torch.int32).to(torch.uint8)
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env={"MC_FORCE_TCP": "1"})
        assert eng.effective_transport.value == "tcp"
        eng.register(src.data_ptr(), src.numel())
        assert eng.probe(session)
        eng.batch_write(session, [src.data_ptr(), src.data_ptr() + 128], [dst, dst + 128], [128, 128])
        eng.wait(eng.submit(session, [src.data_ptr() + 256], [dst + 256], [128]))  # asynchronous
        # numpy address arrays: 0.3.14's *_arrays calls where the wheel has them, else as lists
        a = np.array([src.data_ptr() + 384, src.data_ptr() + 448], dtype=np.uint64)
        b = np.array([dst + 384, dst + 448], dtype=np.uint64)
        eng.wait(eng.submit(session, a[:1], b[:1], np.array([64], dtype=np.uint64)))
        eng.batch_write(session, a[1:], b[1:], np.array([64], dtype=np.int64))
        with pytest.raises(EngineError) as info:
            eng.batch_write(session, [src.data_ptr()], [dst + (1 << 40)], [64])
        assert info.value.rc != 0 and info.value.context["blocks"] == 1
        parent.send("read")
        assert parent.poll(30)
        assert parent.recv() == bytes(src.tolist())
    finally:
        proc.kill()
        proc.join(5)


# ---- a hand-written prefill against the real decode process ---------------------------------
@pytest.mark.slow
def test_decode_judges_corruption_room_mismatch_stale_room_and_failed_sender(cfg_factory, tmp_path):
    peer = PrefillPeer(cfg_factory("mem_pool=NVLINK", "transport.timeout_s=1"), tmp_path)
    try:
        # 1. intact row -> verified
        assert peer.handoff(1) == (Outcome.verified, Detail.none)
        # 2. one byte flipped in transit -> corrupted (digest), never accepted
        assert peer.handoff(2, corrupt=(4, 10)) == (Outcome.corrupted, Detail.checksum_mismatch)
        # 3. the row carries another room than the one announced -> corrupted (room mismatch)
        room, tag = peer.fill(3)
        slot = peer.arrive(3, room + 1)
        peer.send_frames(room + 1, slot, peer.rows())  # the frames name the granted room ...
        peer.status(room + 1, 3, slot, tag)  # ... the row inside holds another
        assert peer.verdict(3) == (Outcome.corrupted, Detail.room_mismatch)
        # 4. bootstrap_room never sent into a reused slot: the previous tenant's room was
        #    zeroed, so the gate waits, then fails it
        room, tag = peer.fill(4)
        slot = peer.arrive(4, room)
        peer.send_frames(room, slot, peer.rows(), skip={peer.buffers.room_field})
        peer.status(room, 4, slot, tag)
        assert peer.verdict(4) == (Outcome.failed, Detail.room_never_landed)
        # 5. sender saw its write fail: data complete or not, the slot is not accepted
        room, tag = peer.fill(5)
        slot = peer.arrive(5, room)
        peer.send_frames(room, slot, peer.rows())
        peer.status(room, 5, slot, tag, status=KVPoll.Failed)
        assert peer.verdict(5) == (Outcome.failed, Detail.sender_error)
        # 6. frames for a slot that was never granted are refused (no grant: no session key
        #    opens them), nothing written
        peer.send_frames(999, 5, peer.rows())
        assert peer.handoff(6) == (Outcome.verified, Detail.none)
    finally:
        stats = peer.close()
    assert stats.outcomes[Outcome.verified] == 2 and stats.outcomes[Outcome.corrupted] == 2
    assert stats.outcomes[Outcome.failed] == 2 and stats.refused.rejected_auth == len(peer.buffers.fields)


@pytest.mark.slow
def test_engine_route_room_mismatch_detected(cfg_factory, tmp_path):
    """Same gate on the engine route: bytes written by a real Mooncake batch write."""
    peer = PrefillPeer(cfg_factory("mem_pool=NONE"), tmp_path)
    try:
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env=peer.plan.mc_env)
        eng.register(peer.buffers.arena_ptr, peer.buffers.arena_bytes)
        ptrs, _, lens = peer.buffers.get_buf_infos()
        dst_ptrs, session = peer.bootstrap.aux_ptrs, peer.bootstrap.session_id

        def write(slot):
            eng.batch_write(session, ptrs, [d + n * slot for d, n in zip(dst_ptrs, lens)], lens)

        room, tag = peer.fill(10)
        slot = peer.arrive(10, room)
        write(slot)
        peer.status(room, 10, slot, tag)
        assert peer.verdict(10) == (Outcome.verified, Detail.none)
        room, tag = peer.fill(11)  # the row holds request 11's room ...
        slot = peer.arrive(12, 12345)  # ... but request 12 was announced with another
        write(slot)
        peer.status(12345, 12, slot, tag)
        assert peer.verdict(12) == (Outcome.corrupted, Detail.room_mismatch)
        # AUX_DATA frames mean nothing on the engine route: counted, never written
        room, tag = peer.fill(13)
        slot = peer.arrive(13, room)
        peer.send_frames(room, slot, peer.rows())
        write(slot)
        peer.status(room, 13, slot, tag)  # behind the frames on the data socket
        assert peer.verdict(13) == (Outcome.verified, Detail.none)
    finally:
        stats = peer.close()
    assert stats.outcomes[Outcome.verified] == 2 and stats.outcomes[Outcome.corrupted] == 1
    assert stats.refused.unexpected == len(lens)


@pytest.mark.slow
def test_grants_come_at_arrival_and_go_back_on_bye(cfg_factory, tmp_path):
    peer = PrefillPeer(cfg_factory("mem_pool=NVLINK", "buffers.size=2"), tmp_path)
    try:
        a, b = peer.arrive(1, 111), peer.arrive(2, 222)  # slots before any row is ready
        assert {a, b} == {0, 1}
        peer.send_control(wire.encode("arrive", reqs=[[3, 333]], contiguous=False))
        assert peer.quiet(300)  # no slot free: request 3 waits
        peer.send_control(wire.encode("bye"))  # this prefill writes nothing more
        peer.recv()
        assert 3 in peer.grants
    finally:
        peer.close()


@pytest.mark.slow
def test_cli_run_writes_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "workload.requests=100",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified 100, corrupted 0, failed 0" in proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert len(lines) <= 8 and "None" not in proc.stdout, proc.stdout  # a quiet console
    assert proc.stderr.strip() == "", proc.stderr
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "results.json", "decisions.jsonl",
                 "orchestrator.log", "requests.jsonl", "verdicts-decode.jsonl", "fingerprint.json",
                 "latency.png"):
        assert (run_dir / name).exists(), name
    res = json.loads((run_dir / "results.json").read_text())
    for key in ("requests", "verified", "failed", "routes", "latency_us", "handoffs_per_s",
                "mb_per_s", "effective_transport", "startup_s", "exit_code"):
        assert key in res
    assert {"p50", "p99", "p999", "mean", "max", "percentiles"} <= set(res["latency_us"]["send_aux"])
    assert len((run_dir / "decisions.jsonl").read_text().splitlines()) == 100


@pytest.mark.slow
def test_all_pairs_two_prefill_two_decode_ranks(run_job, tmp_path):
    res = run_job(tmp_path, "endpoints.prefill_ranks=2", "endpoints.decode_ranks=2", "workload.requests=100")
    assert (res.verified, res.failed, res.corrupted) == (200, 0, 0), res
    assert set(res.pairs) == {"p0->d0", "p0->d1", "p1->d0", "p1->d1"}
    assert all(p.verified == 50 for p in res.pairs.values())
    rates = [p.handoffs_per_s for p in res.pairs.values()]
    assert all(r and r > 0 for r in rates) and len(set(rates)) == 4  # each pair's own rate
    rids = [r["rid"] for r in _records(tmp_path)]
    assert sorted(rids) == list(range(200))  # unique across prefill ranks


@pytest.mark.slow
def test_effective_transport_differs_from_declared(cfg_factory, tmp_path):
    """Declaring rdma on a box without an HCA: Mooncake quietly comes up on TCP. Under strict
    the run stops and says so; under degrade it runs and logs the fallback."""
    cfg = cfg_factory("transport.mooncake.transport=rdma", "workload.requests=50")
    plan = plan_of(cfg, CPU)
    assert plan.mc_env["MC_FORCE_TCP"] is None and plan.declared_transport == "mooncake-rdma"
    specs = build_specs(cfg, plan)
    res = build_results(specs.report, run_handoffs(specs, tmp_path / "strict"))
    assert res.verified == 0 and res.exit_code == 3
    assert "came up on mooncake-tcp, declared mooncake-rdma" in res.error

    cfg = cfg_factory("transport.mooncake.transport=rdma", "transport.fallback=degrade",
                      "workload.requests=50")
    plan = plan_of(cfg, CPU)
    specs = build_specs(cfg, plan)
    res = build_results(specs.report, run_handoffs(specs, tmp_path / "degrade"))
    assert res.verified == 50 and res.transports.effective_transport == "mooncake-tcp"
    assert "effective_transport_differs" in (tmp_path / "degrade" / "decode.log").read_text()
