"""Turn a run's typed results into results.json, a short console summary and an exit code.

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
from pathlib import Path
from typing import Any, Optional

from .config import OrchestratorConfig
from .outcomes import Detail, Outcome
from .plan import Plan
from .results import LATENCIES, STAGES, RankResult, counter_dict, decode_dict, write_atomic
from .results import RunResult
from .rundir import RunFiles, parse_proc_name
from .stats import LatencyHistogram

EXIT_OK, EXIT_NOT_VERIFIED, EXIT_REFUSED, EXIT_LOST = 0, 1, 2, 3
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}


def _summary(h: LatencyHistogram) -> dict[str, Optional[float]]:
    return h.summary()


def build_results(cfg: OrchestratorConfig, plan: Plan, out: RunResult) -> dict[str, Any]:
    ranks: list[RankResult] = [r for r in out.ranks.values() if isinstance(r, RankResult)]
    requests = cfg.workload.requests * cfg.endpoints.prefill_ranks
    outcomes: Counter = Counter()
    details: Counter = Counter()
    routes: Counter = Counter()
    lat = {k: LatencyHistogram() for k in LATENCIES}
    stages = {k: LatencyHistogram() for k in STAGES}
    pairs: dict[str, dict] = {}
    sends = blocks = rejected = replayed = not_started = 0
    for r in ranks:
        not_started += r.not_started
        outcomes.update(r.outcomes)
        details.update(r.details)
        routes.update(r.routes)
        for k, h in r.latency.items():
            lat[k].merge(h)
        for k, h in r.stages.items():
            stages[k].merge(h)
        for j, p in sorted(r.pairs.items()):
            rate = p.rate
            pairs[f"p{r.rank}->d{j}"] = {
                "requests": sum(p.outcomes.values()), "verified": p.verified,
                "handoff_us": p.handoff_us.summary(),
                "handoffs_per_s": round(rate, 2) if rate else None}
        sends += r.sends
        blocks += r.send_blocks
        rejected += r.rejected
        replayed += r.replayed
    verified, corrupted = outcomes[Outcome.verified], outcomes[Outcome.corrupted]
    accounted = sum(outcomes.values()) + not_started
    failed = requests - verified - corrupted - not_started
    if accounted < requests:  # a rank that left no trace at all (cannot start)
        details["run_error" if out.error else "prefill_lost"] += requests - accounted
    starts = [r.t_start for r in ranks if r.t_start is not None]
    lasts = [r.t_last for r in ranks if r.t_last is not None]
    wall = (max(lasts) - min(starts)) if starts and lasts and max(lasts) > min(starts) else None
    row_bytes = max((r.row_bytes for r in ranks), default=0)
    transports = set(out.transports.values())
    effective = transports.pop() if len(transports) == 1 else (
        "mixed:" + ",".join(f"{k}={v}" for k, v in sorted(out.transports.items())) if transports else None)
    decodes = {name: decode_dict(d) for name, d in out.decodes.items()}
    decode_verified = sum(d.outcomes[Outcome.verified] for d in out.decodes.values()
                          if parse_proc_name(d.name).tp_leader)
    w, t = cfg.workload, cfg.transport
    results = {
        "requests": requests,
        "verified": verified,
        "corrupted": corrupted,
        "failed": failed,
        "not_started": not_started,  # never arrived: an interrupt came first (no requests.jsonl line)
        "routes": counter_dict(routes),
        "failure_reasons": counter_dict(details),
        "latency_us": {"set_buf": lat["set_buf_us"].summary(), "send_aux": lat["send_us"].summary(),
                       "taken": lat["taken_us"].summary(), "handoff": lat["handoff_us"].summary(),
                       "e2e": lat["e2e_us"].summary()},
        "latency_clock": ranks[0].clock if ranks else None,
        "handoff_stages_us": {k: h.summary() for k, h in stages.items()},
        "handoffs_per_s": round(verified / wall, 1) if wall and verified else None,
        "mb_per_s": round(verified * row_bytes / wall / 1e6, 3) if wall and verified else None,
        "bytes_per_request": row_bytes,
        "sends": sends,
        "blocks_per_send": round(blocks / sends, 2) if sends else None,
        "startup_s": out.startup_s,
        "startup_by_process": out.startup_by_process,  # s from spawn to each side's engine up
        "wall_s": round(wall, 4) if wall else None,
        "workload": {"concurrency": w.concurrency, "rate": w.rate, "batch_size": w.batch_size,
                     "fill": w.fill.value, "coalesce": t.coalesce, "status": t.status.value,
                     "duplicate_rooms": w.duplicate_rooms, "seed": w.seed, "layout": cfg.layout.name,
                     "digest": cfg.verify.digest.value,
                     "in_flight_max": w.concurrency * cfg.endpoints.prefill_ranks,
                     "decode_rows": cfg.buffers.size * cfg.endpoints.decode_ranks},
        "effective_transport": effective,
        "declared_transport": plan.declared_transport,
        "endpoint_transports": out.transports,
        "pairs": pairs,
        "authenticated": {"secret": f"transport.secret_env={t.secret_env}" if t.secret_env
                          else "generated for this run", "rejected": rejected + sum(
                              d.rejected_auth for d in out.decodes.values()),
                          "replayed": replayed + sum(d.replayed for d in out.decodes.values()),
                          "hijack_refused": sum(d.hijack_refused for d in out.decodes.values())},
        "decode": decodes,
        "decode_verified": decode_verified,
        "memory_kb": {**{name: r.memory for name, r in out.ranks.items() if isinstance(r, RankResult)},
                      **{name: d.memory for name, d in out.decodes.items()}},
        "faults_applied": out.faults_applied,
        "engine_listeners_beyond_loopback": out.engine_exposed,
        "lost": out.lost,
        "interrupted": out.interrupted is not None,
        "signal": out.interrupted,
        "slow_to_stop": out.slow_to_stop,
        "engine_log": out.engine_log,
        "plan": plan.as_dict(),
        "error": out.error,
    }
    results["tp"] = _tp(cfg, out)
    results["decode_gate"] = _gate(cfg, out)
    results["offered_per_s"] = w.rate * cfg.endpoints.prefill_ranks if w.rate is not None else None
    results["warnings"] = batch_caps(cfg, results) + _open_loop_warnings(results)
    results["exit_code"] = exit_code(results)
    return results


def _gate(cfg: OrchestratorConfig, out: RunResult) -> dict[str, Any]:
    """What the readiness gate's reads cost the decode loop (gate.read), per poll, over every
    decode process; and endpoints.decode_load's forward steps/s with and without handoffs."""
    reads, stalls = LatencyHistogram(), LatencyHistogram()
    for d in out.decodes.values():
        reads.merge(d.gate_read_us)
        stalls.merge(d.stall_us)
    loads = [d.load for d in out.decodes.values() if d.load]
    return {"read": cfg.gate.read.value, "gate_read_us_per_poll": reads.summary(),
            "stall_us_per_poll": stalls.summary(), "polls": reads.n,
            "load": loads[0] if len(loads) == 1 else (loads or None)}


def batch_caps(cfg: OrchestratorConfig, results: dict[str, Any]) -> list[str]:
    """What keeps a forward step below workload.batch_size, with the cap and the key to
    raise (once per run, in results.json `warnings` and the summary)."""
    from .layout import profile_layout

    w, t, b = cfg.workload, cfg.transport, cfg.buffers
    if w.batch_size == 1:
        return []
    caps = []
    if w.rate is None and w.concurrency < w.batch_size:
        caps.append(f"workload.batch_size={w.batch_size} is capped at {w.concurrency} requests per step "
                    f"by workload.concurrency={w.concurrency}: raise workload.concurrency (and buffers.size) "
                    f"to several times the batch")
    per_request = len(profile_layout(cfg)) * cfg.endpoints.decode_tp  # blocks of one request's write
    window = t.max_inflight_blocks // per_request
    if not t.coalesce and window < w.batch_size:
        caps.append(f"workload.batch_size={w.batch_size} is capped at {max(1, window)} requests per step "
                    f"by transport.max_inflight_blocks={t.max_inflight_blocks} ({per_request} blocks per "
                    f"request): raise transport.max_inflight_blocks")
    sends, routed = results.get("sends") or 0, sum(results.get("routes", {}).values())
    per_send = routed * cfg.endpoints.decode_tp / sends if sends else None
    if t.coalesce and per_send is not None and not caps and per_send < 0.5 * w.batch_size:
        caps.append(f"coalesced sends carried {per_send:.1f} requests each, workload.batch_size="
                    f"{w.batch_size}: a step takes what is ready; raise workload.concurrency={w.concurrency} "
                    f"and buffers.size={b.size} (16x the batch fills most steps)")
    return caps


def _open_loop_warnings(results: dict[str, Any]) -> list[str]:
    """Open loop: the offered load was not sustained (achieved < 95% of offered)."""
    offered, achieved = results.get("offered_per_s"), results.get("handoffs_per_s")
    if offered is None or results.get("interrupted"):
        return []
    if achieved is None or achieved < 0.95 * offered:
        got = _num(achieved) if achieved is not None else "no measured rate"
        return [f"offered {_num(float(offered))} requests/s, achieved {got} handoffs/s "
                f"({achieved / offered:.0%}): not sustained; latency from arrival includes the queue"
                if achieved is not None else
                f"offered {_num(float(offered))} requests/s, achieved {got}"]
    return []


def _tp(cfg: OrchestratorConfig, out: RunResult) -> Optional[dict[str, Any]]:
    """Decode TP groups: where ranks disagreed before agreeing, what a decode without this
    tool's digest would have taken silently, what hung, and what the agreement cost."""
    if cfg.endpoints.decode_tp == 1:
        return None
    ranks = [d for d in out.decodes.values() if d.tp]
    leaders = [d.tp for d in ranks if d.tp.get("rank") == 0]
    hist = LatencyHistogram()
    per_step = [d.tp.get("allreduce_mean_us") for d in ranks if d.tp.get("allreduce_mean_us")]
    return {
        "ranks": cfg.endpoints.decode_tp,
        "gate": {"readiness": cfg.gate.readiness, "zero_room_on_free": cfg.gate.zero_room_on_free,
                 "settle_ms": cfg.gate.settle_ms},
        "steps": sum(t.get("steps", 0) for t in leaders),
        "steps_disagreed": sum(t.get("steps_disagreed", 0) for t in leaders),
        "requests_disagreed": sum(t.get("requests_disagreed", 0) for t in leaders),
        "silent_corruptions": sum(d.tp.get("taken_unready", 0) + d.tp.get("taken_wrong_room", 0)
                                  for d in ranks),
        "taken_unready": sum(d.tp.get("taken_unready", 0) for d in ranks),
        "taken_wrong_room": sum(d.tp.get("taken_wrong_room", 0) for d in ranks),
        "hung": sum(d.details.get(Detail.room_never_landed, 0) for d in ranks),
        # the gate saw the right room but the rest of the row had not landed (blocks of one
        # batch write land in any order): only the digest catches these
        "torn": sum(d.details.get(Detail.checksum_mismatch, 0) for d in ranks),
        # rows the room gate alone would have taken torn, held by gate.settle_ms until whole
        "settled": sum(d.settled for d in ranks),
        "per_rank": {d.name: {"outcomes": counter_dict(d.outcomes), "details": counter_dict(d.details),
                              **{k: d.tp.get(k) for k in ("taken_unready", "taken_wrong_room", "gate_waits")}}
                     for d in ranks},
        "allreduce_us_mean": round(sum(per_step) / len(per_step), 1) if per_step else None,
        "allreduce_us": {d.name: d.tp.get("allreduce_us") for d in ranks},
    }


def build_decode_side(cfg: OrchestratorConfig, plan: Plan, out: RunResult) -> dict[str, Any]:
    """role=decode: what this side judged (the whole run's verdicts are the prefill side's)."""
    leaders = [d for d in out.decodes.values() if parse_proc_name(d.name).tp_leader]
    outcomes, details = Counter(), Counter()
    for d in leaders:
        outcomes.update(d.outcomes)
        details.update(d.details)
    judged = sum(outcomes.values())
    transports = set(out.transports.values())
    results = {
        "role": "decode", "bootstrap": out.bootstrap, "prefills_seen": out.prefills_seen,
        "requests": judged, "verified": outcomes[Outcome.verified],
        "corrupted": outcomes[Outcome.corrupted], "failed": outcomes[Outcome.failed],
        "failure_reasons": counter_dict(details),
        "decode": {name: decode_dict(d) for name, d in out.decodes.items()},
        "startup_s": out.startup_s,
        "effective_transport": transports.pop() if len(transports) == 1 else None,
        "declared_transport": plan.declared_transport, "endpoint_transports": out.transports,
        "engine_listeners_beyond_loopback": out.engine_exposed, "lost": out.lost,
        "interrupted": out.interrupted is not None, "signal": out.interrupted,
        "engine_log": out.engine_log, "plan": plan.as_dict(), "error": out.error,
        "tp": _tp(cfg, out),
    }
    results["exit_code"] = exit_code(results)
    return results


def exit_code(results: dict[str, Any]) -> int:
    if results.get("signal"):
        return EXIT_SIGNAL.get(results["signal"], 130)
    if results.get("error") or results.get("lost"):
        return EXIT_LOST
    if results["verified"] != results["requests"] - results.get("not_started", 0):
        return EXIT_NOT_VERIFIED
    return EXIT_OK


def write(run_dir: Path, results: dict[str, Any]) -> None:
    """results.json, written atomically (requests.jsonl was streamed by the prefill)."""
    write_atomic(RunFiles(run_dir).results, json.dumps(results, indent=2) + "\n")


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


def _fmt(d: dict) -> str:
    return " / ".join("-" if d.get(q) is None else _num(d[q]) for q in ("p50", "p99", "p999"))


def _rate_line(results: dict[str, Any]) -> str:
    """handoffs/s and MB/s over the handoff phase that ran (first arrival to the last verdict
    a decode gave); never `None`."""
    sides = results.get("startup_by_process") or {}
    detail = f" ({', '.join(f'{k} {_num(v)}' for k, v in sides.items())})" if len(sides) in (2, 3) else ""
    start = f"start-up {results['startup_s']} s{detail} excluded" if results.get("startup_s") is not None else \
        "start-up not reached"
    if results.get("handoffs_per_s") is None:
        return (f"rate not measured ({results['verified']} verified, no handoff phase to time); "
                f"{results['bytes_per_request']} B per request; {start}")
    phase = f" over {_num(results['wall_s'])} s" if results.get("wall_s") else ""
    return (f"{_num(results['handoffs_per_s'])} handoffs/s, {results['mb_per_s']} MB/s{phase} "
            f"({results['bytes_per_request']} B per request); {start}")


def summary(results: dict[str, Any], run_dir: Path) -> str:
    """At most 8 lines for a default run: what ran, what happened, how fast, where."""
    if results.get("role") == "decode":
        return decode_summary(results, run_dir)
    lat = results["latency_us"]
    plan = results["plan"]
    routes = ", ".join(f"{k}={v}" for k, v in sorted(results["routes"].items())) or "none"
    lines = [
        f"mem_pool={plan['mem_pool']} buffers on {plan['buffer_device']}, route {plan['route']} "
        f"({plan['route_reason']}), transport {results['effective_transport'] or plan['declared_transport']}",
        f"requests {results['requests']}: verified {results['verified']}, corrupted {results['corrupted']}, "
        f"failed {results['failed']}"
        + (f", not started {results['not_started']}" if results.get("not_started") else "")
        + f"   routes: {routes}",
    ]
    w = results["workload"]
    if results["verified"]:
        set_buf = lat["set_buf"]["p50"]  # None when rows were filled ahead (workload.fill)
        if all(v is None for v in lat["handoff"].values()) and all(v is None for v in lat["send_aux"].values()):
            lines.append("latency: not recorded (the prefill's own records ended with it; verdicts "
                         "from the decode's file)")
        else:
            lines.append(f"latency us p50/p99/p999: send_aux {_fmt(lat['send_aux'])}   "
                         + (f"taken {_fmt(lat['taken'])}   " if (lat.get("taken") or {}).get("p50") is not None else "")
                         + f"handoff {_fmt(lat['handoff'])}"
                         + (f"   from arrival {_fmt(lat['e2e'])}" if w["rate"] is not None else "")
                         + (f"   set_buf p50 {_num(set_buf)}" if set_buf is not None else ""))
        lines.append(_rate_line(results))
    if results["failure_reasons"]:
        lines.append("not verified: " + ", ".join(f"{k}={v}" for k, v in results["failure_reasons"].items()))
    problems = []
    if results["error"]:
        problems.append(f"ERROR: {results['error']}")
    if results["lost"]:
        problems.append("lost: " + "; ".join(f"{k} {v}" for k, v in results["lost"].items()))
    if results.get("engine_log"):
        problems.append(f"engine said: {results['engine_log'][-200:]}")
    if results["interrupted"]:
        slow = results.get("slow_to_stop")
        problems.append(f"interrupted ({results['signal']}): counts so far"
                        + (f" ({', '.join(slow)} ended by the runner; counted from its records and the "
                           "decodes' verdicts)" if slow else ""))
    lines = problems[:2] + lines
    lines += [f"warning: {c}" for c in results.get("warnings", [])]
    if w["rate"] is None and w["in_flight_max"] > w["decode_rows"]:
        lines.append(f"{w['in_flight_max']} requests in flight (workload.concurrency x prefill ranks) "
                     f"> {w['decode_rows']} decode rows (buffers.size x decode ranks): the rest wait "
                     "for a row, inside handoff latency")
    gate = results.get("decode_gate") or {}
    load = gate.get("load")
    if isinstance(load, dict) and load:
        lines.append(f"decode loaded (endpoints.decode_load.step_ms={load['step_ms']}, measured "
                     f"{load['step_ms_measured']} ms): {load['forward_steps_per_s_serving']} forward steps/s "
                     f"with handoffs, {load['forward_steps_per_s_idle']} without; gate.read={gate['read']}: "
                     f"gate read per poll p50/p99/p999 {_fmt(gate['gate_read_us_per_poll'])} us, loop stalled per "
                     f"poll p50/p99/p999 {_fmt(gate['stall_us_per_poll'])} us")
    tp = results.get("tp")
    if tp:
        lines.append(f"decode TP x{tp['ranks']} (readiness gate {'on' if tp['gate']['readiness'] else 'OFF'}, "
                     f"zero room on free {'on' if tp['gate']['zero_room_on_free'] else 'OFF'}): "
                     f"{tp['steps_disagreed']} steps disagreed before the all-reduce, "
                     f"{tp['silent_corruptions']} taken unready or with a wrong room (silent in "
                     f"SGLang), {tp['torn']} with the right room but a torn row (digest only; "
                     f"{tp['settled']} more held until whole by gate.settle_ms), "
                     f"{tp['hung']} hung; all-reduce "
                     + (f"{tp['allreduce_us_mean']} us" if tp['allreduce_us_mean'] is not None else "not timed"))
    pairs = results["pairs"]
    if len(pairs) > 1:
        rates = [p["handoffs_per_s"] for p in pairs.values() if p["handoffs_per_s"]]
        if rates:
            lines.append(f"{len(pairs)} pairs: {min(rates)}-{max(rates)} handoffs/s each "
                         "(results.json: pairs)")
    files = "results.json, requests.jsonl" + (", latency.png" if (Path(run_dir) / "latency.png").exists() else "")
    lines.append(f"run dir: {rel(run_dir)} ({files}, logs)")
    return "\n".join(lines)


def decode_summary(results: dict[str, Any], run_dir: Path) -> str:
    lines = [f"decode side at {results['bootstrap'] or '(no bootstrap address yet)'}: buffers on {results['plan']['buffer_device']}, "
             f"transport {results['effective_transport'] or results['declared_transport']}",
             f"judged {results['requests']} from prefill ranks {results['prefills_seen']}: verified "
             f"{results['verified']}, corrupted {results['corrupted']}, failed {results['failed']}"]
    if results["error"]:
        lines.insert(0, f"ERROR: {results['error']}")
    if results["interrupted"]:
        lines.insert(0, f"interrupted ({results['signal']}): counts so far")
    lines.append(f"run dir: {rel(run_dir)}")
    return "\n".join(lines)


def merge(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, bool]:
    """The summary of a run split across hosts, from its two run dirs' results: the
    prefill side's verdicts, the decode side's own counts, and whether they agree."""
    sides = {r.get("role", "both"): r for r in (a, b)}
    if set(sides) != {"prefill", "decode"}:
        raise ValueError("expected the run dirs of one role=prefill and one role=decode run")
    p, d = sides["prefill"], sides["decode"]
    agree = p["verified"] == d["verified"]
    lines = [summary(p, Path(p.get("run_dir", "prefill"))).rsplit("\n", 1)[0],
             f"decode side at {d['bootstrap']} judged {d['requests']}: verified {d['verified']}, "
             f"corrupted {d['corrupted']}, failed {d['failed']}",
             "both sides agree" if agree else
             f"THE SIDES DISAGREE: prefill verified {p['verified']}, decode verified {d['verified']}"]
    return "\n".join(lines), agree and p["exit_code"] == 0 and d["exit_code"] == 0


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.report SWEEP_DIR`: rebuild summary.csv, .md and .png;
    `python -m orchestrator.report PREFILL_RUN_DIR DECODE_RUN_DIR`: one summary of a run
    split across hosts."""
    import argparse
    import sys

    from .sweep import SweepError, summarize

    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.report",
        description="Rebuild the summary of a Hydra sweep dir, or merge the run dirs of the two "
                    "sides of a run across hosts into one summary.")
    parser.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                        help="a sweep dir (outputs/multirun/<date>/<time>), or two run dirs")
    args = parser.parse_args(argv)
    if len(args.dirs) == 2:
        try:
            a, b = (json.loads(RunFiles(d).results.read_text()) for d in args.dirs)
            text, ok = merge(a, b)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        print(text, flush=True)
        return 0 if ok else 1
    if len(args.dirs) != 1:
        print("error: one sweep dir, or two run dirs", file=sys.stderr, flush=True)
        return 2
    try:
        paths = summarize(args.dirs[0])
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for path in paths:
        print(rel(path), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
