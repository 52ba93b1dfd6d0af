"""The control channel (ZMQ DEALER -> ROUTER): bootstrap info, slot grants, results.

Messages are JSON objects with a "type" and typed fields, decoded with json only (no pickle or
any other code-executing decoder) and checked against SCHEMA; a message that does not fit
raises ControlError and is dropped and counted by the receiver.

prefill -> decode: hello {item_lens}, grant_request {room, rid}, bye {}
decode -> prefill: bootstrap {session_id, aux_ptrs, item_lens, slots}, grant {room, slot},
                   result {room, slot, outcome, detail}, error {detail}
"""

from __future__ import annotations

import json
from typing import Any

MAX_MESSAGE_BYTES = 64 * 1024

_int_list = "int_list"
SCHEMA: dict[str, dict[str, Any]] = {
    "hello": {"item_lens": _int_list},
    "grant_request": {"room": int, "rid": int},
    "bye": {},
    "bootstrap": {"session_id": (str, type(None)), "aux_ptrs": _int_list, "item_lens": _int_list,
                  "slots": int},
    "grant": {"room": int, "slot": int},
    "result": {"room": int, "slot": int, "outcome": str, "detail": str},
    "error": {"detail": str},
}
OUTCOMES = ("verified", "corrupted", "failed")


class ControlError(ValueError):
    """A control message that is not one of SCHEMA's; dropped and counted."""


def encode(msg_type: str, **fields: Any) -> bytes:
    return json.dumps({"type": msg_type, **fields}, separators=(",", ":")).encode()


def _fits(value: Any, kind: Any) -> bool:
    if kind == _int_list:
        return isinstance(value, list) and len(value) <= 64 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64
    return isinstance(value, kind)


def decode(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ControlError(f"message of {len(raw)} B exceeds {MAX_MESSAGE_BYTES} B")
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) or msg["type"] not in SCHEMA:
        raise ControlError("not a known message type")
    fields = SCHEMA[msg["type"]]
    extra = set(msg) - set(fields) - {"type"}
    if extra:
        raise ControlError(f"{msg['type']}: unexpected keys {sorted(extra)}")
    for key, kind in fields.items():
        if key not in msg or not _fits(msg[key], kind):
            raise ControlError(f"{msg['type']}: bad or missing {key!r}")
    if msg["type"] == "result" and msg["outcome"] not in OUTCOMES:
        raise ControlError(f"result: outcome {msg['outcome']!r} not in {OUTCOMES}")
    return msg
