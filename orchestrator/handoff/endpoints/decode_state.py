"""What a decode process keeps between messages: the prefill ranks it knows (Peers, one
PrefillSession each), the requests it holds (Ledger of Grants), what the leader tells the
runner (Notices), how a message not acted on is counted (Drops), and the control socket's
sealed replies (Replies)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import structlog
import zmq

from orchestrator.handoff.digest import Keys
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.common import heartbeat_s
from orchestrator.handoff.transport.auth import Authenticator, Session, new_nonce
from orchestrator.profile.platform import boot_id, pid_namespace
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import DecodeResult


@dataclass(slots=True)
class PrefillSession:
    """One prefill rank as this process knows it: its connection, keys and last contact."""

    rank: int
    identity: bytes
    auth: Session
    keys: Keys
    told: float = 0.0  # the last message this process sent it


@dataclass(slots=True)
class Grant:
    prank: int
    rid: int
    room: int
    slot: int
    pad: tuple[int, int]
    t_granted: float
    status: Optional[int] = None  # KVPoll value of the status received
    tag: int = 0  # from the status, when the row has no kv_checksum field
    t_status: float = 0.0
    shared: bool = True  # a TP leader's grant goes out only once every rank knows it
    settling: bool = False  # the gate held it: right room, digest not yet (gate.settle_ms)


@dataclass(slots=True)
class Verdict:
    """This rank's verdict on a request in one step: `t_ns` when it was made, `t_taken_ns`
    when the readiness gate let it through (0: never taken)."""

    outcome: Outcome
    detail: Detail
    t_ns: int
    t_taken_ns: int

    @property
    def code(self) -> int:
        """What a TP group's ranks agree on (the MIN: failed before corrupted before verified)."""
        return self.outcome.code * 256 + self.detail.code


class Peers:
    """The prefill ranks this process knows, and what it tells them of itself: the
    hello-level authenticator (the bare secret), each rank's session (bound at its first
    authentic hello), when each was last heard from, and this process's nonce and process
    space (boot id, pid namespace)."""

    def __init__(self, secret: bytes, timeout_s: float):
        self.secret = secret
        self.auth = Authenticator(secret)  # hello and its answer only: the rest is per session
        self.keys = Keys(secret)
        self.nonce = new_nonce()
        self.boot_id, self.pid_ns = boot_id(), pid_namespace()
        self.sessions: dict[bytes, PrefillSession] = {}  # control identity -> session
        self.ranks: dict[int, PrefillSession] = {}  # prefill rank -> its session (bound at hello)
        self.heard: dict[int, float] = {}  # prefill rank -> last authentic message from it
        self.started: set[int] = set()  # ranks whose loop runs (an arrive came, maybe empty)
        self.done: set[int] = set()  # ranks that said bye or were declared lost
        self.watched_at = _clock()  # the last liveness check (role=decode)
        self.heartbeat_s = heartbeat_s(timeout_s)

    def keys_of(self, prank: int) -> Keys:
        """The pads' keys of a prefill rank: its session's once bound."""
        sess = self.ranks.get(prank)
        return sess.keys if sess is not None else self.keys

    def pad(self, prank: int, rid: int) -> tuple[int, int]:
        return self.keys_of(prank).pad(prank, rid)

    def bind(self, sess: PrefillSession) -> None:
        self.sessions[sess.identity] = sess
        self.ranks[sess.rank] = sess
        self.heard[sess.rank] = _clock()


class Ledger:
    """The requests this rank holds: its grants, in grant order (a TP group's shared order),
    by request and by slot; those whose status arrived, not yet judged; arrivals waiting for
    a free slot; and what the leader owes: grants to share with its ranks and to tell the
    prefills, verdicts to send, prefill ranks to release on every rank."""

    def __init__(self, size: int):
        self.grants: dict[tuple[int, int], Grant] = {}
        self.by_slot: dict[int, Grant] = {}
        self.ready: dict[tuple[int, int], Grant] = {}  # grants whose status arrived, not yet judged
        # arrivals without a free slot: (prefill rank, rid, room, contiguous)
        self.waiting: collections.deque[tuple[int, int, int, bool]] = collections.deque()
        self.waiting_cap = max(4 * size, 1024)
        self.next_slot: dict[int, int] = {}  # prefill rank -> the slot after its last grant
        self.new_grants: list[Grant] = []  # granted since the last step (the leader shares them)
        self.verdicts: dict[int, list[list[int]]] = collections.defaultdict(list)
        self.granted: dict[int, list[Grant]] = collections.defaultdict(list)  # not yet told
        self.pending_releases: list[int] = []  # prefills released since the last TP step

    def add(self, g: Grant) -> None:
        self.grants[(g.prank, g.rid)] = g
        self.by_slot[g.slot] = g

    def drop(self, g: Grant) -> None:
        self.drop_many([g])

    def drop_many(self, gs: list[Grant]) -> None:
        grants, by_slot, ready = self.grants, self.by_slot, self.ready
        for g in gs:
            key = (g.prank, g.rid)
            del grants[key]
            del by_slot[g.slot]
            ready.pop(key, None)

    def of(self, prank: int) -> list[Grant]:
        return [g for g in self.grants.values() if g.prank == prank]


class Notices:
    """What the leader tells the runner: prefill ranks that said bye, were refused at hello
    (and why), or went silent (role=decode only)."""

    def __init__(self) -> None:
        self.byes: list[int] = []
        self.refused: list[tuple[int, str]] = []
        self.lost: list[tuple[int, str]] = []

    @property
    def pending(self) -> bool:
        return bool(self.byes or self.refused or self.lost)

    def send(self, chan: control.Pipe) -> None:
        while self.byes:
            chan.send(control.Bye(self.byes.pop()))
        while self.refused:
            chan.send(control.Refused(*self.refused.pop()))
        while self.lost:
            chan.send(control.PrefillLost(*self.lost.pop()))


class Drops:
    """A message not acted on: counted in the rank's result (`counter`, a field of its
    records.Refusals), logged the first few times of each kind, then every 1000th."""

    def __init__(self, res: DecodeResult, log: structlog.stdlib.BoundLogger):
        self.refused, self.log = res.refused, log

    def __call__(self, counter: str, event: str, **kw: Any) -> None:
        n = getattr(self.refused, counter) + 1
        setattr(self.refused, counter, n)
        if n <= 5 or n % 1000 == 0:
            self.log.warning(event, count=n, **kw)


class Replies:
    """The control socket's way back to a prefill: sealed under its session once bound (the
    hello's answer under the bare secret), and when each rank was last told something."""

    def __init__(self, control: zmq.Socket, peers: Peers, log: structlog.stdlib.BoundLogger):
        self.control, self.peers, self.log = control, peers, log

    def send(self, identity: bytes, payload: bytes) -> None:
        sess = self.peers.sessions.get(identity)
        auth = sess.auth if sess is not None else self.peers.auth
        try:
            self.control.send_multipart([identity, auth.seal(payload)])
        except zmq.ZMQError as exc:
            self.log.warning("reply_failed", error=str(exc))
            return
        if sess is not None:
            sess.told = _clock()
