"""SGLang's AUX_DATA wire format: exact bytes, strict length checks on receipt."""

from __future__ import annotations

import struct

import pytest

from orchestrator.transport import zmq_aux

LENS = [64, 64, 512]


def test_aux_data_bytes_match_sglang():
    frames = zmq_aux.encode_aux(42, 1, 3, b"x" * 64)
    assert frames == [b"AUX_DATA", b"42", b"1", b"3", struct.pack(">I", 64), b"x" * 64]
    msg = zmq_aux.parse(frames, LENS, slots=8)
    assert (msg.room, msg.field_index, msg.slot, msg.payload) == (42, 1, 3, b"x" * 64)


def test_status_round_trip():
    msg = zmq_aux.parse(zmq_aux.encode_status(7, 2, "ok", "ab12"), LENS, slots=4)
    assert (msg.room, msg.slot, msg.status, msg.checksum) == (7, 2, "ok", "ab12")


@pytest.mark.parametrize("frames", [
    [],
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 64)],  # too few frames
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 63), b"x" * 64],  # declared != actual
    [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 65), b"x" * 65],  # != row length
    [b"AUX_DATA", b"1", b"3", b"0", struct.pack(">I", 64), b"x" * 64],  # field out of range
    [b"AUX_DATA", b"1", b"0", b"8", struct.pack(">I", 64), b"x" * 64],  # slot out of range
    [b"AUX_DATA", b"-1", b"0", b"0", struct.pack(">I", 64), b"x" * 64],  # not a number
    [b"AUX_DATA", b"1", b"0", b"0", b"\x00\x40", b"x" * 64],  # short length frame
    [b"AUX_STATUS", b"1", b"0", b"ok"],
    [b"NOPE", b"1"],
])
def test_malformed_frames_are_rejected(frames):
    with pytest.raises(zmq_aux.FrameError):
        zmq_aux.parse(frames, LENS, slots=8)
