"""Mooncake's RPC port range and a bind probe for it.

Mooncake picks its handshake (RPC) port at random in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT and
SEGFAULTS in initialize when none is free; the engine wrapper and the doctor both ask here
first.
"""

from __future__ import annotations

import errno
import random
import socket
from typing import Mapping

DEFAULT_RPC_PORTS = (15000, 17000)
def rpc_port_range(env: Mapping[str, str]) -> tuple[int, int]:
    """MC_MIN_RPC_PORT..MC_MAX_RPC_PORT (inclusive), defaults 15000..17000.
    Raises ValueError naming the variable when one is not a port number."""
    bounds = []
    for name, default in zip(("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT"), DEFAULT_RPC_PORTS):
        raw = env.get(name)
        if raw is None:
            bounds.append(default)
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a port number") from None
        if not 1 <= value <= 65535:
            raise ValueError(f"{name}={raw!r} is outside 1..65535")
        bounds.append(value)
    return bounds[0], bounds[1]


def port_is_free(host: str, port: int) -> bool:
    """Can a TCP socket bind `port` now? Mooncake binds its RPC port on every interface
    (INADDR_ANY), so the wildcard is tried first, then the declared host (skipped when the
    host is not an address of this machine: the host check reports that)."""
    for addr in dict.fromkeys(("0.0.0.0", host)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((addr, port))
            except OSError as exc:
                if addr == host and exc.errno == errno.EADDRNOTAVAIL:
                    continue
                return False
    return True


def any_free_port(env: Mapping[str, str], host: str, sample: int = 32) -> bool:
    """True when at least one sampled port of the range binds (raises ValueError for a bad range)."""
    lo, hi = rpc_port_range(env)
    if hi < lo:
        raise ValueError(f"MC_MIN_RPC_PORT..MC_MAX_RPC_PORT is empty ({lo}..{hi})")
    ports = range(lo, hi + 1)
    candidates = list(ports) if len(ports) <= sample else random.sample(ports, sample)
    return any(port_is_free(host, p) for p in candidates)
