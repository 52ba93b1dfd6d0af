"""The decode's slots for requests: arrivals wait for a free slot and are granted what is
free (past the waiting cap one is shed, failed at once as decode_overloaded); a TP follower
adopts its leader's grants; a prefill that said bye (or died) gets its slots back; at the end
of each step the leader tells each prefill its new grants and verdicts in one update, and
tells a prefill that waits on it and heard nothing for a while that it is alive."""

from __future__ import annotations

import collections
import time
from operator import attrgetter

import structlog

from orchestrator.handoff.buffers import SlotAllocator
from orchestrator.handoff.endpoints.decode_state import Drops, Grant, Ledger, Peers, Replies
from orchestrator.handoff.endpoints.judge import Rows
from orchestrator.handoff.transport import wire
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import DecodeResult

_GRANT_ROW = attrgetter("rid", "slot")  # a grant as an update tells it


class Grants:
    """One rank's grants (`group_size` ranks in its TP group; `leader`: rank 0 of it)."""

    def __init__(self, ledger: Ledger, slots: SlotAllocator, rows: Rows, peers: Peers, res: DecodeResult,
                 replies: Replies, drop: Drops, log: structlog.stdlib.BoundLogger, group_size: int,
                 leader: bool):
        self.ledger, self.slots, self.rows, self.peers, self.res = ledger, slots, rows, peers, res
        self.replies, self.drop, self.log = replies, drop, log
        self.group_size, self.leader = group_size, leader

    def arrive(self, prank: int, reqs: wire.Rows, contiguous: bool) -> None:
        """Arrivals wait for a slot (and are granted what is free); past the waiting cap one
        is shed, failed at once as decode_overloaded."""
        led = self.ledger
        if len(led.waiting) + len(reqs) <= led.waiting_cap:  # (as a rule: none is shed)
            led.waiting.extend([(prank, rid, room, contiguous) for rid, room in reqs])
            self.grant_waiting()
            return
        for rid, room in reqs:
            if len(led.waiting) >= led.waiting_cap:  # shed, and say so
                self.drop("dropped_control", "arrival_shed",
                          error=f"{len(led.waiting)} arrivals already wait for a slot")
                now_ns = time.monotonic_ns()
                led.verdicts[prank].append([rid, Outcome.failed.code, Detail.decode_overloaded.code,
                                            now_ns, now_ns, 0])
                continue
            led.waiting.append((prank, rid, room, contiguous))
        self.grant_waiting()

    def grant_waiting(self) -> None:
        """Grant slots to waiting arrivals, in order. Arrivals marked contiguous get
        consecutive slots (continuing after the prefill's previous grant when it can), so a
        coalesced send covers them with one block per field. A run's pads are taken together
        (its arrivals are one prefill rank's)."""
        led, alloc = self.ledger, self.slots
        waiting = led.waiting
        if not (waiting and alloc.available):
            return
        now = _clock()
        shared = self.group_size == 1  # one rank has no one to share it with
        grants, add, added = led.grants, led.add, 0
        while waiting and alloc.available:
            prank, rid, room, contiguous = waiting[0]
            n = 1
            if contiguous:
                while (n < len(waiting) and n < alloc.available
                       and waiting[n][0] == prank and waiting[n][3]):
                    n += 1
                slots = alloc.alloc_run(n, led.next_slot.get(prank))
                led.next_slot[prank] = slots[-1] + 1
            else:
                slot = alloc.alloc()
                assert slot is not None  # (slots available)
                slots = [slot]
            run = [waiting.popleft() for _ in slots]  # (one prefill rank's: see above)
            pads = self.peers.keys_of(prank).pads(prank, [w[1] for w in run])
            told = led.granted[prank]
            for slot, (_, rid, room, _), pad in zip(slots, run, pads):
                if (prank, rid) in grants:
                    alloc.free(slot)
                    self.drop("unexpected", "duplicate_arrival", prefill=prank, rid=rid)
                    continue
                g = Grant(prank, rid, room, slot, pad, now, shared=shared)
                add(g)
                added += 1
                if not shared:
                    led.new_grants.append(g)
                told.append(g)
        self.res.grants += added

    def add(self, g: Grant) -> None:
        self.ledger.add(g)
        self.res.grants += 1

    def adopt(self, prank: int, rid: int, slot: int, room: int) -> Grant:
        """A TP follower learns a grant its leader made (the same slot in its own buffers)."""
        self.slots.take(slot)
        g = Grant(prank, rid, room, slot, self.peers.pad(prank, rid), _clock())
        self.add(g)
        return g

    def remove(self, g: Grant) -> None:
        self.remove_many([g])

    def remove_many(self, gs: list[Grant]) -> None:
        """remove() of each (a step's verified requests at once)."""
        self.ledger.drop_many(gs)
        self.rows.free_many([g.slot for g in gs])

    def release(self, prank: int, why: str) -> None:
        """A prefill that said bye (or died) writes nothing more: its slots go back (in a TP
        group, on every rank at the next step)."""
        led = self.ledger
        if self.group_size > 1:
            if self.leader:
                led.pending_releases.append(prank)
            return
        gone = led.of(prank)
        for g in gone:
            self.remove(g)
        self.flush()
        led.waiting = collections.deque(w for w in led.waiting if w[0] != prank)
        if gone:
            self.log.info("grants_released", prefill=prank, count=len(gone), why=why)
        self.grant_waiting()

    def flush(self) -> None:
        """End of a step: zero the freed rooms, send the verdicts, grant what waits."""
        self.rows.zero_freed()
        led = self.ledger
        if self.leader and led.waiting:
            self.grant_waiting()
        verdicts, granted = led.verdicts, led.granted
        if not (verdicts or granted):
            return
        ranks = self.peers.ranks
        for prank in (list(verdicts) if not granted else list(granted) if not verdicts
                      else list(set(verdicts) | set(granted))):
            gs = granted.pop(prank, None)
            v = verdicts.pop(prank, None) or []
            told: list[tuple[int, int]] = []
            if gs:
                if self.group_size == 1:  # one rank: every grant is known, told at once
                    told = list(map(_GRANT_ROW, gs))
                else:
                    told = [_GRANT_ROW(g) for g in gs if g.shared]
                    left = [g for g in gs if not g.shared]
                    if left:
                        granted[prank] = left
            if told or v:
                self.replies.send(ranks[prank].identity, wire.update_frame(told, v))

    def heartbeat(self, now: float) -> float:
        """The leader's word (an empty update) to every bound prefill that waits on this
        process (a grant or an arrival of its is here) and has heard nothing for a while:
        the prefill's liveness check of this process rests on this process alone, not on
        what other prefills make it wait for. Returns when the next one can be due (a rank
        is told something at least that often: a reply only moves its time on)."""
        every = self.peers.heartbeat_s
        ranks = self.peers.ranks.values()
        due = [s for s in ranks if now - s.told >= every]
        if due:
            waiting = {g.prank for g in self.ledger.grants.values()} | {w[0] for w in self.ledger.waiting}
            for sess in due:
                if sess.rank in waiting:
                    self.replies.send(sess.identity, wire.encode(wire.UpdateMsg(grants=[], v=[])))
                else:
                    sess.told = now  # nothing owed: look again in a while
        return min((s.told for s in ranks), default=now) + every
