"""`python -m orchestrator.bench phases=ladder`: the cost ladder, from the careful loop to the
full run, one component per rung, on one prefill/decode pair, one handoff in flight.

Every rung is a fresh pair of processes on the profile's engine route (real Mooncake engine,
real ZMQ sockets), moving bench.ladder_handoffs rows filled ahead (after 50 untimed), each
handoff verified (a rung with any handoff not verified is FAILED). Rungs:

  R0..R5  the ladder's own pair (orchestrator.sweep.ladder_pair, whose docstring says what
          each rung holds): the yardstick's loop from our pieces, + authenticated frames,
          + our seal, + the readiness gate, + the send path as the run drives it, + slot grants
  R6      the bench's own harness: its `handoff 1-in-flight` phase (orchestrator.sweep.bench,
          BenchDriver) between the real endpoints: everything of R5 inside the run's
          PrefillLoop and decode loop (Links, heartbeats, the decode's step), plus records
          (requests.jsonl), decisions (structlog) and progress. The run's loop writes its
          records and decisions unconditionally: they cannot be taken out of it without a
          benchmark branch on the hot path, so R5 -> R6 holds both the loop's own machinery
          and the records
  R7      the full `python -m orchestrator` run of the same profile and overrides (one in
          flight, fill=ahead, ladder_handoffs requests), its results.json handoff p50
  yardstick  ../shared/tools/handoff_yardstick.py (bench.yardstick) in the same call

Rounds (bench.ladder_rounds) run every rung once each, interleaved (R0..R7, yardstick, then
again). Per rung: the median over rounds of each round's p50, its increment over the rung
below, and the min and max of the p50s across rounds. Latency: R0-R5 and the yardstick, row
ready -> verdict received on the prefill; R6 and R7, forward step done -> verdict on the
decode (the run's `handoff`, one way on the shared monotonic clock): R6/R7 lack the
verdict's trip back, so their increment is if anything understated.
A rung that failed in any round is FAILED (the ladder exits 1): its cell names each failure
with its rounds (a side of the pair that ended early: which one, its exit, its last log line)
and, if any round passed, the median of those that did, so a flaky rung still gives a reading.

Device rows share a GPU: R0-R5 and the yardstick run under CUDA MPS where the profile's
endpoints.mps decides so (one daemon of the ladder's own per rung, orchestrator.job.mps);
R6 and R7 start theirs as every run does.
Output: the table on the console, ladder.md and ladder.json in the run dir.

The ladder sees only its spec (LadderSpec: the pair's PairSpec, R6's job, the rounds), built
once by its entry (orchestrator.bench) from the checked profile.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from structlog.stdlib import BoundLogger

from orchestrator.job import failure, warmstart
from orchestrator.job.lifecycle import spawn
from orchestrator.job.mps import mps_for
from orchestrator.job.runner import run_handoffs
from orchestrator.job.specs import JobSpecs
from orchestrator.profile.config import LADDER_ROWS, ConfigError, RouteSetting
from orchestrator.profile.plan import Device, Plan, Route
from orchestrator.results.logs import configure
from orchestrator.results.rundir import write_atomic, write_tables
from orchestrator.results.stats import percentile

if TYPE_CHECKING:  # (the pair's module imports torch: the children's, imported where a pair starts)
    from orchestrator.sweep.ladder_pair import PairSpec

RUNGS: list[tuple[str, str]] = [
    ("R0", "yardstick loop, our pieces: engine batch write, 24 B status on PAIR, device digest, verdict"),
    ("R1", "+ authenticated frames: MAC'd status (PUSH->PULL, wire.parse), sealed UpdateMsg verdict"),
    ("R2", "+ our seal per request: room written, keyed digest and tag (RowDigest.seal), room zeroed"),
    ("R3", "+ readiness gate as configured (judge.Rows/Judge: gate.read, settle_ms, zero on free)"),
    ("R4", "+ send path as the run, alone in flight: Sender submit/pump on the loop's thread, AuxRouter"),
    ("R5", "+ slot grants: sealed arrive -> grant on DEALER/ROUTER, SlotAllocators, Grant table"),
    ("R6", "bench harness 'handoff 1-in-flight': real endpoints (loop, Links) + records, decisions, progress"),
    ("R7", "full `python -m orchestrator` run, same profile (results.json handoff p50)"),
]
YARDSTICK = "yardstick"
assert (*(r for r, _ in RUNGS), YARDSTICK) == LADDER_ROWS  # bench.ladder_rungs' vocabulary
DEFAULT_YARDSTICKS = ("../shared/tools/handoff_yardstick.py", ".whl/handoff_yardstick.py")
_RESULT = re.compile(r"RESULT .*?, (\d+) verified: p50 ([\d.]+) us p99 ([\d.]+) us")


@dataclass
class RungRun:
    """One rung in one round."""

    round: int
    n: int = 0
    verified: int = 0
    p50_us: Optional[float] = None
    min_us: Optional[float] = None
    max_us: Optional[float] = None
    wall_s: float = 0.0
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.n > 0 and self.verified == self.n


@dataclass
class RungRow:
    rung: str
    label: str
    runs: list[RungRun] = field(default_factory=list)
    skipped: Optional[str] = None  # the yardstick not found: why there is no number

    @property
    def p50s(self) -> list[float]:
        return [r.p50_us for r in self.runs if r.ok and r.p50_us is not None]

    @property
    def ok(self) -> bool:
        return self.skipped is not None or (bool(self.runs) and all(r.ok for r in self.runs))

    @property
    def median_us(self) -> Optional[float]:
        p = self.p50s
        return round(statistics.median(p), 1) if p else None

    def to_json(self) -> dict[str, Any]:
        p = self.p50s
        return {"rung": self.rung, "label": self.label, "ok": self.ok, "skipped": self.skipped,
                "median_p50_us": self.median_us, "min_p50_us": min(p) if p else None,
                "max_p50_us": max(p) if p else None, "failed_rounds": [r.round for r in self.runs if not r.ok],
                "verified": sum(r.verified for r in self.runs), "handoffs": sum(r.n for r in self.runs),
                "runs": [asdict(r) for r in self.runs]}


@dataclass
class LadderResults:
    profile: dict
    handoffs: int
    rounds: int
    rows: list[RungRow]
    load_avg: list[float] = field(default_factory=list)
    interrupted: Optional[str] = None  # "SIGINT": the rounds not run are left out

    def _by_round(self) -> dict[str, dict[int, float]]:
        return {r.rung: {run.round: run.p50_us for run in r.runs if run.ok and run.p50_us} for r in self.rows}

    def paired(self) -> list[float]:
        """R7 / yardstick in each round where both passed: the goal's ratio, paired by round
        (the rounds drift together; the ratio of the two medians mixes rounds)."""
        by = self._by_round()
        full, ys = by.get("R7", {}), by.get(YARDSTICK, {})
        return [round(full[k] / ys[k], 3) for k in sorted(full.keys() & ys.keys())]

    def paired_steps(self) -> dict[str, float]:
        """Each rung's increment over the rung run below it, paired by round: the median of
        the rounds' differences (rounds where both passed)."""
        by, out = self._by_round(), {}
        rungs = [r.rung for r in self.rows if r.rung != YARDSTICK and by.get(r.rung)]
        for lo, hi in zip(rungs, rungs[1:]):
            both = sorted(by[lo].keys() & by[hi].keys())
            if both:
                out[hi] = round(statistics.median(by[hi][k] - by[lo][k] for k in both), 1)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "handoffs": self.handoffs, "rounds": self.rounds,
                "load_avg_1_5_15": self.load_avg, "rows": [r.to_json() for r in self.rows],
                "full_over_yardstick_per_round": self.paired(), "paired_increment_us": self.paired_steps(),
                **({"interrupted": self.interrupted} if self.interrupted else {})}


@dataclass(frozen=True)
class LadderSpec:
    """What the ladder reads, built once by its entry (orchestrator.bench) from the profile as
    every rung runs it: one in flight, rows filled ahead, bench.ladder_handoffs requests."""

    pair: PairSpec  # R0-R5: what the ladder's own pair reads (with the rungs' plan)
    job: JobSpecs  # R6: that profile as a job (its specs, handed to the job layer, never read here)
    route: RouteSetting  # transport.route (the rungs need the engine route)
    rounds: int  # bench.ladder_rounds
    yardstick: Optional[str]  # bench.yardstick
    overrides: tuple[str, ...]  # R7: the command line's overrides (the full run's)
    rungs: Optional[tuple[str, ...]] = None  # bench.ladder_rungs: the rows run (None: all)

    @property
    def plan(self) -> Plan:
        return self.pair.plan

    @property
    def handoffs(self) -> int:
        return self.pair.handoffs


def _stats(samples: list[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    if not samples:
        return None, None, None
    return percentile(samples, 50), round(min(samples), 2), round(max(samples), 2)


# ---- R0-R5: the ladder's own pair ------------------------------------------------------------
def last_log_line(rdir: Path, side: str, width: int = 240) -> str:
    """The last line the side wrote to its structured log (else its Mooncake log), shortened:
    what a side that ended early was doing last."""
    for name in (f"{side}.log", f"{side}.mooncake.log"):
        try:
            lines = (rdir / name).read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        if lines:
            line = lines[-1].strip()
            return f"{name}: {line[:width]}{'...' if len(line) > width else ''}"
    return "no log line"


def exit_reason(code: Optional[int]) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class PairFailed(RuntimeError):
    """A side of the pair sent an error or ended without its result: `detail` is the full
    text (a child's traceback) for error.txt; str() is the one line for the table."""

    def __init__(self, line: str, detail: str = "") -> None:
        super().__init__(line)
        self.detail = detail or line


class PairLink:
    """The parent's ends of the pair's two pipes. Messages are read from whichever side sends
    as they come, and a side's end is judged against that side's own messages only: the
    decode ends as soon as it has the prefill's bye, usually before the prefill has sent its
    result, and that is the normal order, not a failure. A side that sends an error, or ends
    without having sent its result, fails the pair at once, named, with its exit reason and
    its last log line."""

    def __init__(self, procs: dict[str, BaseProcess], conns: dict[str, Connection], rdir: Path,
                 timeout_s: float) -> None:
        self.procs, self.conns, self.rdir, self.timeout_s = procs, conns, rdir, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.inbox: dict[str, dict[str, Any]] = {s: {} for s in procs}
        self.seen: dict[str, list[str]] = {s: [] for s in procs}  # the kinds each side sent, in order
        self.delivered: set[str] = set()  # the sides whose result came
        self.ended: dict[str, Optional[int]] = {}  # side -> exit code, once ended and drained
        self.closed: set[str] = set()  # the sides whose pipe gave EOF

    def get(self, side: str, want: str) -> Any:
        """The next `want` message of `side`, reading every side's messages meanwhile."""
        while want not in self.inbox[side]:
            self._check_ended()
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise PairFailed(f"no {want} from the {side} within {self.timeout_s:.0f} s; "
                                 f"its {last_log_line(self.rdir, side)}")
            waits: list[Any] = [self.conns[s] for s in self.procs if s not in self.closed]
            waits += [self.procs[s].sentinel for s in self.procs if s not in self.ended]
            for ready in mp_wait(waits, min(left, 1.0)):
                for s in self.procs:
                    if ready is self.conns[s]:
                        self._read(s)
                    elif ready == self.procs[s].sentinel and s not in self.ended:
                        self._drain(s)
                        self.procs[s].join()  # reaped: its exit code
                        self.ended[s] = self.procs[s].exitcode
        return self.inbox[side].pop(want)

    def _read(self, side: str) -> None:
        try:
            kind, value = self.conns[side].recv()
        except (EOFError, OSError):
            self.closed.add(side)
            return
        if kind == "error":
            text = str(value)
            raise PairFailed(f"{text.splitlines()[0]} (traceback in error.txt)", text)
        if kind == "result":
            self.delivered.add(side)
        self.seen[side].append(kind)
        self.inbox[side][kind] = value

    def _drain(self, side: str) -> None:
        """Everything a side that ended had sent (all of it is in the pipe by now)."""
        while side not in self.closed and self.conns[side].poll(0):
            self._read(side)

    def broken(self, exc: OSError) -> PairFailed:
        """A send to a side failed (its pipe is gone): the side that ended, named as get()
        names it, once the sides that are ending have ended (5 s at most)."""
        for side, proc in self.procs.items():
            if side not in self.ended:
                proc.join(5)
                if proc.exitcode is not None:
                    try:
                        self._drain(side)
                    except PairFailed as failed:
                        return failed
                    self.ended[side] = proc.exitcode
        try:
            self._check_ended()
        except PairFailed as failed:
            return failed
        return PairFailed(f"a pipe to the pair broke: {exc}")

    def exchange(self) -> tuple[Any, Any]:
        """The pair's start and end, in order: infos swapped, the decode ready, go; the
        prefill's result and the decode's (the two in whichever order they come)."""
        d_conn, p_conn = self.conns["decode"], self.conns["prefill"]
        try:
            d_info = self.get("decode", "info")
            p_info = self.get("prefill", "info")
            p_conn.send(d_info)
            d_conn.send(p_info)
            self.get("decode", "ready")
            p_conn.send("go")
            return self.get("prefill", "result"), self.get("decode", "result")
        except OSError as exc:
            raise self.broken(exc) from exc

    def _check_ended(self) -> None:
        for side, code in self.ended.items():
            if side not in self.delivered:
                sent = f"after its {', '.join(self.seen[side])}" if self.seen[side] else "nothing sent"
                raise PairFailed(f"the {side} ended before its result ({exit_reason(code)}, {sent}); "
                                 f"its last {last_log_line(self.rdir, side)}")


def _pair(rung: int, spec: PairSpec, rdir: Path, timeout_s: float,
          corrupt: Optional[int] = None, hold_result: bool = False) -> RungRun:
    """Rung `rung` (0-5) on a fresh pair; `corrupt` (tests): ladder_pair.prefill_main's;
    `hold_result` (tests): the prefill sends its result only once the decode has ended and
    this process has reaped it (the order that failed rungs on a GPU host)."""
    from orchestrator.sweep import ladder_pair

    ctx = warmstart.context()  # forked warm, as the run's endpoints are
    secret = secrets.token_bytes(32)
    d_conn, d_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    env = dict(os.environ)
    dec = ctx.Process(target=warmstart.driver_main, name="ladder-decode", daemon=True,
                      args=(f"{ladder_pair.__name__}:decode_main", env, rung, spec, str(rdir), secret, d_child))
    pre: Optional[BaseProcess] = None
    t0 = time.monotonic()
    try:
        warmstart.wait_ready(timeout_s)
        spawn(dec)
        pre = ctx.Process(target=warmstart.driver_main, name="ladder-prefill", daemon=True,
                          args=(f"{ladder_pair.__name__}:prefill_main", env, rung, spec, str(rdir), secret, p_child,
                                corrupt, dec.pid if hold_result else None))
        spawn(pre)
        for c in (d_child, p_child):
            c.close()  # the children's ends: a child's end closes its pipe
        link = PairLink({"decode": dec, "prefill": pre}, {"decode": d_conn, "prefill": p_conn}, rdir, timeout_s)
        res, dres = link.exchange()
    except (PairFailed, OSError, warmstart.NotReady) as exc:
        failed = exc if isinstance(exc, PairFailed) else PairFailed(f"the pair did not start: {exc}")
        write_atomic(rdir / "error.txt", failed.detail + "\n")
        return RungRun(0, error=str(failed).splitlines()[0])
    finally:
        for p in (pre, dec):
            if p is None or p.pid is None:
                continue
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    p50, lo, hi = _stats(res["handoff_us"])
    n = res["n"]
    verified = min(res["verified"], n)
    err = None
    if dres["bad"] or dres["verified"] != n + ladder_pair.WARM:  # the decode judged the untimed ones too
        err = f"decode verified {dres['verified']}, not verified {dres['bad']} (with {ladder_pair.WARM} untimed)"
    return RungRun(0, n, verified, p50, lo, hi, round(time.monotonic() - t0, 1), err)


# ---- R6: the bench's harness -----------------------------------------------------------------
def _bench_rung(spec: LadderSpec, rdir: Path) -> RungRun:
    from orchestrator.sweep.bench import BenchDriver

    phase = "handoff 1-in-flight"
    n = spec.handoffs
    t0 = time.monotonic()
    driver = BenchDriver("R6", n, 1, 1, 1, 1, False, 0, (phase,))
    out = run_handoffs(spec.job, rdir, driver=driver)
    if out.interrupted:  # Ctrl-C reached the runner first: end the ladder as the bench does
        raise KeyboardInterrupt
    res = next(iter(out.paths.values()), None)
    if res is None or phase not in res.phases:
        err = out.error or "; ".join(f"{k}: {v}" for k, v in out.lost.items()) or "no result"
        return RungRun(0, error=str(err).splitlines()[0] if err else "no result")
    ph = res.phases[phase]
    return RungRun(0, ph.requests, ph.verified, ph.handoff_us.p50, None, ph.handoff_us.max,
                   round(time.monotonic() - t0, 1), None if ph.verified == ph.requests else
                   f"{ph.requests - ph.verified} not verified")


# ---- R7: the full run ------------------------------------------------------------------------
def run_overrides(overrides: list[str], n: int) -> list[str]:
    """The user's overrides minus the bench's own and Hydra's, plus one in flight."""
    keep = [o for o in overrides if not re.match(r"^[+~]*(bench\.|phases=|hydra\.)", o)]
    return keep + ["workload.concurrency=1", "workload.batch_size=1", "workload.fill=ahead",
                   "workload.rate=null", "workload.duration_s=null", f"workload.requests={n}"]


def _full_run(overrides: list[str], n: int, rdir: Path, timeout_s: float) -> RungRun:
    cmd = [sys.executable, "-m", "orchestrator", *run_overrides(overrides, n), f"hydra.run.dir={rdir}"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return RungRun(0, error=f"did not end within {timeout_s:.0f} s")
    write_atomic(rdir / "console.txt", p.stdout + p.stderr)
    try:
        r = json.loads((rdir / "results.json").read_text())
    except (OSError, ValueError):
        tail = (p.stderr or p.stdout).strip().splitlines()
        return RungRun(0, error=f"exit {p.returncode}: {tail[-1] if tail else 'no results.json'}")
    h = (r.get("latency_us") or {}).get("handoff") or {}
    err = None if p.returncode == 0 else f"exit {p.returncode}"
    return RungRun(0, int(r.get("requests") or 0), int(r.get("verified") or 0), h.get("p50"), None, h.get("max"),
                   round(time.monotonic() - t0, 1), err)


# ---- the yardstick ---------------------------------------------------------------------------
def find_yardstick(setting: Optional[str]) -> Optional[Path]:
    for cand in ([setting] if setting else DEFAULT_YARDSTICKS):
        if cand and Path(cand).is_file():
            return Path(cand).resolve()
    return None


def _yardstick(path: Path, mode: str, n: int, rdir: Path, timeout_s: float) -> RungRun:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, path.name, mode, str(n)], cwd=path.parent, capture_output=True,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return RungRun(0, error=f"did not end within {timeout_s:.0f} s")
    text = p.stdout + p.stderr
    write_atomic(rdir / "yardstick.txt", text)
    m = _RESULT.search(text)
    if m is None:
        tail = text.strip().splitlines()
        return RungRun(0, error=f"exit {p.returncode}: {tail[-1] if tail else 'no RESULT line'}")
    mismatches = re.search(r"decode: (\d+) digest mismatches", text)
    bad = int(mismatches.group(1)) if mismatches else 0
    n_done = int(m.group(1))
    return RungRun(0, n_done, n_done - bad, float(m.group(2)), None, None, round(time.monotonic() - t0, 1),
                   None if bad == 0 else f"{bad} digest mismatches")


# ---- the ladder ------------------------------------------------------------------------------
def run_ladder(spec: LadderSpec, run_dir: Path) -> LadderResults:
    log = configure(run_dir, "ladder", keep_root_handlers=True)
    plan = spec.plan
    if plan.route is not Route.engine:
        raise ConfigError("transport.route", spec.route.value,
                          "the engine route for bench.phases=ladder (its rungs are Mooncake writes)")
    n = spec.handoffs
    timeout_s = 120.0 + n * 0.05  # a loaded box's start-up plus a slow handoff each
    rows, ypath = _rows(spec)
    results = LadderResults(plan.as_dict(), n, spec.rounds, rows)
    try:
        for rnd in range(spec.rounds):
            for k, row in enumerate(rows):
                if row.skipped:
                    continue
                rdir = run_dir / f"round{rnd}" / row.rung
                rdir.mkdir(parents=True, exist_ok=True)
                _say(f"round {rnd + 1}/{spec.rounds} {row.rung}: {row.label}")
                run = _rung(k, row.rung, spec, rdir, timeout_s, ypath, log)
                run.round = rnd
                row.runs.append(run)
                _say(f"round {rnd + 1} {row.rung}: " + (f"p50 {run.p50_us} us, {run.verified}/{run.n} verified"
                                                         if run.ok else f"FAILED: {run.error or 'not all verified'} "
                                                         f"(logs in {rdir})"))
    except KeyboardInterrupt:  # Ctrl-C: the rounds so far are written, exit 130
        results.interrupted = "SIGINT"
        _say("interrupted (SIGINT): the rounds so far are in the table")
    return _end(results, run_dir)


def _rows(spec: LadderSpec) -> tuple[list[RungRow], Optional[Path]]:
    """The table's rows, R0..R7 then the yardstick's (unless bench.yardstick=off; skipped, saying
    why, when it is not found), and the yardstick's path."""
    ypath = None if spec.yardstick == "off" else find_yardstick(spec.yardstick)
    rows = [RungRow(r, label) for r, label in RUNGS]
    if spec.yardstick != "off":
        yrow = RungRow(YARDSTICK, f"{spec.yardstick or DEFAULT_YARDSTICKS[0]} "
                       f"{'gpu' if spec.plan.buffer_device is Device.cuda else 'cpu'} {spec.handoffs}"
                       + (" YARDSTICK_ROOM=1" if os.environ.get("YARDSTICK_ROOM") else ""))
        if ypath is None:
            yrow.skipped = f"not found: {spec.yardstick or ' nor '.join(DEFAULT_YARDSTICKS)}"
        rows.append(yrow)
    if spec.rungs is not None:
        for row in rows:
            if row.rung not in spec.rungs and row.skipped is None:
                row.skipped = "not selected (bench.ladder_rungs)"
    return rows, ypath


def _rung(k: int, rung: str, spec: LadderSpec, rdir: Path, timeout_s: float, ypath: Optional[Path],
          log: BoundLogger) -> RungRun:
    """Row `k` (rung `rung`) once, in `rdir`: R0-R5 and the yardstick under the rungs' own MPS
    daemon where the plan shares GPUs under it."""
    plan = spec.plan
    if k <= 5:
        with mps_for(plan.sharing, plan.sharing.as_dict(), rdir, log):
            return _pair(k, spec.pair, rdir, timeout_s)
    if rung == "R6":
        return _bench_rung(spec, rdir)
    if rung == "R7":
        return _full_run(list(spec.overrides), spec.handoffs, rdir, timeout_s)
    assert ypath is not None
    mode = "gpu" if plan.buffer_device is Device.cuda else "cpu"
    with mps_for(plan.sharing, plan.sharing.as_dict(), rdir, log):
        return _yardstick(ypath, mode, spec.handoffs, rdir, timeout_s)


def _end(results: LadderResults, run_dir: Path) -> LadderResults:
    """The load average, the table written (ladder.md, ladder.json; the console), and the exit:
    130 interrupted, 1 a rung FAILED."""
    try:
        results.load_avg = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    write_tables(run_dir, "ladder", results.to_json(), markdown(results))
    if results.interrupted:
        failure.leave(failure.Stopped(results.interrupted))
    failed = [r.rung for r in results.rows if not r.ok]
    if failed:
        failure.leave(failure.RowsFailed("ladder: rungs FAILED (not every handoff verified, or no result): "
                                         + ", ".join(failed)))
    return results


def _say(what: str) -> None:
    print(f"ladder: {what}", file=sys.stderr, flush=True)


HEADER = ("| rung | contains | verified | p50 us (median of rounds) | + over rung below | % of R0 "
          "| min p50 | max p50 | rounds |")


def markdown(results: LadderResults) -> str:
    rows = results.rows
    r0 = rows[0].median_us if rows else None
    lines = [HEADER, "|---|---|---|---|---|---|---|---|---|"]
    below: Optional[float] = None
    for row in rows:
        p, med = row.p50s, row.median_us
        verified = f"{sum(r.verified for r in row.runs)}/{sum(r.n for r in row.runs)}"
        if row.skipped:
            lines.append(f"| {row.rung} | {row.label} | - | {row.skipped} | | | | | 0 |")
            continue
        if not row.runs:
            lines.append(f"| {row.rung} | {row.label} | - | not run (interrupted) | | | | | 0 |")
            continue
        cell = str(med)
        if not row.ok:
            cell = failed_cell(row)
            if med is None:  # no round passed: no reading
                lines.append(f"| {row.rung} | {row.label} | {verified} | {cell} | | | | | {len(row.runs)} |")
                if row.rung != YARDSTICK:
                    below = None
                continue
        assert med is not None
        inc = "-" if row.rung == YARDSTICK or below is None else f"{med - below:+.1f}"
        pct = f"{100 * med / r0:.0f}%" if r0 else "-"
        lines.append(f"| {row.rung} | {row.label} | {verified} | {cell} | {inc} | {pct} | {min(p)} | {max(p)} "
                     f"| {len(row.runs)} |")
        if row.rung != YARDSTICK:
            below = med
    prof = results.profile
    paired, meds = results.paired(), {r.rung: r.median_us for r in rows}
    if paired:
        full, ys = meds.get("R7"), meds.get(YARDSTICK)
        mixed = f"; ratio of the medians {full / ys:.2f}x" if full and ys else ""
        lines += ["", f"Full run (R7) / yardstick, round by round: {paired}; median of the rounds' ratios "
                  f"**{statistics.median(paired):.2f}x**{mixed}."]
    steps = results.paired_steps()
    if steps and results.rounds > 1:
        lines += ["", "Each rung over the one below, paired by round (the median of the rounds' differences, us): "
                  + ", ".join(f"{k} {v:+.1f}" + (f" ({100 * v / r0:.0f}% of R0)" if r0 else "")
                              for k, v in steps.items()) + "."]
    lines += ["", f"{results.handoffs} handoffs per rung and round, one in flight, rows filled ahead; "
              f"{results.rounds} rounds, interleaved; rows on {prof.get('buffer_device')}, "
              f"{prof.get('declared_transport') or prof.get('engine_transport')}; load average "
              f"{results.load_avg}.",
              "R0-R5 and the yardstick: row ready -> verdict received on the prefill; R6 and R7: the run's "
              "handoff (row ready -> verdict on the decode)."]
    return "\n".join(lines)


def failed_cell(row: RungRow) -> str:
    """`FAILED in k of n rounds: <why> (rounds ...)`, then the median of the rounds that passed,
    if any did: a flaky rung still gives a reading, marked (the ladder still exits 1)."""
    bad = [r for r in row.runs if not r.ok]
    why: dict[str, list[int]] = {}
    for r in bad:
        why.setdefault(r.error or "not all verified", []).append(r.round + 1)
    errs = "; ".join(f"{e} (round{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                     for e, rs in why.items())
    cell = f"FAILED in {len(bad)} of {len(row.runs)} rounds: {errs}".replace("|", "\\|")  # a log line's bars
    passed = len(row.p50s)
    if passed:
        cell += f"; median of the {passed} passed: {row.median_us}"
    return cell
