"""The pipe between the runner and each endpoint process: one frozen dataclass per message,
and a `Channel` that sends and receives only these.

The network protocol (orchestrator.handoff.transport.wire) is validated field by field because a peer on the
wire is not trusted. This pipe is a multiprocessing Pipe to a child this run spawned, so a
message is trusted, but it is still typed: a receiver matches on the class (`match msg:
case Ready(info=info): ...`), and anything else arriving is a `ProtocolError`, never a
silently ignored tuple.

Child -> runner: Started, Up, Ready, Running, Progress, Phase, FaultReached, Result, Stats, Error,
Bye, Refused, PrefillLost.  Runner -> child: Rendezvous, Decodes, Stop, FaultDone,
DecodeGone, PrefillGone.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Optional, Union


class ProtocolError(RuntimeError):
    """Something that is not a pipe message came through the pipe."""


# ---- child -> runner -------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """A child finished start-up phase `phase` at `at` (time.monotonic(), one clock for every
    process of the machine): progress, and its phase times (orchestrator.job.warmstart)."""

    phase: str
    at: float


@dataclass(frozen=True)
class Up:
    """A prefill's engine is up; `transport` is the effective one it reports."""

    transport: str


@dataclass(frozen=True)
class Ready:
    """A decode is up; `info` holds its endpoints (control, data, bootstrap, transport...)."""

    info: dict


@dataclass(frozen=True)
class Running:
    """A prefill reached its handoff phase (from here on it may hold records)."""


@dataclass(frozen=True)
class Progress:
    """A prefill's count of finished requests, and of those verified (the rest failed or
    were corrupted): counters its loop keeps anyway."""

    finished: int
    verified: int = 0


@dataclass(frozen=True)
class Phase:
    """A driver with several phases (the bench) began one; `label` is its progress line."""

    label: str


@dataclass(frozen=True)
class FaultReached:
    """A prefill reached the checkpoint of the process fault `kind`; it waits for FaultDone."""

    kind: str


@dataclass(frozen=True)
class Result:
    """A prefill's result: its RankResult, or what its driver returned (the bench's)."""

    result: Any


@dataclass(frozen=True)
class Stats:
    """A decode's result (DecodeResult)."""

    result: Any


@dataclass(frozen=True)
class Error:
    """An endpoint failed; `line` is the one line to show."""

    line: str


@dataclass(frozen=True)
class Bye:
    """A decode leader: prefill rank `rank` said bye."""

    rank: int


@dataclass(frozen=True)
class Refused:
    """A decode leader refused prefill rank `rank` at hello, and why."""

    rank: int
    why: str


@dataclass(frozen=True)
class PrefillLost:
    """A decode leader (role=decode) saw prefill rank `rank` go silent, and why."""

    rank: int
    why: str


# ---- runner -> child -------------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    """A decode TP group's torch.distributed rendezvous."""

    init_method: str
    backend: str


@dataclass(frozen=True)
class Decodes:
    """Every decode instance's endpoints, per instance a list per TP rank."""

    infos: list


@dataclass(frozen=True)
class Stop:
    """End the handoffs and send the result."""


@dataclass(frozen=True)
class FaultDone:
    """The runner carried out the process fault a prefill waited at."""


@dataclass(frozen=True)
class DecodeGone:
    """Decode instance `index` is gone (the runner saw it exit), and why."""

    index: int
    why: str


@dataclass(frozen=True)
class PrefillGone:
    """Prefill rank `rank`'s process is gone."""

    rank: int


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
