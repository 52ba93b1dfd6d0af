"""The wire formats: SGLang's AUX_DATA and status messages byte for byte, this tool's
identity frame and step status, strict receipt, and MACs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.results.outcomes import KVPoll

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


def test_status_is_sglangs_message_plus_one_identity_frame():
    frames = wire.encode_status(7, KVPoll.Success, 2, rid=11, slot=3, tag=0xABC)
    assert frames[:4] == [b"7", b"4", b"2", b""]  # what SGLang's parser reads
    assert len(frames) == 5 and frames[4].startswith(wire.EXT)
    msg = wire.parse(frames, LENS, slots=4)
    assert (msg.room, msg.status, msg.prefill_rank, msg.rid, msg.slot, msg.tag) == (7, 4, 2, 11, 3, 0xABC)
    bare = wire.parse([b"7", b"0", b"2", b"KV transfer failed"], LENS, slots=4)
    assert bare.rid is None and bare.status == KVPoll.Failed and bare.reason == "KV transfer failed"


def test_step_status_round_trip():
    entries = np.zeros(3, dtype=wire.STEP_DTYPE)
    entries["rid"], entries["room"], entries["slot"], entries["status"] = [1, 2, 3], [9, 9, 8], [0, 1, 2], 4
    msg = wire.parse(wire.encode_step(5, entries), LENS, slots=4)
    assert msg.prefill_rank == 5 and msg.entries["rid"].tolist() == [1, 2, 3]


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
    [b"1", b"4", b"0", b"", b"NOPE" + bytes(20)],  # unknown extension
    [b"1", b"4", b"0", b"", wire.EXT + struct.pack("<QIQ", 1, 99, 0)],  # slot out of range
    [wire.STEP, b"0", b"x" * 33],  # not whole entries
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
