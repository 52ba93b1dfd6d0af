"""The enums every side agrees on: SGLang's transfer status, and a handoff's outcome and its
reason. Codes are what travels on the wire; names are what lands in the run dir."""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Mapping


class RunFailed(RuntimeError):
    """A run's endpoints could not start (a bootstrap refused or unanswered, a process that
    exited or hung at start-up); the message says which and why. Raised below the job (the
    bootstrap) and in it (the runner); the failure policy maps it to its exit code."""


class KVPoll(IntEnum):
    """SGLang's transfer status values (base/conn.py)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Outcome(Enum):
    """A handoff's verdict. Codes order them worst first (a TP group takes the minimum)."""

    failed = "failed"
    corrupted = "corrupted"
    verified = "verified"

    @property
    def code(self) -> int:
        return _OUTCOME_CODES[self]

    @classmethod
    def of(cls, code: int) -> "Outcome":
        return _OUTCOMES_BY_CODE[code]


_OUTCOME_CODES = {Outcome.failed: 0, Outcome.corrupted: 1, Outcome.verified: 2}
_OUTCOMES_BY_CODE = {v: k for k, v in _OUTCOME_CODES.items()}


class Detail(Enum):
    """Why a handoff was not verified (none when it was)."""

    none = ""
    checksum_mismatch = "checksum_mismatch"  # the row's bytes are not what the sender digested
    room_mismatch = "room_mismatch"  # the row carries another request's room
    room_never_landed = "room_never_landed"  # "done" arrived, the room stayed 0 past the timeout
    taken_unready = "taken_unready"  # judged while its room was still 0 (no readiness gate)
    sender_error = "sender_error"  # the sender's write failed (no rollback: never trust the slot)
    peer_lost = "peer_lost"  # in flight when the decode side went silent
    not_sent_peer_lost = "not_sent_peer_lost"  # never sent: the decode side was already lost
    prefill_lost = "prefill_lost"  # the prefill process died before it recorded a verdict
    decode_lost = "decode_lost"  # the decode process died before it judged the request
    interrupted = "interrupted"  # in flight when the run was interrupted
    not_sent_interrupted = "not_sent_interrupted"  # never sent: the run was interrupted
    run_error = "run_error"  # the run could not start or an endpoint failed
    tp_disagreement = "tp_disagreement"  # ranks of one decode TP group judged it differently
    decode_overloaded = "decode_overloaded"  # the decode's arrival queue was full: shed
    # the row's kv_checksum holds a tag its authenticated sender did not write (it said which
    # in its status): someone else wrote into the registered row
    written_by_someone_else = "written_by_someone_else"

    @property
    def code(self) -> int:
        return _DETAIL_CODES[self]

    @classmethod
    def of(cls, code: int) -> "Detail":
        return _DETAILS_BY_CODE[code]


_DETAIL_CODES = {d: i for i, d in enumerate(Detail)}
_DETAILS_BY_CODE = {i: d for d, i in _DETAIL_CODES.items()}
# Outcome.of / Detail.of as mappings (a batch of codes looked up without a call each)
OUTCOME_OF: Mapping[int, Outcome] = _OUTCOMES_BY_CODE
DETAIL_OF: Mapping[int, Detail] = _DETAILS_BY_CODE
