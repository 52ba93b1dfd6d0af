"""The plan's backend for one endpoint process: the engine route's (mooncake) or the tcp
route's (zmq), behind the interface of orchestrator.handoff.backends.base."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import structlog

from orchestrator.handoff.backends.base import Backend
from orchestrator.handoff.backends.mooncake.backend import MooncakeBackend
from orchestrator.handoff.backends.zmq.backend import ZmqBackend
from orchestrator.handoff.buffers import MetadataBuffers
from orchestrator.handoff.specs import EngineSpec
from orchestrator.profile.plan import Plan, Route


def open_backend(buffers: MetadataBuffers, plan: Plan, engine: EngineSpec, role: str, run_dir: Path,
                 log: structlog.stdlib.BoundLogger, mark: Callable[[str], None]) -> Backend:
    """The backend of `plan.route` over `buffers`, up (the engine route: its engine as `engine`
    says, `mark("engine")` once it is up with the buffers registered)."""
    if plan.route is Route.engine:
        return MooncakeBackend.start(buffers, engine, plan, role, run_dir, log, mark)
    return ZmqBackend(buffers)
