"""The wire formats: SGLang's AUX_DATA and status messages byte for byte, this tool's binary
status frame (one request's or a step's statuses, its MAC inside), the binary arrive and
update frames, strict receipt, and MACs."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator, Replayed
from orchestrator.results.outcomes import Detail, KVPoll, Outcome

LENS = [64, 64, 512]


def test_aux_data_bytes_match_sglang():
    frames = wire.encode_aux(42, 1, 3, b"x" * 64)
    assert frames == [b"AUX_DATA", b"42", b"1", b"3", struct.pack(">I", 64), b"x" * 64]
    msg = wire.parse(frames, LENS, slots=8)
    assert (msg.room, msg.field_index, msg.slot, msg.rows, msg.payload) == (42, 1, 3, 1, b"x" * 64)


def test_a_coalesced_frame_carries_consecutive_rows():
    msg = wire.parse(wire.encode_aux(9, 2, 4, b"y" * 512 * 3), LENS, slots=8)
    assert (msg.slot, msg.rows) == (4, 3)
    with pytest.raises(wire.WireError, match="run past"):
        wire.parse(wire.encode_aux(9, 2, 6, b"y" * 512 * 3), LENS, slots=8)


def test_bare_status_is_sglangs_message():
    frames = wire.encode_status(7, KVPoll.Success, 2)
    assert frames == [b"7", b"4", b"2", b""]  # what SGLang's parser reads
    msg = wire.parse(frames, LENS, slots=4)
    assert isinstance(msg, wire.Status) and (msg.room, msg.status, msg.prefill_rank) == (7, 4, 2)
    bare = wire.parse([b"7", b"0", b"2", b"KV transfer failed"], LENS, slots=4)
    assert isinstance(bare, wire.Status) and bare.status == KVPoll.Failed and bare.reason == "KV transfer failed"


U64, U32 = (1 << 64) - 1, (1 << 32) - 1
_HEAD = struct.Struct("<4sII")  # the binary frames' header
ENTRIES = [(11, 7, 3, 4, 0xABC), (0, 0, 0, 0, 0), (U64, U64, 7, 3, U64), (5, 1, 6, 2, 1)]


def _frame(entries=ENTRIES[:1], rank=2) -> bytes:
    return wire.status_frame(rank, entries)


def test_status_frame_layout_is_fixed():
    """The 12-byte header (magic, prefill rank, count), then STEP_DTYPE entries unpadded,
    little-endian; with a key, the 16-byte MAC of all of it after them: 60 B for one request."""
    raw = _frame()
    assert raw == b"ORS1" + struct.pack("<II", 2, 1) + struct.pack("<QQIIQ", 11, 7, 3, 4, 0xABC)
    assert wire.STEP_DTYPE.itemsize == 32 and len(raw) == 44
    assert len(Authenticator(b"k").sign_frame(raw)) == 60
    assert Authenticator(None).sign_frame(raw) == raw  # no secret: no MAC
    assert wire.STATUS not in (wire.ARRIVE, wire.UPDATE, wire.AUX_DATA[:4])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_status_frame_round_trip_one_and_many(n):
    msg = wire.parse([_frame(ENTRIES[:n], rank=U32)], LENS, slots=8)
    assert isinstance(msg, wire.StepStatus) and msg.prefill_rank == U32
    assert msg.entries == ENTRIES[:n]
    assert all(type(x) is int for r in msg.entries for x in r)  # plain ints, not numpy's
    array = np.array(ENTRIES[:n], dtype=wire.STEP_DTYPE)
    assert wire.status_frame(U32, array) == _frame(ENTRIES[:n], rank=U32)  # rows or an array: the same bytes


def test_the_largest_status_frame_fits_a_frame_and_a_larger_one_is_refused():
    most = [(1, 2, 0, 4, 5)] * wire.MAX_STATUSES
    raw = wire.status_frame(0, most)
    assert len(raw) <= wire.MAX_MESSAGE_BYTES and len(wire.parse([raw], LENS, slots=1).entries) == wire.MAX_STATUSES
    assert len(raw) + 16 <= wire.max_frame_bytes(LENS, 1)
    with pytest.raises(wire.WireError):
        wire.status_frame(0, most + most[:1])


@pytest.mark.parametrize("what", [
    lambda: wire.status_frame(0, []),  # no entry
    lambda: wire.status_frame(0, [(-1, 0, 0, 4, 0)]),  # negative
    lambda: wire.status_frame(0, [(1, 0, 1 << 32, 4, 0)]),  # a slot past u32
    lambda: wire.status_frame(0, [(1, 0, 0, 4)]),  # a row of another width
    lambda: wire.status_frame(1 << 32, ENTRIES[:1]),  # a rank past u32
    lambda: wire.status_frame(0, np.zeros(2, dtype=wire.GRANT_DTYPE)),  # an array of another dtype
])
def test_a_status_frame_that_cannot_be_sent_is_refused_at_encoding(what):
    with pytest.raises(wire.WireError):
        what()


_S = _frame(ENTRIES[:2])


@pytest.mark.parametrize("raw", [
    b"", b"ORS1", b"ORS1" + bytes(7),  # shorter than the header
    _S[:-1], _S + b"\x00", _S[:-32], _S + bytes(32),  # a byte short, a byte over, an entry short, one over
    _HEAD.pack(b"ORS1", 2, 3) + _S[12:],  # counts 3, carries 2
    _HEAD.pack(b"ORS1", 2, 1) + _S[12:],  # counts 1, carries 2
    _HEAD.pack(b"ORS1", 2, 0),  # no entry
    _HEAD.pack(b"ORS1", 2, wire.MAX_STATUSES + 1) + bytes(32 * (wire.MAX_STATUSES + 1)),  # the right length, too many
    _HEAD.pack(b"ORS1", 2, U32) + _S[12:],
    b"ORS2" + _S[4:], b"ors1" + _S[4:], b"ORA1" + _S[4:], b"ORU1" + _S[4:],  # another magic
    _frame([(1, 2, 8, 4, 0)]),  # slot >= slots
    _frame([(1, 2, 0, 4, 0), (1, 2, U32, 4, 0)]),  # the last entry's slot
    _frame([(1, 2, 0, 5, 0)]),  # status > Success
    _frame([(1, 2, 0, 4, 0), (1, 2, 0, U32, 0)]),
])
def test_malformed_status_frames_are_refused(raw):
    with pytest.raises(wire.WireError):
        wire.parse([raw], LENS, slots=8)


def test_every_truncation_of_a_status_frame_is_refused():
    for n in range(len(_S)):
        with pytest.raises(wire.WireError):
            wire.parse([_S[:n]], LENS, slots=8)


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_any_bytes_behind_the_status_magic_parse_or_raise_wire_error(tail):
    try:
        msg = wire.parse([wire.STATUS + tail], LENS, slots=8)
    except wire.WireError:
        return
    assert isinstance(msg, wire.StepStatus) and len(msg.entries) >= 1
    assert all(e[2] < 8 and e[3] <= KVPoll.Success for e in msg.entries)


def test_status_rank_is_read_from_the_header_only():
    assert wire.status_rank(_frame(rank=7)) == 7
    assert wire.status_rank(_frame(rank=7)[:12]) == 7  # the key is found by it; the MAC decides
    assert wire.status_rank(b"ORS1" + bytes(7)) is None and wire.status_rank(b"ORA1" + bytes(40)) is None


def test_a_status_frame_opens_under_its_sessions_key_only():
    """Forged MAC, another rank's key, another run's, the reflected direction, the bare
    secret, no MAC at all: none opens; and the frame's MAC never opens as a sealed control
    message or a signed multipart one under the same key (its label)."""
    base = Authenticator(b"s3cret")
    p, d = "a" * 32, "b" * 32
    tx, rx = base.session(0, p, d, "prefill"), base.session(0, p, d, "decode")
    raw = _frame(rank=0)
    signed = tx.sign_frame(raw)
    assert len(signed) == len(raw) + 16 and rx.open_frame(signed) == raw
    assert rx.open_frame(signed[:-1] + bytes([signed[-1] ^ 1])) is None  # forged MAC
    assert rx.open_frame(_with(signed, 20, signed[20] ^ 1)) is None  # a changed entry
    assert rx.open_frame(raw) is None and rx.open_frame(signed[:15]) is None  # no MAC; shorter than one
    assert base.session(1, p, d, "decode").open_frame(signed) is None  # another rank's key
    assert base.session(0, p, "c" * 32, "decode").open_frame(signed) is None  # another run's
    assert Authenticator(b"other").session(0, p, d, "decode").open_frame(signed) is None  # another secret
    assert tx.open_frame(signed) is None and base.open_frame(signed) is None  # reflected; the bare secret
    assert Authenticator(None).open_frame(raw) == raw  # no secret: nothing to check
    assert rx.unseal(signed) is None  # not a control message
    assert rx.open([raw, signed[-16:]]) is None
    assert rx.open_frame(tx.seal(raw)) is None  # a sealed control payload is no status frame
    assert rx.open_frame(raw + tx.sign([raw])[-1]) is None


@pytest.mark.parametrize("frames", [
    [],
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 64)],  # too few frames
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 63), b"x" * 64],  # declared != actual
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 65), b"x" * 65],  # not whole rows
    [b"AUX_DATA", b"1", b"3", b"0", struct.pack(">I", 64), b"x" * 64],  # field out of range
    [b"AUX_DATA", b"1", b"0", b"8", struct.pack(">I", 64), b"x" * 64],  # slot out of range
    [b"AUX_DATA", b"-1", b"0", b"0", struct.pack(">I", 64), b"x" * 64],  # not a number
    [b"AUX_DATA", b"1", b"0", b"0", b"\x00\x40", b"x" * 64],  # short length frame
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 0), b""],  # empty payload
    [b"1", b"4"],  # status too short
    [b"1", b"9", b"0"],  # not a KVPoll value
    [b"1", b"4", b"0", b"", b"NOPE" + bytes(20)],  # a fifth frame
    [b"1", b"4", b"0", b"", b"ORCH1" + struct.pack("<QIQ", 1, 3, 0)],  # the identity status before issue 39
    [b"ORCH_STEP", b"0", bytes(32)],  # the step status before issue 39
    [b"ORS1" + struct.pack("<II", 0, 1) + bytes(32), b""],  # a status frame and another frame
    [b"NOPE", b"1", b"2", b"3", b"4", b"5", b"6"],
])
def test_malformed_messages_are_rejected(frames):
    with pytest.raises(wire.WireError):
        wire.parse(frames, LENS, slots=8)


def test_mac_rejects_missing_wrong_and_foreign():
    a, b = Authenticator(b"s3cret"), Authenticator(b"other")
    body = [b"AUX_DATA", b"1"]
    signed = a.sign(body)
    assert a.open(signed) == body
    assert a.open(body) is None  # missing (the last frame is not a MAC of the rest)
    assert a.open(body + [b"0" * 16]) is None  # wrong
    assert a.open(b.sign(body)) is None  # another secret
    assert a.open([b"AUX_DATA", b"2", signed[-1]]) is None  # replaced body
    sealed = a.seal(b'{"type":"bye"}')
    assert a.unseal(sealed) == b'{"type":"bye"}'
    assert a.unseal(b'{"type":"bye"}') is None and b.unseal(sealed) is None
    assert a.unseal(sealed[:-1] + bytes([sealed[-1] ^ 1])) is None


# ---- the hot control frames: arrive and update, binary ------------------------------------
T = (1 << 64) - 1  # the largest time a verdict carries
REQS = [[0, 0], [7, 123], [T, T]]
GRANTS = [[0, 0], [9, 3], [T, (1 << 32) - 1]]
VERDICTS = [[9, 2, 0, 10, 11, 12], [T, 0, len(Detail) - 1, T, T, 0]]


def _rows(msg_rows):
    return [list(r) for r in msg_rows]


@pytest.mark.parametrize("n", [0, 1, 64])
def test_hot_frames_round_trip(n):
    reqs = [[i, 1000 + i] for i in range(n)]
    for contiguous in (False, True):
        msg = wire.decode(wire.encode(wire.ArriveMsg(reqs=reqs, contiguous=contiguous)))
        assert isinstance(msg, wire.ArriveMsg) and _rows(msg.reqs) == reqs and msg.contiguous is contiguous
    grants = [[i, i % 7] for i in range(n)]
    v = [[i, i % 3, i % len(Detail), i, i + 1, i + 2] for i in range(n)]
    msg = wire.decode(wire.encode(wire.UpdateMsg(grants=grants, v=v)))
    assert isinstance(msg, wire.UpdateMsg) and _rows(msg.grants) == grants and _rows(msg.v) == v
    assert all(type(x) is int for r in msg.grants + msg.v for x in r)  # plain ints, not numpy's


def test_hot_frames_carry_every_value_their_fields_hold():
    assert _rows(wire.decode(wire.encode("arrive", reqs=REQS, contiguous=False)).reqs) == REQS
    msg = wire.decode(wire.encode("update", grants=GRANTS, v=VERDICTS))
    assert (_rows(msg.grants), _rows(msg.v)) == (GRANTS, VERDICTS)


def test_hot_frame_layout_is_fixed():
    """A header (magic, two u32), then the entries unpadded, little-endian, as the dtypes."""
    assert wire.encode(wire.ArriveMsg(reqs=[[1, 2]], contiguous=True)) == (
        b"ORA1" + struct.pack("<II", 1, 1) + struct.pack("<QQ", 1, 2))
    assert wire.encode(wire.UpdateMsg(grants=[[3, 4]], v=[[5, 2, 1, 6, 7, 8]])) == (
        b"ORU1" + struct.pack("<II", 1, 1) + struct.pack("<QI", 3, 4) + struct.pack("<QBBQQQ", 5, 2, 1, 6, 7, 8))
    assert wire.encode(wire.UpdateMsg(grants=[], v=[])) == b"ORU1" + bytes(8)  # the heartbeat: 12 B
    assert (wire.ARRIVE_DTYPE.itemsize, wire.GRANT_DTYPE.itemsize, wire.VERDICT_DTYPE.itemsize) == (16, 12, 34)


def test_hot_frames_from_arrays_are_the_same_bytes():
    reqs = np.array([tuple(r) for r in REQS], dtype=wire.ARRIVE_DTYPE)
    grants = np.array([tuple(r) for r in GRANTS], dtype=wire.GRANT_DTYPE)
    v = np.array([tuple(r) for r in VERDICTS], dtype=wire.VERDICT_DTYPE)
    assert wire.arrive_frame(reqs, True) == wire.encode(wire.ArriveMsg(reqs=REQS, contiguous=True))
    assert wire.update_frame(grants, v) == wire.encode(wire.UpdateMsg(grants=GRANTS, v=VERDICTS))
    assert wire.update_frame(grants[:0], v) == wire.encode(wire.UpdateMsg(grants=[], v=VERDICTS))


@pytest.mark.parametrize("what", [
    lambda: wire.arrive_frame([[-1, 0]], False),  # negative
    lambda: wire.arrive_frame([[1 << 64, 0]], False),  # past u64
    lambda: wire.arrive_frame([[1, 2, 3]], False),  # a row of another width
    lambda: wire.update_frame([[1, 1 << 32]], []),  # a slot past u32
    lambda: wire.update_frame([], [[1, 256, 0, 0, 0, 0]]),  # an outcome past its byte
    lambda: wire.update_frame(np.zeros(2, dtype=wire.ARRIVE_DTYPE), []),  # an array of another dtype
    lambda: wire.update_frame(np.zeros((2, 2), dtype=wire.GRANT_DTYPE), []),  # not 1-d
    lambda: wire.update_frame([[0, 0]] * (wire.MAX_LIST + 1), []),  # over MAX_LIST entries
    lambda: wire.update_frame([], [[0] * 6] * 40_000),  # over MAX_MESSAGE_BYTES
])
def test_a_hot_frame_that_cannot_be_sent_is_refused_at_encoding(what):
    with pytest.raises(wire.WireError):
        what()


_ARRIVE = wire.encode("arrive", reqs=REQS, contiguous=False)
_UPDATE = wire.encode("update", grants=GRANTS, v=VERDICTS)
_VAT = 12 + len(GRANTS) * 12  # where the verdicts start


def _with(raw: bytes, at: int, value: int) -> bytes:
    return raw[:at] + bytes([value]) + raw[at + 1:]


@pytest.mark.parametrize("raw", [
    b"ORA1", b"ORU1" + bytes(7),  # shorter than the header
    _ARRIVE[:-1], _ARRIVE + b"\x00", _ARRIVE[:-16],  # a byte short, a byte over, an entry short
    _HEAD.pack(b"ORA1", 4, 0) + _ARRIVE[12:],  # counts 4, carries 3
    _HEAD.pack(b"ORA1", 3, 2) + _ARRIVE[12:],  # unknown flags
    _HEAD.pack(b"ORA1", 3, 1 << 31) + _ARRIVE[12:],
    _UPDATE[:-1], _UPDATE + b"\x00", _UPDATE[:-34],
    _HEAD.pack(b"ORU1", 3, 1) + _UPDATE[12:],  # the same bytes split another way
    _HEAD.pack(b"ORU1", 2, 2) + _UPDATE[12:],
    _HEAD.pack(b"ORU1", (1 << 32) - 1, 0) + _UPDATE[12:],
    _with(_UPDATE, _VAT + 8, len(Outcome)),  # the first verdict's outcome out of range
    _with(_UPDATE, _VAT + 34 + 8, 255),  # the last one's
    _with(_UPDATE, _VAT + 9, len(Detail)),  # a detail out of range
    _with(_UPDATE, _VAT + 34 + 9, 255),
    _HEAD.pack(b"ORU1", wire.MAX_LIST + 1, 0) + bytes(12 * (wire.MAX_LIST + 1)),  # the right length, too many
    _HEAD.pack(b"ORA1", wire.MAX_LIST, 0) + bytes(16 * wire.MAX_LIST),  # over MAX_MESSAGE_BYTES
    b'{"type":"arrive","reqs":[[1,2]],"contiguous":false}',  # the JSON they were before
    b'{"type":"update","grants":[],"v":[]}',
    b"ORA2" + bytes(8), b"ora1" + bytes(8),  # no such frame: not JSON either
])
def test_malformed_hot_frames_are_refused(raw):
    with pytest.raises(wire.WireError):
        wire.decode(raw)


def test_every_truncation_of_a_hot_frame_is_refused():
    for raw in (_ARRIVE, _UPDATE):
        for n in range(len(raw)):
            with pytest.raises(wire.WireError):
                wire.decode(raw[:n])


def test_the_largest_legal_hot_frames_fit_a_control_frame():
    most = (wire.MAX_MESSAGE_BYTES - 12) // 34
    raw = wire.update_frame([], [[1, 2, 0, 3, 4, 5]] * most)
    assert len(raw) <= wire.MAX_MESSAGE_BYTES and len(wire.decode(raw).v) == most
    raw = wire.arrive_frame([[1, 2]] * ((wire.MAX_MESSAGE_BYTES - 12) // 16), False)
    assert len(raw) + 8 + 16 <= wire.CONTROL_FRAME_BYTES  # with its sequence number and MAC


@given(st.binary(max_size=200), st.sampled_from([b"ORA1", b"ORU1"]))
@settings(max_examples=300, deadline=None)
def test_any_bytes_behind_a_hot_magic_decode_or_raise_wire_error(tail, magic):
    try:
        msg = wire.decode(magic + tail)
    except wire.WireError:
        return
    assert isinstance(msg, wire.ArriveMsg if magic == b"ORA1" else wire.UpdateMsg)


def test_a_sealed_hot_frame_opens_once_under_its_session_only():
    base = Authenticator(b"s3cret")
    tx, rx = base.session(0, "a" * 32, "b" * 32, "decode"), base.session(0, "a" * 32, "b" * 32, "prefill")
    sealed = tx.seal(_UPDATE)
    assert rx.unseal(sealed) == _UPDATE
    with pytest.raises(Replayed):
        rx.unseal(sealed)
    assert rx.unseal(sealed[:-1] + bytes([sealed[-1] ^ 1])) is None
    assert tx.unseal(tx.seal(_UPDATE)) is None  # reflected back: the other direction's key


def test_mac_bytes_are_the_keyed_blake2b_of_the_length_prefixed_frames():
    """The MAC is what it was: keyed once per authenticator changes no byte of it."""
    key = hashlib.blake2b(b"s3cret", digest_size=32, person=b"orch-mac-v1").digest()
    frames = wire.encode_status(7, KVPoll.Success, 2)
    h = hashlib.blake2b(key=key, digest_size=16)
    for f in frames:
        h.update(len(f).to_bytes(4, "big") + f)
    a = Authenticator(b"s3cret")
    assert a.sign(frames)[-1] == h.digest() == a.sign(frames)[-1]
    raw = _frame()  # a status frame's: the same keyed blake2b over the frame, then its label
    h = hashlib.blake2b(key=key, digest_size=16)
    for f in (raw, b"orch-frame-v1"):
        h.update(len(f).to_bytes(4, "big") + f)
    assert a.sign_frame(raw) == raw + h.digest()
