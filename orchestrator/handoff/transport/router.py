"""send_aux: move a step's rows to one decode process by the planned route, then say so.

The route and its reason come from orchestrator.profile.plan (computed once, applied per step); this
module only carries them out. A step's requests for one decode process are grouped into
sends: one per request (SGLang's send_aux: one batch write of one block per field), or, with
`coalesce` (a phase's transport.coalesce, passed to sends()), one per run of consecutive
source and destination slots (one block per field for the whole run, in SGLang's own
field-major layout, so the peer sees nothing new).

A send is started (the batch write submitted; on the tcp route the AUX_DATA frames pushed)
and later finished (waited for), so the transfer thread can keep several writes in flight
as SGLang's transfer workers do. After a send finishes, the status of its requests goes out
on the data socket behind it: SGLang's per-request status message, or, with the phase's
`status=per_step` (passed to sends(), carried by each Send), one message for the step once
all its sends are done.

Faults wrap this class (orchestrator.handoff.faults); nothing here knows about them or about the
benchmark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import numpy as np
import zmq

from orchestrator.handoff.buffers import WARM_BYTES, MetadataBuffers
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.handoff.transport.engine import EngineError, MooncakeEngine
from orchestrator.profile.kinds import StatusMode
from orchestrator.profile.plan import Plan, Route
from orchestrator.results.outcomes import KVPoll

_now = time.monotonic


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
    reason: str = ""


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


class Router(Protocol):
    """The send path to one decode process as the prefill's handshake, loop and transfer
    thread use it: AuxRouter, or the fault wrapper around it (orchestrator.handoff.faults)."""

    @property
    def item_lens(self) -> list[int]: ...

    @property
    def peer(self) -> Optional[Peer]: ...

    @property
    def starts_in_caller(self) -> bool: ...

    def connect(self, peer: Peer) -> None: ...

    def peer_session(self) -> str: ...

    def warm(self) -> float: ...

    def sends(self, transfers: Sequence[Transfer], coalesce: bool = False,
              status: StatusMode = StatusMode.per_request) -> list[Send]: ...

    def blocks(self, send: Send) -> Blocks: ...

    def start(self, send: Send, session: Optional[str] = None, blocks: Optional[Blocks] = None,
              push: Optional[zmq.Socket] = None) -> None: ...

    def ready(self, send: Send) -> bool: ...

    def judged(self, rid: int) -> None: ...

    def finish(self, send: Send) -> None: ...

    def after_send(self, send: Send) -> None: ...

    def after_step(self, transfers: Sequence[Transfer], per_step: bool) -> None: ...


class AuxRouter:
    """The send path to ONE decode process (a TP rank of a decode instance)."""

    def __init__(self, plan: Plan, buffers: MetadataBuffers, auth: Authenticator, prefill_rank: int,
                 engine: Optional[MooncakeEngine], push: zmq.Socket, *, max_blocks_per_batch: int = 1024,
                 tag_in_status: bool = True):
        self.plan = plan
        self.route = plan.route
        self.buffers = buffers
        self.auth = auth
        self.rank = prefill_rank
        self.engine = engine
        self.push = push
        self.max_blocks = max_blocks_per_batch
        self.tag_in_status = tag_in_status
        self.src_ptrs, _, self.item_lens = buffers.get_buf_infos()
        self.peer: Optional[Peer] = None
        if self.route is Route.engine and engine is None:
            raise ValueError("the engine route needs a MooncakeEngine")

    def connect(self, peer: Peer) -> None:
        if list(peer.item_lens) != list(self.item_lens):
            raise LayoutMismatch(f"decode item lengths {peer.item_lens} != prefill {self.item_lens}")
        if self.route is Route.engine and not peer.session_id:
            raise LayoutMismatch("the decode side has no engine session for the engine route")
        self.peer = peer
        if peer.auth is not None:  # from here on, every message is signed for this run and pair
            self.auth = peer.auth

    def connected_peer(self) -> Peer:
        """The decode process connect() gave (every send goes to it)."""
        assert self.peer is not None, "connect() first"
        return self.peer

    def mooncake(self) -> MooncakeEngine:
        """The engine of the engine route."""
        assert self.engine is not None, "the engine route has an engine"
        return self.engine

    def peer_session(self) -> str:
        """The peer's engine session id (the engine route: connect() refused a peer without one)."""
        session = self.connected_peer().session_id
        assert session is not None, "connect() checked it"
        return session

    def warm(self) -> float:
        """Engine route: one write of our scratch into the peer's (no field covers either),
        so the engine's one-time work for this peer (opening its CUDA IPC mapping, or its
        TCP connection) happens at start-up. Returns its seconds (0.0: nothing to warm)."""
        if self.route is not Route.engine:
            return 0.0
        peer = self.connected_peer()
        if not peer.scratch_ptr:
            return 0.0
        t0 = _now()
        self.mooncake().batch_write(self.peer_session(), [self.buffers.scratch_ptr],
                                    [peer.scratch_ptr], [WARM_BYTES])
        return _now() - t0

    @property
    def starts_in_caller(self) -> bool:
        """An engine-route send can be submitted from any thread (Mooncake's submit is
        asynchronous); a tcp-route send pushes frames, which the socket's own thread must."""
        return self.route is Route.engine

    # ---- grouping -----------------------------------------------------------------------
    def sends(self, transfers: Sequence[Transfer], coalesce: bool = False,
              status: StatusMode = StatusMode.per_request) -> list[Send]:
        """A step's sends: one per request, or with `coalesce` one per run of consecutive
        slots; each carries the `status` mode its statuses go out in."""
        groups = runs(transfers) if coalesce else [[t] for t in transfers]
        per_step = status is StatusMode.per_step
        return [Send(g, per_step=per_step) for g in groups]

    def blocks(self, send: Send) -> Blocks:
        """Engine-route blocks of a send: per field, src/dst = base + item_len * first slot,
        length = item_len * rows."""
        first, n = send.transfers[0], len(send.transfers)
        srcs = [p + k * first.src_slot for p, k in zip(self.src_ptrs, self.item_lens)]
        dsts = [p + k * first.dst_slot for p, k in zip(self.connected_peer().aux_ptrs, self.item_lens)]
        return srcs, dsts, [k * n for k in self.item_lens]

    def frames(self, send: Send) -> list[list[bytes]]:
        """tcp route: one AUX_DATA message per field, n consecutive rows in its payload."""
        first, n = send.transfers[0], len(send.transfers)
        rows = wire.read_rows(self.src_ptrs, self.item_lens, first.src_slot, n)
        ad = b"".join(t.rid.to_bytes(8, "little") for t in send.transfers)  # the slots' tenants
        return [self.auth.sign(wire.encode_aux(first.room, i, first.dst_slot, payload), ad)
                for i, payload in enumerate(rows)]

    # ---- moving bytes -------------------------------------------------------------------
    def start(self, send: Send, session: Optional[str] = None, blocks: Optional[Blocks] = None,
              push: Optional[zmq.Socket] = None) -> None:
        """Submit a send (batch writes of at most max_blocks_per_batch blocks; on the tcp
        route its frames go out now). `session`, `blocks` and `push` replace the planned
        ones (fault injection). Never raises: an error is recorded on the send."""
        send.t0 = _now()
        try:
            if self.route is Route.engine:
                srcs, dsts, lens = blocks or self.blocks(send)
                send.blocks, send.nbytes = len(srcs), sum(lens)
                target = session or self.peer_session()
                step, engine = self.max_blocks, self.mooncake()
                for i in range(0, len(srcs), step):
                    send.handles.append(engine.submit(target, srcs[i:i + step], dsts[i:i + step],
                                                      lens[i:i + step]))
            else:
                msgs = self.frames(send)
                send.blocks, send.nbytes = len(msgs), sum(len(m[5]) for m in msgs)
                for m in msgs:
                    (push or self.push).send_multipart(m, copy=False)
        except (EngineError, zmq.ZMQError) as exc:
            send.error = str(exc)

    def ready(self, send: Send) -> bool:
        """Whether finish() may be called now (a started send can always be waited for)."""
        return True

    def judged(self, rid: int) -> None:
        """A verdict on request `rid` came back before its send finished (a decode shed it);
        nothing to do here (a fault holding the send back acts on it: FaultyRouter)."""

    def finish(self, send: Send) -> None:
        """Wait until a started send has landed; record its latency and error."""
        for batch in send.handles:
            if send.error is not None:
                break
            try:
                self.mooncake().wait(batch, session=self.connected_peer().session_id, blocks=send.blocks)
            except EngineError as exc:
                send.error = str(exc)
        send.handles = []
        send.latency_us = (_now() - send.t0) * 1e6
        if send.error is not None:
            for t in send.transfers:
                t.status, t.reason = KVPoll.Failed, "sender_error"

    # ---- statuses -----------------------------------------------------------------------
    def status_frames(self, transfers: Sequence[Transfer], per_step: bool) -> list[list[bytes]]:
        if per_step and len(transfers) > 1:
            entries = np.zeros(len(transfers), dtype=wire.STEP_DTYPE)
            for i, t in enumerate(transfers):
                entries[i] = (t.rid, t.room, t.dst_slot, int(t.status),
                              t.tag if self.tag_in_status else 0)
            return [self.auth.sign(wire.encode_step(self.rank, entries))]
        return [self.auth.sign(wire.encode_status(
            t.room, t.status, self.rank, t.rid, t.dst_slot, t.tag if self.tag_in_status else 0,
            t.reason)) for t in transfers]

    def send_status(self, transfers: Sequence[Transfer], per_step: bool) -> None:
        for frames in self.status_frames(transfers, per_step):
            try:
                self.push.send_multipart(frames, copy=False)
            except zmq.ZMQError:
                pass  # the data plane is stuck: the peer-lost timer ends it

    def after_send(self, send: Send) -> None:
        """A finished send's statuses (per-request mode)."""
        if not send.per_step:
            self.send_status(send.transfers, False)

    def after_step(self, transfers: Sequence[Transfer], per_step: bool) -> None:
        """All of a step's sends to this process finished (per-step mode: one status)."""
        if per_step:
            self.send_status(transfers, True)
