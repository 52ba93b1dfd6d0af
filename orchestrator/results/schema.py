"""results.json's schema: a job's results (JobResults, or DecodeSideResults for role=decode, or
NotRun for a job that did not run), written to and read from results.json here only (`to_json`,
`Results.from_json`, `Results.read`); everyone else reads their attributes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence, TypeVar, Union

from orchestrator.results.records import DecodeResult, RunResult, counter_dict
from orchestrator.results.rundir import RunFiles
from orchestrator.results.stats import LatencyHistogram
from orchestrator.results.transferring import Held

EXIT_OK, EXIT_NOT_VERIFIED, EXIT_REFUSED, EXIT_LOST = 0, 1, 2, 3
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


class RunStatus(Enum):
    """A sweep job's status (summary.csv's `status` column)."""

    ok = "ok"  # every request verified, no error
    failed = "failed"  # ran, but not every request was verified
    interrupted = "interrupted"  # SIGINT/SIGTERM ended it (counts so far)
    error = "error"  # results.json carries an error, or cannot be read
    missing = "missing"  # no results.json: the job crashed before writing one
    not_started = "not started"  # a combination of the sweep whose job never began


def _plain(v: Any) -> Any:
    """A results section as JSON: its own to_json, a dataclass field by field, dicts and lists
    item by item."""
    if hasattr(v, "to_json"):
        return v.to_json()
    if hasattr(v, "__dataclass_fields__"):
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


S = TypeVar("S")


def read_section(cls: type[S], d: Any, **typed: Callable[[Any], Any]) -> S:
    """A section read back from JSON: each field as it is there (absent: None), the `typed`
    ones through their own reader."""
    d = d if isinstance(d, dict) else {}
    return cls(**{f.name: typed[f.name](d.get(f.name)) if f.name in typed else d.get(f.name)
                  for f in fields(cls)})  # type: ignore[arg-type]  # cls: a dataclass


def each(read: Callable[[Any], S]) -> Callable[[Any], dict[str, S]]:
    """A reader of {name: section} from one of a section."""
    return lambda d: {k: read(v) for k, v in (d or {}).items()}


@dataclass(frozen=True)
class Percentiles:
    """p50 / p99 / p999 of a latency in us (None: nothing measured), its mean and max, and
    where asked for (report.percentiles) `percentiles`: {"p50": .., "p90": .., "p99.9": ..}."""

    p50: Optional[float] = None
    p99: Optional[float] = None
    p999: Optional[float] = None
    mean: Optional[float] = None
    max: Optional[float] = None
    percentiles: Optional[dict[str, Optional[float]]] = None

    @classmethod
    def of(cls, h: LatencyHistogram, qs: Sequence[float] = ()) -> "Percentiles":
        return cls(**h.summary(), mean=h.mean, max=h.peak, percentiles=h.chosen(qs) if qs else None)

    @classmethod
    def from_json(cls, d: Any) -> "Percentiles":
        return read_section(cls, d)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"p50": self.p50, "p99": self.p99, "p999": self.p999, "mean": self.mean,
                             "max": self.max}
        if self.percentiles is not None:
            d["percentiles"] = dict(self.percentiles)
        return d

    @property
    def measured(self) -> bool:
        return any(v is not None for v in (self.p50, self.p99, self.p999))


@dataclass
class LatencyUs:
    """results.json `latency_us`: set_buf and send_aux of every send; taken, handoff and e2e
    (from arrival) of verified requests."""

    set_buf: Percentiles = field(default_factory=Percentiles)
    send_aux: Percentiles = field(default_factory=Percentiles)
    taken: Percentiles = field(default_factory=Percentiles)
    handoff: Percentiles = field(default_factory=Percentiles)
    e2e: Percentiles = field(default_factory=Percentiles)

    @classmethod
    def from_json(cls, d: Any) -> "LatencyUs":
        return read_section(cls, d, **{f.name: Percentiles.from_json for f in fields(cls)})


@dataclass
class Workload:
    """results.json `workload`: the shape of the load that ran."""

    concurrency: Optional[int] = None
    rate: Optional[float] = None
    batch_size: Optional[int] = None
    fill: Optional[str] = None
    coalesce: Optional[bool] = None
    status: Optional[str] = None
    duplicate_rooms: Any = None
    seed: Optional[int] = None
    layout: Optional[str] = None
    digest: Optional[str] = None
    in_flight_max: Optional[int] = None  # workload.concurrency x prefill ranks
    decode_rows: Optional[int] = None  # buffers.size x decode ranks
    duration_s: Optional[float] = None  # workload.duration_s (null: a request count ran)
    burstiness: Optional[float] = None  # workload.burstiness (open loop; 1 = Poisson)


@dataclass
class Pair:
    """results.json `pairs` entry: one prefill rank -> decode instance pair."""

    requests: int
    verified: int
    handoff_us: Percentiles
    handoffs_per_s: Optional[float]

    @classmethod
    def from_json(cls, d: Any) -> "Pair":
        return read_section(cls, d, handoff_us=Percentiles.from_json)


@dataclass
class Authenticated:
    """results.json `authenticated`: the run's secret and the messages refused by their MAC."""

    secret: Optional[str] = None
    rejected: Optional[int] = None
    replayed: Optional[int] = None
    hijack_refused: Optional[int] = None


@dataclass
class DecodeCounts:
    """results.json `decode` entry: what one decode process judged and refused."""

    outcomes: dict[str, int]
    details: dict[str, int]
    rejected_auth: int
    dropped_data: int
    dropped_control: int
    unexpected: int
    replayed: int
    hijack_refused: int
    ambiguous: int
    gate_waits: int
    settled: int
    grants: int
    steps: int
    verify_us_per_batch: Percentiles
    batch_mean: Optional[float]
    gate_read_us_per_poll: Percentiles
    stall_us_per_poll: Percentiles
    load: dict  # endpoints.decode_load's summary, as the decode gave it
    tp: dict  # the TP group's own statistics, as the decode gave them
    memory: dict
    error: Optional[str]

    @classmethod
    def of(cls, d: DecodeResult) -> "DecodeCounts":
        r = d.refused
        return cls(counter_dict(d.outcomes), counter_dict(d.details), r.rejected_auth, r.dropped_data,
                   r.dropped_control, r.unexpected, r.replayed, r.hijack_refused, r.ambiguous, d.gate_waits,
                   d.settled, d.grants, d.steps, Percentiles.of(d.verify_us), d.batch.mean,
                   Percentiles.of(d.gate_read_us), Percentiles.of(d.stall_us), d.load, d.tp, d.memory, d.error)

    @classmethod
    def from_json(cls, d: Any) -> "DecodeCounts":
        return read_section(cls, d, **{k: Percentiles.from_json for k in (
            "verify_us_per_batch", "gate_read_us_per_poll", "stall_us_per_poll")})


@dataclass
class DecodeLoad:
    """endpoints.decode_load's forward loop on a decode: steps/s idle and while serving."""

    step_ms: Optional[float] = None
    matmuls_per_step: Optional[int] = None
    step_ms_measured: Optional[float] = None
    forward_steps_per_s_idle: Optional[float] = None
    forward_steps_per_s_serving: Optional[float] = None
    serving_over_idle: Optional[float] = None


def _loads(v: Any) -> Union[None, DecodeLoad, list[DecodeLoad]]:
    if v is None:
        return None
    return [read_section(DecodeLoad, x) for x in v] if isinstance(v, list) else read_section(DecodeLoad, v)


@dataclass
class DecodeGate:
    """results.json `decode_gate`: what the readiness gate's reads cost the decode loop, and
    the forward loop's steps/s (one DecodeLoad, a list for several decodes, or None)."""

    read: Optional[str] = None
    gate_read_us_per_poll: Percentiles = field(default_factory=Percentiles)
    stall_us_per_poll: Percentiles = field(default_factory=Percentiles)
    polls: Optional[int] = None
    load: Any = None

    @property
    def one_load(self) -> Optional[DecodeLoad]:
        """The forward loop of the run's one loaded decode (None: none, or several)."""
        return self.load if isinstance(self.load, DecodeLoad) else None

    @classmethod
    def from_json(cls, d: Any) -> "DecodeGate":
        return read_section(cls, d, gate_read_us_per_poll=Percentiles.from_json,
                            stall_us_per_poll=Percentiles.from_json, load=_loads)


@dataclass
class TpGate:
    readiness: bool
    zero_room_on_free: bool
    settle_ms: float


@dataclass
class TpRank:
    """One TP rank's verdicts and what it would have taken without the gate."""

    outcomes: dict[str, int]
    details: dict[str, int]
    taken_unready: Optional[int]
    taken_wrong_room: Optional[int]
    gate_waits: Optional[int]


@dataclass
class TpSummary:
    """results.json `tp` (decode_tp > 1): where the ranks disagreed before agreeing, what a
    decode without this tool's digest would have taken silently, what hung, and what the
    agreement cost."""

    ranks: int
    gate: TpGate
    steps: int
    steps_disagreed: int
    requests_disagreed: int
    silent_corruptions: int
    taken_unready: int
    taken_wrong_room: int
    hung: int
    torn: int  # the right room, a torn row: only the digest catches these
    settled: int  # held by gate.settle_ms until whole
    per_rank: dict[str, TpRank]
    allreduce_us_mean: Optional[float]
    allreduce_us: dict

    @classmethod
    def from_json(cls, d: Any) -> Optional["TpSummary"]:
        if d is None:
            return None
        return read_section(cls, d, gate=lambda g: read_section(TpGate, g),
                            per_rank=each(lambda r: read_section(TpRank, r)))


@dataclass
class PlanInfo:
    """results.json `plan` (orchestrator.profile.plan.Plan.as_dict()), kept whole; what readers use,
    by name."""

    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return self.data

    mem_pool = property(lambda self: self.data.get("mem_pool"))
    buffer_device = property(lambda self: self.data.get("buffer_device"))
    route = property(lambda self: self.data.get("route"))
    route_reason = property(lambda self: self.data.get("route_reason"))
    declared_transport = property(lambda self: self.data.get("declared_transport"))
    gpu_sharing = property(lambda self: self.data.get("gpu_sharing") or {})  # GpuSharing.as_dict()

    @property
    def events(self) -> list[dict]:
        return self.data.get("events") or []


@dataclass
class Timing:
    """The handoff phase's rate and the start-up before it (top-level keys of results.json)."""

    startup_s: Optional[float] = None
    startup_by_process: dict[str, float] = field(default_factory=dict)  # s from spawn to its engine up
    wall_s: Optional[float] = None  # the handoff phase: first arrival to the last verdict
    handoffs_per_s: Optional[float] = None
    mb_per_s: Optional[float] = None
    bytes_per_request: Optional[int] = None
    sends: Optional[int] = None
    blocks_per_send: Optional[float] = None
    offered_per_s: Optional[float] = None  # open loop: workload.rate x prefill ranks
    requests_per_send: Optional[float] = None  # request rows per send call (per decode TP rank)
    # per process, its start-up phase by phase (s): interpreter, imports, buffers, engine,
    # warm-up, waiting, bootstrap (orchestrator.job.warmstart); "forkserver": how long the
    # children's start waited for the forkserver's imports (imports_left: what the parent's own
    # start-up had not already covered)
    startup_phases: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Transports:
    """What carried the handoffs (top-level keys of results.json)."""

    effective_transport: Optional[str] = None
    declared_transport: Optional[str] = None
    endpoint_transports: dict[str, str] = field(default_factory=dict)
    engine_listeners_beyond_loopback: list[str] = field(default_factory=list)
    gpu_sharing: dict = field(default_factory=dict)  # the processes on each GPU, and whether MPS was on


@dataclass
class Ending:
    """What was done to the run and how it ended (top-level keys of results.json, but for
    `recorded_exit`: the exit code results.json holds, where it is not the one computed)."""

    faults_applied: list[dict] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)  # process -> why it was lost
    interrupted: bool = False
    signal: Optional[str] = None  # "SIGINT" / "SIGTERM"
    slow_to_stop: list[str] = field(default_factory=list)
    engine_log: Optional[str] = None
    warnings: list[str] = field(default_factory=list)
    recorded_exit: Optional[int] = None

    @classmethod
    def of(cls, out: RunResult) -> "Ending":
        return cls(out.faults_applied, out.lost, out.interrupted is not None, out.interrupted,
                   out.slow_to_stop, out.engine_log, list(out.warnings))


@dataclass
class Agreement:
    """The decode's side of the count (top-level keys): its own verified against the prefill's,
    requests a decode verified (its verdicts file, decode_verified) that their prefill had
    already failed (requests.jsonl, verified): the verdict came after the prefill gave up on
    the decode. verified + verified_after_lost = decode_verified; the ids (first 100) name them."""

    decode_verified: int = 0
    verified_after_lost: int = 0
    verified_after_lost_ids: list[int] = field(default_factory=list)
    # slot-seconds the decode's slots were held by rows that failed room_never_landed or
    # written_by_someone_else (grant to verdict, summed; gate.never_landed_s bounds the first)
    slots_held_by_failed_s: dict[str, float] = field(default_factory=dict)


@dataclass
class Origin:
    """Which side wrote the results and where (top-level keys, set by orchestrator.job.app)."""

    role: Optional[str] = None
    run_dir: Optional[str] = None


@dataclass
class Failures:
    """Why requests were not verified (top-level keys): how many for each reason, and what
    SGLang 0.5.23's decode would hold in Transferring for ever of them (None: nothing)."""

    failure_reasons: dict[str, int] = field(default_factory=dict)
    sglang_0_5_23: Optional[Held] = None


@dataclass
class Latency:
    """Where the handoffs' time went (top-level keys): each latency's percentiles, the clock
    they were taken on ("one_way", or "round_trip" when a decode's clock is not the prefill
    host's), and the handoff's stages' percentiles (records.STAGES)."""

    latency_us: LatencyUs = field(default_factory=LatencyUs)
    latency_clock: Optional[str] = None
    handoff_stages_us: dict[str, Percentiles] = field(default_factory=dict)


@dataclass
class DecodeAccount:
    """The decodes' own account (top-level keys): each decode process's counts, what the
    readiness gate's reads cost the decode loop, and the TP group's (decode_tp > 1)."""

    decode: dict[str, DecodeCounts] = field(default_factory=dict)
    decode_gate: DecodeGate = field(default_factory=DecodeGate)
    tp: Optional[TpSummary] = None


_GROUPS = (Timing, Transports, Ending, Agreement, Origin, Failures, Latency, DecodeAccount)


class Results:
    """What a job's results.json holds: JobResults (a run), DecodeSideResults (role=decode) or
    NotRun (refused, or ended before a run). Written with to_json, read with from_json."""

    # What every kind has (each subclass is a dataclass and declares them as its own)
    __dataclass_fields__: ClassVar[dict[str, Any]]
    requests: int
    verified: int
    corrupted: int
    failed: int
    not_started: int
    routes: Optional[dict[str, int]]
    error: Optional[str]
    if TYPE_CHECKING:  # JobResults and DecodeSideResults: class attribute / field; NotRun: properties
        @property
        def ORDER(self) -> tuple[str, ...]: ...  # results.json's keys, in order

        @property
        def ending(self) -> Ending: ...

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"exit_code": self.exit_code}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, _GROUPS):
                d.update((g.name, _plain(getattr(v, g.name))) for g in fields(v))
            else:
                d[f.name] = _plain(v)
        return {k: d[k] for k in self.ORDER if k in d and (k not in ("role", "run_dir") or d[k] is not None)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Results":
        if d.get("role") == "decode":
            return DecodeSideResults.from_json(d)
        if "refused" in d or "plan" not in d:
            return NotRun.from_json(d)
        return JobResults.from_json(d)

    @staticmethod
    def read(run_dir: Path) -> "Results":
        """A run dir's results.json (OSError, ValueError when it cannot be read)."""
        d = json.loads(RunFiles(run_dir).results.read_text())
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return Results.from_json(d)

    @property
    def exit_code(self) -> int:
        """orchestrator.results.reporting's exit codes: the signal's, lost (3), not verified (1) or 0."""
        e = self.ending
        if e.recorded_exit is not None:
            return e.recorded_exit
        if e.signal:
            return EXIT_SIGNAL.get(e.signal, 130)
        if self.error or e.lost:
            return EXIT_LOST
        if self.requests == 0 and isinstance(self, JobResults):  # nothing handed off: nothing verified
            return EXIT_NOT_VERIFIED
        if self.verified != (self.requests or 0) - (self.not_started or 0):
            return EXIT_NOT_VERIFIED
        return EXIT_OK

    @property
    def status(self) -> RunStatus:
        if self.ending.interrupted:
            return RunStatus.interrupted
        if self.error is not None:
            return RunStatus.error
        return RunStatus.ok if self.requests and self.verified == self.requests else RunStatus.failed

    def headline(self) -> dict[str, Any]:
        """What the job's "results" log line carries (a job that ran)."""
        assert isinstance(self, (JobResults, DecodeSideResults))
        return {"requests": self.requests, "verified": self.verified, "corrupted": self.corrupted,
                "failed": self.failed, "routes": self.routes,
                "effective_transport": self.transports.effective_transport, "exit_code": self.exit_code}

    def failed_writing(self, error: str) -> None:
        """The disk filled writing the run's outputs: exit 3, the error says where."""
        self.error, self.ending.recorded_exit = error, EXIT_LOST


def _groups(d: dict) -> dict[str, Any]:
    return {"timing": read_section(Timing, d), "transports": read_section(Transports, d),
            "ending": read_section(Ending, {**d, "recorded_exit": d.get("exit_code")})}


@dataclass
class JobResults(Results):
    """A run's results (role=both or prefill): every prefill rank's verdicts, merged."""

    requests: int
    verified: int
    corrupted: int
    failed: int
    not_started: int  # never arrived: an interrupt came first (no requests.jsonl line)
    routes: dict[str, int]
    failures: Failures
    latency: Latency
    timing: Timing
    workload: Workload
    transports: Transports
    pairs: dict[str, Pair]
    authenticated: Authenticated
    decodes: DecodeAccount
    agreement: Agreement
    memory_kb: dict[str, dict]
    ending: Ending
    plan: PlanInfo
    error: Optional[str]
    origin: Origin = field(default_factory=Origin)

    # the sections' fields, read by their results.json names (as DecodeSideResults' own)
    @property
    def failure_reasons(self) -> dict[str, int]:
        return self.failures.failure_reasons

    @property
    def sglang_0_5_23(self) -> Optional[Held]:
        return self.failures.sglang_0_5_23

    @property
    def latency_us(self) -> LatencyUs:
        return self.latency.latency_us

    @property
    def latency_clock(self) -> Optional[str]:
        return self.latency.latency_clock

    @property
    def handoff_stages_us(self) -> dict[str, Percentiles]:
        return self.latency.handoff_stages_us

    @property
    def decode(self) -> dict[str, DecodeCounts]:
        return self.decodes.decode

    @property
    def decode_gate(self) -> DecodeGate:
        return self.decodes.decode_gate

    @property
    def tp(self) -> Optional[TpSummary]:
        return self.decodes.tp

    @property
    def decode_verified(self) -> int:
        return self.agreement.decode_verified

    @property
    def verified_after_lost(self) -> int:
        return self.agreement.verified_after_lost

    @property
    def verified_after_lost_ids(self) -> list[int]:
        return self.agreement.verified_after_lost_ids

    @property
    def slots_held_by_failed_s(self) -> dict[str, float]:
        return self.agreement.slots_held_by_failed_s

    @property
    def role(self) -> Optional[str]:
        return self.origin.role

    @role.setter
    def role(self, value: Optional[str]) -> None:
        self.origin.role = value

    @property
    def run_dir(self) -> Optional[str]:
        return self.origin.run_dir

    @run_dir.setter
    def run_dir(self, value: Optional[str]) -> None:
        self.origin.run_dir = value

    ORDER = ("requests", "verified", "corrupted", "failed", "not_started", "routes", "failure_reasons",
             "sglang_0_5_23", "latency_us", "latency_clock", "handoff_stages_us", "handoffs_per_s", "mb_per_s",
             "bytes_per_request", "sends", "blocks_per_send", "startup_s", "startup_by_process", "startup_phases",
             "wall_s", "workload", "effective_transport", "declared_transport", "endpoint_transports", "gpu_sharing",
             "pairs", "authenticated", "decode", "decode_verified", "verified_after_lost", "verified_after_lost_ids",
             "slots_held_by_failed_s",
             "memory_kb", "faults_applied",
             "engine_listeners_beyond_loopback", "lost", "interrupted", "signal", "slow_to_stop",
             "engine_log", "plan", "error", "tp", "decode_gate", "offered_per_s", "requests_per_send",
             "warnings", "exit_code", "role", "run_dir")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobResults":
        flat = {f.name: d.get(f.name) for f in fields(cls)}
        return cls(**{**flat, **_groups(d), "agreement": read_section(Agreement, d),
                      "origin": read_section(Origin, d),
                      "failures": read_section(Failures, d,
                                               sglang_0_5_23=lambda h: read_section(Held, h) if h else None),
                      "latency": read_section(Latency, d, latency_us=LatencyUs.from_json,
                                              handoff_stages_us=each(Percentiles.from_json)),
                      "workload": read_section(Workload, d.get("workload")),
                      "pairs": each(Pair.from_json)(d.get("pairs")),
                      "authenticated": read_section(Authenticated, d.get("authenticated")),
                      "decodes": read_section(DecodeAccount, d, decode=each(DecodeCounts.from_json),
                                              decode_gate=DecodeGate.from_json, tp=TpSummary.from_json),
                      "plan": PlanInfo(d.get("plan") or {})})


@dataclass
class DecodeSideResults(Results):
    """role=decode: what this side judged (the whole run's verdicts are the prefill side's)."""

    bootstrap: Optional[str]  # the address a prefill side looks up
    prefills_seen: list[int]
    requests: int  # judged
    verified: int
    corrupted: int
    failed: int
    failure_reasons: dict[str, int]
    decode: dict[str, DecodeCounts]
    timing: Timing  # start-up only
    transports: Transports
    ending: Ending
    plan: PlanInfo
    error: Optional[str]
    tp: Optional[TpSummary]
    role: str = "decode"
    run_dir: Optional[str] = None
    not_started = 0  # a decode side counts what it judged
    routes = None

    ORDER = ("role", "bootstrap", "prefills_seen", "requests", "verified", "corrupted", "failed",
             "failure_reasons", "decode", "startup_s", "startup_phases", "effective_transport", "declared_transport",
             "endpoint_transports", "gpu_sharing", "engine_listeners_beyond_loopback", "lost", "interrupted", "signal",
             "engine_log", "plan", "error", "tp", "warnings", "exit_code", "run_dir")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DecodeSideResults":
        flat = {f.name: d.get(f.name) for f in fields(cls)}
        return cls(**{**flat, **_groups(d), "decode": each(DecodeCounts.from_json)(d.get("decode")),
                      "plan": PlanInfo(d.get("plan") or {}), "tp": TpSummary.from_json(d.get("tp"))})


@dataclass
class NotRun(Results):
    """A job that did not run: a profile refused before start (`refused`, `key`), a full disk
    (exit 3), a sweep job that raised (`routes` empty), or a run dir in use (not written)."""

    code: Optional[int]  # its exit code (a file without one: lost, 3)
    error: Optional[str]
    refused: Optional[str] = None
    key: Optional[str] = None
    routes: Optional[dict] = None
    requests: int = 0
    verified: int = 0
    corrupted: int = 0
    failed: int = 0
    not_started = 0

    @property
    def ORDER(self) -> tuple[str, ...]:
        counts = ("requests", "verified", "corrupted", "failed")
        if self.refused is not None:
            return ("refused", "key", "exit_code", *counts, "error")
        return (*counts, *(("routes",) if self.routes is not None else ()), "error", "exit_code")

    @property
    def exit_code(self) -> int:
        return EXIT_LOST if self.code is None else self.code

    @property
    def ending(self) -> Ending:
        return Ending()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "NotRun":
        kw: dict[str, Any] = {f.name: d.get(f.name) for f in fields(cls) if f.name != "code"}
        return cls(**kw, code=d.get("exit_code"))
