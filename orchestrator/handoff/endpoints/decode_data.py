"""The decode's data plane: every message on the PULL socket authenticated under the session
of the rank it claims (for AUX_DATA, of the grants of the slots it lands in), parsed against
this rank's layout, then landed (tcp-route rows, host rows only) or taken as statuses: a
status frame's entries (one request's or a step's, each with its identity) all one way
(statuses), a bare SGLang status by its room (bare_status)."""

from __future__ import annotations

from typing import Optional

from orchestrator.handoff.endpoints.decode_state import Drops, Ledger, Peers
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Session
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import KVPoll


class DataPlane:
    """`ptrs`, `item_lens`: this rank's rows; `slots`: buffers.size; `lands`: whether rows
    arrive as frames here (the tcp route on host rows)."""

    def __init__(self, ledger: Ledger, peers: Peers, drop: Drops, ptrs: list[int], item_lens: list[int],
                 slots: int, lands: bool):
        self.ledger, self.peers, self.drop = ledger, peers, drop
        self.ptrs, self.item_lens, self.slots, self.lands = ptrs, item_lens, slots, lands

    def auth_of(self, frames: list[bytes]) -> tuple[Optional[Session], bytes]:
        """The session a data-plane message claims (from the rank it names, or, for
        AUX_DATA, the grants of the slots it lands in) and the associated data its MAC
        covers; (None, b"") when it names nothing this process knows."""
        try:
            if len(frames) == 1:  # a status frame: the rank in its header, nothing else read
                rank = wire.status_rank(frames[0])
                sess = self.peers.ranks.get(rank) if rank is not None else None
                return (sess.auth if sess else None), b""
            if frames[0] == wire.AUX_DATA:
                slot, field = int(frames[3]), int(frames[2])
                rows = max(1, len(frames[5]) // self.item_lens[field])
                found = [self.ledger.by_slot.get(slot + k) for k in range(min(rows, self.slots))]
                gs = [g for g in found if g is not None]
                if not found or len(gs) != len(found):
                    return None, b""
                sess = self.peers.ranks.get(gs[0].prank)
                return (sess.auth if sess else None), b"".join(g.rid.to_bytes(8, "little") for g in gs)
            rank = int(frames[2])
        except (IndexError, ValueError, ZeroDivisionError):
            return None, b""
        sess = self.peers.ranks.get(rank)
        return (sess.auth if sess else None), b""

    def on_data(self, frames: list[bytes]) -> None:
        auth, ad = self.auth_of(frames) if frames else (None, b"")
        body: Optional[list[bytes]] = None
        if auth is not None:
            if len(frames) == 1:  # a status frame: its MAC inside
                payload = auth.open_frame(frames[0])
                body = [payload] if payload is not None else None
            else:
                body = auth.open(frames, ad)
        if body is None and not self.peers.auth.enabled:  # no secret (interop tests): nothing to check
            body = list(frames)
        if body is None:
            self.drop("rejected_auth", "data_rejected", reason="bad or missing MAC")
            return
        try:
            msg = wire.parse(body, self.item_lens, self.slots)
        except wire.WireError as exc:
            self.drop("dropped_data", "frame_dropped", error=str(exc))
            return
        if isinstance(msg, wire.AuxData):
            self.land(msg)
        elif isinstance(msg, wire.StepStatus):
            self.statuses(msg.prefill_rank, msg.entries)
        else:
            self.bare_status(msg.prefill_rank, msg.room, msg.status)

    def land(self, msg: wire.AuxData) -> None:
        if not self.lands:
            self.drop("unexpected", "aux_data_on_engine_route", slot=msg.slot)
            return
        by_slot = self.ledger.by_slot
        first = by_slot.get(msg.slot)
        if first is None or first.room != msg.room or any(
                (msg.slot + k) not in by_slot for k in range(msg.rows)):
            self.drop("unexpected", "frame_for_ungranted_slot", slot=msg.slot, room=msg.room)
            return
        wire.write_rows(self.ptrs, self.item_lens, msg)

    def statuses(self, prank: int, entries: list[wire.StatusRow]) -> None:
        """A status frame's entries ([rid, room, slot, status, tag] each, STEP_DTYPE: one
        request's, or a step's), each by its identity, at one clock read."""
        now = self.peers.heard[prank] = _clock()
        grants, ready = self.ledger.grants, self.ledger.ready
        for rid, room, slot, status, tag in entries:
            g = grants.get((prank, rid))
            if g is None:  # authentic, this run's, for no live grant: judged already (a replay)
                self.drop("replayed", "status_replayed", prefill=prank, rid=rid, slot=slot)
            elif g.slot != slot or g.room != room:
                self.drop("unexpected", "status_for_no_grant", prefill=prank, rid=rid, slot=slot)
            elif status not in (KVPoll.Success, KVPoll.Failed):
                continue  # non-terminal: SGLang ignores those too
            elif g.status is not None:  # a second terminal status for one grant
                self.drop("replayed", "status_replayed", prefill=prank, rid=rid, slot=slot)
            else:
                g.status, g.tag, g.t_status = status, tag, now
                ready[(prank, rid)] = g

    def bare_status(self, prank: int, room: int, status: int) -> None:
        """A bare SGLang status (no identity): the one grant of this rank with its room."""
        self.peers.heard[prank] = _clock()
        found = [g for g in self.ledger.grants.values() if g.prank == prank and g.room == room]
        if len(found) != 1:
            self.drop("ambiguous" if found else "unexpected", "status_without_identity",
                      prefill=prank, room=room, matches=len(found))
            return
        g = found[0]
        if status not in (KVPoll.Success, KVPoll.Failed):
            return  # non-terminal: SGLang ignores those too
        if g.status is not None:  # a second terminal status for one grant
            self.drop("replayed", "status_replayed", prefill=prank, rid=g.rid, slot=g.slot)
            return
        g.status, g.tag, g.t_status = status, 0, _clock()
        self.ledger.ready[(g.prank, g.rid)] = g
