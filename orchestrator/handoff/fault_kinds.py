"""The runner's own acts for a fault (divert_control, strike, resume), without the handoff's
imports (torch, zmq, numpy): the runner calls them. What each fault kind is, the table
FAULTS, is the profile's (orchestrator.profile.fault_table); the hooks inside the endpoints
are in orchestrator.handoff.faults, which re-exports both."""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import replace
from typing import Optional

from orchestrator.handoff.transport.advert import Adverts
from orchestrator.profile.fault_table import FAULTS, Site, acts_at
from orchestrator.profile.kinds import FaultKind


def resume(pid: int) -> None:
    """SIGCONT a process a stop fault may still hold; one already gone is fine."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def silent_listener(host: str) -> socket.socket:
    """A socket that completes TCP handshakes (kernel backlog) and never says a word."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(64)
    return sock


def divert_control(kind: FaultKind, host: str,
                   infos: Adverts) -> tuple[Optional[socket.socket], list[dict]]:
    """silent_control (faults.kind): decode instance 0's control endpoint, as handed to the
    prefills, replaced (in `infos`) by a listener that never answers. Returns the listener and
    the faults applied (none without the fault)."""
    if not acts_at(kind, Site.control):
        return None, []
    silent = silent_listener(host)
    infos[0][0] = replace(infos[0][0], control_endpoint="tcp://%s:%d" % silent.getsockname())
    return silent, [{"fault": kind.value, "control_endpoint": infos[0][0].control_endpoint}]


def strike(kind: str, prefill_pid: Optional[int], decode_pid: Optional[int], duration_s: float) -> bool:
    """A process fault's act (the runner's, when a prefill reached the checkpoint): SIGKILL
    its victim, or SIGSTOP it and SIGCONT it `duration_s` later (a daemon timer: a run that
    ends sooner resumes its processes itself and exits without waiting the rest of
    `duration_s` out). Returns whether the asking prefill lives on to read the runner's answer."""
    traits = FAULTS[FaultKind(kind)]
    pid = prefill_pid if traits.victim == "prefill" else decode_pid
    assert pid is not None, "a decode fault runs where the runner holds the decode (rules: not split)"
    if traits.kills:
        os.kill(pid, signal.SIGKILL)
        return pid != prefill_pid
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(duration_s, resume, (pid,))
    timer.daemon = True
    timer.start()
    return True
