"""The tcp route: SGLang's AUX_DATA multipart frames over a ZMQ PUSH/PULL pair.

Wire format, one message per field of one request:
    [b"AUX_DATA", str(room), str(field_index), str(decode_slot), struct.pack(">I", n), payload]
ASCII decimal numbers, a big-endian 4-byte length, then one row's raw bytes. The status
message that ends a handoff travels on the same socket, so ZMQ's per-socket ordering
delivers every AUX_DATA frame of a request before its status:
    [b"AUX_STATUS", str(room), str(decode_slot), status, checksum]
This route reads and writes host memory only (the plan refuses it for CUDA buffers).
Receipt is strict: anything malformed raises FrameError and writes nothing.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Sequence

AUX_DATA = b"AUX_DATA"
AUX_STATUS = b"AUX_STATUS"
_LEN = struct.Struct(">I")
_MAX_ROOM = (1 << 64) - 1


class FrameError(ValueError):
    """A malformed message on the data plane; the receiver drops and counts it."""


def encode_aux(room: int, field_index: int, slot: int, payload: bytes) -> list[bytes]:
    return [AUX_DATA, str(room).encode(), str(field_index).encode(), str(slot).encode(),
            _LEN.pack(len(payload)), payload]


def encode_status(room: int, slot: int, status: str, checksum: str) -> list[bytes]:
    return [AUX_STATUS, str(room).encode(), str(slot).encode(), status.encode(), checksum.encode()]


def _number(frame: bytes, what: str, upper: int) -> int:
    if not frame or len(frame) > 20 or not frame.isdigit():
        raise FrameError(f"{what} is not an ASCII number: {frame[:24]!r}")
    value = int(frame)
    if value > upper:
        raise FrameError(f"{what} {value} out of range (max {upper})")
    return value


@dataclass(frozen=True)
class AuxData:
    room: int
    field_index: int
    slot: int
    payload: bytes


@dataclass(frozen=True)
class AuxStatus:
    room: int
    slot: int
    status: str
    checksum: str


def parse(frames: Sequence[bytes], item_lens: Sequence[int], slots: int) -> AuxData | AuxStatus:
    """Check a received message against the receiver's own layout; raise FrameError."""
    if not frames:
        raise FrameError("empty message")
    kind = frames[0]
    if kind == AUX_DATA:
        if len(frames) != 6:
            raise FrameError(f"AUX_DATA has {len(frames)} frames, expected 6")
        room = _number(frames[1], "room", _MAX_ROOM)
        field_index = _number(frames[2], "field index", len(item_lens) - 1)
        slot = _number(frames[3], "slot", slots - 1)
        if len(frames[4]) != 4:
            raise FrameError(f"length frame has {len(frames[4])} bytes, expected 4")
        (declared,) = _LEN.unpack(frames[4])
        payload = frames[5]
        expected = item_lens[field_index]
        if declared != len(payload) or declared != expected:
            raise FrameError(f"field {field_index}: declared {declared} B, got {len(payload)} B, "
                             f"row is {expected} B")
        return AuxData(room, field_index, slot, payload)
    if kind == AUX_STATUS:
        if len(frames) != 5:
            raise FrameError(f"AUX_STATUS has {len(frames)} frames, expected 5")
        room = _number(frames[1], "room", _MAX_ROOM)
        slot = _number(frames[2], "slot", slots - 1)
        try:
            status, checksum = frames[3].decode("ascii"), frames[4].decode("ascii")
        except UnicodeDecodeError:
            raise FrameError("status or checksum is not ASCII") from None
        if len(status) > 32 or len(checksum) > 128:
            raise FrameError("status or checksum too long")
        return AuxStatus(room, slot, status, checksum)
    raise FrameError(f"unknown message kind {kind[:24]!r}")


def write_row(ptrs: Sequence[int], item_lens: Sequence[int], msg: AuxData) -> None:
    """Copy a parsed AUX_DATA payload into ptr[field] + item_len[field] * slot (host memory)."""
    n = item_lens[msg.field_index]
    ctypes.memmove(ptrs[msg.field_index] + n * msg.slot, msg.payload, n)


def read_rows(ptrs: Sequence[int], item_lens: Sequence[int], slot: int) -> list[bytes]:
    """One row of every field, read from host memory (the sender's side of the tcp route)."""
    return [ctypes.string_at(p + n * slot, n) for p, n in zip(ptrs, item_lens)]
