"""The engine route's send path: a send's blocks (one per field, or per field and run of slots)
written by Mooncake's batch write into the decode's registered buffers, at most
transport.mooncake.max_blocks_per_batch blocks a batch, several batches in flight."""

from __future__ import annotations

from typing import Optional

import zmq

from orchestrator.handoff.backends.base import Blocks, LayoutMismatch, Peer, Send
from orchestrator.handoff.backends.common import AuxRouter
from orchestrator.handoff.backends.mooncake.engine import EngineError, MooncakeEngine
from orchestrator.handoff.buffers import WARM_BYTES, MetadataBuffers
from orchestrator.handoff.transport.auth import Authenticator
from orchestrator.profile.plan import Route
from orchestrator.profile.platform import clock as now
from orchestrator.results.outcomes import KVPoll


class EngineRouter(AuxRouter):
    """The send path to ONE decode process over `engine`. A send can be submitted from any
    thread (Mooncake's submit is asynchronous): starts_in_caller."""

    route = Route.engine
    starts_in_caller = True

    def __init__(self, buffers: MetadataBuffers, auth: Authenticator, prefill_rank: int, push: zmq.Socket,
                 engine: MooncakeEngine, *, max_blocks_per_batch: int = 1024, tag_in_status: bool = True):
        super().__init__(buffers, auth, prefill_rank, push, tag_in_status=tag_in_status)
        self.engine = engine
        self.max_blocks = max_blocks_per_batch

    def connect(self, peer: Peer) -> None:
        self.check_layout(peer)
        if not peer.session_id:
            raise LayoutMismatch("the decode side has no engine session for the engine route")
        self.bind(peer)

    def peer_session(self) -> str:
        """The peer's engine session id (connect() refused a peer without one)."""
        session = self.connected_peer().session_id
        assert session is not None, "connect() checked it"
        return session

    def warm(self) -> float:
        """One write of our scratch into the peer's (no field covers either), so the engine's
        one-time work for this peer (opening its CUDA IPC mapping, or its TCP connection)
        happens at start-up. Returns its seconds (0.0: nothing to warm)."""
        peer = self.connected_peer()
        if not peer.scratch_ptr:
            return 0.0
        t0 = now()
        self.engine.batch_write(self.peer_session(), [self.buffers.scratch_ptr], [peer.scratch_ptr], [WARM_BYTES])
        return now() - t0

    def start(self, send: Send, session: Optional[str] = None, blocks: Optional[Blocks] = None,
              push: Optional[zmq.Socket] = None) -> None:
        """Submit a send's batch writes (of at most max_blocks_per_batch blocks each)."""
        send.t0 = now()
        try:
            srcs, dsts, lens = blocks or self.blocks(send)
            send.blocks, send.nbytes = len(srcs), sum(lens)
            target = session or self.peer_session()
            step, engine = self.max_blocks, self.engine
            for i in range(0, len(srcs), step):
                send.handles.append(engine.submit(target, srcs[i:i + step], dsts[i:i + step], lens[i:i + step]))
        except EngineError as exc:
            send.error = str(exc)

    @property
    def polls(self) -> bool:  # type: ignore[override]
        return self.engine.polls

    def landed(self, send: Send) -> bool:
        """Whether every batch of the send has landed, each asked once without waiting (the
        landed ones are dropped from its handles: the engine freed them). A failure counts as
        landed, with its error recorded."""
        handles, session = send.handles, self.connected_peer().session_id
        while handles and send.error is None:
            try:
                if not self.engine.landed(handles[0], send.t0, send.nbytes, session=session, blocks=send.blocks):
                    return False
            except EngineError as exc:
                send.error = str(exc)
            del handles[0]
        return True

    def finish(self, send: Send) -> None:
        """Wait until a started send has landed; record its latency and error."""
        for batch in send.handles:
            if send.error is not None:
                break
            try:
                self.engine.wait(batch, session=self.connected_peer().session_id, blocks=send.blocks)
            except EngineError as exc:
                send.error = str(exc)
        send.handles = []
        send.latency_us = (now() - send.t0) * 1e6
        if send.error is not None:
            for t in send.transfers:
                t.status = KVPoll.Failed
