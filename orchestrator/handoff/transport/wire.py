"""What travels between prefill and decode, and how every message is checked on receipt.

Control channel (ZMQ DEALER -> ROUTER). Start-up and the control plane travel as JSON objects
with a "type", decoded with json only (no code-executing decoder) and checked against SCHEMA;
the two hot messages, sent per request or per step, travel as fixed-layout binary frames
(below: "Hot frames"):
    prefill -> decode: hello {rank, layout, fingerprint, nonce, pid_ns, boot_id}, arrive (binary:
                       [rid, room] per request, contiguous; an empty one is the prefill's
                       keepalive), bye {}
    across hosts, a prefill side asks a decode side's bootstrap address (role=decode):
    lookup {rank, prefill_ranks, versions, advertised, nonce, challenge, sent_ms} -> decodes
    {infos: [[{control_endpoint, data_endpoint, transport, session_id}, ...], ...],
    prefill_ranks, versions, advertised, answer_to}
    (infos: each decode process's DecodeAdvert, its public part; versions: what each side
    runs, profile.versions.Versions; advertised: the address SGLang would advertise on its host
    and a port it answers probes on there, an Advertisement: orchestrator.handoff.transport.
    advert, orchestrator.handoff.transport.peercheck). Fresh lookups
    (issue 36): the prefill side's nonce is drawn per run; a lookup without the decode side's
    current challenge gets challenge {challenge, answer_to} back, and only a lookup that carries
    it, sent within the decode side's time window, is judged and answered; every answer echoes
    the lookup's nonce (answer_to), so a recorded lookup or answer opens nowhere else
    (orchestrator.handoff.transport.bootstrap). A lookup from a sender that predates them lacks nonce,
    challenge and sent_ms: it still decodes, and is refused with a line saying why.
    decode -> prefill: bootstrap {session_id, aux_ptrs, item_lens, slots, layout, fingerprint,
                       tp_rank, boot_id, scratch_ptr, nonce, hello_nonce, pid_ns}, update (binary:
                       grants [rid, slot] and verdicts [rid, outcome, detail, t_verified_ns,
                       t_status_ns, t_taken_ns], one message per loop; times are the decode's
                       CLOCK_MONOTONIC; an empty one is the decode's heartbeat), error {detail}
A request is announced ("arrive") when it arrives, as SGLang's decode pre-allocates while the
request bootstraps, so the slot is known before its prefill finishes.

Hot frames (arrive, update; JSON before issue 39, which a receiver now refuses): a 12-byte
header <4sII (magic b"ORA1" or b"ORU1"; arrive: its entry count and flags, bit 0 contiguous;
update: its grant and verdict counts), then the entries back to back, little-endian and
unpadded: ARRIVE_DTYPE (rid u64, room u64), GRANT_DTYPE (rid u64, slot u32), VERDICT_DTYPE
(rid u64, outcome u8, detail u8, t_verified_ns, t_status_ns, t_taken_ns u64). Receipt checks
the magic, the flags, each count (<= MAX_LIST), the exact length and every verdict's outcome
and detail code (orchestrator.results.outcomes) before it reads an entry; an update of one
grant and one verdict is 58 bytes where its JSON was about 95. Like every control message one
frame carries one MAC (the session's seal, over its sequence number), so a step's grants and
verdicts cost one MAC. Decoded, the message is the same ArriveMsg / UpdateMsg, its rows
tuples of ints; arrive_frame / update_frame also take numpy arrays of the dtypes, for a
sender that holds its step in arrays.

Data plane (ZMQ PUSH -> PULL):
    AUX_DATA  [b"AUX_DATA", room, field, slot, >I length, payload]  SGLang's (ASCII numbers;
              a payload of n whole rows fills n consecutive slots from `slot`: one frame per
              field for a coalesced run, which SGLang's handler writes the same way); with a
              secret one more frame, its MAC (Authenticator.sign: the bytes as before issue 39)
    statuses  ONE frame, our own (issue 39; it was SGLang's 4 status frames plus an identity
              frame and a MAC frame per request, or a 3-frame step status, then its MAC frame):
              the 12-byte header <4sII (b"ORS1", prefill rank, entry count), the entries back
              to back as STEP_DTYPE (rid u64, room u64, slot u32, KVPoll value u32, tag u64;
              32 B each), then, with a secret, the 16-byte MAC of everything before it
              (Authenticator.sign_frame, under the session's key). One request's status is
              one entry (60 B with its MAC), a step's statuses to one decode process one
              frame. The tag is the row's digest tag when the layout has no kv_checksum field,
              else 0. No failure reason travels: the KVPoll value says Failed, and our decode
              never read the reason
    bare status [room, KVPoll value, prefill rank(, reason)]  SGLang's own (what a stock SGLang
              prefill sends; our prefill sends none): received and matched by room alone
Receipt is strict: anything malformed raises WireError and writes nothing; a status frame's
MAC is checked (under the session of the rank it names) before any of it is read further.
After hello/bootstrap (which swap the two processes' per-run nonces) the MACs are the
session's. Every socket is opened with ZMQ_MAXMSGSIZE (max_frame_bytes): libzmq drops a
connection that announces a longer frame before buffering it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import operator
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Sequence

import numpy as np

from orchestrator.handoff.transport.advert import Advertisement, DecodeAdvert
from orchestrator.profile.versions import Versions
from orchestrator.results.outcomes import Detail, KVPoll, Outcome

AUX_DATA = b"AUX_DATA"
_LEN = struct.Struct(">I")
_MAX_U64 = (1 << 64) - 1
MAX_MESSAGE_BYTES = 1 << 20
MAX_LIST = 1 << 16
STEP_DTYPE = np.dtype([("rid", "<u8"), ("room", "<u8"), ("slot", "<u4"), ("status", "<u4"),
                       ("tag", "<u8")])


Layout = list[list[str | int]]  # per field: name, dtype, item length (profile.layout.describe)


class WireError(ValueError):
    """A malformed message; the receiver drops and counts it."""


class TooLong(WireError):
    """A message whose only fault may be a string over its field's limit: named as that (a
    field `path` of `chars` characters, over `limit`), never as an unauthentic message."""

    def __init__(self, kind: str, path: str, chars: int, limit: int):
        super().__init__(f"{kind} field {path!r} is {chars} chars, over {limit}")
        self.kind, self.path, self.chars, self.limit = kind, path, chars, limit


# ---- control ---------------------------------------------------------------------------------
def _u64(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_U64


def _ints(v: Any, limit: int = 64) -> bool:
    return isinstance(v, list) and len(v) <= limit and all(_u64(x) for x in v)


def _rows(width: int) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return (isinstance(v, list) and len(v) <= MAX_LIST
                and all(isinstance(r, list) and len(r) == width and all(_u64(x) for x in r) for r in v))
    return check


def _layout(v: Any) -> bool:
    return isinstance(v, list) and len(v) <= 64 and all(
        isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and isinstance(f[1], str)
        and _u64(f[2]) for f in v)


MAX_STR = 4096  # a control message's strings
MAX_VERSION = 256  # a version string (versions: what a side runs)


def _str(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= MAX_STR


def _nonce(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)


def _opt_str(v: Any) -> bool:
    return v is None or _str(v)


_INFO_KEYS: dict[str, Callable[[Any], bool]] = dict(zip(DecodeAdvert.WIRE_KEYS, (_str, _str, _str, _opt_str)))


def _infos(v: Any) -> bool:
    return isinstance(v, list) and 0 < len(v) <= 64 and all(
        isinstance(inst, list) and 0 < len(inst) <= 64 and all(
            isinstance(d, dict) and set(d) == set(_INFO_KEYS) and all(f(d[k]) for k, f in _INFO_KEYS.items())
            for d in inst) for inst in v)


def _read_infos(v: list[list[dict[str, Any]]]) -> list[list[DecodeAdvert]]:
    return [[DecodeAdvert.from_json(d) for d in inst] for inst in v]


_ADVERTISED: dict[str, Callable[[Any], bool]] = dict(zip(Advertisement.WIRE_KEYS,
                                                         (_str, _str, _str, _u64, _str, _str)))
_VERSION_KEYS = frozenset({"mooncake_wheel", "mooncake", "torch", "layout", "orchestrator"})


def _advertised(v: Any) -> bool:
    """The address SGLang would advertise on the sender's host (orchestrator.handoff.transport.reach);
    {} when the sender does not check addresses."""
    return isinstance(v, dict) and (not v or (set(v) == set(_ADVERTISED) and all(
        f(v[k]) for k, f in _ADVERTISED.items())))


def _versions(v: Any) -> bool:
    return isinstance(v, dict) and set(v) <= _VERSION_KEYS and all(
        isinstance(x, str) and len(x) <= MAX_VERSION for x in v.values())


def _over_long(key: str, v: Any) -> Optional[tuple[str, int, int]]:
    """The first string in field `key`'s value over its limit: (its path, its length, the
    limit); None when there is none (the field failed for another reason)."""
    limit = MAX_VERSION if key == "versions" else MAX_STR
    todo: list[tuple[str, Any]] = [(key, v)]
    while todo:
        path, x = todo.pop(0)
        if isinstance(x, str) and len(x) > limit:
            return path, len(x), limit
        if isinstance(x, dict):
            todo += [(f"{path}.{k}", y) for k, y in x.items() if isinstance(k, str)]
        elif isinstance(x, list):
            todo += [(f"{path}[{i}]", y) for i, y in enumerate(x[:MAX_LIST])]
    return None


# Each control message is a frozen dataclass (its fields in wire order, each with its check);
# decode() checks a message once, here, and returns its dataclass, its nested objects built
# as their types (DecodeAdvert, Advertisement, Versions); the endpoints dispatch on the class
# and read its fields as attributes. as_json() is the JSON object it travels as, for tests and
# tools that look at the wire itself.
def _check(fits: Callable[[Any], bool], optional: bool = False, read: Optional[Callable[[Any], Any]] = None) -> Any:
    """A field of a control message: its check; `optional`, a key a sender may leave out (a
    peer that predates it), None here when absent; `read`, what builds its typed value from
    the checked JSON (a nested object: its type's from_json)."""
    meta = {"fits": fits, "optional": optional, "read": read}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


def _json(value: Any) -> Any:
    """A field's value as JSON: a nested object's to_json(), lists of them item by item."""
    if isinstance(value, (Advertisement, DecodeAdvert, Versions)):
        return value.to_json()
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


@dataclass(frozen=True)
class Message:
    """A control message (a subclass per type in SCHEMA)."""

    TYPE: ClassVar[str] = ""

    def fields(self) -> dict[str, Any]:
        """Its JSON object's fields, in wire order (an absent optional key left out)."""
        return {name: value for name, optional in _FIELDS[type(self)]
                if (value := getattr(self, name)) is not None or not optional}

    def as_json(self) -> dict[str, Any]:
        """The JSON object it travels as: "type", then its fields in wire order."""
        return {"type": self.TYPE, **{k: _json(v) for k, v in self.fields().items()}}


@dataclass(frozen=True)
class HelloMsg(Message):
    """prefill -> decode, under the bare secret: who it is and what its rows look like."""

    TYPE: ClassVar[str] = "hello"
    rank: int = _check(_u64)
    layout: Layout = _check(_layout)
    fingerprint: str = _check(_str)
    nonce: str = _check(_nonce)
    pid_ns: Optional[str] = _check(_str, optional=True)
    boot_id: Optional[str] = _check(_str, optional=True)


Rows = Sequence[Sequence[int]]  # a hot message's entries: lists or tuples, each in its dtype's field order


@dataclass(frozen=True)
class ArriveMsg(Message):
    """prefill -> decode: requests arrived (an empty one is the prefill's keepalive). Travels
    as a binary frame (arrive_frame); received, `reqs` holds tuples."""

    TYPE: ClassVar[str] = "arrive"
    reqs: Rows = _check(_rows(2))  # [rid, room]: ARRIVE_DTYPE
    contiguous: bool = _check(lambda v: isinstance(v, bool))


@dataclass(frozen=True)
class ByeMsg(Message):
    """prefill -> decode: this prefill rank writes nothing more."""

    TYPE: ClassVar[str] = "bye"


@dataclass(frozen=True)
class BootstrapMsg(Message):
    """decode -> prefill, the answer to hello (under the bare secret): where its rows are."""

    TYPE: ClassVar[str] = "bootstrap"
    session_id: Optional[str] = _check(_opt_str)
    aux_ptrs: list[int] = _check(_ints)
    item_lens: list[int] = _check(_ints)
    slots: int = _check(_u64)
    layout: Layout = _check(_layout)
    fingerprint: str = _check(_str)
    tp_rank: int = _check(_u64)
    boot_id: str = _check(_str)
    scratch_ptr: int = _check(_u64)
    nonce: str = _check(_nonce)
    hello_nonce: str = _check(_nonce)
    pid_ns: Optional[str] = _check(_str, optional=True)


@dataclass(frozen=True)
class UpdateMsg(Message):
    """decode -> prefill: new grants and verdicts (an empty one is the decode's heartbeat).
    Travels as a binary frame (update_frame); received, `grants` and `v` hold tuples."""

    TYPE: ClassVar[str] = "update"
    grants: Rows = _check(_rows(2))  # [rid, slot]: GRANT_DTYPE
    v: Rows = _check(_rows(6))  # [rid, outcome, detail, t_verified_ns, t_status_ns, t_taken_ns]: VERDICT_DTYPE


@dataclass(frozen=True)
class ErrorMsg(Message):
    """A refusal, with the reason; at the bootstrap address, the nonce of the lookup it
    answers (absent: a lookup whose nonce could not be read, or a decode side before it)."""

    TYPE: ClassVar[str] = "error"
    detail: str = _check(_str)
    answer_to: Optional[str] = _check(_nonce, optional=True)


@dataclass(frozen=True)
class LookupMsg(Message):
    """role=prefill -> role=decode's bootstrap address: where are the decode endpoints?"""

    TYPE: ClassVar[str] = "lookup"
    rank: int = _check(_u64)
    prefill_ranks: int = _check(_u64)
    # what the prefill side runs, and the address SGLang would advertise on its host
    # (orchestrator.handoff.transport.peercheck; a peer that predates them leaves them out)
    versions: Optional[Versions] = _check(_versions, optional=True, read=Versions.from_json)
    advertised: Optional[Advertisement] = _check(_advertised, optional=True, read=Advertisement.from_json)
    # freshness (issue 36): the prefill side's nonce for this run, the decode side's current
    # challenge (None until it said it), and the prefill's wall clock in ms at sending. Read
    # even from a peer that predates them (which the decode side then refuses, saying why)
    nonce: Optional[str] = _check(_nonce, optional=True)
    challenge: Optional[str] = _check(_nonce, optional=True)
    sent_ms: Optional[int] = _check(_u64, optional=True)


@dataclass(frozen=True)
class ChallengeMsg(Message):
    """role=decode's answer to a lookup without its current challenge: the challenge to
    answer, and the nonce of the lookup it answers."""

    TYPE: ClassVar[str] = "challenge"
    challenge: str = _check(_nonce)
    answer_to: str = _check(_nonce)


@dataclass(frozen=True)
class DecodesMsg(Message):
    """The answer to lookup: every decode instance's endpoints, a list per TP rank."""

    TYPE: ClassVar[str] = "decodes"
    infos: list[list[DecodeAdvert]] = _check(_infos, read=_read_infos)
    prefill_ranks: int = _check(_u64)
    versions: Optional[Versions] = _check(_versions, optional=True, read=Versions.from_json)  # as in LookupMsg
    advertised: Optional[Advertisement] = _check(_advertised, optional=True, read=Advertisement.from_json)
    answer_to: Optional[str] = _check(_nonce, optional=True)  # the lookup's nonce


MESSAGES: dict[str, type[Message]] = {cls.TYPE: cls for cls in (
    HelloMsg, ArriveMsg, ByeMsg, BootstrapMsg, UpdateMsg, ErrorMsg, LookupMsg, ChallengeMsg, DecodesMsg)}
# every type's keys and their checks, and the keys a sender may leave out (a peer that predates
# them: the PID namespace and boot id a side sends at bootstrap, plan.same_process_space_rule)
SCHEMA: dict[str, dict[str, Callable[[Any], bool]]] = {
    t: {f.name: f.metadata["fits"] for f in dataclasses.fields(cls)} for t, cls in MESSAGES.items()}
OPTIONAL: dict[str, frozenset[str]] = {
    t: frozenset(f.name for f in dataclasses.fields(cls) if f.metadata["optional"]) for t, cls in MESSAGES.items()}
_FIELDS: dict[type[Message], tuple[tuple[str, bool], ...]] = {
    cls: tuple((f.name, bool(f.metadata["optional"])) for f in dataclasses.fields(cls)) for cls in MESSAGES.values()}
# the fields whose JSON is a nested object: what builds its type (their from_json)
_READS: dict[str, dict[str, Callable[[Any], Any]]] = {
    t: {f.name: f.metadata["read"] for f in dataclasses.fields(cls) if f.metadata["read"] is not None}
    for t, cls in MESSAGES.items()}


CONTROL_FRAME_BYTES = MAX_MESSAGE_BYTES + 64  # a control payload, its sequence number and MAC


def max_frame_bytes(item_lens: Sequence[int], slots: int) -> int:
    """The longest frame a legal message of this layout has: a coalesced AUX_DATA payload
    of every slot of the widest field, a status frame of every slot with its MAC, or a
    control message."""
    return max(max(item_lens, default=0) * slots, _HEAD.size + STEP_DTYPE.itemsize * slots + 16,
               CONTROL_FRAME_BYTES)


# ---- hot control frames: arrive and update, binary ---------------------------------------
# A header (magic, then two u32: arrive: entries, flags with bit 0 = contiguous; update:
# grants, verdicts), then the entries back to back, little-endian, unpadded, as these dtypes.
ARRIVE = b"ORA1"
UPDATE = b"ORU1"
STATUS = b"ORS1"  # the data plane's status frame (below: "data plane")
_HEAD = struct.Struct("<4sII")
ARRIVE_DTYPE = np.dtype([("rid", "<u8"), ("room", "<u8")])
GRANT_DTYPE = np.dtype([("rid", "<u8"), ("slot", "<u4")])
VERDICT_DTYPE = np.dtype([("rid", "<u8"), ("outcome", "u1"), ("detail", "u1"), ("t_verified_ns", "<u8"),
                          ("t_status_ns", "<u8"), ("t_taken_ns", "<u8")])
_ARRIVE, _GRANT, _VERDICT = struct.Struct("<QQ"), struct.Struct("<QI"), struct.Struct("<QBBQQQ")
_OUTCOME_AT, _DETAIL_AT = 8, 9  # a verdict's outcome and detail bytes
_CODES = (len(Outcome), len(Detail))  # codes run 0 .. n-1 (orchestrator.results.outcomes)
HOT_TYPES = frozenset({ArriveMsg.TYPE, UpdateMsg.TYPE})


def _entries(what: str, rows: Rows | np.ndarray, packer: struct.Struct, dtype: np.dtype) -> bytes:
    """Entries packed: rows of ints in the dtype's field order, or an array of the dtype."""
    if isinstance(rows, np.ndarray):
        if rows.dtype != dtype or rows.ndim != 1:
            raise WireError(f"{what}: an array of {rows.dtype} {rows.shape}, expected 1-d {dtype}")
        return rows.tobytes()
    try:
        return b"".join(itertools.starmap(packer.pack, rows))
    except struct.error as exc:  # a negative or too large number, a row of another width
        raise WireError(f"{what}: cannot pack {exc}") from None


def _bounded(what: str, counts: tuple[int, int], body: int) -> None:
    if max(counts) > MAX_LIST or _HEAD.size + body > MAX_MESSAGE_BYTES:
        raise WireError(f"{what}: {counts} entries ({_HEAD.size + body} B) over {MAX_LIST} "
                        f"entries or {MAX_MESSAGE_BYTES} B")


def arrive_frame(reqs: Rows | np.ndarray, contiguous: bool) -> bytes:
    """An arrive's bytes: [rid, room] rows, or an ARRIVE_DTYPE array."""
    n = len(reqs)
    _bounded("arrive", (n, 0), n * _ARRIVE.size)
    return _HEAD.pack(ARRIVE, n, 1 if contiguous else 0) + _entries("arrive", reqs, _ARRIVE, ARRIVE_DTYPE)


def update_frame(grants: Rows | np.ndarray, v: Rows | np.ndarray) -> bytes:
    """An update's bytes: [rid, slot] and [rid, outcome, detail, t_verified_ns, t_status_ns,
    t_taken_ns] rows, or arrays of GRANT_DTYPE and VERDICT_DTYPE."""
    ng, nv = len(grants), len(v)
    _bounded("update", (ng, nv), ng * _GRANT.size + nv * _VERDICT.size)
    return (_HEAD.pack(UPDATE, ng, nv) + _entries("update grants", grants, _GRANT, GRANT_DTYPE)
            + _entries("update verdicts", v, _VERDICT, VERDICT_DTYPE))


def _decode_hot(raw: bytes) -> Message:
    """A binary arrive or update: header, counts, flags, exact length and the verdicts'
    codes checked before an entry is read."""
    if len(raw) < _HEAD.size:
        raise WireError(f"a hot frame of {len(raw)} B, shorter than its {_HEAD.size} B header")
    magic, a, b = _HEAD.unpack_from(raw)
    body = memoryview(raw)[_HEAD.size:]
    if magic == ARRIVE:
        if b > 1:
            raise WireError(f"arrive: unknown flags {b:#x}")
        if a > MAX_LIST or len(body) != a * _ARRIVE.size:
            raise WireError(f"arrive of {a} entries has {len(body)} B of them")
        return ArriveMsg(reqs=list(_ARRIVE.iter_unpack(body)), contiguous=b == 1)
    split = a * _GRANT.size
    if a > MAX_LIST or b > MAX_LIST or len(body) != split + b * _VERDICT.size:
        raise WireError(f"update of {a} grants and {b} verdicts has {len(body)} B of them")
    at = _HEAD.size + split
    if b and (max(raw[at + _OUTCOME_AT::_VERDICT.size]) >= _CODES[0]
              or max(raw[at + _DETAIL_AT::_VERDICT.size]) >= _CODES[1]):
        raise WireError("update: a verdict's outcome or detail code is out of range")
    return UpdateMsg(grants=list(_GRANT.iter_unpack(body[:split])), v=list(_VERDICT.iter_unpack(body[split:])))


def encode(msg: Message | str, **fields: Any) -> bytes:
    """A control message's bytes: a Message, or a type and its fields as given (tests write
    malformed JSON ones this way; arrive and update are built, then framed)."""
    if isinstance(msg, str) and msg in HOT_TYPES:
        msg = MESSAGES[msg](**fields)
    if isinstance(msg, UpdateMsg):
        return update_frame(msg.grants, msg.v)
    if isinstance(msg, ArriveMsg):
        return arrive_frame(msg.reqs, msg.contiguous)
    if isinstance(msg, Message):
        return json.dumps(msg.as_json(), separators=(",", ":")).encode()
    return json.dumps({"type": msg, **{k: _json(v) for k, v in fields.items()}}, separators=(",", ":")).encode()


def decode(raw: bytes) -> Message:
    """A received control message, checked against its type's fields (WireError if not)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(raw)} B exceeds {MAX_MESSAGE_BYTES} B")
    if raw[:4] in (UPDATE, ARRIVE):
        return _decode_hot(raw)
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str) or msg["type"] not in SCHEMA:
        raise WireError("not a known message type")
    kind = msg.pop("type")
    if kind in HOT_TYPES:
        raise WireError(f"{kind} as JSON (a peer from before the binary {kind} frame)")
    fields = SCHEMA[kind]
    extra = set(msg) - set(fields)
    if extra:
        raise WireError(f"{kind}: unexpected keys {sorted(extra)}")
    optional = OPTIONAL[kind]
    for key, fits in fields.items():
        if key not in msg and key in optional:
            continue
        if key not in msg or not fits(msg[key]):
            if key in msg and (long := _over_long(key, msg[key])) is not None:
                raise TooLong(kind, *long)
            raise WireError(f"{kind}: bad or missing {key!r}")
    for key, read in _READS[kind].items():
        if key in msg:
            msg[key] = read(msg[key])
    return MESSAGES[kind](**msg)


def nonce_in(raw: bytes, key: str) -> Optional[str]:
    """The nonce under `key` of a control message (a lookup's "nonce", an answer's
    "answer_to"), read from its JSON alone: for a message that is authentic but failed
    decode() (TooLong), whose sender is still to be told, or told apart. None when absent."""
    if len(raw) > MAX_MESSAGE_BYTES:
        return None
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    nonce = msg.get(key) if isinstance(msg, dict) else None
    return nonce if _nonce(nonce) else None


# ---- data plane: encoding ------------------------------------------------------------------
def encode_aux(room: int, field_index: int, slot: int, payload: bytes) -> list[bytes]:
    """SGLang's AUX_DATA message (one field; `payload` may hold several consecutive rows)."""
    return [AUX_DATA, str(room).encode(), str(field_index).encode(), str(slot).encode(),
            _LEN.pack(len(payload)), payload]


def encode_status(room: int, status: KVPoll, prefill_rank: int, reason: str = "") -> list[bytes]:
    """SGLang's own status message (a bare status: no identity; our prefill sends
    status_frame instead)."""
    return [str(room).encode("ascii"), str(int(status)).encode("ascii"),
            str(prefill_rank).encode("ascii"), reason.encode("utf-8")]


_STATUS_ENTRY = struct.Struct("<QQIIQ")  # STEP_DTYPE's fields
_SLOT_OF, _STATUS_OF = operator.itemgetter(2), operator.itemgetter(3)  # an entry's slot and status
_SUCCESS = int(KVPoll.Success)
MAX_STATUSES = (MAX_MESSAGE_BYTES - _HEAD.size) // _STATUS_ENTRY.size  # a status frame's entries, at most


def status_frame(prefill_rank: int, entries: Rows | np.ndarray) -> bytes:
    """The statuses of one or many requests as one frame, before its MAC
    (Authenticator.sign_frame appends it): [rid, room, slot, status, tag] rows, or a
    STEP_DTYPE array."""
    n = len(entries)
    if not 0 < n <= MAX_STATUSES:
        raise WireError(f"status frame: {n} entries, not 1 to {MAX_STATUSES}")
    try:
        head = _HEAD.pack(STATUS, prefill_rank, n)
    except struct.error as exc:
        raise WireError(f"status frame: cannot pack rank {prefill_rank}: {exc}") from None
    return head + _entries("status frame", entries, _STATUS_ENTRY, STEP_DTYPE)


def read_rows(ptrs: Sequence[int], item_lens: Sequence[int], slot: int, count: int = 1) -> list[bytes]:
    """`count` consecutive rows of every field from host memory (the sender's tcp route)."""
    return [ctypes.string_at(p + n * slot, n * count) for p, n in zip(ptrs, item_lens)]


# ---- data plane: receipt -----------------------------------------------------------------
# (named tuples, not frozen dataclasses: one is built per received frame, at a third of the cost)
class AuxData(NamedTuple):
    room: int
    field_index: int
    slot: int
    rows: int
    payload: bytes


class Status(NamedTuple):
    """A bare SGLang status: one request's "KV done" (or failed), named by its room alone."""

    room: int
    status: int
    prefill_rank: int
    reason: str


StatusRow = tuple[int, int, int, int, int]  # rid, room, slot, KVPoll value, tag: STEP_DTYPE's fields


class StepStatus(NamedTuple):
    """A status frame: the statuses of one request (one entry) or of a step's requests, as
    rows of plain ints (unpacked with struct: for the one or few entries a frame holds, a
    third of numpy's cost of checking them)."""

    prefill_rank: int
    entries: list[StatusRow]


def _number(frame: bytes, what: str, upper: int = _MAX_U64) -> int:
    if not frame or len(frame) > 20 or not frame.isdigit():
        raise WireError(f"{what} is not an ASCII number: {frame[:24]!r}")
    value = int(frame)
    if value > upper:
        raise WireError(f"{what} {value} out of range (max {upper})")
    return value


def status_rank(frame: bytes) -> Optional[int]:
    """The prefill rank a status frame names (whose session's key its MAC must open under);
    None when the frame is not one."""
    if len(frame) < _HEAD.size or frame[:4] != STATUS:
        return None
    return int.from_bytes(frame[4:8], "little")


def _statuses(frame: bytes, slots: int) -> StepStatus:
    """A status frame, its MAC off: magic, count (1 to MAX_STATUSES) and exact length checked
    before an entry is read, then every entry's slot and status."""
    if len(frame) < _HEAD.size:
        raise WireError(f"a one-frame message of {len(frame)} B, shorter than a status header")
    magic, rank, n = _HEAD.unpack_from(frame)
    if magic != STATUS:
        raise WireError(f"a one-frame message that is no status frame: {frame[:4]!r}")
    if not 0 < n <= MAX_STATUSES or len(frame) != _HEAD.size + n * _STATUS_ENTRY.size:
        raise WireError(f"status frame of {n} entries has {len(frame) - _HEAD.size} B of them")
    entries: list[StatusRow] = list(_STATUS_ENTRY.iter_unpack(memoryview(frame)[_HEAD.size:]))
    if max(map(_SLOT_OF, entries)) >= slots or max(map(_STATUS_OF, entries)) > _SUCCESS:
        e = next(e for e in entries if e[2] >= slots or e[3] > _SUCCESS)  # the first wrong one
        raise WireError(f"status frame entry with slot {e[2]} (max {slots - 1}) or status {e[3]}")
    return StepStatus(rank, entries)


def parse(frames: Sequence[bytes], item_lens: Sequence[int], slots: int) -> AuxData | Status | StepStatus:
    """Check a received data-plane message (its MAC off) against the receiver's own layout."""
    if not frames:
        raise WireError("empty message")
    if len(frames) == 1:
        return _statuses(frames[0], slots)
    kind = frames[0]
    if kind == AUX_DATA:
        if len(frames) != 6:
            raise WireError(f"AUX_DATA has {len(frames)} frames, expected 6")
        room = _number(frames[1], "room")
        field_index = _number(frames[2], "field index", len(item_lens) - 1)
        slot = _number(frames[3], "slot", slots - 1)
        if len(frames[4]) != 4:
            raise WireError(f"length frame has {len(frames[4])} bytes, expected 4")
        (declared,) = _LEN.unpack(frames[4])
        payload = frames[5]
        n = item_lens[field_index]
        if declared != len(payload) or declared == 0 or declared % n:
            raise WireError(f"field {field_index}: declared {declared} B, got {len(payload)} B, "
                            f"rows are {n} B")
        rows = declared // n
        if slot + rows > slots:
            raise WireError(f"field {field_index}: {rows} rows from slot {slot} run past slot {slots - 1}")
        return AuxData(room, field_index, slot, rows, payload)
    # SGLang's bare status: [room, status, rank(, reason)]
    if len(frames) not in (3, 4):
        raise WireError(f"status has {len(frames)} frames, expected 3 or 4")
    room = _number(frames[0], "room")
    status = _number(frames[1], "status", KVPoll.Success)
    rank = _number(frames[2], "prefill rank", 1 << 31)
    reason = frames[3].decode("utf-8", errors="replace")[:256] if len(frames) > 3 else ""
    return Status(room, status, rank, reason)


def write_rows(ptrs: Sequence[int], item_lens: Sequence[int], msg: AuxData) -> None:
    """Copy a parsed AUX_DATA payload into ptr[field] + item_len[field] * slot (host memory)."""
    n = item_lens[msg.field_index]
    ctypes.memmove(ptrs[msg.field_index] + n * msg.slot, msg.payload, n * msg.rows)
