"""Per-request records and per-process results: what a prefill rank measured (RankResult), what
a decode process judged (DecodeResult), and one run (RunResult: both, keyed by process name, the
same shape for one rank or many; a driver's own result, the bench's, apart). Endpoints fill them
in; the runner merges them; orchestrator.results.reporting turns a RunResult into a job's results
(results.schema). Times are CLOCK_MONOTONIC seconds of the process that took them.
"""

from __future__ import annotations

import json
import operator
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.stats import LatencyHistogram

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

    def line(self, tag: str = "") -> str:
        """The requests.jsonl line (formatted directly: this runs once per request); `tag`
        (rundir.run_tag: the run's id) ends it."""
        return (f'{{"rid": {self.rid}, "room": {self.room}, "decode": {self.decode}, '
                f'"dst_slot": {self.dst_slot}, "route": "{self.route}", "set_buf_us": {_j(self.set_buf_us)}, '
                f'"send_us": {_j(self.send_us)}, "handoff_us": {_j(self.handoff_us)}, '
                f'"e2e_us": {_j(self.e2e_us)}, "outcome": "{self.outcome.value}", '
                f'"detail": "{self.detail.value}", "checksum": "{self.checksum}", '
                f'"fault": {json.dumps(self.fault)}, "taken_us": {_j(self.taken_us)}{tag}}}')

    @classmethod
    def from_line(cls, text: str) -> "Record":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        fields: dict[str, Any] = {k: d.get(k) for k in RECORD_FIELDS}
        fields["outcome"], fields["detail"] = Outcome(d["outcome"]), Detail(d["detail"])
        return cls(**fields)


_LINE = ('{"rid": %s, "room": %s, "decode": %s, "dst_slot": %s, "route": "%s", "set_buf_us": %s, '
         '"send_us": %s, "handoff_us": %s, "e2e_us": %s, "outcome": "%s", "detail": "%s", "checksum": "%s", '
         '"fault": %s, "taken_us": %s')  # Record.line's, for a batch (Finished.lines)


_VALUES: dict[int, str] = {id(e): e.value for e in (*Outcome, *Detail)}  # by id: an Enum hashes in Python
RUN_FIELDS = ("decode", "route", "send_us", "handoff_us", "e2e_us", "outcome", "detail", "taken_us", "t_verdict")


@dataclass
class Finished:
    """Requests finished together (a pass of the prefill's loop), column by column, run by
    run: each request's own values (rid, room, dst_slot, set_buf_us, checksum, fault), then
    per run of consecutive requests that share the rest (a forward step's requests do) its
    length `n` and what its Records share: RUN_FIELDS (t_verdict: the prefill's clock at the
    verdicts) and its stage times (add_stages' arguments; None: the run has none). Written
    (lines) and counted (RankResult.add_finished) in one go, with no object per request and
    each shared value taken once per run."""

    rid: Sequence[int]
    room: Sequence[int]
    dst_slot: Sequence[int]
    set_buf_us: Sequence[Optional[float]]
    checksum: Sequence[str]
    fault: Sequence[Optional[str]]
    n: Sequence[int]
    decode: Sequence[int]
    route: Sequence[str]
    send_us: Sequence[Optional[float]]
    handoff_us: Sequence[Optional[float]]
    e2e_us: Sequence[Optional[float]]
    outcome: Sequence[Outcome]
    detail: Sequence[Detail]
    taken_us: Sequence[Optional[float]]
    t_verdict: Sequence[Optional[float]]
    stages: Sequence[Optional[tuple[float, ...]]]

    def __len__(self) -> int:
        return len(self.rid)

    @classmethod
    def of_records(cls, recs: Sequence[Record]) -> "Finished":
        """Records as a batch, each its own run."""
        col = {k: [getattr(r, k) for r in recs] for k in RECORD_FIELDS + ("t_verdict",)}
        return cls(col["rid"], col["room"], col["dst_slot"], col["set_buf_us"], col["checksum"], col["fault"],
                   [1] * len(recs), col["decode"], col["route"], col["send_us"], col["handoff_us"], col["e2e_us"],
                   col["outcome"], col["detail"], col["taken_us"], col["t_verdict"], [None] * len(recs))

    def expanded(self, name: str) -> list[Any]:
        """A run's column (RUN_FIELDS, or "stages") as one value per request."""
        out: list[Any] = []
        for n, v in zip(self.n, getattr(self, name)):
            out += [v] * n
        return out

    def records(self) -> list[Record]:
        """One Record per request (what reads them back would build)."""
        return [Record(rid, room, decode, dst, route, set_buf, send, handoff, e2e, outcome, detail, checksum, fault,
                       taken, t)
                for (rid, room, dst, set_buf, checksum, fault, decode, route, send, handoff, e2e, outcome, detail,
                     taken, t) in zip(self.rid, self.room, self.dst_slot, self.set_buf_us, self.checksum, self.fault,
                                      *map(self.expanded, RUN_FIELDS))]

    def lines(self, tag: str = "") -> str:
        """The requests.jsonl lines, each what Record.line(tag) gives, newline-ended: a run's
        shared values formatted once into its line's format, each request's own into that."""
        if not len(self):
            return ""
        end = tag.replace("%", "%%") + "}\n"
        value = _VALUES.__getitem__
        # each distinct float and fault written once: repr() as %s would write it, None as JSON's null
        floats = _Text(repr).__getitem__
        faults = _Text(json.dumps).__getitem__
        n = len(self)
        bare = self.set_buf_us.count(None) == n and self.fault.count(None) == n  # (both null: in the format)
        own = "null" if bare else "%s"
        fmts: list[str] = []
        for k, decode, route, send, handoff, e2e, outcome, detail, taken in zip(
                self.n, self.decode, self.route, self.send_us, self.handoff_us, self.e2e_us, self.outcome,
                self.detail, self.taken_us):
            fmt = _LINE % ("%s", "%s", decode, "%s", route.replace("%", "%%"), own, floats(send), floats(handoff),
                           floats(e2e), value(id(outcome)), value(id(detail)), "%s", own, floats(taken)) + end
            fmts += [fmt] * k
        if bare:
            return "".join(map(operator.mod, fmts, zip(self.rid, self.room, self.dst_slot, self.checksum)))
        return "".join(map(operator.mod, fmts, zip(
            self.rid, self.room, self.dst_slot, map(floats, self.set_buf_us), self.checksum, map(faults, self.fault))))


class _Text(dict):
    """`fn` of each distinct value of a batch, once (None: JSON's null)."""

    def __init__(self, fn: Callable[[Any], str]):
        super().__init__({None: "null"})
        self.fn = fn

    def __missing__(self, value: Any) -> str:
        text = self[value] = self.fn(value)
        return text


_OUTCOMES, _DETAILS = tuple(Outcome), tuple(Detail)


class _Runs:
    """A batch's values for one histogram, each with how often it occurs (a run's requests
    share theirs), in order."""

    __slots__ = ("values", "repeats")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.repeats: list[int] = []

    def add(self, value: float, n: int) -> None:
        self.values.append(value)
        self.repeats.append(n)

    def into(self, hist: LatencyHistogram) -> None:
        if self.values:
            hist.extend_runs(self.values, self.repeats)


class _PairRuns:
    """What a batch's runs add to one decode's PairStats: its verified requests, its other
    runs' outcomes, its handoff times."""

    __slots__ = ("pair", "verified", "others", "handoff")

    def __init__(self, pair: "PairStats"):
        self.pair, self.verified, self.handoff = pair, 0, _Runs()
        self.others: list[tuple[Outcome, int]] = []


def _add_counts(counter: Counter, verified: int, others: Sequence[tuple[Any, ...]],
                keys: Sequence[Any] = _OUTCOMES) -> None:
    """Add a batch's counts to `counter`: `verified` requests verified, and each of `others`
    (member, ..., count) as often as it says. One member alone, or in `keys`' order: as a
    Counter of the batch's column would add them (members hashed only for `others`)."""
    if not others:
        if verified:
            counter[Outcome.verified] += verified
        return
    counts: dict[Any, int] = {Outcome.verified: verified} if verified else {}
    for o in others:
        counts[o[0]] = counts.get(o[0], 0) + o[-1]
    if len(counts) == 1:
        for k, c in counts.items():
            counter[k] += c
        return
    for k in keys:
        n = counts.get(k)
        if n:
            counter[k] += n


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
    ended_by: Optional[str] = None  # workload.duration_s: "duration", or "requests" (its ceiling first)

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

    def add_many(self, recs: Sequence[Record], stages: Sequence[tuple[float, ...]] = ()) -> None:
        """Records finished together (a pass of the loop), as add() each would, in one go
        (Finished.of_records, add_finished). `stages`: the verified ones' stage times, as
        add_stages takes them."""
        self.add_finished(Finished.of_records(recs))
        if stages:
            self._add_stage_rows(Counter(stages))

    def add_finished(self, f: "Finished") -> None:
        """Requests finished together, counted run by run as add() would count each of their
        records (and add_stages each verified one's stage times): counters and histograms fed
        per batch, each run's values taken once, no object per request (and no enum hashed per
        run, but for the runs not verified)."""
        if not len(f):
            return
        verified, local = Outcome.verified, LOCAL_FAILURES
        routes, pairs = self.routes, self.pairs
        by_pair: dict[int, _PairRuns] = {}
        send, taken, handoff, e2e = _Runs(), _Runs(), _Runs(), _Runs()
        others: list[tuple[Outcome, Detail, int]] = []  # the runs not verified
        stages: dict[tuple[float, ...], int] = {}
        every = f.outcome.count(verified) == len(f.outcome)
        t_last = None
        for n, decode, route, send_us, handoff_us, e2e_us, outcome, detail, taken_us, t, row in zip(
                f.n, f.decode, f.route, f.send_us, f.handoff_us, f.e2e_us, f.outcome, f.detail, f.taken_us,
                f.t_verdict, f.stages):
            if route:
                routes[route] += n
            if send_us is not None:
                send.add(send_us, n)
            at = by_pair.get(decode)
            if at is None:
                pair = pairs.get(decode)
                if pair is None:
                    pair = pairs[decode] = PairStats()
                at = by_pair[decode] = _PairRuns(pair)
            if outcome is verified:
                at.verified += n
                if taken_us is not None:
                    taken.add(taken_us, n)
                if handoff_us is not None:
                    handoff.add(handoff_us, n)
                    at.handoff.add(handoff_us, n)
                if e2e_us is not None:
                    e2e.add(e2e_us, n)
                if t is not None:
                    pair = at.pair
                    if pair.first_verdict is None or t < pair.first_verdict:
                        pair.first_verdict = t
                    if pair.last_verdict is None or t > pair.last_verdict:
                        pair.last_verdict = t
            else:
                others.append((outcome, detail, n))
                at.others.append((outcome, n))
            if t is not None and (every or detail not in local) and (t_last is None or t > t_last):
                t_last = t
            if row is not None:
                stages[row] = stages.get(row, 0) + n
        _add_counts(self.outcomes, sum(f.n) - sum(n for _, _, n in others), others)
        if others:
            _add_counts(self.details, 0, [(d, n) for _, d, n in others], _DETAILS)
        set_buf = [v for v in f.set_buf_us if v is not None]
        latency = self.latency
        if set_buf:
            latency["set_buf_us"].extend(set_buf)
        for key, runs in (("send_us", send), ("taken_us", taken), ("handoff_us", handoff), ("e2e_us", e2e)):
            runs.into(latency[key])
        for at in by_pair.values():
            _add_counts(at.pair.outcomes, at.verified, at.others)
            at.handoff.into(at.pair.handoff_us)
        if t_last is not None:
            self.t_last = t_last if self.t_last is None else max(self.t_last, t_last)
        if stages:
            self._add_stage_rows(stages)

    def _add_stage_rows(self, rows: dict[tuple[float, ...], int]) -> None:
        """add_stages of each row as often as `rows` counts it, each distinct row's stage
        times taken once (a step's requests share theirs)."""
        per = [_Runs() for _ in STAGES]
        for t, n in rows.items():
            for j, values in enumerate(per):
                a, b = t[j], t[j + 1]
                if a and b:
                    values.add(max(0.0, (b - a) * 1e6), n)
        for name, values in zip(STAGES, per):
            values.into(self.stages[name])

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
class Refusals:
    """The messages a decode process refused to act on, by why: each is counted under its
    name where it is dropped (orchestrator.handoff.endpoints.decode_state.Drops)."""

    rejected_auth: int = 0  # messages without a valid MAC
    dropped_data: int = 0  # malformed data-plane messages
    dropped_control: int = 0  # malformed control messages
    unexpected: int = 0  # well-formed, authentic, but for no grant of ours
    replayed: int = 0  # authentic, this run's, seen before: a replay (no effect)
    hijack_refused: int = 0  # a hello for a prefill rank already bound to a connection
    ambiguous: int = 0  # a bare SGLang status whose room matches several grants


@dataclass
class DecodeResult:
    """What one decode process judged, and what it refused to act on (`refused`)."""

    name: str
    outcomes: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)
    tp_rank: int = 0  # its rank in its decode instance's TP group (0: the one that gives verdicts)
    refused: Refusals = field(default_factory=Refusals)
    gate_waits: int = 0  # "done" seen before the room landed (re-checked later)
    settled: int = 0  # held by the gate with the right room and a torn row (gate.settle_ms)
    held_s: dict[str, float] = field(default_factory=dict)  # slot-seconds held by failed rows, by detail
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
    gpu_sharing: dict[str, Any] = field(default_factory=dict)  # job.mps: the processes per GPU, MPS on or not
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
    startup_phases: dict[str, dict[str, float]] = field(default_factory=dict)  # per process: phase -> s
    t_phase: Optional[float] = None  # the handoff phase began (this host's CLOCK_MONOTONIC)
    t_stop: Optional[float] = None  # the interrupt, or the first process the runner saw end
    slow_to_stop: list[str] = field(default_factory=list)  # ended by the runner after an interrupt
    warnings: list[str] = field(default_factory=list)  # said before any handoff (the bootstrap's peer checks)
    no_space: Optional[str] = None  # the first file the disk filled up writing (exit 3, named)

    def heard(self, line: str) -> str:
        """An endpoint's error line, noted where it says the disk is full; returned as is."""
        from orchestrator.results.rundir import no_space_path

        self.no_space = self.no_space or no_space_path(line)
        return line

    def add(self, name: str, value: Any) -> None:
        """A prefill's "result" message: its RankResult, or what a driver returned."""
        (self.ranks if isinstance(value, RankResult) else self.paths)[name] = value

    def reported(self, name: str) -> bool:
        """Whether prefill `name` sent its result (a RankResult or a driver's)."""
        return name in self.ranks or name in self.paths


def counter_dict(c: Counter) -> dict[str, int]:
    return {(k.value if hasattr(k, "value") else str(k)): v for k, v in sorted(
        c.items(), key=lambda kv: str(getattr(kv[0], "value", kv[0])))}


_OWN = object()  # read_jsonl's default `run`: the id of the run that owns the file's dir


def read_jsonl(path: Path, convert: Callable[[dict], Any] = lambda d: d, strict: bool = False,
               run: Any = _OWN) -> Iterator[Any]:
    """`convert` of each line of a .jsonl file (requests, verdicts, decisions) that belongs to
    run `run` (by default the run that owns the file's dir, rundir.run_of; None: a dir no run
    claimed): a line whose "run" field names another run, or a line without one in a claimed
    dir, is another run's and skipped. A missing file has none, and so has a link or a
    special file (opened as rundir.open_regular: never followed, a FIFO never blocks). By
    default only complete lines count and one that does not parse is skipped: a writer that
    died may have left a torn last line. `strict` (a finished run's files) reads every
    non-blank line and raises on one that does not parse."""
    import os

    from orchestrator.results.rundir import UnsafePath, open_regular, run_of

    want = run_of(path.parent) if run is _OWN else run
    try:
        fd = open_regular(path, os.O_RDONLY)
    except (FileNotFoundError, UnsafePath):
        return
    with open(fd) as fh:
        for line in fh:
            if strict:
                if not line.strip():
                    continue
                d = json.loads(line)
                if isinstance(d, dict) and d.get("run") == want:
                    yield convert(d)
            elif line.endswith("\n"):
                try:
                    d = json.loads(line)
                    if isinstance(d, dict) and d.get("run") == want:
                        yield convert(d)
                except (ValueError, KeyError, TypeError):
                    continue


def read_records(path: Path, run: Any = _OWN) -> Iterable[Record]:
    """The complete lines of a requests file of run `run` (read_jsonl; a torn last line is
    skipped)."""
    return read_jsonl(path, Record.from_dict, run=run)
