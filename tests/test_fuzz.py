"""Malformed input on the wire (hypothesis): AUX_DATA/AUX_STATUS frames, control messages and
MACs. Every bad message is rejected with our own error type, the receiver keeps serving, and
nothing is written outside the addressed row."""

from __future__ import annotations

import json
import random
import struct
import time

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import MetadataBuffers
from orchestrator.handoff.transport import wire
from orchestrator.results.outcomes import Detail, Outcome

from .helpers.peers import PrefillPeer

BUF = MetadataBuffers(4, 16, torch.float32, 8)
PTRS, _, LENS = BUF.get_buf_infos()
NUMBERS = st.one_of(st.integers(-5, 1 << 70).map(lambda n: str(n).encode()),
                    st.binary(max_size=24))
LENGTH = st.one_of(st.integers(0, 1 << 32 - 1).map(lambda n: struct.pack(">I", n)),
                   st.binary(max_size=8))
STATUS_FRAME = st.tuples(st.integers(0, 1 << 32 - 1), st.integers(0, 4), st.binary(max_size=140)).map(
    lambda t: [wire.STATUS + struct.pack("<II", *t[:2]) + t[2]])  # a status frame's header, any body
AUX = st.lists(st.one_of(st.just(b"AUX_DATA"), st.just(wire.STATUS), st.binary(max_size=12)),
               min_size=1, max_size=1).flatmap(
    lambda head: st.tuples(st.just(head), st.lists(st.one_of(NUMBERS, LENGTH, st.binary(max_size=600)),
                                                   max_size=7))).map(lambda t: t[0] + t[1]) | STATUS_FRAME


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(AUX)
def test_aux_frames_rejected_or_written_only_to_their_row(frames):
    before = [BUF.row_snapshot(s) for s in range(4)]
    try:
        msg = wire.parse(frames, LENS, slots=4)
    except wire.WireError:
        assert [BUF.row_snapshot(s) for s in range(4)] == before
        return
    if isinstance(msg, wire.AuxData):
        assert 0 <= msg.field_index < len(LENS) and 0 <= msg.slot and msg.slot + msg.rows <= 4
        assert len(msg.payload) == LENS[msg.field_index] * msg.rows
        wire.write_rows(PTRS, LENS, msg)
        after = [BUF.row_snapshot(s) for s in range(4)]
        for s in range(4):
            if not msg.slot <= s < msg.slot + msg.rows:
                assert after[s] == before[s]
    elif isinstance(msg, wire.StepStatus):
        assert len(frames) == 1 and len(msg.entries) >= 1
        assert all(e[2] < 4 and e[3] <= 4 for e in msg.entries)
    else:
        assert isinstance(msg, wire.Status) and len(frames) in (3, 4)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["type", "rank", "layout", "fingerprint", "reqs", "contiguous",
                                     "grants", "v", "detail", "session_id", "aux_ptrs", "slots", "x"]),
                    st.one_of(st.integers(-3, 1 << 66), st.text(max_size=8), st.booleans(),
                              st.none(), st.lists(st.integers(-2, 1 << 65), max_size=70),
                              st.lists(st.lists(st.integers(-2, 1 << 65), max_size=5), max_size=5),
                              st.sampled_from(list(wire.SCHEMA))),
                    max_size=6).map(lambda d: json.dumps(d).encode()),
))
def test_control_messages_decode_or_raise_wire_error(raw):
    try:
        msg = wire.decode(raw)
    except wire.WireError:
        return
    fields = wire.SCHEMA[msg.TYPE]  # every required key, and optional ones only as sent
    required = set(fields) - wire.OPTIONAL[msg.TYPE]
    assert required | {"type"} <= set(msg.as_json()) <= set(fields) | {"type"}


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b'"hello"', b'{"type": "update"}', b'{"type": "update", "grants": [[-1, 0]], "v": []}',
    b'{"type": "update", "grants": [[true, 0]], "v": []}', b'{"type": "update", "grants": [], "v": [], "x": 1}',
    b'{"type": "update", "grants": [[1, 2, 3]], "v": []}', b'{"type": "arrive", "reqs": [[1, 2]], "contiguous": 1}',
    b'{"type": "hello", "rank": 0, "layout": [["a", "int32"]], "fingerprint": ""}', b'{"type": "nope"}', b"\xff\xfe",
    b'{"type": "hello", "rank": 0, "layout": ' + json.dumps([["f", "int32", 64]] * 100).encode()
    + b', "fingerprint": ""}',
    b"x" * (wire.MAX_MESSAGE_BYTES + 1),
    b"\x80\x04\x95" + b"cos\nsystem\n",  # a pickle: never decoded as one
])
def test_control_rejects(raw):
    with pytest.raises(wire.WireError):
        wire.decode(raw)


# ---- the live receiver keeps serving ----------------------------------------------------------
def test_live_decode_survives_garbage_and_stays_correct(cfg_factory, tmp_path):
    cfg = cfg_factory("mem_pool=NVLINK", "transport.timeout_s=2")
    peer = PrefillPeer(cfg, tmp_path)
    z = zmq.Context()
    dealer, push = z.socket(zmq.DEALER), z.socket(zmq.PUSH)
    dealer.connect(peer.info.control_endpoint)
    push.connect(peer.info.data_endpoint)
    rng = random.Random(7)
    auth = peer.auth
    bad_data = [[b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 64), b"x" * 63],
                [b"AUX_DATA", b"1", b"99", b"0", struct.pack(">I", 64), b"x" * 64],
                [b"AUX_DATA", b"1", b"0", b"9999", struct.pack(">I", 64), b"x" * 64],
                [b"1"], [b"GARBAGE"], [b"AUX_DATA", b"x" * 1_000_000]]
    bad_data = [auth.sign(f) for f in bad_data]  # authentic, and still malformed
    head = struct.Struct("<4sII")
    bad_data += [[auth.sign_frame(raw)] for raw in (  # authentic status frames, malformed
        head.pack(wire.STATUS, peer.rank, 2) + bytes(32), head.pack(wire.STATUS, peer.rank, 0),
        head.pack(wire.STATUS, peer.rank, 1) + struct.pack("<QQIIQ", 1, 2, 9999, 4, 0),
        head.pack(wire.STATUS, peer.rank, 1) + struct.pack("<QQIIQ", 1, 2, 0, 5, 0))]
    bad_data += [[wire.status_frame(peer.rank, [(1, 2, 0, 4, 0)])],  # no MAC, a forged one, another rank's
                 [wire.status_frame(peer.rank, [(1, 2, 0, 4, 0)]) + bytes(16)],
                 [auth.sign_frame(wire.status_frame(peer.rank + 1, [(1, 2, 0, 4, 0)]))]]
    bad_data += [[rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 8))] for _ in range(100)]
    bad_control = [auth.seal(b""), auth.seal(b"{"), auth.seal(b"[1,2]"), auth.seal(b'{"type":"arrive"}')]
    bad_control += [rng.randbytes(rng.randint(1, 64)) for _ in range(50)]
    for frames in bad_data:
        push.send_multipart(frames)
    for raw in bad_control:
        dealer.send(raw)
    dealer.send_multipart([b"a", b"b", b"c"])  # wrong frame count
    time.sleep(1.0)  # other sockets than the handoff's: no ordering with it, let them land first
    # a real handoff afterwards is still served and verified
    assert peer.handoff(0) == (Outcome.verified, Detail.none)
    dealer.close(0)
    push.close(0)
    z.term()
    stats = peer.close()
    assert peer.decode.proc.exitcode == 0
    dropped = (stats.refused.dropped_data + stats.refused.unexpected + stats.refused.dropped_control
               + stats.refused.rejected_auth)
    assert dropped == len(bad_data) + len(bad_control) + 1  # every bad message counted once
    assert stats.outcomes[Outcome.verified] == 1 and stats.outcomes[Outcome.corrupted] == 0
