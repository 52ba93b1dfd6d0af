"""The decode's control plane: every message on the ROUTER socket opened under the session
of the connection it came on (a hello under the bare secret), checked at the wire, then
acted on: hello on every rank (orchestrator.handoff.endpoints.handshake), arrive and bye on
the leader (orchestrator.handoff.endpoints.grants)."""

from __future__ import annotations

from orchestrator.handoff.endpoints.decode_state import Drops, Notices, Peers, PrefillSession
from orchestrator.handoff.endpoints.grants import Grants
from orchestrator.handoff.endpoints.handshake import DecodeHandshake
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Replayed
from orchestrator.profile.platform import clock as _clock


class Control:
    """One rank's control plane (`leader`: rank 0 of its TP group)."""

    def __init__(self, peers: Peers, handshake: DecodeHandshake, grants: Grants, notices: Notices,
                 drop: Drops, leader: bool):
        self.peers, self.handshake, self.grants, self.notices = peers, handshake, grants, notices
        self.drop, self.leader = drop, leader

    def on_control(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.drop("dropped_control", "control_dropped", error="no payload frame")
            return
        identity = frames[0]
        sess = self.peers.sessions.get(identity)
        try:
            body = (sess.auth if sess is not None else self.peers.auth).unseal(frames[1]) \
                if len(frames) == 2 else None
        except Replayed as exc:
            assert sess is not None  # only a session's unseal raises Replayed
            self.drop("replayed", "control_replayed", prefill=sess.rank, error=str(exc))
            return
        if body is None:
            self.drop("rejected_auth", "control_rejected", reason="bad or missing MAC")
            return
        try:
            msg = wire.decode(body)
        except wire.WireError as exc:
            self.drop("dropped_control", "control_dropped", error=str(exc))
            return
        if sess is not None:
            self.peers.heard[sess.rank] = _clock()
        if isinstance(msg, wire.HelloMsg):
            self.handshake.hello(identity, sess, msg)
        elif sess is None:  # authentic under the bare secret, but only hello may be
            self.drop("rejected_auth", "control_rejected", reason=f"{msg.TYPE} outside a session")
        else:
            self.in_session(sess, msg)

    def in_session(self, sess: PrefillSession, msg: wire.Message) -> None:
        """A message of a bound prefill rank: arrivals and bye, on the leader."""
        match msg:
            case wire.ArriveMsg(reqs=reqs, contiguous=contiguous) if self.leader:
                self.peers.started.add(sess.rank)
                self.grants.arrive(sess.rank, reqs, contiguous)
            case wire.ByeMsg() if self.leader:
                self.peers.done.add(sess.rank)
                self.grants.release(sess.rank, "bye")
                self.notices.byes.append(sess.rank)
            case _:
                self.drop("dropped_control", "control_dropped", error=f"{msg.TYPE} is not for this rank")
