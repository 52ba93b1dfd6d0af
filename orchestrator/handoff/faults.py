"""Faults injected on purpose (faults.kind), so a user can see how a run ends when a peer
dies, stalls, lies or corrupts. FAULTS is the one table of what each kind is: where it acts,
whether it is keyed to request ids, which route and roles it may run with, whom a process
fault strikes and how. Every consumer (the rule book, the endpoints, the runner) reads it.

Faults wrap the send path (FaultyRouter is a SendPath around the backend's) or act through hook
objects built here: the prefill's loop asks a LoopFaults (the record's fault name, the
checkpoint of a process fault), the decode's set-up asks decode_setup and silent_session, the
runner asks divert_control and strike. Without a fault each hook answers as a no-op, so the
loops themselves hold no fault branch. Every fault is keyed to request ids or to an exact
handoff count, so a faulted run replays identically."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Callable, Iterable, Optional, Sequence

import zmq

from orchestrator.handoff.backends.base import Peer, Send, SendPath, Transfer
from orchestrator.handoff.backends.common import AuxRouter
from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.fault_kinds import divert_control, silent_listener, strike
from orchestrator.handoff.specs import FaultSpec
from orchestrator.profile.fault_table import FAULTS, Site, Traits, acts_at
from orchestrator.profile.kinds import FaultKind, StatusMode

# the table is the profile's (fault_table), the runner's own acts are in fault_kinds (torch-free)
__all__ = ["FAULTS", "Site", "Traits", "acts_at", "divert_control", "silent_listener", "strike"]

UNSERVED_SESSION = "127.0.0.1:9"  # the discard port: nothing speaks Mooncake there
BAD_OFFSET = 1 << 40  # far outside any registration
STALE_ROOM = 0x5717E  # what a previous tenant left in every slot (faults=stale_room)


class Injector:
    def __init__(self, faults: FaultSpec):
        self.at, self.every = faults.at_request, faults.every

    def hits(self, rid: int) -> bool:
        return rid >= self.at and (rid - self.at) % self.every == 0


class _Held:
    """status_first: one send held back, and the requests whose verdicts let it go early."""

    def __init__(self, rids: Iterable[int]):
        self.waiting = set(rids)  # no verdict yet
        self.go = threading.Event()  # every verdict is back: start now
        self.done = threading.Event()  # started and landed: finish() may go on


class _Delayer(threading.Thread):
    """status_first: starts a target rank's sends once their statuses went out and either
    `margin` passed or every request of the send has its verdict back (the decode judged the
    row before it landed: without the readiness gate, whatever the load), off the thread that
    drives the sends (which goes on with the other ranks). The tcp route's frames go on a socket of its
    own (a ZMQ socket belongs to one thread)."""

    def __init__(self, inner: AuxRouter):
        super().__init__(name="delayer", daemon=True)
        self.inner = inner
        self.q: queue.Queue = queue.Queue()

    def run(self) -> None:
        push = None
        while True:
            due, send, held = self.q.get()
            held.go.wait(max(0.0, due - time.monotonic()))
            if push is None and self.inner.route.value == "tcp":
                endpoint = self.inner.push.getsockopt_string(zmq.LAST_ENDPOINT)
                push = self.inner.push.context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(endpoint)
            self.inner.start(send, push=push)
            held.done.set()


class FaultyRouter(SendPath):
    """A backend's send path (orchestrator.handoff.backends.common.AuxRouter) with per-request
    faults applied to the requests they hit: each hit request travels in a send of its own,
    altered at start()."""

    def __init__(self, inner: AuxRouter, faults: FaultSpec):
        self.inner, self.cfg = inner, faults
        self.kind = faults.kind
        self.inj = Injector(faults)
        self._lead: dict[int, list[Transfer]] = {}  # status_first: a step's first hit send
        self._held: dict[int, _Held] = {}  # status_first: sends the delayer starts, by id(send)
        self._by_rid: dict[int, _Held] = {}  # status_first: held sends by request, until judged
        self._lock = threading.Lock()  # _by_rid: the sends' driver adds, the main loop takes
        self._delayer: Optional[_Delayer] = None

    # ---- what the fault leaves to the real router --------------------------------------
    @property
    def item_lens(self) -> list[int]:  # type: ignore[override]  # read-only here: the inner path's
        return self.inner.item_lens

    @property
    def starts_in_caller(self) -> bool:  # type: ignore[override]  # read-only here: always False
        return False  # a fault may sleep or alter the send: the queue's driver does it

    @property
    def polls(self) -> bool:  # type: ignore[override]  # read-only here: the inner path's
        return self.inner.polls

    def landed(self, send: Send) -> bool:
        return self.inner.landed(send)  # a held send is not ready(): asked once the delayer started it

    def connect(self, peer: Peer) -> None:
        self.inner.connect(peer)

    # ---- the faults ---------------------------------------------------------------------
    def _targeted(self) -> bool:
        return self.kind is not FaultKind.status_first or self.inner.connected_peer().tp_rank == self.cfg.rank

    def sends(self, transfers: Sequence[Transfer], coalesce: bool = False,
              status: StatusMode = StatusMode.per_request) -> list[Send]:
        if not self._targeted():
            return self.inner.sends(transfers, coalesce, status)
        hit = [t for t in transfers if self.inj.hits(t.rid)]
        out = self.inner.sends([t for t in transfers if not self.inj.hits(t.rid)], coalesce, status)
        if self.kind is FaultKind.status_first and hit:
            sends = self.inner.sends(hit, coalesce, status)  # coalesced as usual; the first one leads
            for send in sends:
                send.fault = FaultKind.status_first
            self._lead[id(sends[0])] = hit
            return sends + out
        for t in hit:
            send = Send([t], per_step=status is StatusMode.per_step)
            send.fault = self.kind
            out.append(send)
        return out

    def start(self, send: Send) -> None:
        inner, kind = self.inner, send.fault
        if kind is None:
            return inner.start(send)
        slot = send.transfers[0].src_slot
        if kind is FaultKind.corrupt_byte:  # after the digest was taken: corruption in transit
            inner.buffers.flip_byte(slot, len(inner.buffers.fields) // 2)
            inner.buffers.sync()
            return inner.start(send)
        if kind is FaultKind.status_first:  # every hit status goes now, the rows margin_us later
            held = self._held[id(send)] = _Held(t.rid for t in send.transfers)
            with self._lock:  # before the statuses go: a verdict may come back at once
                for rid in held.waiting:
                    self._by_rid[rid] = held
            lead = self._lead.pop(id(send), None)
            if lead is not None:
                inner.send_status(lead, send.per_step)
            if self._delayer is None:
                self._delayer = _Delayer(inner)
                self._delayer.start()
            send.t0 = time.monotonic()
            self._delayer.q.put((time.monotonic() + self.cfg.margin_us / 1e6, send, held))
            return
        if kind is FaultKind.aux_lost:  # no block, no frame: the status alone goes out after it
            send.t0 = time.monotonic()
            return
        srcs, dsts, lens = inner.blocks(send)
        if kind is FaultKind.bad_destination:
            return inner.start(send, blocks=(srcs, [dsts[0] + BAD_OFFSET] + dsts[1:], lens))
        if kind is FaultKind.wrong_session:
            return inner.start(send, session=UNSERVED_SESSION)
        if kind is FaultKind.stale_room:  # the room block is never sent
            room = inner.buffers.room_field
            keep = [i for i in range(len(srcs)) if i != room]
            return inner.start(send, blocks=([srcs[i] for i in keep], [dsts[i] for i in keep],
                                             [lens[i] for i in keep]))
        raise ValueError(f"{kind} is not a send-path fault")

    def judged(self, rid: int) -> None:
        """The main loop has request `rid`'s verdict while its send is unfinished: a held
        status_first send whose requests are all judged goes now (the decode took its row
        before it landed; the margin is only the longest wait)."""
        with self._lock:
            held = self._by_rid.pop(rid, None)
            if held is not None:
                held.waiting.discard(rid)
                if not held.waiting:
                    held.go.set()
        self.inner.judged(rid)

    def ready(self, send: Send) -> bool:
        held = self._held.get(id(send))
        return held is None or held.done.is_set()

    def finish(self, send: Send) -> None:
        held = self._held.pop(id(send), None)
        if held is not None:
            held.done.wait()
            with self._lock:  # released by the margin: forget the requests still waiting
                for rid in held.waiting:
                    self._by_rid.pop(rid, None)
        self.inner.finish(send)
        if send.fault is FaultKind.corrupt_byte:  # the source row stays as it was filled
            self.inner.buffers.flip_byte(send.transfers[0].src_slot, len(self.inner.buffers.fields) // 2)

    def after_send(self, send: Send) -> None:
        if send.fault is not FaultKind.status_first:
            self.inner.after_send(send)

    def after_step(self, transfers: Sequence[Transfer], per_step: bool) -> None:
        if self.kind is FaultKind.status_first and self._targeted():
            transfers = [t for t in transfers if not self.inj.hits(t.rid)]
        if transfers:
            self.inner.after_step(transfers, per_step)


def wrap(path: SendPath, faults: FaultSpec) -> SendPath:
    """The backend's send path itself, or the path behind the configured send-path fault."""
    if acts_at(faults.kind, Site.send):
        assert isinstance(path, AuxRouter), "a backend's send path"
        return FaultyRouter(path, faults)
    return path


class LoopFaults:
    """What the prefill's loop asks of the configured fault (a no-op without one).

    `label(rid)`: the fault's name for a record a per-request fault hit, else None. A process
    fault's checkpoint, armed on prefill rank 0 when the runner can be asked (`ask` given):
    once `at_request` handoffs are finished (for decode faults: with nothing left in flight),
    `progress` asks the runner to act and returns when it has; until then `holds` stops the
    announcements of a decode fault's requests from `at_request` on."""

    def __init__(self, faults: FaultSpec, rank: int, ask: Optional[Callable[[str], None]] = None):
        traits = FAULTS[faults.kind]
        self._label = faults.kind.value if traits.per_request else None
        self._inj = Injector(faults)
        armed = Site.checkpoint in traits.sites and rank == 0 and ask is not None
        self.kind = faults.kind if armed else None
        self._decode_side = traits.victim == "decode"
        self.at = faults.at_request
        self.ask = ask
        self.fired = False

    def label(self, rid: int) -> Optional[str]:
        return self._label if self._label is not None and self._inj.hits(rid) else None

    def labels(self, rids: Sequence[int]) -> list[Optional[str]]:
        """label() of each request of a batch."""
        return [None] * len(rids) if self._label is None else list(map(self.label, rids))

    @property
    def armed(self) -> bool:
        return self.kind is not None and not self.fired

    def holds(self, issued: int) -> bool:
        """Whether the prefill must stop announcing new requests (the fault is due at
        `at_request` and the decode faults want nothing in flight when they strike)."""
        return self.armed and self._decode_side and issued >= self.at

    def progress(self, finished: int, in_flight: int) -> None:
        """Fire the checkpoint when it is due."""
        if self.armed and finished >= self.at and (not self._decode_side or in_flight == 0):
            assert self.kind is not None and self.ask is not None, "armed"
            self.fired = True
            self.ask(self.kind.value)


def decode_setup(buffers: MetadataBuffers, faults: FaultSpec, zero_on_free: bool) -> bool:
    """Decode-side part of a fault at start-up; returns whether freed rooms are zeroed.
    stale_room: as if every slot had a previous tenant whose room was never cleared."""
    if acts_at(faults.kind, Site.decode_rows):  # stale_room
        buffers.write_rooms(range(buffers.size), [STALE_ROOM] * buffers.size)
        return False
    return zero_on_free


def silent_session(faults: FaultSpec, host: str) -> Optional[socket.socket]:
    """silent_peer: the listener whose address the decode advertises as its engine session."""
    return silent_listener(host) if acts_at(faults.kind, Site.session) else None
