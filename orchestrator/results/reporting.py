"""Turn a run's typed results into a job's results (orchestrator.results.schema.JobResults), a short
console summary and an exit code; results.json is their to_json().

Exit codes (a script can trust them):
  0    every request verified
  1    some request not verified (corrupted or failed), every process ran to the end
  2    refused before start (a config or profile error; nothing ran)
  3    a side failed or was lost (a process died, stopped answering, or could not start)
  130  interrupted by SIGINT, 143 by SIGTERM
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from orchestrator.profile.kinds import FaultKind
from orchestrator.profile.sharing import sharing_line, sharing_warning
from orchestrator.results.escape import printable
from orchestrator.results.outcomes import Detail, Outcome
from orchestrator.results.records import (
    LATENCIES,
    STAGES,
    RankResult,
    RunResult,
    counter_dict,
    read_jsonl,
    read_records,
)
from orchestrator.results.report_spec import ReportGate, ReportLoad, ReportSpec
from orchestrator.results.rundir import RunFiles, write_atomic
from orchestrator.results.schema import (
    EXIT_LOST,
    EXIT_NOT_VERIFIED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_SIGNAL,
    Agreement,
    Authenticated,
    DecodeAccount,
    DecodeCounts,
    DecodeGate,
    DecodeLoad,
    DecodeSideResults,
    Ending,
    Failures,
    JobResults,
    Latency,
    LatencyUs,
    Pair,
    Percentiles,
    Results,
    Timing,
    TpGate,
    TpRank,
    TpSummary,
    Transports,
    Workload,
)
from orchestrator.results.stats import LatencyHistogram

if TYPE_CHECKING:
    from orchestrator.results.transferring import Held

__all__ = ["EXIT_OK", "EXIT_NOT_VERIFIED", "EXIT_REFUSED", "EXIT_LOST", "EXIT_SIGNAL", "build_results",
           "build_decode_side", "batch_caps", "summary", "decode_summary", "merge", "write", "rel"]


@dataclass
class _Merged:
    """Every prefill rank's counts and histograms, added up."""

    outcomes: Counter = field(default_factory=Counter)
    details: Counter = field(default_factory=Counter)
    routes: Counter = field(default_factory=Counter)
    lat: dict = field(default_factory=lambda: {k: LatencyHistogram() for k in LATENCIES})
    stages: dict = field(default_factory=lambda: {k: LatencyHistogram() for k in STAGES})
    pairs: dict = field(default_factory=dict)
    sends: int = 0
    blocks: int = 0
    rejected: int = 0
    replayed: int = 0
    not_started: int = 0

    def add(self, r: RankResult) -> None:
        self.not_started += r.not_started
        self.outcomes.update(r.outcomes)
        self.details.update(r.details)
        self.routes.update(r.routes)
        for k, h in r.latency.items():
            self.lat[k].merge(h)
        for k, h in r.stages.items():
            self.stages[k].merge(h)
        for j, p in sorted(r.pairs.items()):
            rate = p.rate
            self.pairs[f"p{r.rank}->d{j}"] = Pair(sum(p.outcomes.values()), p.verified,
                                                  Percentiles.of(p.handoff_us), round(rate, 2) if rate else None)
        self.sends += r.sends
        self.blocks += r.send_blocks
        self.rejected += r.rejected
        self.replayed += r.replayed

    def latency(self, qs: Sequence[float], ranks: Sequence[RankResult]) -> Latency:
        """Every latency's percentiles, with the chosen ones (report.percentiles) too, the
        clock they were taken on (the first rank's) and the stages' percentiles."""
        return Latency(LatencyUs(*(Percentiles.of(self.lat[k], qs) for k in
                                   ("set_buf_us", "send_us", "taken_us", "handoff_us", "e2e_us"))),
                       ranks[0].clock if ranks else None,
                       {k: Percentiles.of(h) for k, h in self.stages.items()})


def _effective(out: RunResult) -> Optional[str]:
    transports = set(out.transports.values())
    return transports.pop() if len(transports) == 1 else (
        "mixed:" + ",".join(f"{k}={v}" for k, v in sorted(out.transports.items())) if transports else None)


def _timing(spec: ReportSpec, out: RunResult, m: _Merged) -> Timing:
    ranks = list(out.ranks.values())
    verified = m.outcomes[Outcome.verified]
    starts = [r.t_start for r in ranks if r.t_start is not None]
    lasts = [r.t_last for r in ranks if r.t_last is not None]
    wall = (max(lasts) - min(starts)) if starts and lasts and max(lasts) > min(starts) else None
    row_bytes = max((r.row_bytes for r in ranks), default=0)
    w, prefill_ranks = spec.load, spec.ranks.prefill
    per_send = _per_send(spec.ranks.decode_tp, m.sends, sum(m.routes.values()))
    return Timing(out.startup_s, out.startup_by_process, round(wall, 4) if wall else None,
                  round(verified / wall, 1) if wall and verified else None,
                  round(verified * row_bytes / wall / 1e6, 3) if wall and verified else None,
                  row_bytes, m.sends, round(m.blocks / m.sends, 2) if m.sends else None,
                  w.rate * prefill_ranks if w.rate is not None else None,
                  round(per_send, 2) if per_send is not None else None, out.startup_phases)


def _per_send(decode_tp: int, sends: Optional[int], routed: int) -> Optional[float]:
    """Request rows per send call: `routed` requests went to every decode TP rank in `sends`."""
    return routed * decode_tp / sends if sends else None


def _workload(spec: ReportSpec) -> Workload:
    w, t, rows = spec.load, spec.send, spec.rows
    return Workload(w.concurrency, w.rate, w.batch_size, w.fill.value, t.coalesce, t.status.value,
                    w.duplicate_rooms, w.seed, rows.layout, rows.digest.value,
                    w.concurrency * spec.ranks.prefill, rows.slots * spec.ranks.decode,
                    w.duration_s, w.burstiness)


def _authenticated(secret_env: Optional[str], out: RunResult, m: _Merged) -> Authenticated:
    decodes = out.decodes.values()
    return Authenticated(f"transport.secret_env={secret_env}" if secret_env else "generated for this run",
                         m.rejected + sum(d.refused.rejected_auth for d in decodes),
                         m.replayed + sum(d.refused.replayed for d in decodes),
                         sum(d.refused.hijack_refused for d in decodes))


def build_results(spec: ReportSpec, out: RunResult) -> JobResults:
    m = _Merged()
    for r in out.ranks.values():
        m.add(r)
    requests = spec.load.requests * spec.ranks.prefill
    if spec.load.duration_s is not None:  # what arrived (a rank that left no trace: none)
        requests = sum(r.requests for r in out.ranks.values())
    verified, corrupted = m.outcomes[Outcome.verified], m.outcomes[Outcome.corrupted]
    accounted = sum(m.outcomes.values()) + m.not_started
    if accounted < requests and out.interrupted and not out.error and not out.lost:
        m.not_started += requests - accounted  # stopped before its processes started: none arrived
    elif accounted < requests:  # a rank that left no trace at all (cannot start)
        m.details["run_error" if out.error else "prefill_lost"] += requests - accounted
    ranks = list(out.ranks.values())
    decode_verified = sum(d.outcomes[Outcome.verified] for d in out.decodes.values() if d.tp_rank == 0)
    # this module's own sections first, then what lower modules give (the plan's view last)
    t, workload = _timing(spec, out, m), _workload(spec)
    auth, tp = _authenticated(spec.send.secret_env, out, m), _tp(spec.ranks.decode_tp, spec.gate, out)
    warnings = (batch_caps(spec, t.sends, sum(m.routes.values()))
                + _open_loop_warnings(t.offered_per_s, t.handoffs_per_s, out.interrupted is not None)
                + [w for w in (sharing_warning(out.gpu_sharing),) if w]
                + _ceiling_warnings(spec.load, out))
    gate = _gate(spec.gate, out)
    res = JobResults(
        requests, verified, corrupted, requests - verified - corrupted - m.not_started, m.not_started,
        counter_dict(m.routes), Failures(counter_dict(m.details)), m.latency(spec.percentiles, ranks),
        t, workload,
        Transports(_effective(out), spec.plan.declared_transport, out.transports, out.engine_exposed,
                   out.gpu_sharing),
        m.pairs, auth, DecodeAccount({name: DecodeCounts.of(d) for name, d in out.decodes.items()}, gate, tp),
        Agreement(decode_verified), {**{name: r.memory for name, r in out.ranks.items()},
                          **{name: d.memory for name, d in out.decodes.items()}},
        Ending.of(out), spec.plan, out.error)
    res.ending.warnings += warnings
    res.failures.sglang_0_5_23 = _held(spec, res)
    for d in out.decodes.values():
        for why, s in (d.held_s.items() if d.tp_rank == 0 else ()):
            res.slots_held_by_failed_s[why] = round(res.slots_held_by_failed_s.get(why, 0.0) + s, 3)
    if decode_verified != verified and out.run_dir:  # one truth: the difference, named
        late = verified_after_lost(Path(out.run_dir))
        res.agreement.verified_after_lost, res.agreement.verified_after_lost_ids = len(late), late[:100]
    return res


def _held(spec: ReportSpec, res: JobResults) -> Optional[Held]:
    """What SGLang 0.5.23's decode would hold in Transferring for ever (orchestrator.results.transferring)."""
    from orchestrator.results.transferring import held

    exact = spec.fault is FaultKind.aux_lost and spec.ranks.prefill == 1
    return held(res.failure_reasons, res.requests - res.not_started, res.workload.decode_rows or spec.rows.slots,
                (spec.fault_at, spec.fault_every) if exact else None)


HELD_FEW = 3  # failed rows that held their slots: said on the console from this many


def _held_lines(results: JobResults) -> list[str]:
    """How long the slots of rows that never landed (or were overwritten) were held, when
    more than a few: what a run slowed by zeroed rooms pays, and the key that bounds it."""
    out = []
    for why, held in sorted(results.slots_held_by_failed_s.items()):
        n = results.failure_reasons.get(why, 0)
        if n >= HELD_FEW:
            out.append(f"slots held by {n} {why} rows: {held:,.1f} s in all ({held / n:.2f} s each; "
                       f"gate.never_landed_s bounds the hold of a room that never lands, default "
                       f"transport.timeout_s)")
    return out


def verified_after_lost(run_dir: Path) -> list[int]:
    """The requests a decode leader's verdicts file says verified and their prefill's
    requests file says failed, by id (ids are unique across ranks): the verdict reached the
    decode's file after the prefill had declared that decode lost."""
    files = RunFiles(run_dir)
    verified = {v.get("rid") for decode, f in files.all_verdicts() if decode.tp_leader
                for v in read_jsonl(f) if v.get("outcome") == Outcome.verified.value}
    return sorted({rec.rid for path in files.all_requests() for rec in read_records(path)
                   if rec.outcome is not Outcome.verified and rec.rid in verified})


def _gate(g: ReportGate, out: RunResult) -> DecodeGate:
    """What the readiness gate's reads cost the decode loop (gate.read), per poll, over every
    decode process; and endpoints.decode_load's forward steps/s with and without handoffs."""
    reads, stalls = LatencyHistogram(), LatencyHistogram()
    for d in out.decodes.values():
        reads.merge(d.gate_read_us)
        stalls.merge(d.stall_us)
    loads = [DecodeLoad(**d.load) for d in out.decodes.values() if d.load]
    return DecodeGate(g.read.value, Percentiles.of(reads), Percentiles.of(stalls), reads.n,
                      loads[0] if len(loads) == 1 else (loads or None))


def batch_caps(spec: ReportSpec, sends: Optional[int], routed: int) -> list[str]:
    """What keeps a forward step below workload.batch_size, with the cap and the key to
    raise (once per run, in results.json `warnings` and the summary); `sends` were made for
    `routed` requests."""
    w, t = spec.load, spec.send
    if w.batch_size == 1:
        return []
    caps = []
    if w.rate is None and w.concurrency < w.batch_size:
        caps.append(f"workload.batch_size={w.batch_size} is capped at {w.concurrency} requests per step "
                    f"by workload.concurrency={w.concurrency}: raise workload.concurrency (and buffers.size) "
                    f"to several times the batch")
    per_request = spec.rows.blocks * spec.ranks.decode_tp  # blocks of one request's write
    window = t.max_inflight_blocks // per_request
    if not t.coalesce and window < w.batch_size:
        caps.append(f"workload.batch_size={w.batch_size} is capped at {max(1, window)} requests per step "
                    f"by transport.max_inflight_blocks={t.max_inflight_blocks} ({per_request} blocks per "
                    f"request): raise transport.max_inflight_blocks")
    per_send = _per_send(spec.ranks.decode_tp, sends, routed)
    if t.coalesce and per_send is not None and not caps and per_send < 0.5 * w.batch_size:
        caps.append(f"coalesced sends carried {per_send:.1f} requests each, workload.batch_size="
                    f"{w.batch_size}: a step takes what is ready; raise workload.concurrency={w.concurrency} "
                    f"and buffers.size={spec.rows.slots} (16x the batch fills most steps)")
    return caps


def _ceiling_warnings(w: ReportLoad, out: RunResult) -> list[str]:
    """workload.duration_s: the ranks that reached workload.requests before the clock."""
    early = sorted(name for name, r in out.ranks.items() if r.ended_by == "requests")
    if w.duration_s is None or not early:
        return []
    return [f"workload.duration_s={w.duration_s:g}: {', '.join(early)} stopped at the workload.requests="
            f"{w.requests} ceiling before the duration ran out: raise workload.requests to run for the time"]


def _open_loop_warnings(offered: Optional[float], achieved: Optional[float],
                        interrupted: bool = False) -> list[str]:
    """Open loop: the offered load (requests/s) was not sustained (achieved handoffs/s < 95%
    of offered)."""
    if offered is None or interrupted:
        return []
    if achieved is None or achieved < 0.95 * offered:
        got = _num(achieved) if achieved is not None else "no measured rate"
        return [f"offered {_num(float(offered))} requests/s, achieved {got} handoffs/s "
                f"({achieved / offered:.0%}): not sustained; latency from arrival includes the queue"
                if achieved is not None else
                f"offered {_num(float(offered))} requests/s, achieved {got}"]
    return []


def _tp(decode_tp: int, g: ReportGate, out: RunResult) -> Optional[TpSummary]:
    """Decode TP groups (endpoints.decode_tp ranks each): where ranks disagreed before
    agreeing, what a decode without this tool's digest would have taken silently, what hung,
    and what the agreement cost."""
    if decode_tp == 1:
        return None
    ranks = [d for d in out.decodes.values() if d.tp]
    leaders = [d.tp for d in ranks if d.tp_rank == 0]
    per_step: list[float] = [d.tp["allreduce_mean_us"] for d in ranks if d.tp.get("allreduce_mean_us")]
    unready, wrong_room = (sum(d.tp.get(k, 0) for d in ranks) for k in ("taken_unready", "taken_wrong_room"))
    steps, disagreed, requests_disagreed = (sum(t.get(k, 0) for t in leaders)
                                            for k in ("steps", "steps_disagreed", "requests_disagreed"))
    return TpSummary(
        decode_tp, TpGate(g.readiness, g.zero_room_on_free, g.settle_ms),
        steps, disagreed, requests_disagreed, unready + wrong_room, unready, wrong_room,
        sum(d.details.get(Detail.room_never_landed, 0) for d in ranks),
        # the gate saw the right room but the rest of the row had not landed (blocks of one
        # batch write land in any order): only the digest catches these
        sum(d.details.get(Detail.checksum_mismatch, 0) for d in ranks),
        # rows the room gate alone would have taken torn, held by gate.settle_ms until whole
        sum(d.settled for d in ranks),
        {d.name: TpRank(counter_dict(d.outcomes), counter_dict(d.details),
                        *(d.tp.get(k) for k in ("taken_unready", "taken_wrong_room", "gate_waits")))
         for d in ranks},
        round(sum(per_step) / len(per_step), 1) if per_step else None,
        {d.name: d.tp.get("allreduce_us") for d in ranks})


def build_decode_side(spec: ReportSpec, out: RunResult) -> DecodeSideResults:
    """role=decode: what this side judged (the whole run's verdicts are the prefill side's)."""
    outcomes: Counter[Outcome] = Counter()
    details: Counter[Detail] = Counter()
    for d in out.decodes.values():
        if d.tp_rank == 0:
            outcomes.update(d.outcomes)
            details.update(d.details)
    transports = set(out.transports.values())
    effective = transports.pop() if len(transports) == 1 else None
    tp = _tp(spec.ranks.decode_tp, spec.gate, out)
    return DecodeSideResults(
        out.bootstrap, out.prefills_seen, sum(outcomes.values()), outcomes[Outcome.verified],
        outcomes[Outcome.corrupted], outcomes[Outcome.failed], counter_dict(details),
        {name: DecodeCounts.of(d) for name, d in out.decodes.items()},
        Timing(startup_s=out.startup_s, startup_phases=out.startup_phases),
        Transports(effective, spec.plan.declared_transport, out.transports, out.engine_exposed, out.gpu_sharing),
        Ending.of(out), spec.plan, out.error, tp)


def write(run_dir: Path, results: Results) -> None:
    """results.json, written atomically (requests.jsonl was streamed by the prefill)."""
    write_atomic(RunFiles(run_dir).results, json.dumps(results.to_json(), indent=2) + "\n")


def rel(path: Path) -> str:
    """A path as the user typed it: relative to the working directory when under it."""
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _num(v: float) -> str:
    """A measured number with the digits it was rounded to (`%g` keeps 6 significant digits:
    328546.37 would print as 328546, 1234567.8 as 1.23457e+06)."""
    return f"{v:.2f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)


def _fmt(p: Percentiles) -> str:
    return " / ".join("-" if v is None else _num(v) for v in (p.p50, p.p99, p.p999))


def _rate_line(results: JobResults) -> str:
    """handoffs/s and MB/s over the handoff phase that ran (first arrival to the last verdict
    a decode gave); never `None`."""
    t = results.timing
    sides = t.startup_by_process or {}
    detail = f" ({', '.join(f'{k} {_num(v)}' for k, v in sides.items())})" if len(sides) in (2, 3) else ""
    start = f"start-up {t.startup_s} s{detail} excluded" if t.startup_s is not None else \
        "start-up not reached"
    if t.handoffs_per_s is None:
        return (f"rate not measured ({results.verified} verified, no handoff phase to time); "
                f"{t.bytes_per_request} B per request; {start}")
    phase = f" over {_num(t.wall_s)} s" if t.wall_s else ""
    sends = (f", {_num(t.requests_per_send)} requests per send" if results.workload.coalesce
             and t.requests_per_send is not None else "")
    return (f"{_num(t.handoffs_per_s)} handoffs/s, {t.mb_per_s} MB/s{phase} "
            f"({t.bytes_per_request} B per request{sends}); {start}")


def _latency_line(results: JobResults) -> str:
    lat = results.latency_us
    if not lat.handoff.measured and not lat.send_aux.measured:
        return ("latency: not recorded (the prefill's own records ended with it; verdicts "
                "from the decode's file)")
    set_buf = lat.set_buf.p50  # None when rows were filled ahead (workload.fill)
    keys = list(lat.handoff.percentiles or lat.send_aux.percentiles or {})  # report.percentiles

    def fmt(p: Percentiles) -> str:
        if not keys:
            return _fmt(p)
        chosen = p.percentiles or {}
        return " / ".join("-" if (v := chosen.get(k)) is None else _num(v) for k in keys)

    return (f"latency us {'/'.join(keys) if keys else 'p50/p99/p999'}: send_aux {fmt(lat.send_aux)}   "
            + (f"taken {fmt(lat.taken)}   " if lat.taken.p50 is not None else "")
            + f"handoff {fmt(lat.handoff)}"
            + (f"   from arrival {fmt(lat.e2e)}" if results.workload.rate is not None else "")
            + (f"   set_buf p50 {_num(set_buf)}" if set_buf is not None else ""))


def nothing_handed_off(w: Workload) -> str:
    """Why a run that ran handed off no request (its exit code is 1: nothing was verified)."""
    if w.duration_s is not None and w.rate is not None:
        why = (f"workload.duration_s={w.duration_s:g} s at workload.rate={w.rate:g}/s: no arrival of "
               "the seeded schedule fell inside it; a longer duration or a higher rate")
    elif w.duration_s is not None:
        why = (f"workload.duration_s={w.duration_s:g} s: the phase ended before the first request "
               "arrived; a longer duration")
    else:
        why = "no request arrived"
    return f"no request was handed off ({why})"


def _problems(results: JobResults) -> list[str]:
    """The summary's first lines: what went wrong (the first two are shown)."""
    e = results.ending
    problems = []
    if results.error:
        problems.append(f"ERROR: {results.error}")
    if e.lost:
        problems.append("lost: " + "; ".join(f"{k} {v}" for k, v in e.lost.items()))
    if e.engine_log:
        problems.append(f"engine said: {e.engine_log[-200:]}")
    if results.requests == 0 and not e.interrupted and not results.error:
        problems.append(f"ERROR: {nothing_handed_off(results.workload)}")
    if e.interrupted:
        slow = e.slow_to_stop
        problems.append(f"interrupted ({e.signal}): counts so far"
                        + (f" ({', '.join(slow)} ended by the runner; counted from its records and the "
                           "decodes' verdicts)" if slow else ""))
    return problems[:2]


def _load_line(gate: DecodeGate) -> list[str]:
    load = gate.one_load
    if load is None:
        return []
    return [f"decode loaded (endpoints.decode_load.step_ms={load.step_ms}, measured "
            f"{load.step_ms_measured} ms): {load.forward_steps_per_s_serving} forward steps/s "
            f"with handoffs, {load.forward_steps_per_s_idle} without; gate.read={gate.read}: "
            f"gate read per poll p50/p99/p999 {_fmt(gate.gate_read_us_per_poll)} us, loop stalled per "
            f"poll p50/p99/p999 {_fmt(gate.stall_us_per_poll)} us"]


def _tp_line(tp: Optional[TpSummary]) -> list[str]:
    if not tp:
        return []
    return [f"decode TP x{tp.ranks} (readiness gate {'on' if tp.gate.readiness else 'OFF'}, "
            f"zero room on free {'on' if tp.gate.zero_room_on_free else 'OFF'}): "
            f"{tp.steps_disagreed} steps disagreed before the all-reduce, "
            f"{tp.silent_corruptions} taken unready or with a wrong room (silent in "
            f"SGLang), {tp.torn} with the right room but a torn row (digest only; "
            f"{tp.settled} more held until whole by gate.settle_ms), "
            f"{tp.hung} hung; all-reduce "
            + (f"{tp.allreduce_us_mean} us" if tp.allreduce_us_mean is not None else "not timed")]


def summary(results: JobResults | DecodeSideResults, run_dir: Path, plot: bool = False,
            drawing: bool = False) -> str:
    """At most 8 lines for a default run: what ran, what happened, how fast, where. `plot`:
    latency.png is being drawn beside the exit (an interrupted run's); `drawing`: it is being
    drawn and is there when the command returns."""
    if isinstance(results, DecodeSideResults):
        return decode_summary(results, run_dir)
    plan, w = results.plan, results.workload
    routes = ", ".join(f"{k}={v}" for k, v in sorted(results.routes.items())) or "none"
    lines = [
        f"mem_pool={plan.mem_pool} buffers on {plan.buffer_device}, route {plan.route} "
        f"({plan.route_reason}), transport {results.transports.effective_transport or plan.declared_transport}",
        f"requests {results.requests}: verified {results.verified}, corrupted {results.corrupted}, "
        f"failed {results.failed}"
        + (f", not started {results.not_started}" if results.not_started else "")
        + f"   routes: {routes}",
    ]
    if results.verified:
        lines += [_latency_line(results), _rate_line(results)]
    if results.failure_reasons:
        lines.append("not verified: " + ", ".join(f"{k}={v}" for k, v in results.failure_reasons.items()))
    if results.sglang_0_5_23 is not None:
        lines.append(results.sglang_0_5_23.line())
    lines += _held_lines(results)
    if results.verified_after_lost:
        lines.append(f"verified after lost: {results.verified_after_lost} (the decode verified them after "
                     f"their prefill had failed them; decode_verified {results.decode_verified})")
    lines = _problems(results) + lines
    lines += [x for x in (sharing_line(results.transports.gpu_sharing),) if x]
    lines += [f"warning: {c}" for c in results.ending.warnings + _repeated(run_dir)]
    rows, in_flight = w.decode_rows, w.in_flight_max  # (both set by _workload)
    if w.rate is None and in_flight is not None and rows is not None and in_flight > rows:
        lines.append(f"{in_flight} requests in flight (workload.concurrency x prefill ranks) "
                     f"> {rows} decode rows (buffers.size x decode ranks): the rest wait "
                     "for a row, inside handoff latency")
    lines += _load_line(results.decode_gate) + _tp_line(results.tp)
    pairs = results.pairs
    if len(pairs) > 1:
        rates = [p.handoffs_per_s for p in pairs.values() if p.handoffs_per_s]
        if rates:
            lines.append(f"{len(pairs)} pairs: {min(rates)}-{max(rates)} handoffs/s each "
                         "(results.json: pairs)")
    png = ", latency.png" if drawing or (Path(run_dir) / "latency.png").exists() else \
        ", latency.png in a few seconds" if plot else ""
    files = "results.json, requests.jsonl" + png
    lines.append(f"run dir: {rel(run_dir)} ({files}, logs)")
    return "\n".join(map(printable, lines))  # peer strings escaped (orchestrator.results.escape)


def _repeated(run_dir: Path) -> list[str]:
    """The run's repeated warnings, one counted line each (the console showed none of them)."""
    from orchestrator.results.logs import repeated_warnings

    return repeated_warnings(run_dir)


def decode_summary(results: DecodeSideResults, run_dir: Path) -> str:
    t = results.transports
    lines = [f"decode side at {results.bootstrap or '(no bootstrap address yet)'}: buffers on "
             f"{results.plan.buffer_device}, transport {t.effective_transport or t.declared_transport}",
             f"judged {results.requests} from prefill ranks {results.prefills_seen}: verified "
             f"{results.verified}, corrupted {results.corrupted}, failed {results.failed}"]
    if results.error:
        lines.insert(0, f"ERROR: {results.error}")
    if results.ending.interrupted:
        lines.insert(0, f"interrupted ({results.ending.signal}): counts so far")
    lines += [f"warning: {w}" for w in results.ending.warnings + _repeated(run_dir)]
    lines.append(f"run dir: {rel(run_dir)}")
    return "\n".join(map(printable, lines))


def merge(a: Results, b: Results) -> tuple[str, bool]:
    """The summary of a run split across hosts, from its two run dirs' results: the
    prefill side's verdicts, the decode side's own counts, and whether they agree."""
    sides = {getattr(r, "role", None) or "both": r for r in (a, b)}
    if set(sides) != {"prefill", "decode"}:
        raise ValueError("expected the run dirs of one role=prefill and one role=decode run")
    p, d = sides["prefill"], sides["decode"]
    assert isinstance(p, JobResults) and isinstance(d, DecodeSideResults)  # what from_json reads for each role
    agree = p.verified == d.verified
    lines = [summary(p, Path(p.run_dir or "prefill")).rsplit("\n", 1)[0],
             printable(f"decode side at {d.bootstrap} judged {d.requests}: verified {d.verified}, "
                       f"corrupted {d.corrupted}, failed {d.failed}"),
             "both sides agree" if agree else
             f"THE SIDES DISAGREE: prefill verified {p.verified}, decode verified {d.verified}"]
    return "\n".join(lines), agree and p.exit_code == 0 and d.exit_code == 0
