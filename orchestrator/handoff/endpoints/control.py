"""The endpoints' own words on the runner's pipe: the messages a prefill or decode sends or
matches inside its loop, the pipe end it needs (`Pipe`: send, recv, poll, fileno), and the
start-up phase marks (`mark`).

The job's side of the pipe (orchestrator.job.protocol) imports these, adds its own messages
(the entries' Up, Ready, Running, Result, Stats, Error; the runner's Decodes), the unions
and the Channel that carries only pipe messages. The endpoints never import the job: a
child's entry (orchestrator.job.children) hands them its Channel as a `Pipe`, and the warm
start (orchestrator.job.warmstart.child_main) points `mark` at it.

Endpoint -> runner: Started, Progress, Phase, FaultReached, Bye, Refused, PrefillLost.
Runner -> endpoint: Rendezvous, Stop, FaultDone, DecodeGone, PrefillGone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Protocol, Union


class ProtocolError(RuntimeError):
    """Something that is not a pipe message came through the pipe, or a message its
    receiver does not take."""


# ---- endpoint -> runner ----------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """A child finished start-up phase `phase` at `at` (time.monotonic(), one clock for every
    process of the machine): progress, and its phase times (orchestrator.job.warmstart)."""

    phase: str
    at: float


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


# ---- runner -> endpoint ----------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous:
    """A decode TP group's torch.distributed rendezvous."""

    init_method: str
    backend: str


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


Said = Union[Started, Progress, Phase, FaultReached, Bye, Refused, PrefillLost]
"""What an endpoint itself sends on the pipe."""


class Pipe(Protocol):
    """The end of the runner's pipe an endpoint needs (orchestrator.job.protocol.Channel is one)."""

    def send(self, msg: Said) -> None: ...

    def recv(self) -> object: ...

    def poll(self, timeout: Optional[float] = 0.0) -> bool: ...

    def fileno(self) -> int: ...


_marks: Optional[Pipe] = None  # where this child's start-up marks go (marks_to)


def marks_to(pipe: Optional[Pipe]) -> None:
    """Send this process's start-up marks to `pipe` (None: nowhere). The warm start's
    child_main sets it to the child's pipe before the endpoint's module is imported."""
    global _marks
    _marks = pipe


def mark(phase: str) -> None:
    """This child reached the end of start-up phase `phase` (sent to the runner as Started;
    nothing in a process whose marks go nowhere)."""
    if _marks is None:
        return
    try:
        _marks.send(Started(phase=phase, at=time.monotonic()))
    except (BrokenPipeError, OSError):
        pass
