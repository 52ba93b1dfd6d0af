"""send_aux: move one request's aux row to its decode slot by the planned route, and log why.

The route and its reason come from orchestrator.plan (computed once, applied per request);
this module only carries them out and records each one as a structured decision event
(`route_decision`, one JSON line in decisions.jsonl) with the measured latency and outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import structlog
import zmq

from .buffers import MetadataBuffers
from .plan import Plan, Route
from .transport import zmq_aux
from .transport.engine import EngineError, MooncakeEngine

DECISIONS_LOGGER = "orchestrator.decisions"
_now = time.perf_counter


class LayoutMismatch(ValueError):
    """Both sides of the engine route must have identical item lengths."""


@dataclass
class Peer:
    """What the decode side told us at bootstrap."""

    session_id: Optional[str]
    aux_ptrs: list[int]
    item_lens: list[int]
    slots: int


@dataclass(slots=True)
class Decision:
    """One routing decision and its outcome. The per-run constant part (pool, device, route,
    reason, transport, blocks, bytes) is shared, so building one costs next to nothing on
    the hot path; event() renders the full, stable set of keys."""

    room: int
    slot: int
    dst_slot: int
    latency_us: float
    outcome: str  # "ok" or "error"
    error: Optional[str]
    static: dict

    @property
    def route(self) -> str:
        return self.static["route"]

    def event(self) -> dict:
        return {"room": self.room, "slot": self.slot, "dst_slot": self.dst_slot, **self.static,
                "latency_us": round(self.latency_us, 2), "outcome": self.outcome,
                "error": self.error}


class AuxRouter:
    def __init__(
        self,
        plan: Plan,
        buffers: MetadataBuffers,
        transport: str,
        engine: Optional[MooncakeEngine] = None,
        push: Optional[zmq.Socket] = None,
        max_blocks_per_batch: int = 1024,
    ):
        self.plan = plan
        self.route = plan.route
        self.reason = plan.route_reason.value
        self.transport = transport
        self.engine = engine
        self.push = push
        self.src_ptrs, _, self.item_lens = buffers.get_buf_infos()
        self.row_bytes = sum(self.item_lens)
        self.max_blocks = max_blocks_per_batch
        self._static = {
            "mem_pool": plan.mem_pool.value, "buffer_device": plan.buffer_device.value,
            "route": plan.route.value, "reason": self.reason, "transport": transport,
            "blocks": len(self.item_lens), "bytes": self.row_bytes,
            # a plan-time fallback (e.g. INTRA_NODE_NVLINK degraded to host buffers over TCP)
            # travels with every decision it shaped; null when the plan ran as declared
            "fallback": plan.events[0].reason.value if plan.events else None,
        }
        self._engine_route = plan.route is Route.engine
        self.peer: Optional[Peer] = None
        self._src_blocks: dict[int, list[int]] = {}
        self._dst_blocks: dict[int, list[int]] = {}
        self._log = structlog.get_logger(DECISIONS_LOGGER)
        if self.route is Route.engine and engine is None:
            raise ValueError("the engine route needs a MooncakeEngine")
        if self.route is Route.tcp and push is None:
            raise ValueError("the tcp route needs a ZMQ PUSH socket")

    def connect(self, peer: Peer) -> None:
        if list(peer.item_lens) != list(self.item_lens):
            raise LayoutMismatch(f"decode item lengths {peer.item_lens} != prefill {self.item_lens}")
        if len(self.item_lens) > self.max_blocks:
            raise LayoutMismatch(f"{len(self.item_lens)} blocks per request exceed "
                                 f"transport.mooncake.max_blocks_per_batch={self.max_blocks}")
        if self.route is Route.engine and not peer.session_id:
            raise LayoutMismatch("the decode side has no engine session for the engine route")
        self.peer = peer
        self._dst_blocks.clear()

    def blocks(self, slot: int, dst_slot: int) -> tuple[list[int], list[int], list[int]]:
        """Engine-route blocks: src/dst = base + item_len * slot, one per field. Memoized per
        slot: the addresses of a row never change while the peer stays the same."""
        srcs = self._src_blocks.get(slot)
        if srcs is None:
            srcs = self._src_blocks[slot] = [p + n * slot for p, n in zip(self.src_ptrs, self.item_lens)]
        dsts = self._dst_blocks.get(dst_slot)
        if dsts is None:
            dsts = self._dst_blocks[dst_slot] = [
                p + n * dst_slot for p, n in zip(self.peer.aux_ptrs, self.item_lens)]
        return srcs, dsts, self.item_lens

    def send_aux(self, room: int, slot: int, dst_slot: int, blocks=None,
                 session: Optional[str] = None) -> Decision:
        """Move the row; return the decision with its measured latency and outcome. Logging
        is left to the caller (log()), after the status is on its way, so the JSON encoding
        of the event stays off the handoff's critical path. `blocks` and `session` replace
        the computed ones (fault injection only)."""
        error = None
        t0 = _now()
        try:
            if self._engine_route:
                srcs, dsts, lens = blocks or self.blocks(slot, dst_slot)
                self.engine.batch_write(session or self.peer.session_id, srcs, dsts, lens)
            else:
                self._send_frames(room, slot, dst_slot)
        except (EngineError, zmq.ZMQError) as exc:
            error = str(exc)
        latency_us = (_now() - t0) * 1e6
        return Decision(room, slot, dst_slot, latency_us, "ok" if error is None else "error",
                        error, self._static)

    def log(self, decision: Decision) -> None:
        """One `route_decision` JSON line in decisions.jsonl (stable keys: Decision.event())."""
        self._log.info("route_decision", **decision.event())

    def _send_frames(self, room: int, slot: int, dst_slot: int) -> None:
        rows: Sequence[bytes] = zmq_aux.read_rows(self.src_ptrs, self.item_lens, slot)
        for index, payload in enumerate(rows):
            self.push.send_multipart(zmq_aux.encode_aux(room, index, dst_slot, payload))
