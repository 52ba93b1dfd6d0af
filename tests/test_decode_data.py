"""The decode's data plane on status frames (issue 39: one binary frame, its MAC inside, for
one request's status or a step's): the MAC checked under the session of the rank the frame
names before anything else is read, then every entry taken by its identity the same way
(ledger semantics: replayed, for no grant, non-terminal, a second terminal), with the drop
counters the decode keeps; a bare SGLang status still matched by its room."""

from __future__ import annotations

import struct

import pytest
import structlog

from orchestrator.handoff.digest import Keys
from orchestrator.handoff.endpoints.decode_data import DataPlane
from orchestrator.handoff.endpoints.decode_state import Drops, Grant, Ledger, Peers, PrefillSession
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Session, new_nonce
from orchestrator.results.outcomes import KVPoll
from orchestrator.results.records import DecodeResult

SECRET = b"data-plane-secret"
OK, FAILED, BUSY = int(KVPoll.Success), int(KVPoll.Failed), int(KVPoll.Transferring)


class Plane:
    """A DataPlane with prefill ranks 0 and 1 bound (their prefill-side sessions in `tx`) and
    grants (rank 0: rids 1-3 in slots 1-3, room 100 + rid; rank 1: rid 1 in slot 5)."""

    def __init__(self, keyed: bool = True):
        secret = SECRET
        self.peers = Peers(secret, 5.0)
        if not keyed:  # SGLang interop's mode: no MACs (a decode's row digests still keyed)
            self.peers.auth = Authenticator(None)
        self.tx: dict[int, Session] = {}
        for rank in (0, 1):
            nonce = new_nonce()
            base = self.peers.auth
            self.tx[rank] = base.session(rank, nonce, self.peers.nonce, "prefill")
            self.peers.bind(PrefillSession(rank, b"id%d" % rank, base.session(rank, nonce, self.peers.nonce, "decode"),
                                           Keys(secret, nonce)))
        self.ledger = Ledger(8)
        for prank, rid, slot in ((0, 1, 1), (0, 2, 2), (0, 3, 3), (1, 1, 5)):
            self.ledger.add(Grant(prank, rid, 100 + rid, slot, (0, 0), 0.0))
        self.res = DecodeResult("decode")
        self.dp = DataPlane(self.ledger, self.peers, Drops(self.res, structlog.get_logger()), [], [64], 8, False)

    def send(self, entries, rank=0, by=None, raw=None) -> None:
        frame = raw if raw is not None else wire.status_frame(rank, entries)
        self.dp.on_data([self.tx[rank if by is None else by].sign_frame(frame)])

    def ready(self) -> dict[tuple[int, int], tuple[int, int]]:
        return {k: (g.status, g.tag) for k, g in self.ledger.ready.items()}

    def refused(self) -> dict[str, int]:
        return {k: v for k, v in vars(self.res.refused).items() if v}


def test_one_request_status_frame_readies_its_grant():
    p = Plane()
    p.send([(1, 101, 1, OK, 77)])
    assert p.ready() == {(0, 1): (OK, 77)} and p.refused() == {}


def test_a_step_frame_readies_every_entry_each_by_its_identity():
    p = Plane()
    p.send([(1, 101, 1, OK, 7), (2, 102, 2, FAILED, 0), (3, 103, 3, BUSY, 9)])
    assert p.ready() == {(0, 1): (OK, 7), (0, 2): (FAILED, 0)}  # Transferring: ignored, as SGLang
    p.send([(1, 101, 5, OK, 0)], rank=1)  # rank 1's rid 1 is another request: its own grant
    assert p.ready()[(1, 1)] == (OK, 0) and p.refused() == {}


@pytest.mark.parametrize("entry,counter", [
    ((9, 109, 1, OK, 0), "replayed"),  # no live grant: judged already
    ((1, 101, 2, OK, 0), "unexpected"),  # another slot than its grant's
    ((1, 999, 1, OK, 0), "unexpected"),  # another room
])
def test_an_entry_for_no_grant_is_counted_and_changes_nothing(entry, counter):
    p = Plane()
    p.send([entry])
    assert p.ready() == {} and p.refused() == {counter: 1}


def test_a_second_terminal_status_and_a_replay_after_the_verdict_are_replays():
    p = Plane()
    p.send([(1, 101, 1, BUSY, 0)])
    assert p.ready() == {} and p.refused() == {}
    p.send([(1, 101, 1, OK, 5)])
    p.send([(1, 101, 1, FAILED, 0)])  # a second terminal status: the first stands
    assert p.ready() == {(0, 1): (OK, 5)} and p.refused() == {"replayed": 1}
    p.ledger.drop(p.ledger.grants[(0, 1)])  # judged
    p.send([(1, 101, 1, OK, 5)])
    assert p.ready() == {} and p.refused() == {"replayed": 2}


def test_the_mac_is_checked_first_under_the_named_ranks_key():
    p = Plane()
    good = wire.status_frame(0, [(1, 101, 1, OK, 0)])
    p.send(None, by=1, raw=good)  # names rank 0, MAC'd with rank 1's key
    p.dp.on_data([good])  # no MAC
    signed = p.tx[0].sign_frame(good)
    p.dp.on_data([signed[:-1] + bytes([signed[-1] ^ 1])])  # a forged MAC (a zero byte was the real one 1 run in 256)
    p.send(None, rank=1, raw=wire.status_frame(7, [(1, 101, 1, OK, 0)]))  # a rank nobody bound
    malformed = struct.pack("<4sII", wire.STATUS, 0, 2) + good[12:]  # counts 2, carries 1
    p.dp.on_data([malformed + bytes(16)])  # malformed and not authentic: refused on its MAC alone
    p.dp.on_data([b"ORSX" + good[4:]])  # no status magic: no key to check it under
    assert p.ready() == {} and p.refused() == {"rejected_auth": 6}
    p.send(None, raw=malformed)  # authentic and malformed: dropped after its MAC opened
    p.send(None, raw=wire.status_frame(0, [(1, 101, 8, OK, 0)]))  # slot >= slots
    p.send(None, raw=good[:12] + good[12:28] + struct.pack("<I", 1) + struct.pack("<I", 5) + good[36:])  # status 5
    assert p.ready() == {} and p.refused() == {"rejected_auth": 6, "dropped_data": 3}
    p.send(None, raw=good)
    assert p.ready() == {(0, 1): (OK, 0)}


def test_without_a_secret_the_frame_carries_no_mac_and_is_taken_as_it_is():
    p = Plane(keyed=False)
    assert p.tx[0].sign_frame(b"x") == b"x"
    p.dp.on_data([wire.status_frame(0, [(1, 101, 1, OK, 3)])])
    p.dp.on_data([wire.status_frame(0, [(2, 102, 2, OK, 0)]) + bytes(16)])  # a trailer: malformed here
    assert p.ready() == {(0, 1): (OK, 3)} and p.refused() == {"dropped_data": 1}


def test_a_bare_sglang_status_is_matched_by_its_room():
    p = Plane()
    p.dp.on_data(p.tx[0].sign(wire.encode_status(102, KVPoll.Success, 0)))
    p.dp.on_data(p.tx[0].sign(wire.encode_status(555, KVPoll.Success, 0)))  # no grant has that room
    assert p.ready() == {(0, 2): (OK, 0)} and p.refused() == {"unexpected": 1}


@pytest.mark.parametrize("checksum_field, blake", [(1, False), (None, False), (1, True)])
def test_judge_clean_one_by_one_is_the_array_test(monkeypatch, checksum_field, blake):
    """Judge.clean compares a few candidates one by one in Python and more as arrays: the
    same mask either way, over rows that pass and rows each test on its own fails (status,
    room, a zero room, the tag)."""
    from types import SimpleNamespace

    import numpy as np

    from orchestrator.handoff.digest import MARK, P, StepRead, pack_tag
    from orchestrator.handoff.endpoints import judge as judge_mod
    from orchestrator.results.outcomes import KVPoll

    rng = np.random.default_rng(11)
    k = 12
    c = rng.integers(0, P, (k, 4), dtype=np.int64)
    if blake:
        c[:, 0] = rng.integers(0, 1 << 40, k, dtype=np.int64) | MARK
    rooms = rng.integers(1, 1 << 63, k, dtype=np.uint64)
    pads = [tuple(int(x) for x in rng.integers(0, P, 2)) for _ in range(k)]
    want = [int(c[i, 0]) if blake else pack_tag(int(c[i, 0]), int(c[i, 1]), pads[i]) for i in range(k)]
    grants = [SimpleNamespace(status=int(KVPoll.Success), room=int(rooms[i]), pad=pads[i], tag=want[i])
              for i in range(k)]
    tags = np.array(want, dtype=np.uint64)
    grants[1].status = int(KVPoll.Failed)
    grants[2].room += 1
    rooms[3] = 0
    grants[3].room = 0
    if checksum_field is not None:
        tags[4] ^= 1
    else:
        grants[4].tag ^= 1
    grants[5].status = None
    step = StepRead(c, rooms, tags, [None] * k if blake else None)  # type: ignore[list-item]
    me = SimpleNamespace(buffers=SimpleNamespace(checksum_field=checksum_field))
    expect = [True, False, False, False, False, False] + [True] * (k - 6)
    assert judge_mod.Judge.clean(me, grants, step) == expect  # 12 > _SCALAR_MOST: arrays
    monkeypatch.setattr(judge_mod, "_SCALAR_MOST", k)
    assert judge_mod.Judge.clean(me, grants, step) == expect  # one by one
    for i in range(k):  # each alone (one by one at the default bound)
        monkeypatch.setattr(judge_mod, "_SCALAR_MOST", 4)
        one = StepRead(c[i:i + 1], rooms[i:i + 1], tags[i:i + 1], [None] if blake else None)  # type: ignore[list-item]
        assert judge_mod.Judge.clean(me, [grants[i]], one) == [expect[i]], i
