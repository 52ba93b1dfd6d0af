"""What a prefill rank holds of its decodes: its requests (Req), one Link per decode process,
one Instance per decode instance, and Links, the control channel with the instances'
leaders (sealed sends, opened receipts, the poller its loop waits on, the transfer thread's
wake-up socket). The loop and the handshake use Links; neither reaches into the endpoint."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

import structlog
import zmq

from orchestrator.handoff.backends.base import SendPath
from orchestrator.handoff.digest import Keys
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Replayed, Session
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import Detail, Outcome


@dataclass(slots=True)
class Req:
    """One request's life on the prefill."""

    rid: int
    room: int
    inst: int
    t_arrive: float
    pad: tuple[int, int]
    dst_slot: int = -1
    src_slot: int = -1
    t_step: float = 0.0  # the forward step that finished it began
    t_taken: float = 0.0  # the decode took it: status in, readiness gate passed (decode's clock)
    t_ready: float = 0.0  # its row filled and digested
    t_landed: float = 0.0  # its write(s) finished
    t_status_out: float = 0.0  # its status sent
    t_status_in: float = 0.0  # its status read by the decode (decode's clock)
    set_buf_us: Optional[float] = None
    send_us: Optional[float] = None
    content: str = ""
    route: str = ""
    sent: bool = False
    done: bool = False
    verdict: Optional[tuple[Outcome, Detail, Optional[float]]] = None  # outcome, detail, t_verified
    t_done: float = 0.0  # the prefill's clock when it finished (its record's t_verdict)


@dataclass
class Link:
    """One decode process (a TP rank of a decode instance) as this prefill sees it."""

    inst: int
    tp_rank: int
    push: zmq.Socket
    router: SendPath  # the backend's send path to it, or a FaultyRouter around that
    name: str = ""


@dataclass
class Instance:
    """One decode instance: its leader's control channel, and one link per TP rank."""

    index: int
    control: zmq.Socket
    links: list[Link] = field(default_factory=list)
    last_heard: float = 0.0
    told: float = 0.0  # when this process last sent its leader anything (the keepalive's clock)
    lost: bool = False
    owed: int = 0  # requests announced to it and not yet judged
    ungranted: int = 0  # announced, no slot yet: at most `slots` (backpressure)
    slots: int = 0  # the leader's buffer rows
    backlog: collections.deque[Req] = field(default_factory=collections.deque)  # arrived, not announced
    announce: list[list[int]] = field(default_factory=list)
    same_clock: bool = True
    auth: Optional[Session] = None  # the session with its leader (None until the handshake)


@dataclass
class Credentials:
    """Who this prefill process is, this run: the hello's authenticator (the rest is per
    session), its nonce (in every session key and pad), the digest keys, its boot id."""

    auth: Authenticator
    nonce: str
    keys: Keys
    boot_id: str


@dataclass
class Dropped:
    """Control messages refused (bad MAC, undecodable) and replayed (not ours, or again)."""

    rejected: int = 0
    replayed: int = 0


class Links:
    """The decode instances of one prefill rank and its control channel with their leaders."""

    def __init__(self, ctx: zmq.Context, me: Credentials, log: structlog.stdlib.BoundLogger,
                 timeout_s: float):
        self.ctx, self.me, self.log, self.timeout_s = ctx, me, log, timeout_s
        self.instances: list[Instance] = []
        self.poller = zmq.Poller()
        self.dropped = Dropped()
        self.wake_addr = f"inproc://wake-{id(self)}"  # the transfer thread connects to it
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.bind(self.wake_addr)
        self.poller.register(self.wake, zmq.POLLIN)

    def add(self, inst: Instance) -> None:
        self.poller.register(inst.control, zmq.POLLIN)
        self.instances.append(inst)

    def send(self, inst: Instance, payload: bytes) -> None:
        """A control message to an instance's leader, sealed under its session."""
        inst.control.send((inst.auth or self.me.auth).seal(payload))
        inst.told = _clock()

    def open(self, frames: list[bytes], auth: Optional[Authenticator] = None) -> Optional[wire.Message]:
        """A received control message, opened and checked; None when refused (counted)."""
        try:
            body = (auth or self.me.auth).unseal(frames[0]) if len(frames) == 1 else None
        except Replayed as exc:
            self.dropped.replayed += 1
            self.log.warning("control_replayed", error=str(exc))
            return None
        if body is None:
            self.dropped.rejected += 1
            self.log.warning("control_rejected", reason="bad or missing MAC", frames=len(frames))
            return None
        try:
            return wire.decode(body)
        except wire.WireError as exc:
            self.dropped.rejected += 1
            self.log.warning("control_dropped", error=str(exc))
            return None

    def poll(self, timeout_ms: int) -> dict:
        return dict(self.poller.poll(timeout_ms))

    def drain_wake(self) -> None:
        """Empty the wake-up socket (the transfer thread finished steps)."""
        wake = self.wake
        while wake.get(zmq.EVENTS) & zmq.POLLIN:  # (no zmq.Again raised per drain)
            wake.recv(zmq.NOBLOCK)

    def close(self) -> None:
        """Say bye to every instance, close the sockets."""
        for inst in self.instances:
            try:
                self.send(inst, wire.encode(wire.ByeMsg()))
            except zmq.ZMQError:
                pass
            inst.control.close(0)
            for link in inst.links:
                link.push.close(0)
        self.wake.close(0)
