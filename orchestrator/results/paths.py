"""What a driver in a prefill process measured on one route (the bench's: sweep.bench.BenchDriver),
sent back to the runner in protocol.Result (RunResult.paths), then reported in bench.json
(sweep.bench.PathReport): per handoff phase (PhaseResult), our sends against raw Mooncake
writes, and one large block (Bulk). PrefillResult: what a prefill rank's driver returns, this
or (the default driver's) its RankResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from orchestrator.results.records import RankResult
from orchestrator.results.schema import Percentiles, read_section


@dataclass
class PhaseResult:
    """One handoff phase of a route: its rate, latencies and stage medians."""

    name: str
    requests: int
    verified: int
    batch_size: int
    concurrency: int
    handoffs_per_s: Optional[float]
    handoff_us: Percentiles  # forward step done -> verdict (the digest checked) on the decode
    taken_us: Percentiles  # forward step done -> taken (status in, readiness gate passed) on the decode
    set_buf_us: Percentiles
    send_us: Percentiles
    requests_per_send: Optional[float]
    stages_p50_us: dict[str, Optional[float]]  # STAGES -> p50 us

    @classmethod
    def from_json(cls, d: Any) -> "PhaseResult":
        return read_section(cls, d, **{k: Percentiles.from_json for k in
                                       ("handoff_us", "taken_us", "set_buf_us", "send_us")})


@dataclass(frozen=True)
class Bulk:
    """One large block written back to back (bandwidth)."""

    bytes: int
    median_s: float
    gb_per_s: float


@dataclass
class PathResult:
    """Everything a driver measured on one route (RunResult.paths)."""

    path: str
    transport: str = ""
    row_bytes: int = 0
    blocks: int = 0
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    ours_us: list[float] = field(default_factory=list)
    raw_us: list[float] = field(default_factory=list)
    raw_run_us: list[float] = field(default_factory=list)  # one B-slot run per write
    bulk: Optional[Bulk] = None
    error: Optional[str] = None


PrefillResult = Union[RankResult, PathResult]  # what a prefill rank's driver returns (protocol.Result)
