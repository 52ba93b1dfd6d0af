"""Faults injected on purpose (faults.kind), so a user can see how a run ends when a peer
dies, stalls, lies or corrupts. Faults wrap the send path (FaultyRouter has AuxRouter's
interface) or act at a checkpoint of the prefill's progress (Checkpoint); the endpoints'
own loops carry no fault branches. Every fault is keyed to request ids or to an exact
handoff count, so a faulted run replays identically. Nothing here runs unless a fault is
configured."""

from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Callable, Optional, Sequence

from .buffers import MetadataBuffers
from .config import FaultKind, FaultsConfig
from .router import AuxRouter, Send, Transfer

PER_REQUEST = {FaultKind.bad_destination, FaultKind.wrong_session, FaultKind.stale_room,
               FaultKind.corrupt_byte}
ENGINE_ONLY = {FaultKind.bad_destination, FaultKind.wrong_session, FaultKind.stale_room,
               FaultKind.silent_peer}
PROCESS = {FaultKind.decode_killed, FaultKind.decode_stopped, FaultKind.prefill_killed,
           FaultKind.prefill_stopped}
PREFILL_SIDE = {FaultKind.prefill_killed, FaultKind.prefill_stopped}
UNSERVED_SESSION = "127.0.0.1:9"  # the discard port: nothing speaks Mooncake there
BAD_OFFSET = 1 << 40  # far outside any registration
STALE_ROOM = 0x5717E  # what a previous tenant left in every slot (faults=stale_room)


class Injector:
    def __init__(self, faults: FaultsConfig):
        self.kind = faults.kind
        self.at, self.every = faults.at_request, faults.every

    def hits(self, rid: int) -> bool:
        return rid >= self.at and (rid - self.at) % self.every == 0


class _Delayer(threading.Thread):
    """status_first: starts a target rank's sends `margin` after their statuses went out,
    off the transfer thread (which goes on with the other ranks). The tcp route's frames go
    on a socket of its own (a ZMQ socket belongs to one thread)."""

    def __init__(self, inner: AuxRouter):
        super().__init__(name="delayer", daemon=True)
        self.inner = inner
        self.q: queue.Queue = queue.Queue()

    def run(self) -> None:
        import zmq

        push = None
        while True:
            due, send, done = self.q.get()
            left = due - time.monotonic()
            if left > 0:
                time.sleep(left)
            if push is None and self.inner.route.value == "tcp":
                endpoint = self.inner.push.getsockopt_string(zmq.LAST_ENDPOINT)
                push = self.inner.push.context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(endpoint)
            self.inner.start(send, push=push)
            done.set()


class FaultyRouter:
    """AuxRouter's interface, with per-request faults applied to the requests they hit:
    each hit request travels in a send of its own, altered at start()."""

    def __init__(self, inner: AuxRouter, faults: FaultsConfig):
        self.inner, self.cfg = inner, faults
        self.kind = faults.kind
        self.inj = Injector(faults)
        self._lead: dict[int, list[Transfer]] = {}  # status_first: a step's first hit send
        self._held: dict[int, threading.Event] = {}  # status_first: sends the delayer starts
        self._delayer: Optional[_Delayer] = None

    def __getattr__(self, name):  # connect, peer, route, coalesce, ... come from the real router
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in ("inner", "cfg", "kind", "inj", "starts_in_caller", "_lead", "_held", "_delayer"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    starts_in_caller = False  # a fault may sleep or alter the send: the transfer thread does it

    def _targeted(self) -> bool:
        return self.kind is not FaultKind.status_first or self.inner.connected_peer().tp_rank == self.cfg.rank

    def sends(self, transfers: Sequence[Transfer]) -> list[Send]:
        if not self._targeted():
            return self.inner.sends(transfers)
        hit = [t for t in transfers if self.inj.hits(t.rid)]
        out = self.inner.sends([t for t in transfers if not self.inj.hits(t.rid)])
        if self.kind is FaultKind.status_first and hit:
            sends = self.inner.sends(hit)  # coalesced as usual; the first one leads
            for send in sends:
                send.fault = FaultKind.status_first
            self._lead[id(sends[0])] = hit
            return sends + out
        for t in hit:
            send = Send([t])
            send.fault = self.kind
            out.append(send)
        return out

    def start(self, send: Send, session=None, blocks=None) -> None:
        inner, kind = self.inner, send.fault
        if kind is None:
            return inner.start(send)
        slot = send.transfers[0].src_slot
        if kind is FaultKind.corrupt_byte:  # after the digest was taken: corruption in transit
            inner.buffers.flip_byte(slot, len(inner.buffers.fields) // 2)
            inner.buffers.sync()
            return inner.start(send)
        if kind is FaultKind.status_first:  # every hit status goes now, the rows margin_us later
            lead = self._lead.pop(id(send), None)
            if lead is not None:
                inner.send_status(lead)
            if self._delayer is None:
                self._delayer = _Delayer(inner)
                self._delayer.start()
            send.t0 = time.monotonic()
            done = self._held[id(send)] = threading.Event()
            self._delayer.q.put((time.monotonic() + self.cfg.margin_us / 1e6, send, done))
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

    def ready(self, send: Send) -> bool:
        held = self._held.get(id(send))
        return held is None or held.is_set()

    def finish(self, send: Send) -> None:
        held = self._held.pop(id(send), None)
        if held is not None:
            held.wait()
        self.inner.finish(send)
        if send.fault is FaultKind.corrupt_byte:  # the source row stays as it was filled
            self.inner.buffers.flip_byte(send.transfers[0].src_slot, len(self.inner.buffers.fields) // 2)

    def after_send(self, send: Send) -> None:
        if send.fault is not FaultKind.status_first:
            self.inner.after_send(send)

    def after_step(self, transfers: Sequence[Transfer]) -> None:
        if self.kind is FaultKind.status_first and self._targeted():
            transfers = [t for t in transfers if not self.inj.hits(t.rid)]
        if transfers:
            self.inner.after_step(transfers)


def wrap(router: AuxRouter, faults: FaultsConfig):
    """The router itself, or the router behind the configured send-path fault."""
    if faults.kind in PER_REQUEST or faults.kind is FaultKind.status_first:
        return FaultyRouter(router, faults)
    return router


class Checkpoint:
    """A process fault keyed to an exact handoff count of prefill rank 0: once `at_request`
    handoffs are finished (for decode faults: with nothing left in flight), the prefill asks
    the runner to act and waits until it has. `ask(kind)` sends the request and returns when
    the runner answered."""

    def __init__(self, faults: FaultsConfig, rank: int, ask: Callable[[str], None]):
        self.kind = faults.kind if faults.kind in PROCESS and rank == 0 else None
        self.at = faults.at_request
        self.ask = ask
        self.fired = False

    @property
    def armed(self) -> bool:
        return self.kind is not None and not self.fired

    def holds(self, issued: int) -> bool:
        """Whether the prefill must stop announcing new requests (the fault is due at
        `at_request` and the decode faults want nothing in flight when they strike)."""
        return self.armed and self.kind not in PREFILL_SIDE and issued >= self.at

    def due(self, finished: int, in_flight: int) -> bool:
        if not self.armed or finished < self.at:
            return False
        return self.kind in PREFILL_SIDE or in_flight == 0

    def fire(self) -> None:
        assert self.kind is not None, "fired only when armed"
        self.fired = True
        self.ask(self.kind.value)


def decode_setup(buffers: MetadataBuffers, faults: FaultsConfig, zero_on_free: bool) -> bool:
    """Decode-side part of a fault at start-up; returns whether freed rooms are zeroed.
    stale_room: as if every slot had a previous tenant whose room was never cleared."""
    if faults.kind is FaultKind.stale_room:
        buffers.write_rooms(range(buffers.size), [STALE_ROOM] * buffers.size)
        return False
    return zero_on_free


def silent_listener(host: str) -> socket.socket:
    """A socket that completes TCP handshakes (kernel backlog) and never says a word."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock
