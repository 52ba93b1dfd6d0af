"""The decode's loop: one poll over everything it serves, for as long as its timers allow;
the leader's heartbeats run when due (not on every pass) and still reach every prefill
that waits on it well inside transport.timeout_s."""

from __future__ import annotations

import time

import pytest
import structlog

from orchestrator.handoff.buffers import SlotAllocator
from orchestrator.handoff.endpoints.decode import IDLE_MS, poll_wait_ms
from orchestrator.handoff.endpoints.decode_state import Drops, Grant, Ledger, Peers, PrefillSession, Replies
from orchestrator.handoff.endpoints.grants import Grants
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, new_nonce
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import DecodeResult

from .helpers.peers import PrefillPeer


class _Sent:
    """A control socket that keeps what was sent on it."""

    def __init__(self) -> None:
        self.frames: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes]) -> None:
        self.frames.append(frames)


def _grants(timeout_s: float) -> tuple[Grants, Peers, _Sent, list[str]]:
    log = structlog.get_logger()
    peers = Peers(b"s" * 32, timeout_s)
    sent = _Sent()
    res = DecodeResult("decode")
    ledger = Ledger(4)
    grants = Grants(ledger, SlotAllocator(4), None, peers, res, Replies(sent, peers, log),  # type: ignore[arg-type]
                    Drops(res, log), log, 1, True)
    nonces = [new_nonce(), new_nonce()]  # each prefill rank's
    for rank in (0, 1):
        peers.bind(PrefillSession(rank, b"id%d" % rank, peers.auth.session(rank, nonces[rank], peers.nonce, "decode"),
                                  peers.keys, 0.0))
    return grants, peers, sent, nonces


def test_a_heartbeat_goes_when_due_to_a_waiting_prefill_and_says_when_the_next_can_be():
    grants, peers, sent, nonces = _grants(timeout_s=2.0)
    every = peers.heartbeat_s
    assert every == 0.5
    grants.ledger.add(Grant(0, 7, 70, 0, (0, 0), 0.0))  # rank 0 waits on this decode; rank 1 does not
    t = time.monotonic()
    peers.ranks[0].told, peers.ranks[1].told = t - 0.2, t - 1.0
    assert grants.heartbeat(t) == pytest.approx(t + 0.3)  # rank 0's, next; rank 1 owed nothing
    assert sent.frames == [] and peers.ranks[1].told == t
    later = t + 0.31
    nxt = grants.heartbeat(later)  # rank 0 due: told (an empty update)
    assert [f[0] for f in sent.frames] == [b"id0"]
    prefill = Authenticator(b"s" * 32).session(0, nonces[0], peers.nonce, "prefill")
    assert wire.decode(prefill.unseal(sent.frames[0][1])) == wire.UpdateMsg(grants=[], v=[])
    assert nxt == pytest.approx(min(peers.ranks[0].told, t) + every) and nxt > later


def test_arrivals_are_granted_in_runs_once_each_with_their_pads_and_shed_past_the_cap():
    grants, peers, sent, _ = _grants(timeout_s=2.0)
    led = grants.ledger
    grants.arrive(0, [(7, 70), (8, 80), (7, 71)], True)  # a run, one of its requests twice
    assert [(g.rid, g.room, g.slot) for g in led.granted[0]] == [(7, 70, led.grants[(0, 7)].slot),
                                                                 (8, 80, led.grants[(0, 8)].slot)]
    assert led.grants[(0, 8)].slot == led.grants[(0, 7)].slot + 1  # consecutive
    assert grants.res.refused.unexpected == 1 and grants.res.grants == 2
    assert grants.slots.available == 2  # the duplicate's slot went back
    for (prank, rid), g in led.grants.items():
        assert g.pad == peers.keys.pad(prank, rid) and led.by_slot[g.slot] is g
    led.waiting_cap = 3
    grants.arrive(1, [(1, 10), (2, 20), (3, 30), (4, 40), (5, 50)], False)  # 3 wait, then 2 are granted
    assert [w[1] for w in led.waiting] == [3] and grants.res.refused.dropped_control == 2
    assert [v[:3] for v in led.verdicts[1]] == [[rid, Outcome.failed.code, Detail.decode_overloaded.code]
                                                for rid in (4, 5)]
    assert [g.rid for g in led.granted[1]] == [1, 2]


def test_the_poll_sleeps_until_the_timers_are_due_within_its_bounds():
    now = 1000.0
    assert poll_wait_ms(True, True, now + 5, now) == 0  # spin (or a forward loop): never sleeps
    assert poll_wait_ms(False, True, now + 5, now) == 1  # the gate holds a request: re-checked every ms
    assert poll_wait_ms(False, False, now + 5, now) == IDLE_MS
    assert poll_wait_ms(False, False, now + 0.0104, now) == 11
    assert poll_wait_ms(False, False, now - 1, now) == 1  # (overdue: at once, never a blocking poll)


@pytest.mark.slow
def test_a_prefill_waiting_for_a_slot_hears_the_decode_while_it_waits(cfg_factory, tmp_path):
    """Both slots granted, a third arrival waits: the decode has nothing to say about it
    but says so (empty updates) every transport.timeout_s/4, on its timer."""
    peer = PrefillPeer(cfg_factory("mem_pool=NVLINK", "buffers.size=2", "transport.timeout_s=1"), tmp_path)
    try:
        peer.arrive(1, 111)
        peer.arrive(2, 222)
        peer.send_control(wire.encode("arrive", reqs=[[3, 333]], contiguous=False))
        beats = [peer.recv(timeout_ms=20000) for _ in range(3)]
        assert all(m.TYPE == "update" and not m.grants and not m.v for m in beats), beats
    finally:
        peer.close()
