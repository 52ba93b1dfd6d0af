"""Prefill endpoint (sender): fills a row per finished request, asks decode for a slot,
sends the aux by the planned route, sends the status (with the row's checksum) on the data
socket, and waits for decode's verdict. Keeps `workload.concurrency` handoffs in flight.

A decode side silent for `transport.timeout_s` is declared lost: the requests in flight and
those not yet sent are counted as failed, and the run ends instead of hanging. Per-request
records stream to requests.jsonl; only counters and latency arrays stay in memory, so a
100,000-handoff soak runs in flat memory.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from .. import control
from ..auth import Authenticator, from_env
from ..buffers import SlotAllocator
from ..config import FaultKind, OrchestratorConfig
from ..faults import BAD_OFFSET, UNSERVED_SESSION, FaultInjector
from ..plan import Plan
from ..router import AuxRouter, Peer
from ..stats import LatencyHistogram
from ..transport import zmq_aux
from ..workload import make_request
from .common import build_side, new_socket, rank_gpu, role_name, rss_kb, start_process

RECORD_FIELDS = ("rid", "room", "decode_rank", "dst_slot", "route", "send_us", "deliver_us",
                 "handoff_us", "outcome", "detail", "checksum", "fault")


@dataclass
class Handoff:
    rid: int
    room: int
    slot: int
    checksum: str
    t_start: float
    deadline: float
    decode_rank: int = 0
    dst_slot: int = -1
    route: str = ""
    send_us: float = 0.0
    t_send: float = 0.0
    deliver_us: float = 0.0  # send_aux start -> decode's verdict received
    handoff_us: float = 0.0  # slot request -> decode's verdict received
    outcome: str = ""
    detail: str = ""
    fault: Optional[str] = None

    def record(self) -> dict:
        return {name: getattr(self, name) for name in RECORD_FIELDS}


class Tally:
    """What the run keeps in memory: counters and fixed-size latency histograms."""

    def __init__(self, sink_path: Optional[Path]):
        self.outcomes: Counter = Counter()
        self.routes: Counter = Counter()
        self.reasons: Counter = Counter()
        self.send_us = LatencyHistogram()
        self.deliver_us = LatencyHistogram()
        self.handoff_us = LatencyHistogram()
        self.pairs: dict[int, dict] = {}  # decode rank -> outcomes and deliver latencies
        self._sink = open(sink_path, "w", buffering=1 << 16) if sink_path else None

    def add(self, h: Handoff) -> None:
        self.outcomes[h.outcome] += 1
        if h.route:
            self.routes[h.route] += 1
            self.send_us.add(h.send_us)
        pair = self.pairs.setdefault(h.decode_rank, {"outcomes": Counter(),
                                                     "deliver_us": LatencyHistogram()})
        pair["outcomes"][h.outcome] += 1
        if h.outcome == "verified":
            self.deliver_us.add(h.deliver_us)
            self.handoff_us.add(h.handoff_us)
            pair["deliver_us"].add(h.deliver_us)
        else:
            self.reasons[h.detail] += 1
        if self._sink is not None:
            self._sink.write(json.dumps(h.record()) + "\n")

    @property
    def count(self) -> int:
        return sum(self.outcomes.values())

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()

    def result(self) -> dict:
        return {"outcomes": dict(self.outcomes), "routes": dict(self.routes),
                "reasons": dict(self.reasons), "send_us": self.send_us.to_dict(),
                "deliver_us": self.deliver_us.to_dict(), "handoff_us": self.handoff_us.to_dict(),
                "pairs": {j: {"outcomes": dict(p["outcomes"]), "deliver_us": p["deliver_us"].to_dict()}
                          for j, p in self.pairs.items()}}


@dataclass
class Link:
    """One decode rank as this prefill rank sees it: control channel, data socket, router."""

    rank: int
    control: zmq.Socket
    push: zmq.Socket
    router: AuxRouter


class PrefillEndpoint:
    """Prefill rank `rank`: hands its requests round-robin to every decode rank in
    `decode_infos` (all-pairs when several prefill ranks run)."""

    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log,
                 decode_infos: list[dict], rank: int = 0):
        self.cfg, self.plan, self.log = cfg, plan, log
        ranks = cfg.endpoints.prefill_ranks
        role = role_name("prefill", rank, ranks)
        self.rid_base = rank * cfg.workload.requests
        self.side = build_side(cfg, plan, role, run_dir, log, rank_gpu(plan, "prefill", rank))
        self.buffers = self.side.buffers
        self.slots = SlotAllocator(cfg.buffers.size)
        self.timeout_s = cfg.transport.timeout_s
        self.auth: Authenticator = from_env(cfg.transport.secret_env)
        self.faults = FaultInjector(cfg.faults)
        self.ctx = zmq.Context()
        self.links: list[Link] = []
        self.poller = zmq.Poller()
        for j, info in enumerate(decode_infos):
            ctl = new_socket(self.ctx, zmq.DEALER, self.timeout_s)
            ctl.connect(info["control_endpoint"])
            push = new_socket(self.ctx, zmq.PUSH, self.timeout_s)
            push.connect(info["data_endpoint"])
            router = AuxRouter(plan, self.buffers, self.side.transport, engine=self.side.engine,
                               push=push,
                               max_blocks_per_batch=cfg.transport.mooncake.max_blocks_per_batch)
            self.links.append(Link(j, ctl, push, router))
            self.poller.register(ctl, zmq.POLLIN)
        self.router = self.links[0].router  # the benchmark drives one pair
        self.in_flight: dict[int, Handoff] = {}
        records = "requests.jsonl" if ranks == 1 else f"requests-{role}.jsonl"
        self.tally = Tally(run_dir / records)
        self.rejected_auth = 0
        self.memory: dict[str, int] = {}
        self.stuck = False  # a Mooncake call that never returned: exit hard

    # ---- control channel ----------------------------------------------------------------
    def _send(self, link: Link, payload: bytes) -> None:
        link.control.send_multipart(self.auth.sign([payload]))

    def _recv(self, timeout_s: float, link: Link) -> Optional[dict]:
        """A decoded control message from `link`, {} for one that was dropped, None on timeout."""
        if not link.control.poll(int(timeout_s * 1000)):
            return None
        return self._decode(link.control.recv_multipart())

    def _recv_any(self, timeout_s: float) -> list[dict]:
        """One message from EVERY decode rank that has one (fair: no rank starves another)."""
        ready = self.poller.poll(int(timeout_s * 1000))
        return [msg for sock, _ in ready if (msg := self._decode(sock.recv_multipart()))]

    def _decode(self, frames: list[bytes]) -> dict:
        """The decoded message, or {} for one that was dropped."""
        body = self.auth.check(frames, 1)
        if body is None:
            self.rejected_auth += 1
            self.log.warning("control_rejected", reason="bad or missing MAC", frames=len(frames))
            return {}
        try:
            return control.decode(body[0])
        except control.ControlError as exc:
            self.log.warning("control_dropped", error=str(exc))
            return {}

    def bootstrap(self) -> None:
        for link in self.links:
            self._send(link, control.encode("hello", item_lens=self.buffers.item_lens))
            msg = self._recv(self.timeout_s, link)
            if msg is None:
                raise TimeoutError(f"decode rank {link.rank} did not answer hello within "
                                   f"transport.timeout_s={self.timeout_s:g}")
            if msg.get("type") != "bootstrap":
                raise RuntimeError(f"bootstrap refused by decode rank {link.rank}: "
                                   f"{msg.get('detail', msg)}")
            peer = Peer(msg["session_id"], msg["aux_ptrs"], msg["item_lens"], msg["slots"])
            link.router.connect(peer)
            if self.side.engine is not None:
                self._probe_bounded(peer.session_id)
            self.log.info("bootstrapped", decode_rank=link.rank, peer_session=peer.session_id,
                          slots=peer.slots)

    def _probe_bounded(self, session: str) -> None:
        """Mooncake's handshake with a peer that accepts and never answers blocks ~60 s and
        ignores its timeout variables: run it on a watchdog of transport.timeout_s."""
        result: dict[str, bool] = {}
        t = threading.Thread(target=lambda: result.update(ok=self.side.engine.probe(session)),
                             daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self.stuck = True
            raise TimeoutError(f"Mooncake handshake with decode session {session} did not finish "
                               f"within transport.timeout_s={self.timeout_s:g}")
        if not result.get("ok"):
            raise RuntimeError(f"Mooncake probe of decode session {session} failed")

    # ---- one handoff --------------------------------------------------------------------
    def _issue(self, rid: int) -> None:
        """A prefill finished: fill its row, checksum it, ask a decode rank for a slot."""
        gid = self.rid_base + rid  # unique across prefill ranks
        link = self.links[rid % len(self.links)]
        slot = self.slots.alloc()
        req = make_request(self.cfg.workload, gid, self.cfg.buffers.hidden_size)
        req.metadata_buffer_index = slot
        self.buffers.set_buf(req)
        now = time.perf_counter()
        h = Handoff(gid, req.bootstrap_room, slot, self.buffers.row_checksum(slot), now,
                    now + self.timeout_s, decode_rank=link.rank)
        self.in_flight[h.room] = h
        self._send(link, control.encode("grant_request", room=h.room, rid=gid))

    def _on_grant(self, h: Handoff, dst_slot: int) -> None:
        link = self.links[h.decode_rank]
        h.dst_slot = dst_slot
        fault = self.faults.for_request(h.rid)
        h.t_send = time.perf_counter()
        if fault is None:
            decision = link.router.send_aux(h.room, h.slot, dst_slot)
        else:
            decision = self._send_with_fault(fault, link.router, h, dst_slot)
        h.route, h.send_us = decision.route, round(decision.latency_us, 2)
        status = "ok" if decision.outcome == "ok" else "error"
        try:
            link.push.send_multipart(
                self.auth.sign(zmq_aux.encode_status(h.room, dst_slot, status, h.checksum)))
        except zmq.ZMQError as exc:  # the data plane is stuck: the peer-lost timer ends it
            self.log.warning("status_send_failed", room=h.room, error=str(exc))
        link.router.log(decision)

    def _send_with_fault(self, fault: FaultKind, router: AuxRouter, h: Handoff, dst_slot: int):
        h.fault = fault.value
        self.log.info("fault_injected", fault=fault.value, rid=h.rid, room=h.room)
        if fault is FaultKind.corrupt_byte:  # after the checksum was taken: "in transit"
            self.buffers.flip_byte(h.slot, field_index=len(self.buffers.fields) // 2)
            return router.send_aux(h.room, h.slot, dst_slot)
        srcs, dsts, lens = router.blocks(h.slot, dst_slot)
        if fault is FaultKind.bad_destination:
            return router.send_aux(h.room, h.slot, dst_slot,
                                   blocks=(srcs, [dsts[0] + BAD_OFFSET] + dsts[1:], lens))
        if fault is FaultKind.wrong_session:
            return router.send_aux(h.room, h.slot, dst_slot, session=UNSERVED_SESSION)
        if fault is FaultKind.stale_room:
            return router.send_aux(h.room, h.slot, dst_slot, blocks=(srcs[:-1], dsts[:-1], lens[:-1]))
        raise ValueError(f"{fault} is not a per-request fault")

    def _finish(self, h: Handoff, outcome: str, detail: str) -> None:
        h.outcome, h.detail = outcome, detail
        now = time.perf_counter()
        h.handoff_us = round((now - h.t_start) * 1e6, 2)
        if h.t_send:
            h.deliver_us = round((now - h.t_send) * 1e6, 2)
        self.buffers.clear_room(h.slot)
        self.slots.free(h.slot)
        self.tally.add(h)

    # ---- the loop -----------------------------------------------------------------------
    def run(self, conn) -> float:
        """Run the workload; returns the wall time in seconds."""
        total = self.cfg.workload.requests
        window = min(self.cfg.workload.concurrency, self.cfg.buffers.size)
        warm = min(1000, total // 10)  # memory is sampled after warm-up and at the end
        next_rid = 0
        last_progress = t0 = time.perf_counter()
        peer_lost: Optional[str] = None
        while self.tally.count < total:
            while next_rid < total and len(self.in_flight) < window and peer_lost is None:
                self._issue(next_rid)
                next_rid += 1
            if peer_lost is not None or not self.in_flight:
                break
            msgs = self._recv_any(min(0.2, self.timeout_s))
            now = time.perf_counter()
            for msg in msgs:
                h = self.in_flight.get(msg.get("room", -1))
                if h is None:
                    self.log.warning("unexpected_control", msg_type=msg["type"])
                elif msg["type"] == "grant":
                    self._on_grant(h, msg["slot"])
                    h.deadline = time.perf_counter() + self.timeout_s
                elif msg["type"] == "result":
                    del self.in_flight[h.room]
                    self._finish(h, msg["outcome"], msg["detail"])
                    if self.tally.count == warm:
                        self.memory["rss_kb_warm"] = rss_kb()
            oldest = min((h.deadline for h in self.in_flight.values()), default=now)
            if now > oldest:
                peer_lost = f"decode silent for transport.timeout_s={self.timeout_s:g}"
                self.log.error("peer_lost", detail=peer_lost, in_flight=len(self.in_flight))
            if now - last_progress >= 0.25:
                conn.send(("progress", self.tally.count))
                last_progress = now
        wall = time.perf_counter() - t0
        for h in list(self.in_flight.values()):
            self._finish(h, "failed", "peer_lost")
        self.in_flight.clear()
        for rid in range(next_rid, total):
            self.tally.add(Handoff(self.rid_base + rid, 0, -1, "", 0, 0, decode_rank=rid % len(self.links),
                                   outcome="failed", detail="not_sent_peer_lost"))
        self.memory["rss_kb_end"] = rss_kb()
        for link in self.links:
            try:
                self._send(link, control.encode("bye"))
            except zmq.ZMQError:
                pass
        return wall

    def close(self) -> None:
        self.tally.close()
        for link in self.links:
            link.control.close(0)
            link.push.close(0)
        self.ctx.term()


def run_workload(endpoint: PrefillEndpoint, conn, decode_info: dict) -> dict:
    """The default driver: the configured workload through the full handoff protocol."""
    wall = endpoint.run(conn)
    return {"wall_s": wall, "row_bytes": endpoint.buffers.row_bytes, **endpoint.tally.result(),
            "memory": endpoint.memory, "rejected_auth": endpoint.rejected_auth}


def prefill_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, decode_infos: list[dict],
                 conn, driver=run_workload, rank: int = 0) -> None:
    """Process entry (multiprocessing spawn) of prefill rank `rank`. `driver(endpoint, conn,
    decode_info)` does the work once bootstrapped and returns the result dict (the benchmark
    passes its own; it gets the first decode rank's info)."""
    run_path = Path(run_dir)
    log = start_process(role_name("prefill", rank, cfg.endpoints.prefill_ranks), run_path)
    endpoint = None
    try:
        endpoint = PrefillEndpoint(cfg, plan, run_path, log, decode_infos, rank)
        conn.send(("transport", endpoint.side.transport))
        endpoint.bootstrap()
        conn.send(("result", driver(endpoint, conn, decode_infos[0])))
    except Exception as exc:
        log.error("prefill_failed", error=f"{type(exc).__name__}: {exc}")
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if endpoint is not None and endpoint.stuck:
            os._exit(1)  # a Mooncake call is still blocked inside the engine: do not wait on it
        if endpoint is not None:
            endpoint.close()
