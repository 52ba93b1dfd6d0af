"""Malformed input on the wire (hypothesis): AUX_DATA/AUX_STATUS frames, control messages and
MACs. Every bad message is rejected with our own error type, the receiver keeps serving, and
nothing is written outside the addressed row."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator import MetadataBuffers, control
from orchestrator.auth import Authenticator
from orchestrator.transport import zmq_aux
from orchestrator.workload import make_request

from .conftest import DecodeProcess

BUF = MetadataBuffers(4, 16, torch.float32)
PTRS, _, LENS = BUF.get_buf_infos()
NUMBERS = st.one_of(st.integers(-5, 1 << 70).map(lambda n: str(n).encode()),
                    st.binary(max_size=24))
LENGTH = st.one_of(st.integers(0, 1 << 32 - 1).map(lambda n: struct.pack(">I", n)),
                   st.binary(max_size=8))
AUX = st.lists(st.one_of(st.just(b"AUX_DATA"), st.just(b"AUX_STATUS"), st.binary(max_size=12)),
               min_size=1, max_size=1).flatmap(
    lambda head: st.tuples(st.just(head), st.lists(st.one_of(NUMBERS, LENGTH, st.binary(max_size=600)),
                                                   max_size=7))).map(lambda t: t[0] + t[1])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(AUX)
def test_aux_frames_rejected_or_written_only_to_their_row(frames):
    before = [BUF.row_snapshot(s) for s in range(4)]
    try:
        msg = zmq_aux.parse(frames, LENS, slots=4)
    except zmq_aux.FrameError:
        assert [BUF.row_snapshot(s) for s in range(4)] == before
        return
    if isinstance(msg, zmq_aux.AuxData):
        assert 0 <= msg.field_index < len(LENS) and 0 <= msg.slot < 4
        assert len(msg.payload) == LENS[msg.field_index]
        zmq_aux.write_row(PTRS, LENS, msg)
        after = [BUF.row_snapshot(s) for s in range(4)]
        for s in range(4):
            if s != msg.slot:
                assert after[s] == before[s]
    else:
        assert 0 <= msg.slot < 4


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["type", "room", "slot", "rid", "item_lens", "outcome",
                                     "detail", "session_id", "aux_ptrs", "slots", "x"]),
                    st.one_of(st.integers(-3, 1 << 66), st.text(max_size=8), st.booleans(),
                              st.none(), st.lists(st.integers(-2, 1 << 65), max_size=70),
                              st.sampled_from(list(control.SCHEMA) + list(control.OUTCOMES))),
                    max_size=6).map(lambda d: json.dumps(d).encode()),
))
def test_control_messages_decode_or_raise_control_error(raw):
    try:
        msg = control.decode(raw)
    except control.ControlError:
        return
    fields = control.SCHEMA[msg["type"]]
    assert set(msg) == set(fields) | {"type"}


@pytest.mark.parametrize("raw", [
    b"", b"null", b"[]", b'"hello"', b'{"type": "grant"}', b'{"type": "grant", "room": -1, "slot": 0}',
    b'{"type": "grant", "room": true, "slot": 0}', b'{"type": "grant", "room": 1, "slot": 0, "x": 1}',
    b'{"type": "result", "room": 1, "slot": 0, "outcome": "fine", "detail": ""}',
    b'{"type": "hello", "item_lens": [64, -1]}', b'{"type": "nope"}', b"\xff\xfe",
    b'{"type": "hello", "item_lens": ' + json.dumps(list(range(100))).encode() + b"}",
    b"x" * (control.MAX_MESSAGE_BYTES + 1),
    b"\x80\x04\x95" + b"cos\nsystem\n",  # a pickle: never decoded as one
])
def test_control_rejects(raw):
    with pytest.raises(control.ControlError):
        control.decode(raw)


def test_mac_rejects_missing_wrong_and_foreign():
    a, b = Authenticator(b"s3cret"), Authenticator(b"other")
    body = [b'{"type":"bye"}']
    signed = a.sign(body)
    assert a.check(signed, 1) == body
    assert a.check(body, 1) is None  # missing
    assert a.check([body[0], b"0" * 64], 1) is None  # wrong
    assert a.check(b.sign(body), 1) is None  # another secret
    assert a.check([b'{"type":"grant","room":1,"slot":0}', signed[1]], 1) is None  # replaced body
    assert Authenticator(None).check(signed, 1) is None  # unexpected extra frame


# ---- the live receiver keeps serving ----------------------------------------------------------
def test_live_decode_survives_garbage_and_stays_correct(cfg_factory, tmp_path):
    cfg = cfg_factory("mem_pool=NVLINK", "transport.timeout_s=2")
    decode = DecodeProcess(cfg, tmp_path)
    info = decode.info
    z = zmq.Context()
    dealer, push = z.socket(zmq.DEALER), z.socket(zmq.PUSH)
    dealer.connect(info["control_endpoint"])
    push.connect(info["data_endpoint"])
    rng = random.Random(7)
    bad_data = [[b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 64), b"x" * 63],
                [b"AUX_DATA", b"1", b"99", b"0", struct.pack(">I", 64), b"x" * 64],
                [b"AUX_DATA", b"1", b"0", b"9999", struct.pack(">I", 64), b"x" * 64],
                [b"AUX_STATUS", b"1"], [b"GARBAGE"], [b"AUX_DATA", b"x" * 10_000_000]]
    bad_data += [[rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 8))] for _ in range(100)]
    bad_control = [b"", b"{", b"[1,2]", b'{"type":"grant_request"}', rng.randbytes(300)]
    bad_control += [rng.randbytes(rng.randint(1, 64)) for _ in range(50)]
    for frames in bad_data:
        push.send_multipart(frames)
    for raw in bad_control:
        dealer.send(raw)
    dealer.send_multipart([b"a", b"b", b"c"])  # wrong frame count
    # a real handoff afterwards is still served and verified
    buf = MetadataBuffers(cfg.buffers.size, 16, torch.float32)
    dealer.send(control.encode("hello", item_lens=buf.item_lens))
    req = make_request(cfg.workload, 0, 16)
    req.metadata_buffer_index = 0
    buf.set_buf(req)
    dealer.send(control.encode("grant_request", room=req.bootstrap_room, rid=0))
    msgs = []
    while len(msgs) < 2:
        assert dealer.poll(20000)
        msgs.append(control.decode(dealer.recv()))
    grant = next(m for m in msgs if m["type"] == "grant")
    ptrs, _, lens = buf.get_buf_infos()
    for i, payload in enumerate(zmq_aux.read_rows(ptrs, lens, 0)):
        push.send_multipart(zmq_aux.encode_aux(req.bootstrap_room, i, grant["slot"], payload))
    push.send_multipart(zmq_aux.encode_status(req.bootstrap_room, grant["slot"], "ok", buf.row_checksum(0)))
    assert dealer.poll(20000)
    result = control.decode(dealer.recv())
    assert result["outcome"] == "verified"
    stats = decode.stop()
    dealer.close(0)
    push.close(0)
    z.term()
    assert decode.proc.exitcode == 0
    dropped = (stats["dropped_data"] + stats["unexpected"] + stats["dropped_control"]
               + stats["rejected_auth"])
    assert dropped == len(bad_data) + len(bad_control) + 1  # every bad message counted once
    assert stats["verified"] == 1 and stats["corrupted"] == 0
