"""Faults injected on purpose (faults.kind), so a user can see how a run ends when a peer
dies, stalls, lies or corrupts. Which side acts on which fault is decided here; the endpoints
and the runner only ask. Nothing here runs unless a fault is configured."""

from __future__ import annotations

import socket
from typing import Optional

from .config import ConfigError, FaultKind, FaultsConfig
from .plan import Plan, Route

PER_REQUEST = {FaultKind.bad_destination, FaultKind.wrong_session, FaultKind.stale_room,
               FaultKind.corrupt_byte}
ENGINE_ONLY = {FaultKind.bad_destination, FaultKind.wrong_session, FaultKind.stale_room,
               FaultKind.silent_peer}
PROCESS = {FaultKind.decode_killed, FaultKind.decode_stopped}
UNSERVED_SESSION = "127.0.0.1:9"  # the discard port: nothing speaks Mooncake there
BAD_OFFSET = 1 << 40  # far outside any registration


def check(faults: FaultsConfig, plan: Plan) -> None:
    if faults.kind in ENGINE_ONLY and plan.route is not Route.engine:
        raise ConfigError("faults.kind", faults.kind.value,
                          "decode_killed, decode_stopped, silent_control or corrupt_byte with the "
                          "tcp route (the others need the engine route)")


class FaultInjector:
    def __init__(self, faults: FaultsConfig):
        self.kind = faults.kind
        self.at, self.every = faults.at_request, faults.every

    def for_request(self, rid: int) -> Optional[FaultKind]:
        """The per-request fault that hits request `rid`, if any."""
        if self.kind in PER_REQUEST and rid >= self.at and (rid - self.at) % self.every == 0:
            return self.kind
        return None

    @property
    def keep_stale_rooms(self) -> bool:
        """decode side of stale_room: do not zero a freed slot's room (the old SGLang bug)."""
        return self.kind is FaultKind.stale_room


def silent_listener(host: str) -> socket.socket:
    """A socket that completes TCP handshakes (kernel backlog) and never says a word."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock
