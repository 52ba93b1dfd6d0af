"""What both routes' send paths share (SGLang's disaggregation/common/conn.py): a step's requests
grouped into sends, the layout check at connect, and the statuses on the data socket.

The route and its reason come from orchestrator.profile.plan (computed once, applied per step);
the backends only carry them out. A step's requests for one decode process are grouped into
sends: one per request (SGLang's send_aux: one batch write of one block per field), or, with
`coalesce` (a phase's transport.coalesce, passed to sends()), one per run of consecutive
source and destination slots (one block per field for the whole run, in SGLang's own
field-major layout, so the peer sees nothing new).

A send is started (the engine route: the batch write submitted; the tcp route: the AUX_DATA
frames pushed) and later finished (waited for), so the prefill can keep several
writes in flight as SGLang's transfer workers do. After a send finishes, the status of its
requests goes out on the data socket behind it: one status frame per request (wire.status_frame,
one entry, its MAC inside; where SGLang sends its multipart status message), or, with the
phase's `status=per_step` (passed to sends(), carried by each Send), one frame for the step
once all its sends are done.

Faults wrap these classes (orchestrator.handoff.faults); nothing here knows about them or
about the benchmark.
"""

from __future__ import annotations

from abc import abstractmethod
from operator import attrgetter
from typing import Optional, Sequence

import zmq

from orchestrator.handoff.backends.base import Blocks, LayoutMismatch, Peer, Send, SendPath, Transfer, runs
from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.transport import wire
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.profile.kinds import StatusMode
from orchestrator.profile.plan import Route
from orchestrator.profile.platform import clock as now
from orchestrator.results.outcomes import KVPoll

_STATUS_ROW = attrgetter("rid", "room", "dst_slot", "status", "tag")  # a transfer's status entry


class AuxRouter(SendPath):
    """The send path to ONE decode process (a TP rank of a decode instance), less how the rows
    travel: the engine route's (mooncake.router.EngineRouter) or the tcp route's
    (zmq.router.TcpRouter). `route`: which one."""

    route: Route

    def __init__(self, buffers: MetadataBuffers, auth: Authenticator, prefill_rank: int, push: zmq.Socket,
                 *, tag_in_status: bool = True):
        self.buffers = buffers
        self.auth = auth
        self.rank = prefill_rank
        self.push = push
        self.tag_in_status = tag_in_status
        self.src_ptrs, _, self.item_lens = buffers.get_buf_infos()
        self.peer: Optional[Peer] = None

    def check_layout(self, peer: Peer) -> None:
        if list(peer.item_lens) != list(self.item_lens):
            raise LayoutMismatch(f"decode item lengths {peer.item_lens} != prefill {self.item_lens}")

    def bind(self, peer: Peer) -> None:
        self.peer = peer
        if peer.auth is not None:  # from here on, every message is signed for this run and pair
            self.auth = peer.auth

    def connect(self, peer: Peer) -> None:
        self.check_layout(peer)
        self.bind(peer)

    def connected_peer(self) -> Peer:
        """The decode process connect() gave (every send goes to it)."""
        assert self.peer is not None, "connect() first"
        return self.peer

    # ---- grouping -----------------------------------------------------------------------
    def sends(self, transfers: Sequence[Transfer], coalesce: bool = False,
              status: StatusMode = StatusMode.per_request) -> list[Send]:
        """A step's sends: one per request, or with `coalesce` one per run of consecutive
        slots; each carries the `status` mode its statuses go out in."""
        groups = runs(transfers) if coalesce else [[t] for t in transfers]
        per_step = status is StatusMode.per_step
        return [Send(g, per_step=per_step) for g in groups]

    def blocks(self, send: Send) -> Blocks:
        """A send's blocks: per field, src/dst = base + item_len * first slot,
        length = item_len * rows."""
        first, n = send.transfers[0], len(send.transfers)
        srcs = [p + k * first.src_slot for p, k in zip(self.src_ptrs, self.item_lens)]
        dsts = [p + k * first.dst_slot for p, k in zip(self.connected_peer().aux_ptrs, self.item_lens)]
        return srcs, dsts, [k * n for k in self.item_lens]

    # ---- moving bytes -------------------------------------------------------------------
    @abstractmethod
    def start(self, send: Send, session: Optional[str] = None, blocks: Optional[Blocks] = None,
              push: Optional[zmq.Socket] = None) -> None:
        """Submit a send. `session`, `blocks` (the engine route) and `push` (the tcp route)
        replace the planned ones (fault injection). Never raises: an error is recorded on
        the send."""

    def finish(self, send: Send) -> None:
        """Record a started send's latency and, on an error, its requests' failure (nothing
        to wait for: the tcp route's frames went out at start())."""
        send.latency_us = (now() - send.t0) * 1e6
        if send.error is not None:
            for t in send.transfers:
                t.status = KVPoll.Failed

    # ---- statuses -----------------------------------------------------------------------
    def status_frames(self, transfers: Sequence[Transfer], per_step: bool) -> list[bytes]:
        """The statuses of `transfers` as signed status frames (wire.status_frame): one per
        request, or with `per_step` one for them all (split only past wire.MAX_STATUSES)."""
        rows = (list(map(_STATUS_ROW, transfers)) if self.tag_in_status  # (KVPoll packs as its int)
                else [(t.rid, t.room, t.dst_slot, t.status, 0) for t in transfers])
        at = range(0, len(rows), wire.MAX_STATUSES) if per_step else range(len(rows))
        width = wire.MAX_STATUSES if per_step else 1
        return [self.auth.sign_frame(wire.status_frame(self.rank, rows[i:i + width])) for i in at]

    def send_status(self, transfers: Sequence[Transfer], per_step: bool) -> None:
        for frame in self.status_frames(transfers, per_step):
            try:
                self.push.send(frame)
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
