"""FAULTS: what each fault kind is (where it acts, whether it is keyed to request ids, which
route and roles it may run with, whom a process fault strikes and how). The rule book checks a
profile against it; the runner's acts (orchestrator.handoff.fault_kinds) and the hooks inside
the endpoints (orchestrator.handoff.faults) read it too."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from orchestrator.profile.kinds import FaultKind


class Site(Enum):
    """Where a fault acts."""

    send = "send"  # the prefill's send path (FaultyRouter)
    checkpoint = "checkpoint"  # the runner signals a process at a handoff count (LoopFaults, strike)
    control = "control"  # the runner hands out a control endpoint that never answers
    session = "session"  # the decode advertises an engine session that never answers
    decode_rows = "decode_rows"  # the decode's rows at start-up (decode_setup)


@dataclass(frozen=True)
class Traits:
    """One fault kind's properties (FAULTS)."""

    sites: frozenset[Site] = frozenset()
    # alters each request it hits (at_request, every) in a send of its own; their records name it
    # (status_first hits requests too, but delays the usual sends of one TP rank, unnamed)
    per_request: bool = False
    engine_only: bool = False  # needs the engine route
    split: bool = False  # may run with role=prefill or role=decode (acts on one side only)
    victim: Optional[str] = None  # a process fault: "prefill" (rank 0) or "decode" (instance 0)
    kills: bool = False  # a process fault: SIGKILL (else SIGSTOP for faults.duration_s)


def _t(*sites: Site, **kw: Any) -> Traits:
    return Traits(frozenset(sites), **kw)


FAULTS: dict[FaultKind, Traits] = {
    FaultKind.none: _t(split=True),
    FaultKind.decode_killed: _t(Site.checkpoint, victim="decode", kills=True),
    FaultKind.decode_stopped: _t(Site.checkpoint, victim="decode"),
    FaultKind.prefill_killed: _t(Site.checkpoint, victim="prefill", kills=True, split=True),
    FaultKind.prefill_stopped: _t(Site.checkpoint, victim="prefill", split=True),
    FaultKind.silent_control: _t(Site.control),
    FaultKind.silent_peer: _t(Site.session, engine_only=True),
    FaultKind.bad_destination: _t(Site.send, per_request=True, engine_only=True, split=True),
    FaultKind.wrong_session: _t(Site.send, per_request=True, engine_only=True, split=True),
    FaultKind.stale_room: _t(Site.send, Site.decode_rows, per_request=True, engine_only=True),
    FaultKind.corrupt_byte: _t(Site.send, per_request=True, split=True),
    FaultKind.status_first: _t(Site.send),
    FaultKind.aux_lost: _t(Site.send, per_request=True, split=True),
}


def acts_at(kind: FaultKind, site: Site) -> bool:
    """Whether a fault of this kind acts at this site (FAULTS)."""
    return site in FAULTS[kind].sites
