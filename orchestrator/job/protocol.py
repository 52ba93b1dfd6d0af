"""The pipe between the runner and each endpoint process: one frozen dataclass per message,
and a `Channel` that sends and receives only these.

The network protocol (orchestrator.handoff.transport.wire) is validated field by field because a peer on the
wire is not trusted. This pipe is a multiprocessing Pipe to a child this run spawned, so a
message is trusted, but it is still typed: a receiver matches on the class (`match msg:
case Ready(info=info): ...`), and anything else arriving is a `ProtocolError`, never a
silently ignored tuple.

The messages an endpoint sends or matches inside its own loop are the handoff's words
(orchestrator.handoff.endpoints.control: Started, Progress, Phase, FaultReached, Bye, Refused,
PrefillLost; Rendezvous, Stop, FaultDone, DecodeGone, PrefillGone); this module adds those of
the child's entry (orchestrator.job.children) and of the runner, the unions and the Channel.

Child -> runner: Started, Up, Ready, Running, Progress, Phase, FaultReached, Result, Stats, Error,
Bye, Refused, PrefillLost.  Runner -> child: Rendezvous, Decodes, Stop, FaultDone,
DecodeGone, PrefillGone.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional, Union

from orchestrator.handoff.endpoints.control import (
    Bye,
    DecodeGone,
    FaultDone,
    FaultReached,
    Phase,
    PrefillGone,
    PrefillLost,
    Progress,
    ProtocolError,
    Refused,
    Rendezvous,
    Started,
    Stop,
)
from orchestrator.handoff.transport.advert import Adverts, DecodeAdvert
from orchestrator.results.paths import PrefillResult
from orchestrator.results.records import DecodeResult

# ---- child -> runner (the entry's own) ---------------------------------------------------


@dataclass(frozen=True)
class Up:
    """A prefill's engine is up; `transport` is the effective one it reports."""

    transport: str


@dataclass(frozen=True)
class Ready:
    """A decode is up; `info` holds its endpoints (control, data), transport and engine session."""

    info: DecodeAdvert


@dataclass(frozen=True)
class Running:
    """A prefill reached its handoff phase (from here on it may hold records)."""


@dataclass(frozen=True)
class Result:
    """A prefill's result: its RankResult, or what its driver returned (the bench's PathResult)."""

    result: PrefillResult


@dataclass(frozen=True)
class Stats:
    """A decode's result."""

    result: DecodeResult


@dataclass(frozen=True)
class Error:
    """An endpoint failed; `line` is the one line to show."""

    line: str


# ---- runner -> child (the runner's own) --------------------------------------------------


@dataclass(frozen=True)
class Decodes:
    """Every decode instance's endpoints, per instance a list per TP rank."""

    infos: Adverts


ToRunner = Union[Started, Up, Ready, Running, Progress, Phase, FaultReached, Result, Stats, Error, Bye,
                 Refused, PrefillLost]
ToChild = Union[Rendezvous, Decodes, Stop, FaultDone, DecodeGone, PrefillGone]
MESSAGES = (Started, Up, Ready, Running, Progress, Phase, FaultReached, Result, Stats, Error, Bye,
            Refused, PrefillLost, Rendezvous, Decodes, Stop, FaultDone, DecodeGone, PrefillGone)


class Channel:
    """One end of a runner<->endpoint pipe that carries only the messages above."""

    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, msg: ToRunner | ToChild) -> None:
        if not isinstance(msg, MESSAGES):
            raise ProtocolError(f"not a pipe message: {msg!r}")
        self.conn.send(msg)

    def recv(self) -> ToRunner | ToChild:
        """The next message; EOFError/OSError when the other end is gone."""
        msg = self.conn.recv()
        if not isinstance(msg, MESSAGES):
            raise ProtocolError(f"not a pipe message: {type(msg).__name__}")
        return msg

    def poll(self, timeout: Optional[float] = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        self.conn.close()
