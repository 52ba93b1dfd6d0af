"""The backend interface: the few calls the endpoints make to move a step's aux rows and their
statuses, and what the bench compares them with, whatever carries the bytes (SGLang's
disaggregation/base/conn.py, one folder per backend behind it).

Two classes, as SGLang's KVManager and KVSender:

- `Backend`, one per endpoint process: its buffers reachable by the peer (the session id a
  decode advertises), the send path it opens to each decode process, the first contact with
  one (the engine's handshake and warm-up write), and the bench's raw calls.
- `SendPath`, one per decode process a prefill rank sends to: a step's requests grouped into
  sends, each started, finished and followed by its statuses. The fault wrapper
  (orchestrator.handoff.faults) is a SendPath around a backend's; the loops hold no fault
  branch.

The backends: orchestrator.handoff.backends.mooncake (the engine route) and
orchestrator.handoff.backends.zmq (the tcp route); factory.open_backend picks the plan's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import structlog
import zmq

from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.transport.advert import Advertisement
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.profile.kinds import AddressCheck, StatusMode
from orchestrator.results.outcomes import KVPoll


class LayoutMismatch(ValueError):
    """Both sides of a handoff must have identical layouts."""


@dataclass
class Peer:
    """What a decode process told us at bootstrap."""

    session_id: Optional[str]
    aux_ptrs: list[int]
    item_lens: list[int]
    slots: int
    tp_rank: int = 0
    boot_id: str = ""
    scratch_ptr: int = 0  # the decode's warm-up target (0: none advertised)
    auth: Optional[Authenticator] = None  # the session's keys (orchestrator.handoff.transport.auth.Session)


@dataclass(slots=True)
class Transfer:
    """One request of a step, bound for one decode process."""

    rid: int
    room: int
    src_slot: int
    dst_slot: int
    tag: int = 0  # the row's digest tag (travels in the status when the row has no kv_checksum)
    status: KVPoll = KVPoll.Success


@dataclass(slots=True)
class Send:
    """One batch write (or one set of AUX_DATA frames) and the requests it carried."""

    transfers: list[Transfer]
    blocks: int = 0
    nbytes: int = 0
    latency_us: float = 0.0
    error: Optional[str] = None
    t0: float = 0.0  # CLOCK_MONOTONIC when it started
    t_status: float = 0.0  # when its status went out
    handles: list = field(default_factory=list)  # batch ids of the writes in flight
    fault: Optional[object] = None  # set by a fault wrapper for the sends it alters
    per_step: bool = False  # its statuses go in one message for the step (status=per_step)


def runs(transfers: Sequence[Transfer]) -> list[list[Transfer]]:
    """Maximal runs of transfers whose source AND destination slots both go up by one."""
    out: list[list[Transfer]] = []
    for t in transfers:
        last = out[-1][-1] if out else None
        if last is not None and t.src_slot == last.src_slot + 1 and t.dst_slot == last.dst_slot + 1:
            out[-1].append(t)
        else:
            out.append([t])
    return out


Blocks = tuple[list[int], list[int], list[int]]  # sources, destinations, lengths of a batch write


class SendPath(ABC):
    """The send path to ONE decode process (a TP rank of a decode instance): what the prefill's
    handshake (connect), loop (sends, start, judged) and send queue (start, ready, finish,
    after_send, after_step: endpoints.sender, driven by the loop's thread or the transfer
    thread, one at a time) call. `item_lens`: the fields' row lengths (a send moves one block
    per field); `starts_in_caller`: whether start() may run on the loop's thread while the
    transfer thread drives the queue."""

    item_lens: list[int]
    starts_in_caller: bool

    @abstractmethod
    def connect(self, peer: Peer) -> None:
        """Bind to the decode process `peer` describes (LayoutMismatch when it does not fit)."""

    @abstractmethod
    def sends(self, transfers: Sequence[Transfer], coalesce: bool = False,
              status: StatusMode = StatusMode.per_request) -> list[Send]:
        """A step's requests for this process, grouped into sends."""

    @abstractmethod
    def start(self, send: Send) -> None:
        """Submit a send; never raises (an error is recorded on the send)."""

    def ready(self, send: Send) -> bool:
        """Whether finish() may be called now (a started send can always be waited for)."""
        return True

    polls = True
    """landed() answers without waiting (a route whose finish() has nothing to wait for, or an
    engine whose wheel exports its batch status)"""

    def landed(self, send: Send) -> bool:
        """Whether a started send has landed, asked once, without waiting (`polls`); finish()
        then does not wait. A failure counts as landed (finish() records it)."""
        return True

    def judged(self, rid: int) -> None:
        """A verdict on request `rid` came back before its send finished (a decode shed it);
        nothing to do but for a fault holding the send back."""
        return None

    @abstractmethod
    def finish(self, send: Send) -> None:
        """Wait until a started send has landed; record its latency and error."""

    @abstractmethod
    def after_send(self, send: Send) -> None:
        """A finished send's statuses (per-request mode)."""

    @abstractmethod
    def after_step(self, transfers: Sequence[Transfer], per_step: bool) -> None:
        """All of a step's sends to this process finished (per-step mode: one status)."""


@dataclass(frozen=True)
class RawWrites:
    """The bench's yardstick: the backend's own calls, bare, on the blocks of `path`'s sends
    (decode instance 0, TP rank 0). Each is the backend's bound call itself, so a timed call
    costs what the backend's call costs: `write(session, srcs, dsts, lens)` and
    `bulk(session, src, dst, nbytes)` return its return code."""

    path: SendPath
    session: str
    blocks: Callable[[Send], Blocks]
    write: Callable[[str, list[int], list[int], list[int]], int]
    bulk: Callable[[str, int, int, int], int]
    register: Callable[[int, int], None]


class Backend(ABC):
    """What carries one endpoint process's aux rows (SGLang's KVManager): its buffers, reachable
    by the peer as `session_id` (None: the peer writes nothing into them; rows come as
    frames), and the send paths it opens. `transport`: the effective transport ("zmq-tcp",
    "mooncake-<transport>"). `stuck`: a call into the backend never returned (the process
    must exit hard)."""

    transport: str
    stuck: bool = False

    def __init__(self, buffers: MetadataBuffers):
        self.buffers = buffers

    @property
    def session_id(self) -> Optional[str]:
        """The session a decode advertises at bootstrap (None: none)."""
        return None

    def exposed(self) -> list[str]:
        """The backend's listeners on this host bound beyond loopback."""
        return []

    @abstractmethod
    def router(self, push: zmq.Socket, auth: Authenticator, prefill_rank: int,
               tag_in_status: bool = True) -> SendPath:
        """The send path to one decode process, whose data socket `push` is connected to."""

    def first_contact(self, path: SendPath, advertised: Optional[Advertisement], timeout_s: float,
                      address_check: AddressCheck, log: structlog.stdlib.BoundLogger) -> float:
        """After path.connect(): what the backend does with the peer before any handoff (the
        engine's handshake, its probe of the address SGLang would advertise, the warm-up
        write), within `timeout_s`; returns the warm-up write's seconds."""
        return 0.0

    def raw(self) -> Optional[RawWrites]:
        """The bench's yardstick on the first send path opened (None: the backend has none)."""
        return None

    def bulk_target(self, nbytes: int) -> Optional[int]:
        """A region of `nbytes` on the buffers' device the peer may write (the bench's bandwidth
        point): its address, or None where the peer writes nothing here."""
        return None
