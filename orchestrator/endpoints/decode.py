"""Decode endpoint (receiver): grants slots, lands aux rows, gates on bootstrap_room,
verifies every byte against the sender's checksum, frees the slot, answers with the outcome.

Readiness gate (SGLang PR 26394 and follow-ups): a slot is accepted only when its
bootstrap_room equals the room it was granted for. Room 0 means "not landed yet" and is
re-checked until the timeout; any other room is corruption. A freed slot's room is zeroed,
so the previous tenant's room can never pass for the next one's.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from .. import control
from ..auth import from_env
from ..buffers import SlotAllocator, checksum
from ..config import FaultKind, OrchestratorConfig
from ..faults import FaultInjector, silent_listener
from ..plan import Device, Plan
from ..stats import LatencyHistogram
from ..transport import zmq_aux
from ..transport.engine import exposed, listening_sockets
from .common import build_side, new_socket, rank_gpu, role_name, rss_kb, start_process


@dataclass
class Grant:
    room: int
    identity: bytes
    granted_at: float
    status: zmq_aux.AuxStatus | None = None
    deadline: float = 0.0


@dataclass
class DecodeStats:
    verified: int = 0
    corrupted: int = 0
    failed: int = 0
    dropped_data: int = 0
    dropped_control: int = 0
    rejected_auth: int = 0  # control or status messages without a valid MAC
    unexpected: int = 0
    gate_waits: int = 0  # status seen before the room landed (re-checked later)
    reasons: dict = field(default_factory=dict)
    verify_us: LatencyHistogram = field(default_factory=LatencyHistogram)  # gate + checksum
    memory: dict = field(default_factory=dict)

    def summary(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "verify_us"}
        out["verify_us"] = self.verify_us.summary()
        return out

    def drop(self, counter: str, log, event: str, **kw) -> None:
        """Count a rejected message; log the first few of each kind, then every 1000th, so
        a flood of garbage cannot flood the console."""
        n = getattr(self, counter) + 1
        setattr(self, counter, n)
        if n <= 5 or n % 1000 == 0:
            log.warning(event, count=n, **kw)

    def count(self, outcome: str, detail: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome != "verified":
            self.reasons[detail] = self.reasons.get(detail, 0) + 1


class DecodeEndpoint:
    def __init__(self, cfg: OrchestratorConfig, plan: Plan, run_dir: Path, log, rank: int = 0):
        self.cfg, self.plan, self.log = cfg, plan, log
        role = role_name("decode", rank, cfg.endpoints.decode_ranks)
        self.side = build_side(cfg, plan, role, run_dir, log, rank_gpu(plan, "decode", rank))
        self.buffers = self.side.buffers
        self.ptrs, _, self.item_lens = self.buffers.get_buf_infos()
        self.room_offset = self.buffers.room_offset
        self.slots = SlotAllocator(cfg.buffers.size)
        self.grants: dict[int, Grant] = {}
        self.waiting: deque[tuple[bytes, int]] = deque()  # grant requests without a free slot
        self.waiting_cap = max(4 * cfg.buffers.size, 1024)
        self.settling: set[int] = set()  # slots whose status arrived before their room landed
        self.stats = DecodeStats()
        self.timeout_s = cfg.transport.timeout_s
        self.auth = from_env(cfg.transport.secret_env)
        self.faults = FaultInjector(cfg.faults)
        self.warm = min(1000, cfg.workload.requests // 10)
        self._silent = None
        if cfg.faults.kind is FaultKind.silent_peer:
            self._silent = silent_listener(cfg.transport.host)
        self.ctx = zmq.Context()
        host = cfg.transport.host
        self.control = new_socket(self.ctx, zmq.ROUTER, self.timeout_s)
        self.data = new_socket(self.ctx, zmq.PULL, self.timeout_s)
        self.control_endpoint = _bind(self.control, host)
        self.data_endpoint = _bind(self.data, host)

    # ---- control plane ------------------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.stats.drop("dropped_control", self.log, "control_dropped", error="no payload frame")
            return
        identity = frames[0]
        body = self.auth.check(frames[1:], 1)
        if body is None:
            self.stats.drop("rejected_auth", self.log, "control_rejected",
                            reason="bad or missing MAC, or wrong frame count")
            return
        try:
            msg = control.decode(body[0])
        except control.ControlError as exc:
            self.stats.drop("dropped_control", self.log, "control_dropped", error=str(exc))
            return
        kind = msg["type"]
        if kind == "hello":
            if msg["item_lens"] != self.item_lens:
                self._reply(identity, control.encode(
                    "error", detail=f"layout mismatch: decode item_lens {self.item_lens}"))
                return
            self._reply(identity, control.encode(
                "bootstrap", session_id=self.session_id,
                aux_ptrs=self.ptrs, item_lens=self.item_lens, slots=self.cfg.buffers.size))
        elif kind == "grant_request":
            if len(self.waiting) >= self.waiting_cap:
                self.stats.drop("dropped_control", self.log, "grant_request_dropped",
                                error=f"{len(self.waiting)} requests already wait for a slot")
                return
            self.waiting.append((identity, msg["room"]))
            self._grant_waiting()
        elif kind == "bye":
            pass
        else:
            self.stats.drop("dropped_control", self.log, "control_dropped",
                            error=f"{kind} is not a message decode accepts")

    def _grant_waiting(self) -> None:
        while self.waiting and self.slots.available:
            identity, room = self.waiting.popleft()
            slot = self.slots.alloc()
            self.grants[slot] = Grant(room, identity, time.monotonic())
            self._reply(identity, control.encode("grant", room=room, slot=slot))

    def _reply(self, identity: bytes, payload: bytes) -> None:
        try:
            self.control.send_multipart([identity] + self.auth.sign([payload]))
        except zmq.ZMQError as exc:
            self.log.warning("reply_failed", error=str(exc))

    # ---- data plane ---------------------------------------------------------------------
    def on_data(self, frames: list[bytes]) -> None:
        if frames and frames[0] == zmq_aux.AUX_STATUS:
            body = self.auth.check(frames, 5)
            if body is None:
                self.stats.drop("rejected_auth", self.log, "status_rejected",
                                reason="bad or missing MAC, or wrong frame count")
                return
            frames = body
        try:
            msg = zmq_aux.parse(frames, self.item_lens, self.cfg.buffers.size)
        except zmq_aux.FrameError as exc:
            self.stats.drop("dropped_data", self.log, "frame_dropped", error=str(exc))
            return
        grant = self.grants.get(msg.slot)
        if grant is None or grant.room != msg.room:
            self.stats.drop("unexpected", self.log, "frame_for_ungranted_slot", slot=msg.slot,
                            room=msg.room)
            return
        if isinstance(msg, zmq_aux.AuxData):
            if self.buffers.device.type != Device.cpu.value:
                self.stats.drop("dropped_data", self.log, "frame_dropped",
                                error="AUX_DATA for device-resident buffers")
                return
            zmq_aux.write_row(self.ptrs, self.item_lens, msg)
            return
        grant.status = msg
        grant.deadline = time.monotonic() + self.timeout_s
        if not self._settle(msg.slot, grant):
            self.settling.add(msg.slot)

    def _settle(self, slot: int, grant: Grant) -> bool:
        """Apply the readiness gate and verification; True when the slot was released."""
        status = grant.status
        if status.status != "ok":
            return self._release(slot, grant, "failed", f"sender_{status.status}")
        t0 = time.perf_counter()
        snapshot = self.buffers.row_snapshot(slot)
        room = self.buffers.snapshot_room(snapshot, self.room_offset)
        if room == 0:
            if time.monotonic() < grant.deadline:
                self.stats.gate_waits += 1
                return False  # not landed yet: re-check later
            return self._release(slot, grant, "failed", "room_never_landed")
        if room != grant.room:
            return self._release(slot, grant, "corrupted", "room_mismatch")
        if checksum(snapshot) != status.checksum:
            return self._release(slot, grant, "corrupted", "checksum_mismatch")
        self.stats.verify_us.add((time.perf_counter() - t0) * 1e6)
        return self._release(slot, grant, "verified", "")

    def _release(self, slot: int, grant: Grant, outcome: str, detail: str) -> bool:
        self.settling.discard(slot)
        self.stats.count(outcome, detail)
        if outcome != "verified":
            self.log.warning("handoff_rejected", slot=slot, room=grant.room, outcome=outcome,
                             detail=detail)
        if not self.faults.keep_stale_rooms:
            self.buffers.clear_room(slot)
        del self.grants[slot]
        if self.stats.verified + self.stats.corrupted + self.stats.failed == self.warm:
            self.stats.memory["rss_kb_warm"] = rss_kb()
        self.slots.free(slot)
        self._reply(grant.identity, control.encode("result", room=grant.room, slot=slot,
                                                   outcome=outcome, detail=detail))
        self._grant_waiting()
        return True

    def recheck_pending(self) -> None:
        for slot in list(self.settling):
            self._settle(slot, self.grants[slot])

    def expire_grants(self) -> None:
        """A slot granted but never followed by a status within transport.timeout_s goes
        back to the pool (failed, grant_expired): a sender that vanished, or one that only
        asks for slots, cannot hold them forever."""
        limit = time.monotonic() - self.timeout_s
        for slot, grant in list(self.grants.items()):
            if grant.status is None and grant.granted_at < limit:
                self._release(slot, grant, "failed", "grant_expired")

    # ---- loop ---------------------------------------------------------------------------
    def serve(self, conn) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        next_expiry = time.monotonic()
        while True:
            events = dict(poller.poll(1 if self.settling else 200))
            if self.control in events:
                for _ in range(256):
                    try:
                        frames = self.control.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_control(frames)
            if self.data in events:
                for _ in range(1024):
                    try:
                        frames = self.data.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_data(frames)
            if self.settling:
                self.recheck_pending()
            if time.monotonic() >= next_expiry:
                self.expire_grants()
                next_expiry = time.monotonic() + 0.25
            if conn.fileno() in events and conn.poll():
                if conn.recv() == "stop":
                    self.stats.memory["rss_kb_end"] = rss_kb()
                    return

    @property
    def session_id(self):
        """The engine session advertised at bootstrap (silent_peer: a port that never answers)."""
        if self._silent is not None:
            return "%s:%d" % self._silent.getsockname()
        return self.side.engine.session_id if self.side.engine else None

    def close(self) -> None:
        if self._silent is not None:
            self._silent.close()
        self.control.close(0)
        self.data.close(0)
        self.ctx.term()


def _bind(sock, host: str) -> str:
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def decode_main(cfg: OrchestratorConfig, plan: Plan, run_dir: str, conn,
                bulk_bytes: int = 0, rank: int = 0) -> None:
    """Process entry (multiprocessing spawn) of decode rank `rank`. `bulk_bytes` > 0 also
    registers a bulk target region of that size on the buffers' device (the benchmark's
    bandwidth point)."""
    run_path = Path(run_dir)
    log = start_process(role_name("decode", rank, cfg.endpoints.decode_ranks), run_path)
    endpoint = None
    try:
        endpoint = DecodeEndpoint(cfg, plan, run_path, log, rank)
        info = {
            "control_endpoint": endpoint.control_endpoint,
            "data_endpoint": endpoint.data_endpoint,
            "transport": endpoint.side.transport,
            "session_id": endpoint.side.engine.session_id if endpoint.side.engine else None,
            "engine_exposed": exposed(listening_sockets()) if endpoint.side.engine else [],
        }
        if bulk_bytes and endpoint.side.engine is not None:
            import torch

            bulk = torch.empty(bulk_bytes, dtype=torch.uint8, device=endpoint.buffers.device)
            endpoint.side.engine.register(bulk.data_ptr(), bulk_bytes)
            info["bulk_ptr"] = bulk.data_ptr()
        conn.send(("ready", info))
        endpoint.serve(conn)
        conn.send(("stats", endpoint.stats.summary()))
    except Exception as exc:  # reported to the runner, which owns the user-facing message
        log.error("decode_failed", error=str(exc), traceback=traceback.format_exc())
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if endpoint is not None:
            endpoint.close()
