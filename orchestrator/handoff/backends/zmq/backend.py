"""The tcp route in one endpoint process: nothing to bring up (the rows travel as AUX_DATA
frames on the data sockets the endpoints open), so no session to advertise, no first contact
beyond the hello, and no raw call for the bench to compare with."""

from __future__ import annotations

import zmq

from orchestrator.handoff.backends.base import Backend
from orchestrator.handoff.backends.zmq.router import TcpRouter
from orchestrator.handoff.transport.auth import Authenticator


class ZmqBackend(Backend):
    """The send paths of the tcp route (TcpRouter), over the buffers they read rows from."""

    transport = "zmq-tcp"

    def router(self, push: zmq.Socket, auth: Authenticator, prefill_rank: int,
               tag_in_status: bool = True) -> TcpRouter:
        return TcpRouter(self.buffers, auth, prefill_rank, push, tag_in_status=tag_in_status)
