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

import pytest
import torch
import zmq

from orchestrator import MetadataBuffers, control
from orchestrator.plan import Platform, make_plan
from orchestrator.runner import run_handoffs
from orchestrator.report import build_results
from orchestrator.transport import zmq_aux
from orchestrator.transport.engine import EngineError, MooncakeEngine
from orchestrator.workload import make_request

from .conftest import ROOT, DecodeProcess

pytestmark = pytest.mark.integration
CPU = Platform(cuda_devices=0)


def _run(cfg_factory, tmp_path, *overrides):
    cfg = cfg_factory("workload.requests=200", *overrides)
    plan = make_plan(cfg, CPU)
    out = run_handoffs(cfg, plan, tmp_path)
    return build_results(cfg.workload.requests, plan, out), tmp_path


def _decisions(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]


def test_engine_route_over_mooncake_tcp(cfg_factory, tmp_path):
    res, run_dir = _run(cfg_factory, tmp_path, "mem_pool=NONE")
    assert (res["verified"], res["failed"], res["corrupted"]) == (200, 0, 0), res
    assert res["routes"] == {"engine": 200}
    assert res["effective_transport"] == "mooncake-tcp"
    decisions = _decisions(run_dir)
    assert len(decisions) == 200
    required = {"event", "room", "slot", "mem_pool", "buffer_device", "route", "reason",
                "transport", "blocks", "bytes", "latency_us", "outcome"}
    for d in decisions:
        assert required <= set(d) and d["fallback"] is None
        assert (d["event"], d["route"], d["transport"], d["blocks"], d["bytes"], d["outcome"]) == \
            ("route_decision", "engine", "mooncake-tcp", 10, 1600, "ok")
    assert "MC_FORCE_TCP is set" in (run_dir / "decode.mooncake.log").read_text()


def test_nvlink_pool_goes_over_zmq(cfg_factory, tmp_path):
    res, run_dir = _run(cfg_factory, tmp_path, "mem_pool=NVLINK")
    assert (res["verified"], res["failed"]) == (200, 0), res
    assert res["routes"] == {"tcp": 200} and res["effective_transport"] == "zmq-tcp"
    assert {d["reason"] for d in _decisions(run_dir)} == {"pool_nvlink_sends_over_tcp"}


def test_forced_tcp_route(cfg_factory, tmp_path):
    res, run_dir = _run(cfg_factory, tmp_path, "transport.route=tcp", "buffers.hidden_size=7168",
                        "buffers.hidden_states_dtype=bfloat16", "workload.concurrency=32")
    assert (res["verified"], res["failed"]) == (200, 0), res
    assert res["routes"] == {"tcp": 200}
    assert {d["reason"] for d in _decisions(run_dir)} == {"route_forced_tcp"}
    assert res["bytes_per_request"] == 15872  # DeepSeek-V3-class hidden 7168 bf16 (the notes)


def test_degraded_intra_node_nvlink_runs_on_host_over_engine_tcp(cfg_factory, tmp_path):
    res, run_dir = _run(cfg_factory, tmp_path, "mem_pool=INTRA_NODE_NVLINK", "transport.fallback=degrade")
    assert res["verified"] == 200 and res["effective_transport"] == "mooncake-tcp"
    assert res["plan"]["events"][0]["event"] == "fallback"
    decisions = _decisions(run_dir)
    assert {(d["mem_pool"], d["buffer_device"], d["fallback"]) for d in decisions} == {
        ("INTRA_NODE_NVLINK", "cpu", "degraded_no_cuda")}


# ---- the Mooncake wrapper between two processes ---------------------------------------------
def _engine_target(conn):
    buf = torch.zeros(4096, dtype=torch.uint8)
    eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env={"MC_FORCE_TCP": "1"})
    eng.register(buf.data_ptr(), buf.numel())
    conn.send((eng.session_id, buf.data_ptr()))
    conn.recv()
    conn.send(bytes(buf[:256].tolist()))


def test_mooncake_wrapper_moves_bytes_and_raises_on_bad_destination():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_target, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(60)
        session, dst = parent.recv()
        src = torch.arange(256, dtype=torch.uint8)
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env={"MC_FORCE_TCP": "1"})
        assert eng.effective_transport.value == "tcp"
        eng.register(src.data_ptr(), src.numel())
        assert eng.probe(session)
        eng.batch_write(session, [src.data_ptr(), src.data_ptr() + 128], [dst, dst + 128], [128, 128])
        with pytest.raises(EngineError) as info:
            eng.batch_write(session, [src.data_ptr()], [dst + (1 << 40)], [64])
        assert info.value.rc != 0 and info.value.context["blocks"] == 1
        parent.send("read")
        assert parent.poll(30)
        assert parent.recv() == bytes(range(256))
    finally:
        proc.kill()
        proc.join(5)


# ---- a hand-written sender against the real decode process ----------------------------------
class DecodePeer:
    """Starts the real decode endpoint; the test plays prefill with raw sockets."""

    def __init__(self, cfg, tmp_path):
        self.cfg = cfg
        self.decode = DecodeProcess(cfg, tmp_path)
        self.plan, self.info = self.decode.plan, self.decode.info
        self.zctx = zmq.Context()
        self.control = self.zctx.socket(zmq.DEALER)
        self.control.connect(self.info["control_endpoint"])
        self.push = self.zctx.socket(zmq.PUSH)
        self.push.connect(self.info["data_endpoint"])
        self.buffers = MetadataBuffers(cfg.buffers.size, cfg.buffers.hidden_size, torch.float32)
        self.control.send(control.encode("hello", item_lens=self.buffers.item_lens))
        self.bootstrap = self.recv()
        assert self.bootstrap["type"] == "bootstrap"

    def recv(self, timeout_ms=20000):
        assert self.control.poll(timeout_ms), "decode did not answer"
        return control.decode(self.control.recv())

    def grant(self, room: int) -> int:
        self.control.send(control.encode("grant_request", room=room, rid=0))
        msg = self.recv()
        assert msg["type"] == "grant" and msg["room"] == room
        return msg["slot"]

    def filled_row(self, rid: int, slot: int = 0):
        req = make_request(self.cfg.workload, rid, self.cfg.buffers.hidden_size)
        req.metadata_buffer_index = slot
        self.buffers.set_buf(req)
        return req.bootstrap_room, self.buffers.row_checksum(slot)

    def send_frames(self, room, dst_slot, rows, skip=()):
        for i, payload in enumerate(rows):
            if i not in skip:
                self.push.send_multipart(zmq_aux.encode_aux(room, i, dst_slot, payload))

    def status(self, room, dst_slot, checksum, status="ok"):
        self.push.send_multipart(zmq_aux.encode_status(room, dst_slot, status, checksum))
        return self.recv()

    def close(self):
        stats = self.decode.stop()
        self.control.close(0)
        self.push.close(0)
        self.zctx.term()
        return stats


def _rows(peer):
    ptrs, _, lens = peer.buffers.get_buf_infos()
    return zmq_aux.read_rows(ptrs, lens, 0)


def test_decode_detects_corruption_room_mismatch_stale_room_and_failed_sender(cfg_factory, tmp_path):
    peer = DecodePeer(cfg_factory("mem_pool=NVLINK", "transport.timeout_s=1"), tmp_path)
    try:
        # 1. intact row -> verified
        room, checksum = peer.filled_row(1)
        slot = peer.grant(room)
        peer.send_frames(room, slot, _rows(peer))
        assert peer.status(room, slot, checksum)["outcome"] == "verified"

        # 2. one byte flipped in transit -> corrupted (checksum), never accepted
        room, checksum = peer.filled_row(2)
        slot = peer.grant(room)
        rows = _rows(peer)
        rows[4] = bytes([rows[4][0] ^ 0xFF]) + rows[4][1:]
        peer.send_frames(room, slot, rows)
        res = peer.status(room, slot, checksum)
        assert (res["outcome"], res["detail"]) == ("corrupted", "checksum_mismatch")

        # 3. the row carries another request's room -> corrupted (room mismatch)
        other_room, _ = peer.filled_row(3)
        room = other_room + 1
        slot = peer.grant(room)
        peer.send_frames(room, slot, _rows(peer))
        res = peer.status(room, slot, "whatever")
        assert (res["outcome"], res["detail"]) == ("corrupted", "room_mismatch")

        # 4. bootstrap_room never written into a reused (freed) slot: the stale room of the
        #    previous tenant was zeroed, so the gate waits, then fails it
        room, checksum = peer.filled_row(4)
        slot = peer.grant(room)
        peer.send_frames(room, slot, _rows(peer), skip={len(peer.buffers.fields) - 1})
        res = peer.status(room, slot, checksum)
        assert (res["outcome"], res["detail"]) == ("failed", "room_never_landed")

        # 5. sender saw its batch fail: data complete or not, the slot is not accepted
        room, checksum = peer.filled_row(5)
        slot = peer.grant(room)
        peer.send_frames(room, slot, _rows(peer))
        res = peer.status(room, slot, checksum, status="error")
        assert (res["outcome"], res["detail"]) == ("failed", "sender_error")

        # 6. frames for a slot that was never granted are dropped, nothing written
        peer.send_frames(999, 5, _rows(peer))
        room, checksum = peer.filled_row(6)
        slot = peer.grant(room)
        peer.send_frames(room, slot, _rows(peer))
        assert peer.status(room, slot, checksum)["outcome"] == "verified"
    finally:
        stats = peer.close()
    assert stats["verified"] == 2 and stats["corrupted"] == 2 and stats["failed"] == 2
    assert stats["unexpected"] == len(peer.buffers.fields)


def test_engine_route_room_mismatch_detected(cfg_factory, tmp_path):
    """Same gate on the engine route: bytes written by a real Mooncake batch write."""
    peer = DecodePeer(cfg_factory("mem_pool=NONE"), tmp_path)
    try:
        eng = MooncakeEngine("127.0.0.1", "P2PHANDSHAKE", "tcp", env=peer.plan.mc_env)
        eng.register(peer.buffers.arena_ptr, peer.buffers.arena_bytes)
        ptrs, _, lens = peer.buffers.get_buf_infos()
        dst_ptrs = peer.bootstrap["aux_ptrs"]
        session = peer.bootstrap["session_id"]

        def write(slot):
            eng.batch_write(session, [p for p in ptrs], [d + n * slot for d, n in zip(dst_ptrs, lens)], lens)

        room, checksum = peer.filled_row(10)
        slot = peer.grant(room)
        write(slot)
        assert peer.status(room, slot, checksum)["outcome"] == "verified"

        _, checksum = peer.filled_row(11)  # row holds request 11's room ...
        room = 12345  # ... but the grant was for another room
        slot = peer.grant(room)
        write(slot)
        res = peer.status(room, slot, checksum)
        assert (res["outcome"], res["detail"]) == ("corrupted", "room_mismatch")
    finally:
        stats = peer.close()
    assert stats["verified"] == 1 and stats["corrupted"] == 1


def test_cli_run_writes_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "workload.requests=100",
                           f"hydra.run.dir={run_dir}"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verified 100, corrupted 0, failed 0" in proc.stdout
    for name in (".hydra/config.yaml", ".hydra/overrides.yaml", "results.json", "decisions.jsonl",
                 "orchestrator.log"):
        assert (run_dir / name).exists(), name
    res = json.loads((run_dir / "results.json").read_text())
    for key in ("requests", "verified", "failed", "routes", "latency_us", "handoffs_per_s",
                "mb_per_s", "effective_transport"):
        assert key in res
    assert set(res["latency_us"]["send_aux"]) == {"p50", "p99", "p999"}
    assert len((run_dir / "decisions.jsonl").read_text().splitlines()) == 100


def test_all_pairs_two_prefill_two_decode_ranks(cfg_factory, tmp_path):
    cfg = cfg_factory("endpoints.prefill_ranks=2", "endpoints.decode_ranks=2", "workload.requests=100")
    plan = make_plan(cfg, CPU)
    res = build_results(200, plan, run_handoffs(cfg, plan, tmp_path))
    assert (res["verified"], res["failed"], res["corrupted"]) == (200, 0, 0), res
    assert set(res["pairs"]) == {"p0->d0", "p0->d1", "p1->d0", "p1->d1"}
    assert all(p["verified"] == 50 for p in res["pairs"].values())
    rids = [json.loads(x)["rid"] for f in ("requests-prefill0.jsonl", "requests-prefill1.jsonl")
            for x in (tmp_path / f).read_text().splitlines()]
    assert sorted(rids) == list(range(200))  # unique across prefill ranks


def test_grant_without_status_expires_and_frees_the_slot(cfg_factory, tmp_path):
    """A sender that takes a slot and vanishes cannot hold it past transport.timeout_s."""
    peer = DecodePeer(cfg_factory("mem_pool=NVLINK", "transport.timeout_s=1", "buffers.size=1"), tmp_path)
    try:
        slot = peer.grant(111)  # the only slot, never followed by data or status
        res = peer.recv(5000)
        assert (res["type"], res["outcome"], res["detail"]) == ("result", "failed", "grant_expired")
        room, checksum = peer.filled_row(1)
        again = peer.grant(room)  # the slot is back in the pool
        assert again == slot
        peer.send_frames(room, again, _rows(peer))
        assert peer.status(room, again, checksum)["outcome"] == "verified"
    finally:
        stats = peer.close()
    assert stats["reasons"] == {"grant_expired": 1} and stats["verified"] == 1


def test_effective_transport_differs_from_declared(cfg_factory, tmp_path):
    """Declaring rdma on a box without an HCA: Mooncake quietly comes up on TCP. Under strict
    the run stops and says so; under degrade it runs and logs the fallback."""
    cfg = cfg_factory("transport.mooncake.transport=rdma", "workload.requests=50")
    plan = make_plan(cfg, CPU)
    assert plan.mc_env["MC_FORCE_TCP"] is None and plan.declared_transport == "mooncake-rdma"
    res = build_results(50, plan, run_handoffs(cfg, plan, tmp_path / "strict"))
    assert res["verified"] == 0
    assert "came up on mooncake-tcp, declared mooncake-rdma" in res["error"]

    cfg = cfg_factory("transport.mooncake.transport=rdma", "transport.fallback=degrade",
                      "workload.requests=50")
    plan = make_plan(cfg, CPU)
    res = build_results(50, plan, run_handoffs(cfg, plan, tmp_path / "degrade"))
    assert res["verified"] == 50 and res["effective_transport"] == "mooncake-tcp"
    assert "effective_transport_differs" in (tmp_path / "degrade" / "decode.log").read_text()
