"""Prefill endpoint (sender): fills a row per finished request, asks decode for a slot,
sends the aux by the planned route, sends the status (with the row's checksum) on the data
socket, and waits for decode's verdict. Keeps `workload.concurrency` handoffs in flight.

A decode side silent for `transport.timeout_s` is declared lost: the requests in flight and
those not yet sent are counted as failed, and the run ends instead of hanging.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from .. import control
from ..buffers import SlotAllocator
from ..config import OrchestratorConfig
from ..plan import Plan
from ..router import AuxRouter, Peer
from ..transport import zmq_aux
from ..workload import make_request
from .common import build_side, new_socket, start_process


@dataclass
class Handoff:
    rid: int
    room: int
    slot: int
    checksum: str
    t_start: float
    deadline: float
    dst_slot: int = -1
    route: str = ""
    send_us: float = 0.0
    t_send: float = 0.0
    deliver_us: float = 0.0  # send_aux start -> decode's verdict received
    handoff_us: float = 0.0  # slot request -> decode's verdict received
    outcome: str = ""
    detail: str = ""

    def record(self) -> tuple:
        return (self.rid, self.room, self.dst_slot, self.route, self.send_us, self.deliver_us,
                self.handoff_us, self.outcome, self.detail, self.checksum)


RECORD_FIELDS = ("rid", "room", "dst_slot", "route", "send_us", "deliver_us", "handoff_us",
                 "outcome", "detail", "checksum")


class PrefillEndpoint:
    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log,
                 control_endpoint: str, data_endpoint: str):
        self.cfg, self.plan, self.log = cfg, plan, log
        self.side = build_side(cfg, plan, "prefill", run_dir, log)
        self.buffers = self.side.buffers
        self.slots = SlotAllocator(cfg.buffers.size)
        self.timeout_s = cfg.transport.timeout_s
        self.ctx = zmq.Context()
        self.control = new_socket(self.ctx, zmq.DEALER, self.timeout_s)
        self.control.connect(control_endpoint)
        self.push = new_socket(self.ctx, zmq.PUSH, self.timeout_s)
        self.push.connect(data_endpoint)
        self.router = AuxRouter(plan, self.buffers, self.side.transport, engine=self.side.engine,
                                push=self.push,
                                max_blocks_per_batch=cfg.transport.mooncake.max_blocks_per_batch)
        self.in_flight: dict[int, Handoff] = {}
        self.done: list[Handoff] = []
        self.ready: deque[int] = deque()

    def _recv(self, timeout_s: float) -> Optional[dict]:
        if not self.control.poll(int(timeout_s * 1000)):
            return None
        try:
            return control.decode(self.control.recv())
        except control.ControlError as exc:
            self.log.warning("control_dropped", error=str(exc))
            return {}

    def bootstrap(self) -> None:
        self.control.send(control.encode("hello", item_lens=self.buffers.item_lens))
        msg = self._recv(self.timeout_s)
        if msg is None:
            raise TimeoutError(f"decode did not answer hello within transport.timeout_s={self.timeout_s}")
        if msg.get("type") != "bootstrap":
            raise RuntimeError(f"bootstrap refused: {msg.get('detail', msg)}")
        peer = Peer(msg["session_id"], msg["aux_ptrs"], msg["item_lens"], msg["slots"])
        self.router.connect(peer)
        if self.side.engine is not None and not self.side.engine.probe(peer.session_id):
            raise RuntimeError(f"Mooncake probe of decode session {peer.session_id} failed")
        self.log.info("bootstrapped", peer_session=peer.session_id, slots=peer.slots)

    def _issue(self, rid: int) -> None:
        """A prefill finished: fill its row, checksum it, ask decode for a slot."""
        w = self.cfg.workload
        slot = self.slots.alloc()
        req = make_request(w, rid, self.cfg.buffers.hidden_size)
        req.metadata_buffer_index = slot
        self.buffers.set_buf(req)
        now = time.perf_counter()
        h = Handoff(rid, req.bootstrap_room, slot, self.buffers.row_checksum(slot), now,
                    now + self.timeout_s)
        self.in_flight[h.room] = h
        self.control.send(control.encode("grant_request", room=h.room, rid=rid))

    def _on_grant(self, h: Handoff, dst_slot: int) -> None:
        h.dst_slot = dst_slot
        h.t_send = time.perf_counter()
        decision = self.router.send_aux(h.room, h.slot, dst_slot)
        h.route, h.send_us = decision.route, round(decision.latency_us, 2)
        status = "ok" if decision.outcome == "ok" else "error"
        try:
            self.push.send_multipart(zmq_aux.encode_status(h.room, dst_slot, status, h.checksum))
        except zmq.ZMQError as exc:  # the data plane is stuck: the peer-lost timer ends it
            self.log.warning("status_send_failed", room=h.room, error=str(exc))
        self.router.log(decision)

    def _finish(self, h: Handoff, outcome: str, detail: str) -> None:
        h.outcome, h.detail = outcome, detail
        now = time.perf_counter()
        h.handoff_us = round((now - h.t_start) * 1e6, 2)
        if h.t_send:
            h.deliver_us = round((now - h.t_send) * 1e6, 2)
        self.buffers.clear_room(h.slot)
        self.slots.free(h.slot)
        self.done.append(h)

    def run(self, conn) -> float:
        """Run the workload; returns the wall time in seconds."""
        total = self.cfg.workload.requests
        window = min(self.cfg.workload.concurrency, self.cfg.buffers.size)
        next_rid = 0
        last_progress = t0 = time.perf_counter()
        peer_lost: Optional[str] = None
        while len(self.done) < total:
            while next_rid < total and len(self.in_flight) < window and peer_lost is None:
                self._issue(next_rid)
                next_rid += 1
            if peer_lost is not None or not self.in_flight:
                break
            msg = self._recv(min(0.2, self.timeout_s))
            now = time.perf_counter()
            if msg:
                h = self.in_flight.get(msg.get("room", -1))
                if h is None:
                    self.log.warning("unexpected_control", msg_type=msg["type"])
                elif msg["type"] == "grant":
                    self._on_grant(h, msg["slot"])
                    h.deadline = time.perf_counter() + self.timeout_s
                elif msg["type"] == "result":
                    del self.in_flight[h.room]
                    self._finish(h, msg["outcome"], msg["detail"])
            oldest = min((h.deadline for h in self.in_flight.values()), default=now)
            if now > oldest:
                peer_lost = f"decode silent for transport.timeout_s={self.timeout_s}"
                self.log.error("peer_lost", detail=peer_lost, in_flight=len(self.in_flight))
            if now - last_progress >= 1.0:
                conn.send(("progress", len(self.done)))
                last_progress = now
        wall = time.perf_counter() - t0
        for h in list(self.in_flight.values()):
            self._finish(h, "failed", "peer_lost")
        self.in_flight.clear()
        for rid in range(next_rid, total):
            self.done.append(Handoff(rid, 0, -1, "", 0, 0, outcome="failed", detail="not_sent_peer_lost"))
        try:
            self.control.send(control.encode("bye"), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        return wall

    def close(self) -> None:
        self.control.close(0)
        self.push.close(0)
        self.ctx.term()


def run_workload(endpoint: PrefillEndpoint, conn, decode_info: dict) -> dict:
    """The default driver: the configured workload through the full handoff protocol."""
    wall = endpoint.run(conn)
    return {"wall_s": wall, "row_bytes": endpoint.buffers.row_bytes,
            "records": [h.record() for h in endpoint.done]}


def prefill_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, decode_info: dict, conn,
                 driver=run_workload) -> None:
    """Process entry (multiprocessing spawn). `driver(endpoint, conn, decode_info)` does the
    work once bootstrapped and returns the result dict (the benchmark passes its own)."""
    run_path = Path(run_dir)
    log = start_process("prefill", run_path)
    endpoint = None
    try:
        endpoint = PrefillEndpoint(cfg, plan, run_path, log, decode_info["control_endpoint"],
                                   decode_info["data_endpoint"])
        conn.send(("transport", endpoint.side.transport))
        endpoint.bootstrap()
        conn.send(("result", driver(endpoint, conn, decode_info)))
    except Exception as exc:
        log.error("prefill_failed", error=str(exc), traceback=traceback.format_exc())
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if endpoint is not None:
            endpoint.close()
