"""Mooncake's send_probe, one implementation: towards a peer's handshake port (which Mooncake
binds on every interface), feature-detected (a wheel without send_probe answers None), and on
a watchdog where the caller needs one (a handshake with a peer that accepts and never answers
blocks ~60 s and ignores Mooncake's timeout variables)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional


def send_probe(engine: Any, session: str) -> Optional[int]:
    """Mooncake's send_probe towards `session` (host:port; `engine` is a TransferEngine): its
    return code, or None where the installed wheel has no send_probe."""
    probe = getattr(engine, "send_probe", None)
    return None if probe is None else probe(session)


def bounded(work: Callable[[], None], timeout_s: float) -> bool:
    """Run `work` in a daemon thread and wait at most `timeout_s`: whether it returned (one
    that did not is left behind, blocked inside the engine)."""
    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def mooncake_probe(engine: Any, address: str, rpc_port: int, timeout_s: float) -> Optional[str]:
    """send_probe towards `address`:`rpc_port` on a watchdog: None when it answered or when the
    installed wheel has no send_probe, else why not."""
    session = f"{address}:{rpc_port}"
    result: list[Optional[int]] = []
    if not bounded(lambda: result.append(send_probe(engine, session)), timeout_s) or not result:
        return f"Mooncake send_probe to {session} did not answer within {timeout_s:g} s"
    rc = result[0]
    return None if rc in (0, None) else f"Mooncake send_probe to {session} returned {rc}"
