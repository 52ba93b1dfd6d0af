"""What a run's report reads of the config: `ReportSpec`, frozen, built once by the job from
the checked config (orchestrator.job.specs.build_specs) and read by the report (results.json and the
summary: orchestrator.results.reporting), the run's other outputs (its log, progress line and
latency.png: orchestrator.results.outputs) and the accounting of a rank that could not report
(orchestrator.job.recovery). It holds the values read, never a config section: what the
report depends on is this file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from orchestrator.profile.kinds import DigestKind, FaultKind, FillMode, GateRead, Role, StatusMode
from orchestrator.results.schema import PlanInfo


@dataclass(frozen=True)
class ReportLoad:
    """workload: the load each prefill rank offered."""

    requests: int  # workload.requests, per prefill rank
    concurrency: int
    rate: Optional[float]
    batch_size: int
    fill: FillMode
    duplicate_rooms: int
    seed: Optional[int]  # as configured (a run resolves a null one before its spec is built)
    duration_s: Optional[float]
    burstiness: float

    @property
    def room_seed(self) -> int:
        """The seed rooms derive from (orchestrator.handoff.workload.seed_of: null is 0)."""
        return 0 if self.seed is None else self.seed


@dataclass(frozen=True)
class ReportRanks:
    """endpoints: the processes of each side."""

    prefill: int  # endpoints.prefill_ranks
    decode: int  # endpoints.decode_ranks
    decode_tp: int  # endpoints.decode_tp


@dataclass(frozen=True)
class ReportRows:
    """buffers, layout and verify: one process's rows, as the profile lays them out."""

    slots: int  # buffers.size
    row_bytes: int  # one request's row, every field (orchestrator.profile.layout.profile_layout)
    blocks: int  # the fields of a row: the blocks of one request's write to one decode rank
    layout: str  # layout.name
    digest: DigestKind  # verify.digest


@dataclass(frozen=True)
class ReportSend:
    """transport: how the prefill sends."""

    coalesce: bool
    status: StatusMode
    max_inflight_blocks: int
    secret_env: Optional[str]


@dataclass(frozen=True)
class ReportGate:
    """gate: the decode's readiness gate."""

    read: GateRead
    readiness: bool
    zero_room_on_free: bool
    settle_ms: float


@dataclass(frozen=True)
class ReportConsole:
    """logging: what the console shows of a run."""

    console: bool  # logging.console: the structured log lines too
    progress: Optional[bool]  # logging.progress (null: a live line on a terminal)
    progress_every_s: float  # logging.progress_every_s


@dataclass(frozen=True)
class ReportSpec:
    """Everything the report reads of one run's config (see the module's docstring)."""

    role: Role
    plan: PlanInfo  # the run's plan as its log, fingerprint.json and results.json show it (Plan.as_dict)
    load: ReportLoad
    ranks: ReportRanks
    rows: ReportRows
    send: ReportSend
    gate: ReportGate
    fault: FaultKind  # faults.kind
    fault_at: int  # faults.at_request
    fault_every: int  # faults.every
    percentiles: tuple[float, ...]  # report.percentiles
    console: ReportConsole
