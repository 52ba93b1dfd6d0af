"""Typed results: what a prefill rank measured (RankResult), what a decode process judged
(DecodeResult), and one run (RunResult: both, keyed by process name, the same shape for one
rank or many; a driver's own result, the bench's, apart). Endpoints fill them in; the
runner merges them; orchestrator.reporting turns a RunResult into a job's results (JobResults,
or DecodeSideResults for role=decode, or NotRun for a job that did not run), which are
written to and read from results.json here only (`to_json`, `Results.from_json`,
`Results.read`); everyone else reads their attributes. Times are CLOCK_MONOTONIC seconds of
the process that took them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, Optional

from .outcomes import Detail, Outcome
from .rundir import RunFiles
from .stats import LatencyHistogram

LATENCIES = ("set_buf_us", "send_us", "taken_us", "handoff_us", "e2e_us")
# Where a handoff's time goes (forward step done -> verified), in order; they add up to it.
STAGES = ("fill_digest", "write", "status_out", "to_decode", "judge")
RECORD_FIELDS = ("rid", "room", "decode", "dst_slot", "route", "set_buf_us", "send_us",
                 "handoff_us", "e2e_us", "outcome", "detail", "checksum", "fault", "taken_us")


# Failures a prefill gives itself (no decode judged them): the phase's end is the last
# verdict a decode gave, so a rate is not stretched by a wait for a peer already gone.
LOCAL_FAILURES = frozenset({Detail.peer_lost, Detail.not_sent_peer_lost, Detail.prefill_lost,
                            Detail.decode_lost, Detail.interrupted, Detail.not_sent_interrupted,
                            Detail.run_error})


def _j(v: Optional[float]) -> str:
    return "null" if v is None else repr(v)


@dataclass(slots=True)
class Record:
    """One request as its prefill rank saw it end (a line of requests.jsonl)."""

    rid: int
    room: int
    decode: int  # decode instance
    dst_slot: int
    route: str
    set_buf_us: Optional[float]
    send_us: Optional[float]
    handoff_us: Optional[float]  # forward step done -> decode verified it
    e2e_us: Optional[float]  # arrival -> decode verified it
    outcome: Outcome
    detail: Detail
    checksum: str  # content fingerprint (public digest columns)
    fault: Optional[str] = None
    # forward step done -> the decode took it (status in, readiness gate passed: where
    # SGLang's decode starts decoding); handoff_us runs on to the digest's verdict
    taken_us: Optional[float] = None
    t_verdict: Optional[float] = None  # not written: the prefill's clock at the verdict

    def line(self) -> str:
        """The requests.jsonl line (formatted directly: this runs once per request)."""
        return (f'{{"rid": {self.rid}, "room": {self.room}, "decode": {self.decode}, '
                f'"dst_slot": {self.dst_slot}, "route": "{self.route}", "set_buf_us": {_j(self.set_buf_us)}, '
                f'"send_us": {_j(self.send_us)}, "handoff_us": {_j(self.handoff_us)}, '
                f'"e2e_us": {_j(self.e2e_us)}, "outcome": "{self.outcome.value}", '
                f'"detail": "{self.detail.value}", "checksum": "{self.checksum}", '
                f'"fault": {json.dumps(self.fault)}, "taken_us": {_j(self.taken_us)}}}')

    @classmethod
    def from_line(cls, text: str) -> "Record":
        d = json.loads(text)
        d["outcome"], d["detail"] = Outcome(d["outcome"]), Detail(d["detail"])
        return cls(**{k: d.get(k) for k in RECORD_FIELDS})


@dataclass
class PairStats:
    """One prefill rank -> decode instance pair, measured on its own verdict times."""

    outcomes: Counter = field(default_factory=Counter)
    handoff_us: LatencyHistogram = field(default_factory=LatencyHistogram)
    first_verdict: Optional[float] = None
    last_verdict: Optional[float] = None

    def add(self, rec: Record) -> None:
        self.outcomes[rec.outcome] += 1
        if rec.outcome is Outcome.verified:
            if rec.handoff_us is not None:
                self.handoff_us.add(rec.handoff_us)
            t = rec.t_verdict
            if t is not None:
                self.first_verdict = t if self.first_verdict is None else min(self.first_verdict, t)
                self.last_verdict = t if self.last_verdict is None else max(self.last_verdict, t)

    @property
    def verified(self) -> int:
        return self.outcomes[Outcome.verified]

    @property
    def rate(self) -> Optional[float]:
        """Verified handoffs per second between this pair's own first and last verdict."""
        n, first, last = self.verified, self.first_verdict, self.last_verdict
        if n < 2 or not last or first is None or last <= first:  # (first is set with last)
            return None
        return (n - 1) / (last - first)


@dataclass
class RankResult:
    """What one prefill rank measured in one phase."""

    rank: int
    requests: int
    outcomes: Counter = field(default_factory=Counter)  # Outcome -> count
    details: Counter = field(default_factory=Counter)  # Detail -> count (not verified)
    routes: Counter = field(default_factory=Counter)
    latency: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {k: LatencyHistogram() for k in LATENCIES})
    pairs: dict[int, PairStats] = field(default_factory=dict)
    stages: dict[str, LatencyHistogram] = field(
        default_factory=lambda: {k: LatencyHistogram() for k in STAGES})
    t_start: Optional[float] = None  # first arrival of the phase
    t_last: Optional[float] = None  # last verdict
    sends: int = 0  # send calls (batch writes, or sets of AUX_DATA frames)
    send_blocks: int = 0
    row_bytes: int = 0
    clock: str = "one_way"  # "round_trip" when decode's clock is not this host's
    rejected: int = 0  # messages dropped: bad MAC or malformed
    replayed: int = 0  # authentic, but a replay or for a request not in the state it needs
    memory: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    not_started: int = 0  # never arrived (an interrupt came first): no record, not failed
    error: Optional[str] = None
    lost: dict[int, str] = field(default_factory=dict)  # decode instance -> why it was declared lost

    def add(self, rec: Record) -> None:
        self.outcomes[rec.outcome] += 1
        if rec.route:
            self.routes[rec.route] += 1
        if rec.outcome is not Outcome.verified:
            self.details[rec.detail] += 1
        for key in LATENCIES:
            value = getattr(rec, key)
            if value is not None and (key in ("set_buf_us", "send_us") or rec.outcome is Outcome.verified):
                self.latency[key].add(value)
        self.pairs.setdefault(rec.decode, PairStats()).add(rec)
        if rec.t_verdict is not None and rec.detail not in LOCAL_FAILURES:
            self.t_last = rec.t_verdict if self.t_last is None else max(self.t_last, rec.t_verdict)

    def add_stages(self, *times: float) -> None:
        """One verified request's stage times (all on one clock): step start, row ready,
        write landed, status out, status read by the decode, verified."""
        for name, a, b in zip(STAGES, times, times[1:]):
            if a and b:
                self.stages[name].add(max(0.0, (b - a) * 1e6))

    @property
    def finished(self) -> int:
        return sum(self.outcomes.values())

    @property
    def verified(self) -> int:
        return self.outcomes[Outcome.verified]

    @property
    def wall_s(self) -> Optional[float]:
        """The handoff phase: first arrival to last verdict (start-up excluded)."""
        if self.t_start is None or self.t_last is None or self.t_last <= self.t_start:
            return None
        return self.t_last - self.t_start


@dataclass
class DecodeResult:
    """What one decode process judged, and what it refused to act on."""

    name: str
    outcomes: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)
    tp_rank: int = 0  # its rank in its decode instance's TP group (0: the one that gives verdicts)
    rejected_auth: int = 0  # messages without a valid MAC
    dropped_data: int = 0  # malformed data-plane messages
    dropped_control: int = 0  # malformed control messages
    unexpected: int = 0  # well-formed, authentic, but for no grant of ours
    replayed: int = 0  # authentic, this run's, seen before: a replay (no effect)
    hijack_refused: int = 0  # a hello for a prefill rank already bound to a connection
    ambiguous: int = 0  # a bare SGLang status whose room matches several grants
    gate_waits: int = 0  # "done" seen before the room landed (re-checked later)
    settled: int = 0  # held by the gate with the right room and a torn row (gate.settle_ms)
    grants: int = 0
    steps: int = 0
    verify_us: LatencyHistogram = field(default_factory=LatencyHistogram)  # per judged batch
    batch: LatencyHistogram = field(default_factory=LatencyHistogram)  # requests per judged batch
    gate_read_us: LatencyHistogram = field(default_factory=LatencyHistogram)  # the gate's room reads, per poll
    stall_us: LatencyHistogram = field(default_factory=LatencyHistogram)  # the loop blocked on the device, per poll
    load: dict[str, Any] = field(default_factory=dict)  # endpoints.decode_load: forward steps/s
    tp: dict[str, Any] = field(default_factory=dict)  # TP group statistics (decode_tp > 1)
    memory: dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None

    @property
    def judged(self) -> int:
        return sum(self.outcomes.values())


@dataclass
class RunResult:
    """One run: every prefill rank's result and every decode process's, keyed by name."""

    ranks: dict[str, RankResult] = field(default_factory=dict)
    paths: dict[str, Any] = field(default_factory=dict)  # a driver's own result (the bench's PathResult)
    decodes: dict[str, DecodeResult] = field(default_factory=dict)
    transports: dict[str, str] = field(default_factory=dict)
    startup_s: Optional[float] = None
    faults_applied: list[dict] = field(default_factory=list)
    engine_exposed: list[str] = field(default_factory=list)
    lost: dict[str, str] = field(default_factory=dict)  # process -> why it was lost
    error: Optional[str] = None  # the run could not start, or an endpoint failed
    engine_log: Optional[str] = None  # the last line an engine printed before a failure
    interrupted: Optional[str] = None  # "SIGINT" / "SIGTERM"
    bootstrap: Optional[str] = None  # role=decode: the address a prefill side looks up
    prefills_seen: list[int] = field(default_factory=list)  # role=decode: ranks that said bye
    run_dir: str = ""
    startup_by_process: dict[str, float] = field(default_factory=dict)  # s from spawn to its engine up
    t_phase: Optional[float] = None  # the handoff phase began (this host's CLOCK_MONOTONIC)
    t_stop: Optional[float] = None  # the interrupt, or the first process the runner saw end
    slow_to_stop: list[str] = field(default_factory=list)  # ended by the runner after an interrupt

    def add(self, name: str, value: Any) -> None:
        """A prefill's "result" message: its RankResult, or what a driver returned."""
        (self.ranks if isinstance(value, RankResult) else self.paths)[name] = value

    def reported(self, name: str) -> bool:
        """Whether prefill `name` sent its result (a RankResult or a driver's)."""
        return name in self.ranks or name in self.paths


def counter_dict(c: Counter) -> dict[str, int]:
    return {(k.value if hasattr(k, "value") else str(k)): v for k, v in sorted(
        c.items(), key=lambda kv: str(getattr(kv[0], "value", kv[0])))}


EXIT_OK, EXIT_NOT_VERIFIED, EXIT_REFUSED, EXIT_LOST = 0, 1, 2, 3
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


class RunStatus(Enum):
    """A sweep job's status (summary.csv's `status` column)."""

    ok = "ok"  # every request verified, no error
    failed = "failed"  # ran, but not every request was verified
    error = "error"  # results.json carries an error, or cannot be read
    missing = "missing"  # no results.json: the job crashed before writing one


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


def read_section(cls, d: Any, **typed):
    """A section read back from JSON: each field as it is there (absent: None), the `typed`
    ones through their own reader."""
    d = d if isinstance(d, dict) else {}
    return cls(**{f.name: typed[f.name](d.get(f.name)) if f.name in typed else d.get(f.name)
                  for f in fields(cls)})


def each(read):
    """A reader of {name: section} from one of a section."""
    return lambda d: {k: read(v) for k, v in (d or {}).items()}


@dataclass(frozen=True)
class Percentiles:
    """p50 / p99 / p999 of a latency in us (None: nothing measured)."""

    p50: Optional[float] = None
    p99: Optional[float] = None
    p999: Optional[float] = None

    @classmethod
    def of(cls, h: LatencyHistogram) -> "Percentiles":
        return cls(**h.summary())

    @classmethod
    def from_json(cls, d: Any) -> "Percentiles":
        return read_section(cls, d)

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
        return cls(counter_dict(d.outcomes), counter_dict(d.details), d.rejected_auth, d.dropped_data,
                   d.dropped_control, d.unexpected, d.replayed, d.hijack_refused, d.ambiguous, d.gate_waits,
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


def _loads(v: Any):
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
    """results.json `plan` (orchestrator.plan.Plan.as_dict()), kept whole; what readers use,
    by name."""

    data: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return self.data

    mem_pool = property(lambda self: self.data.get("mem_pool"))
    buffer_device = property(lambda self: self.data.get("buffer_device"))
    route = property(lambda self: self.data.get("route"))
    route_reason = property(lambda self: self.data.get("route_reason"))
    declared_transport = property(lambda self: self.data.get("declared_transport"))

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


@dataclass
class Transports:
    """What carried the handoffs (top-level keys of results.json)."""

    effective_transport: Optional[str] = None
    declared_transport: Optional[str] = None
    endpoint_transports: dict[str, str] = field(default_factory=dict)
    engine_listeners_beyond_loopback: list[str] = field(default_factory=list)


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
                   out.slow_to_stop, out.engine_log)


_GROUPS = (Timing, Transports, Ending)


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
        """orchestrator.reporting's exit codes: the signal's, lost (3), not verified (1) or 0."""
        e = self.ending
        if e.recorded_exit is not None:
            return e.recorded_exit
        if e.signal:
            return EXIT_SIGNAL.get(e.signal, 130)
        if self.error or e.lost:
            return EXIT_LOST
        if self.verified != (self.requests or 0) - (self.not_started or 0):
            return EXIT_NOT_VERIFIED
        return EXIT_OK

    @property
    def status(self) -> RunStatus:
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
    failure_reasons: dict[str, int]
    latency_us: LatencyUs
    latency_clock: Optional[str]
    handoff_stages_us: dict[str, Percentiles]
    timing: Timing
    workload: Workload
    transports: Transports
    pairs: dict[str, Pair]
    authenticated: Authenticated
    decode: dict[str, DecodeCounts]
    decode_verified: int
    memory_kb: dict[str, dict]
    ending: Ending
    plan: PlanInfo
    error: Optional[str]
    tp: Optional[TpSummary]
    decode_gate: DecodeGate
    role: Optional[str] = None  # set by orchestrator.app
    run_dir: Optional[str] = None

    ORDER = ("requests", "verified", "corrupted", "failed", "not_started", "routes", "failure_reasons",
             "latency_us", "latency_clock", "handoff_stages_us", "handoffs_per_s", "mb_per_s",
             "bytes_per_request", "sends", "blocks_per_send", "startup_s", "startup_by_process", "wall_s",
             "workload", "effective_transport", "declared_transport", "endpoint_transports", "pairs",
             "authenticated", "decode", "decode_verified", "memory_kb", "faults_applied",
             "engine_listeners_beyond_loopback", "lost", "interrupted", "signal", "slow_to_stop",
             "engine_log", "plan", "error", "tp", "decode_gate", "offered_per_s", "warnings", "exit_code",
             "role", "run_dir")

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "JobResults":
        flat = {f.name: d.get(f.name) for f in fields(cls)}
        return cls(**{**flat, **_groups(d), "latency_us": LatencyUs.from_json(d.get("latency_us")),
                      "handoff_stages_us": each(Percentiles.from_json)(d.get("handoff_stages_us")),
                      "workload": read_section(Workload, d.get("workload")),
                      "pairs": each(Pair.from_json)(d.get("pairs")),
                      "authenticated": read_section(Authenticated, d.get("authenticated")),
                      "decode": each(DecodeCounts.from_json)(d.get("decode")),
                      "plan": PlanInfo(d.get("plan") or {}), "tp": TpSummary.from_json(d.get("tp")),
                      "decode_gate": DecodeGate.from_json(d.get("decode_gate"))})


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
             "failure_reasons", "decode", "startup_s", "effective_transport", "declared_transport",
             "endpoint_transports", "engine_listeners_beyond_loopback", "lost", "interrupted", "signal",
             "engine_log", "plan", "error", "tp", "exit_code", "run_dir")

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


def read_jsonl(path: Path, parse: Callable[[str], Any] = json.loads, strict: bool = False) -> Iterator[Any]:
    """`parse` of each line of a .jsonl file (requests, verdicts, decisions); a missing file
    has none. By default only complete lines count and one that does not parse is skipped:
    a writer that died may have left a torn last line. `strict` (a finished run's files)
    reads every non-blank line and raises on one that does not parse."""
    if not path.exists():
        return
    with open(path) as fh:
        for line in fh:
            if strict:
                if line.strip():
                    yield parse(line)
            elif line.endswith("\n"):
                try:
                    yield parse(line)
                except (ValueError, KeyError, TypeError):
                    continue


def read_records(path: Path) -> Iterable[Record]:
    """The complete lines of a requests file (a torn last line is skipped)."""
    return read_jsonl(path, Record.from_line)


LOCK_NAME = ".run.lock"


class RunDirBusy(Exception):
    """Another live run holds this run dir's lock (refused before start: exit 2)."""


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def lock_run_dir(run_dir: Path):
    """Hold `run_dir`'s lock for as long as the returned file stays open (one run per run
    dir; the kernel drops the lock when the process ends, however it ends). Raises
    RunDirBusy when another process holds it."""
    import fcntl
    import os

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        raise RunDirBusy(f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); "
                         "give this one its own hydra.run.dir") from None
    fh.truncate(0)
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def run_dir_busy(run_dir: Path) -> Optional[str]:
    """The refusal line when a live run holds `run_dir`'s lock, else None (takes nothing)."""
    import fcntl

    path = run_dir / LOCK_NAME
    if not path.exists():
        return None
    try:
        with open(path) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return (f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); give this "
                "one its own hydra.run.dir")
    return None


class NoSpace(OSError):
    """The disk filled while writing `path` (after start: exit 3, one line)."""

    def __init__(self, path: Path):
        super().__init__(28, f"no space left writing {path}")
        self.path = path

    def __str__(self) -> str:
        return f"no space left writing {self.path}"


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that a reader sees the old or the new content, never a torn one; a
    failed write leaves no temporary file behind (a full disk raises NoSpace)."""
    import errno
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, NoSpace):
            raise NoSpace(path) from None
        raise
