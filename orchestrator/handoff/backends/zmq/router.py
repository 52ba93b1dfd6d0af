"""The tcp route's send path: a send's rows read out of the buffers and pushed as AUX_DATA
frames (one per field, n consecutive rows in its payload) on the decode's data socket, ahead
of their statuses on the same socket (SGLang's SGLANG_MOONCAKE_SEND_AUX_TCP path)."""

from __future__ import annotations

from typing import Optional

import zmq

from orchestrator.handoff.backends.base import Blocks, Send
from orchestrator.handoff.backends.common import AuxRouter
from orchestrator.handoff.transport import wire
from orchestrator.profile.plan import Route
from orchestrator.profile.platform import clock as now


class TcpRouter(AuxRouter):
    """The send path to ONE decode process over its data socket. A send pushes frames, which
    the socket's own thread must: not starts_in_caller."""

    route = Route.tcp
    starts_in_caller = False

    def frames(self, send: Send) -> list[list[bytes]]:
        """One AUX_DATA message per field, n consecutive rows in its payload."""
        first, n = send.transfers[0], len(send.transfers)
        rows = wire.read_rows(self.src_ptrs, self.item_lens, first.src_slot, n)
        ad = b"".join(t.rid.to_bytes(8, "little") for t in send.transfers)  # the slots' tenants
        return [self.auth.sign(wire.encode_aux(first.room, i, first.dst_slot, payload), ad)
                for i, payload in enumerate(rows)]

    def start(self, send: Send, session: Optional[str] = None, blocks: Optional[Blocks] = None,
              push: Optional[zmq.Socket] = None) -> None:
        """Push a send's frames now (on `push`, a fault's socket, when given)."""
        send.t0 = now()
        try:
            msgs = self.frames(send)
            send.blocks, send.nbytes = len(msgs), sum(len(m[5]) for m in msgs)
            for m in msgs:
                (push or self.push).send_multipart(m, copy=False)
        except zmq.ZMQError as exc:
            send.error = str(exc)
