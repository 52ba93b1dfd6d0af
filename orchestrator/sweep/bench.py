"""`python -m orchestrator.bench [overrides]`: every aux route side by side, in one run.

For the selected profile, each route (the profile's own; the engine over Mooncake's TCP
transport on the same device and host->host; the tcp route over ZMQ) gets its own pair of
processes (Mooncake picks its transport once per process), and a driver in the prefill
process runs these phases over the same bootstrapped pair:

  handoff 1-in-flight  full handoffs (row ready -> decode verified), one at a time, fill ahead
  per-request          fill ahead, batch 1, one batch write per request (SGLang's send_aux)
  batched              fill ahead, batch B, per-request sends, one status per step
  coalesced            fill ahead, batch B, one block per field per run of slots
  inline               the default shape: SGLang's set_buf in the loop, per-request sends
  inline staged        device rows only: the same with buffers.set_buf=staged (set_buf's
                       writes into pinned host rows, one upload a step)
  send_aux vs raw      our send (start + finish) against Mooncake's batch_transfer_sync_write
                       on the same blocks, interleaved in chunks of 100
  raw back-to-back     raw sync writes of one request's blocks, and of B-slot runs
  bulk                 one large block (bandwidth)

Rates are verified handoffs per second over each phase's own first arrival to last verdict;
latencies are exact per request (one way: prefill's row ready -> decode's verdict, on the
shared monotonic clock). Results: bench.json and bench.md in the run dir.

The bench sees only its spec (BenchSpec: its sizes and the routes it measures), built once by
its entry (orchestrator.bench) from the checked profile.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from orchestrator.handoff.backends.base import Send, Transfer
from orchestrator.handoff.endpoints import control
from orchestrator.handoff.endpoints.prefill import PrefillEndpoint
from orchestrator.handoff.endpoints.prefill_loop import PhaseSpec
from orchestrator.job import failure
from orchestrator.job.runner import run_handoffs
from orchestrator.job.specs import JobSpecs
from orchestrator.profile.config import FillMode, SetBufMode, StatusMode
from orchestrator.profile.plan import Plan, Route
from orchestrator.profile.sharing import sharing_warning
from orchestrator.results.logs import configure
from orchestrator.results.paths import Bulk, PathResult, PhaseResult
from orchestrator.results.records import STAGES, RankResult
from orchestrator.results.rundir import write_tables
from orchestrator.results.schema import Percentiles, each, read_section
from orchestrator.results.stats import percentile

CHUNK = 100


@dataclass(frozen=True)
class SampleStats:
    """Exact percentiles of back-to-back calls (one in flight); per_s = n / sum."""

    n: int = 0
    p50: Optional[float] = None
    p99: Optional[float] = None
    p999: Optional[float] = None
    mean: Optional[float] = None
    per_s: Optional[float] = None

    @classmethod
    def of(cls, samples_us: list[float]) -> "SampleStats":
        if not samples_us:
            return cls()
        return cls(len(samples_us), percentile(samples_us, 50), percentile(samples_us, 99),
                   percentile(samples_us, 99.9), round(statistics.fmean(samples_us), 2),
                   round(len(samples_us) / (sum(samples_us) / 1e6), 1))

    def to_json(self) -> dict[str, Any]:
        return {"n": 0} if not self.n else asdict(self)


def _phase_result(name: str, res: RankResult, phase: PhaseSpec) -> PhaseResult:
    rate = res.verified / res.wall_s if res.wall_s else None
    lat = {k: Percentiles.of(h) for k, h in res.latency.items()}
    return PhaseResult(name, res.requests, res.verified, phase.batch_size, phase.concurrency,
                       round(rate, 1) if rate else None, lat["handoff_us"], lat["taken_us"], lat["set_buf_us"],
                       lat["send_us"], round(res.finished / res.sends, 2) if res.sends else None,
                       {k: h.percentile(50) for k, h in res.stages.items()})


S = TypeVar("S")


def _optional(cls: type[S]) -> Callable[[Any], Optional[S]]:
    """A reader of an optional section of bench.json."""
    return lambda v: None if v is None else read_section(cls, v)


@dataclass
class PathReport:
    """One route in bench.json: what it measured, or only why it has nothing (`error`,
    `row_bytes` None)."""

    path: str
    error: Optional[str] = None
    transport: Optional[str] = None
    row_bytes: Optional[int] = None
    blocks: Optional[int] = None
    buffer_device: Optional[str] = None
    completion: Optional[str] = None
    gpu_sharing: dict = field(default_factory=dict)  # the processes on each GPU, MPS on or not
    phases: dict[str, PhaseResult] = field(default_factory=dict)
    ours_send_aux: Optional[SampleStats] = None  # our send (start + finish) on the engine route
    raw_batch_write: Optional[SampleStats] = None  # Mooncake's batch_transfer_sync_write, same blocks
    ours_over_raw_p50: Optional[float] = None
    raw_run: Optional[SampleStats] = None  # raw writes of B-slot runs
    raw_rows_per_s: Optional[float] = None
    raw_run_rows_per_s: Optional[float] = None
    bulk: Optional[Bulk] = None
    retried: Optional[str] = None  # the first try's error: this row ran twice (run_bench retries a failed row once)

    @classmethod
    def of(cls, res: PathResult, plan: Plan, gpu_sharing: dict) -> "PathReport":
        rep = cls(res.path, res.error, res.transport, res.row_bytes, res.blocks, plan.buffer_device.value,
                  plan.completion.value, gpu_sharing, res.phases, bulk=res.bulk)
        if res.ours_us:
            rep.ours_send_aux, rep.raw_batch_write = ours, raw = SampleStats.of(res.ours_us), SampleStats.of(res.raw_us)
            assert ours.p50 is not None and raw.p50 is not None  # a raw write for each send (BenchDriver._raw)
            rep.ours_over_raw_p50 = round(ours.p50 / raw.p50, 3)
            rep.raw_run = run = SampleStats.of(res.raw_run_us)
            rep.raw_rows_per_s = raw.per_s
            assert run.per_s is not None  # at least one run
            rep.raw_run_rows_per_s = round(run.per_s * max(1, _batch(res)), 1)
        return rep

    @property
    def ok(self) -> bool:
        return not self.error

    def to_json(self) -> dict[str, Any]:
        if self.row_bytes is None:
            return {"path": self.path, "error": self.error, **({"retried": self.retried} if self.retried else {})}
        d: dict[str, Any] = {"path": self.path, "transport": self.transport, "row_bytes": self.row_bytes,
                             "blocks": self.blocks, "buffer_device": self.buffer_device,
                             "completion": self.completion, "gpu_sharing": self.gpu_sharing,
                             "phases": {k: asdict(v) for k, v in self.phases.items()}}
        if self.ours_send_aux is not None:
            assert self.raw_batch_write is not None and self.raw_run is not None  # all set together (of)
            d.update(ours_send_aux=self.ours_send_aux.to_json(), raw_batch_write=self.raw_batch_write.to_json(),
                     ours_over_raw_p50=self.ours_over_raw_p50, raw_run=self.raw_run.to_json(),
                     raw_rows_per_s=self.raw_rows_per_s, raw_run_rows_per_s=self.raw_run_rows_per_s)
        if self.bulk:
            d["bulk"] = asdict(self.bulk)
        if self.error:
            d["error"] = self.error
        if self.retried:
            d["retried"] = self.retried
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PathReport":
        stats, bulk = _optional(SampleStats), _optional(Bulk)
        return read_section(cls, d, phases=each(PhaseResult.from_json), ours_send_aux=stats,
                            raw_batch_write=stats, raw_run=stats, bulk=bulk)


@dataclass
class BenchResults:
    """bench.json: every route's report, and the ratios between them."""

    profile: dict  # the selected profile's plan (orchestrator.profile.plan.Plan.as_dict())
    batch_size: int
    paths: list[PathReport] = field(default_factory=list)
    interrupted: Optional[str] = None  # "SIGINT" / "SIGTERM": the paths not yet run are left out
    ratios: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "batch_size": self.batch_size,
                "paths": [p.to_json() for p in self.paths],
                **({"interrupted": self.interrupted} if self.interrupted else {}), "ratios": self.ratios}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BenchResults":
        return read_section(cls, d, paths=lambda ps: [PathReport.from_json(p) for p in ps or []],
                            ratios=lambda r: r or {})


@dataclass
class BenchDriver:
    """Runs in the prefill process once it is bootstrapped (runner's `driver`)."""

    name: str
    handoffs: int
    requests: int
    batched_requests: int
    batch: int
    iters: int
    raw: bool  # engine route: compare with raw Mooncake calls
    bulk_bytes: int
    only: Optional[tuple[str, ...]] = None  # run only these phases (a path's no-MPS twin)

    def __call__(self, ep: PrefillEndpoint, conn: control.Pipe) -> PathResult:
        out = PathResult(self.name, ep.backend.transport, ep.buffers.row_bytes, len(ep.buffers.item_lens))
        base = 0
        B, n, m = self.batch, self.requests, self.batched_requests
        plan = [
            ("handoff 1-in-flight", PhaseSpec(self.handoffs, 1, None, 1, FillMode.ahead)),
            ("per-request", PhaseSpec(n, 4 * B, None, 1, FillMode.ahead)),
            ("batched", PhaseSpec(m, 4 * B, None, B, FillMode.ahead, False, StatusMode.per_step)),
            ("coalesced", PhaseSpec(m, 4 * B, None, B, FillMode.ahead, True, StatusMode.per_step)),
            ("inline", PhaseSpec(n, ep.workload.concurrency, None, 1, FillMode.inline)),
        ]
        if ep.staged is not None:  # device rows: SGLang's set_buf against the staged fill
            plan.append(("inline staged", PhaseSpec(n, ep.workload.concurrency, None, 1, FillMode.inline,
                                                set_buf=SetBufMode.staged)))
        for name, phase in plan:
            if self.only is not None and name not in self.only:
                continue
            # the bench's progress line
            conn.send(control.Phase(label=f"{name} ({phase.requests} requests)"))
            phase.rid_base = base
            base += phase.requests
            res = ep.run(phase, conn)
            out.phases[name] = _phase_result(name, res, phase)
        if self.raw:
            self._raw(ep, out)
        return out

    def _raw(self, ep: PrefillEndpoint, out: PathResult) -> None:
        """Our send vs the backend's raw call on the same blocks, then raw rates and the bulk
        point (after the handoff phases: these writes leave rows in decode slots)."""
        raw = ep.backend.raw()
        assert raw is not None  # raw writes run on the engine route only
        path, session = raw.path, raw.session
        size = ep.buffers.size
        pc = time.perf_counter
        for start in range(0, self.iters, CHUNK):
            k = min(CHUNK, self.iters - start)
            for i in range(start, start + k):
                send = Send([Transfer(i, 0, i % size, i % size)])
                t0 = pc()
                path.start(send)
                path.finish(send)
                out.ours_us.append((pc() - t0) * 1e6)
                if send.error:
                    raise RuntimeError(f"send_aux failed: {send.error}")
            for i in range(start, start + k):
                srcs, dsts, lens = raw.blocks(Send([Transfer(i, 0, i % size, i % size)]))
                t0 = pc()
                rc = raw.write(session, srcs, dsts, lens)
                out.raw_us.append((pc() - t0) * 1e6)
                if rc != 0:
                    raise RuntimeError(f"raw batch write returned {rc}")
        B = min(self.batch, size)
        for i in range(max(1, self.iters // B)):
            first = (i * B) % (size - B + 1)
            srcs, dsts, lens = raw.blocks(Send([Transfer(j, 0, first + j, first + j) for j in range(B)]))
            t0 = pc()
            rc = raw.write(session, srcs, dsts, lens)
            out.raw_run_us.append((pc() - t0) * 1e6)
            if rc != 0:
                raise RuntimeError(f"raw run write returned {rc}")
        if self.bulk_bytes and ep.bulk_ptr:
            import torch

            src = torch.ones(self.bulk_bytes, dtype=torch.uint8, device=ep.buffers.device)
            raw.register(src.data_ptr(), self.bulk_bytes)
            raw.bulk(session, src.data_ptr(), ep.bulk_ptr, self.bulk_bytes)  # warm-up
            times = []
            for _ in range(20):
                t0 = pc()
                rc = raw.bulk(session, src.data_ptr(), ep.bulk_ptr, self.bulk_bytes)
                times.append(pc() - t0)
                if rc != 0:
                    raise RuntimeError(f"bulk write returned {rc}")
            med = statistics.median(times)
            out.bulk = Bulk(self.bulk_bytes, med, round(self.bulk_bytes / med / 1e9, 2))


# ---- paths -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Path_:
    """One route measured: its label and the job that runs it (its specs, plan included, with
    the bench's sizes: built by the entry, job.specs.build_specs, handed to runner.run_handoffs)."""

    name: str
    job: JobSpecs
    only: Optional[tuple[str, ...]] = None  # BenchDriver.only

    @property
    def plan(self) -> Plan:
        return self.job.plan


@dataclass(frozen=True)
class BenchSpec:
    """What the bench reads, built once by its entry (orchestrator.bench) from the checked
    profile: the profile's own plan, the bench's sizes (bench.*) and the routes it measures."""

    plan: Plan  # the selected profile's (bench.json `profile`)
    handoffs: int  # bench.handoffs: one-in-flight handoffs per path
    requests: int  # bench.requests: per throughput row (per-request, inline)
    batched_requests: int  # bench.batched_requests: per batched and coalesced row
    batch_size: int  # bench.batch_size
    iters: int  # bench.iters: send_aux vs raw batch writes, each, per engine path
    bulk_mib: int  # bench.bulk_mib (0: no bulk point)
    paths: tuple[Path_, ...]


NO_MPS_PHASES = ("handoff 1-in-flight", "per-request")  # what a path's no-MPS twin runs


def run_bench(spec: BenchSpec, run_dir: Path) -> BenchResults:
    configure(run_dir, "bench", keep_root_handlers=True)
    results = BenchResults(spec.plan.as_dict(), spec.batch_size)
    todo = spec.paths
    for k, ph in enumerate(todo, 1):
        progress = _BenchProgress(f"[{k}/{len(todo)}] {ph.name}")
        report = _run_path(spec, ph, run_dir, progress, results)
        if report is not None and not report.ok and results.interrupted is None:
            # one retry: a row that fails twice is a failure, a row that passes its retry says so
            progress.say(f"failed ({report.error}): retrying it once")
            again = _run_path(spec, ph, run_dir, progress, results, suffix="_retry")
            if again is not None:
                again.retried, report = report.error, again
        if report is None:  # Ctrl-C / SIGTERM ends the bench, not only this path
            break
        results.paths.append(report)
    results.ratios = ratios(results.paths)
    write_tables(run_dir, "bench", results.to_json(), markdown(results))
    if results.interrupted:
        failure.leave(failure.Stopped(results.interrupted))
    failed = [p.path for p in results.paths if not p.ok]
    if failed:  # an aggregate with a failed row does not exit 0
        failure.leave(failure.RowsFailed(f"bench: {len(failed)} of {len(results.paths)} rows FAILED (each "
                                         f"after one retry): {'; '.join(failed)}"))
    return results


def _run_path(spec: BenchSpec, ph: Path_, run_dir: Path, progress: "_BenchProgress", results: BenchResults,
              suffix: str = "") -> Optional[PathReport]:
    """One route of the bench (its own run dir under the bench's; `suffix`: a retry's), or
    None when a signal ended it (results.interrupted set)."""
    phase_dir = run_dir / (re.sub(r"[^A-Za-z0-9_.]+", "_", ph.name).strip("_") + suffix)
    engine = ph.plan.route is Route.engine and ph.only is None
    bulk = (spec.bulk_mib << 20) if engine and spec.bulk_mib else 0
    driver = BenchDriver(ph.name, spec.handoffs, spec.requests, spec.batched_requests, spec.batch_size, spec.iters,
                         engine, bulk, ph.only)
    progress.say("starting its processes")
    out = run_handoffs(ph.job, phase_dir, driver=driver, bulk_bytes=bulk, progress=progress)
    sides = ", ".join(f"{name} {s} s" for name, s in out.startup_by_process.items())
    progress.say(f"done; start-up {out.startup_s} s ({sides})" if out.startup_s is not None else
                 f"ended: {out.error or out.lost or 'no result'}")
    if out.interrupted:
        progress.say(f"interrupted ({out.interrupted}): the paths not yet run are left out")
        results.interrupted = out.interrupted
        return None
    res = next(iter(out.paths.values()), None)
    if res is None:
        err = out.error or "; ".join(f"{k}: {v}" for k, v in out.lost.items()) or "no result"
        return PathReport(ph.name, err)
    warn = sharing_warning(out.gpu_sharing) if ph.only is None else None
    if warn:
        progress.say(f"warning: {warn}")
    return PathReport.of(res, ph.plan, out.gpu_sharing)


class _BenchProgress:
    """One line per path and per phase on stderr (the table goes to stdout): a CPU bench runs
    over a minute, and this says where it is."""

    def __init__(self, prefix: str):
        self.prefix, self.t0 = prefix, time.monotonic()

    def say(self, what: str) -> None:
        print(f"bench {self.prefix}: {what} (+{time.monotonic() - self.t0:.1f} s)", file=sys.stderr, flush=True)

    def start(self) -> None:
        self.say("handoffs under way")

    def phase(self, name: str) -> None:
        self.say(f"phase {name}")

    def __call__(self, done: int, verified: Optional[int] = None) -> None:
        pass


def _batch(res: PathResult) -> int:
    ph = res.phases.get("coalesced")
    return ph.batch_size if ph else 1


def _rate(p: PathReport, phase: str) -> Optional[float]:
    ph = p.phases.get(phase)
    return ph.handoffs_per_s if ph else None


def _set_buf_p50(p: PathReport, phase: str) -> Optional[float]:
    ph = p.phases.get(phase)
    return ph.set_buf_us.p50 if ph else None


def _handoff_p50(p: PathReport) -> Optional[float]:
    ph = p.phases.get("handoff 1-in-flight")
    return ph.handoff_us.p50 if ph else None


def ratios(paths: list[PathReport]) -> dict[str, Any]:
    ok = [p for p in paths if p.ok]
    out: dict[str, Any] = {}
    tcp = next((p for p in ok if p.path.startswith("tcp route")), None)
    first = ok[0] if ok else None
    for p in ok:  # a path and its no-MPS twin (next to it)
        twin = next((q for q in ok if q.path == p.path.replace(", MPS", ", no MPS") and q is not p), None)
        if twin is None:
            continue
        h, ht = _handoff_p50(p), _handoff_p50(twin)
        if h and ht:
            out[f"handoff p50 without MPS / with MPS, {p.path}"] = round(ht / h, 2)
        r, rt = _rate(p, "per-request"), _rate(twin, "per-request")
        if r and rt:
            out[f"per-request handoffs/s with MPS / without, {p.path}"] = round(r / rt, 2)
    host = next((q for q in ok if q.buffer_device == "cpu" and "inline" in q.phases), None)
    host_sb = _set_buf_p50(host, "inline") if host else None
    for p in ok:
        name, device = p.path, p.buffer_device
        if p.ours_over_raw_p50 is not None:
            out[f"ours/raw send_aux p50, {name}"] = p.ours_over_raw_p50
        per, co, inl = _rate(p, "per-request"), _rate(p, "coalesced"), _rate(p, "inline")
        if per and co:
            out[f"coalesced / per-request handoffs/s, {name}"] = round(co / per, 2)
        sb = _set_buf_p50(p, "inline")
        if inl and sb:
            out[f"inline handoffs/s / set_buf ceiling (1e6/{sb} us), {name}"] = round(inl / (1e6 / sb), 3)
        st_sb, st_rate = _set_buf_p50(p, "inline staged"), _rate(p, "inline staged")
        if st_sb and st_rate:
            out[f"inline staged handoffs/s / set_buf ceiling (1e6/{st_sb} us), {name}"] = \
                round(st_rate / (1e6 / st_sb), 3)
        if host_sb and device != "cpu":
            if sb:
                out[f"set_buf sglang on {device} rows / host rows, {name}"] = round(sb / host_sb, 2)
            if st_sb:
                out[f"set_buf staged on {device} rows / host rows, {name}"] = round(st_sb / host_sb, 2)
        if inl and p.raw_rows_per_s:
            out[f"inline handoffs/s / raw back-to-back writes/s, {name}"] = round(inl / p.raw_rows_per_s, 3)
    if first and tcp and first is not tcp:
        h1, h2 = _handoff_p50(first), _handoff_p50(tcp)
        if h1 and h2:
            out[f"tcp route handoff p50 / {first.path} handoff p50"] = round(h2 / h1, 2)
        for phase in ("per-request", "batched", "coalesced"):
            a, t = _rate(first, phase), _rate(tcp, phase)
            if a and t:
                out[f"{first.path} / tcp route handoffs/s, {phase}"] = round(a / t, 2)
    return out


def _cell(v: Any) -> Any:
    return "-" if v is None else v


def _phase_rows(paths: list[PathReport]) -> list[str]:
    rows = ["| path | phase | batch | in flight | verified | handoffs/s | taken p50 us | handoff (verdict) p50 us"
            " | p99 us | set_buf p50 us | requests/send |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        if not p.ok:
            rows.append(f"| {p.path} | FAILED: {p.error}" + (f" (its retry; first try: {p.retried})" if p.retried
                                                            else "") + " | | | | | | | | | |")
            continue
        label = f"{p.path} (passed its retry; first try FAILED: {p.retried})" if p.retried else p.path
        for name, ph in p.phases.items():
            rows.append(f"| {label} | {name} | {ph.batch_size} | {ph.concurrency} | "
                        f"{ph.verified}/{ph.requests} | {_cell(ph.handoffs_per_s)} | "
                        f"{_cell(ph.taken_us.p50)} | {_cell(ph.handoff_us.p50)} | {_cell(ph.handoff_us.p99)} | "
                        f"{_cell(ph.set_buf_us.p50)} | {ph.requests_per_send} |")
    return rows


def _raw_rows(paths: list[PathReport], batch: int) -> list[str]:
    raw = ["", "| path | our send_aux p50 us | raw batch write p50 us | ours/raw | raw writes/s (1 request) | "
               f"raw rows/s ({batch}-slot runs) | bulk GB/s |", "|---|---|---|---|---|---|---|"]
    for p in paths:
        if p.ours_send_aux is not None:
            assert p.raw_batch_write is not None  # set with ours_send_aux (PathReport.of)
            raw.append(f"| {p.path} | {p.ours_send_aux.p50} | {p.raw_batch_write.p50} | "
                       f"{p.ours_over_raw_p50} | {p.raw_rows_per_s} | {p.raw_run_rows_per_s} | "
                       f"{p.bulk.gb_per_s if p.bulk else None} |")
    stages = ["", "Where a one-in-flight handoff's time goes (p50 us of each stage; forward step done "
                  "-> verified):", "", "| path | " + " | ".join(STAGES) + " | handoff p50 |",
              "|---|" + "---|" * (len(STAGES) + 1)]
    for p in paths:
        ph = p.phases.get("handoff 1-in-flight")
        if ph:
            stages.append(f"| {p.path} | " + " | ".join(str(ph.stages_p50_us.get(k)) for k in STAGES)
                          + f" | {ph.handoff_us.p50} |")
    return raw + stages


def _sharing_rows(paths: list[PathReport]) -> list[str]:
    rows = ["", "| path | processes on each GPU | CUDA MPS |", "|---|---|---|"]
    for p in paths:
        g = p.gpu_sharing or {}
        if g.get("gpus"):
            on = "; ".join(f"GPU {gpu}: {', '.join(names)}" for gpu, names in g["gpus"].items())
            servers = g.get("servers")
            rows.append(f"| {p.path} | {on} | {'on' if g.get('mps') else 'off'} ({g.get('error') or g.get('why')}"
                        + (f"; server pid {', '.join(servers)}" if servers else "") + ") |")
    return rows if len(rows) > 3 else []


def markdown(results: BenchResults) -> str:
    paths = results.paths
    sb = ["", "set_buf per request (p50 us, on the scheduler's thread; inline phases):", "",
          "| path | rows on | sglang (SGLang 0.5.23's set_buf) | staged (pinned rows, one upload a step) |",
          "|---|---|---|---|"]
    for p in paths:
        if "inline" in p.phases:
            st = _set_buf_p50(p, "inline staged")
            sb.append(f"| {p.path} | {p.buffer_device} | {_set_buf_p50(p, 'inline')} | "
                      f"{_cell(st) if 'inline staged' in p.phases else 'same as sglang (host rows)'} |")
    first = next((p for p in paths if p.row_bytes is not None), None)
    lines = _phase_rows(paths) + _raw_rows(paths, results.batch_size) + sb + _sharing_rows(paths) + [
        "", (f"{first.row_bytes} B per request in {first.blocks} blocks; " if first else "no path finished; ")
        + "handoff = row ready on the prefill -> verified on the decode", "", "Ratios:"]
    lines += [f"- {k}: {v}" for k, v in results.ratios.items()]
    return "\n".join(lines)
