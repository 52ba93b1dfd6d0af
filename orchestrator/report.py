"""Turn what the endpoints measured into results.json and a console summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .plan import Plan
from .runner import RunOutput
from .stats import LatencyHistogram

def _pairs(t: dict, wall: float) -> dict[str, dict]:
    """Per prefill->decode pair: counts, deliver latency, handoffs/s over the rank's wall time."""
    out = {}
    for name, p in sorted(t.get("pairs", {}).items()):
        verified = p["outcomes"].get("verified", 0)
        pair_wall = p.get("wall_s") or wall
        out[name] = {"requests": sum(p["outcomes"].values()), "verified": verified,
                     "deliver_us": LatencyHistogram.from_dict(p["deliver_us"]).summary(),
                     "handoffs_per_s": round(verified / pair_wall, 1) if pair_wall else None}
    return out


def _per_decode(stats: dict, key: str) -> Any:
    """decode_stats is flat for one decode rank, keyed by rank name for several."""
    if "verified" in stats:
        return stats.get(key, {} if key == "memory" else 0)
    values = {name: s.get(key) for name, s in stats.items()}
    return values if key == "memory" else sum(v or 0 for v in values.values())


def build_results(requests: int, plan: Plan, out: RunOutput) -> dict[str, Any]:
    t = out.tally
    outcomes = t.get("outcomes", {})
    verified, corrupted = outcomes.get("verified", 0), outcomes.get("corrupted", 0)
    wall = out.wall_s
    transports = set(out.transports.values())
    effective = transports.pop() if len(transports) == 1 else (
        "mixed:" + ",".join(f"{k}={v}" for k, v in sorted(out.transports.items()))
        if transports else None)
    return {
        "requests": requests,
        "verified": verified,
        "corrupted": corrupted,
        "failed": requests - verified - corrupted,
        "routes": t.get("routes", {}),
        "failure_reasons": t.get("reasons", {}),
        "latency_us": {
            key: LatencyHistogram.from_dict(t.get(field)).summary()
            for key, field in (("send_aux", "send_us"), ("deliver", "deliver_us"),
                               ("handoff", "handoff_us"))
        },
        "handoffs_per_s": round(verified / wall, 1) if wall > 0 else None,
        "mb_per_s": round(verified * out.row_bytes / wall / 1e6, 3) if wall > 0 else None,
        "bytes_per_request": out.row_bytes,
        "wall_s": round(wall, 4),
        "effective_transport": effective,
        "declared_transport": plan.declared_transport,
        "endpoint_transports": out.transports,
        "pairs": _pairs(t, wall),
        "memory_kb": {"prefill": t.get("memory", {}), "decode": _per_decode(out.decode_stats, "memory")},
        "rejected_auth": t.get("rejected_auth", 0) + _per_decode(out.decode_stats, "rejected_auth"),
        "faults_applied": out.faults_applied,
        "engine_listeners_beyond_loopback": out.engine_exposed,
        "decode_stats": out.decode_stats,
        "plan": plan.as_dict(),
        "error": out.error,
    }


def write(run_dir: Path, results: dict[str, Any]) -> None:
    """results.json (requests.jsonl was streamed by the prefill endpoint)."""
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")


def summary(results: dict[str, Any], run_dir: Path) -> str:
    lat = results["latency_us"]
    def fmt(d):
        return " / ".join("-" if v is None else f"{v:g}" for v in (d["p50"], d["p99"], d["p999"]))
    routes = ", ".join(f"{k}={v}" for k, v in sorted(results["routes"].items())) or "none"
    lines = [
        f"mem_pool={results['plan']['mem_pool']} buffers on {results['plan']['buffer_device']}, "
        f"route {results['plan']['route']} ({results['plan']['route_reason']}), "
        f"transport {results['effective_transport']}",
        f"requests {results['requests']}: verified {results['verified']}, "
        f"corrupted {results['corrupted']}, failed {results['failed']}   routes: {routes}",
        f"send_aux p50/p99/p999 us: {fmt(lat['send_aux'])}   handoff: {fmt(lat['handoff'])}",
        f"{results['handoffs_per_s']} handoffs/s, {results['mb_per_s']} MB/s "
        f"({results['bytes_per_request']} B per request)",
        f"run dir: {run_dir}",
    ]
    if results["error"]:
        lines.insert(0, f"ERROR: {results['error']}")
    if len(results.get("pairs", {})) > 1:
        for name, p in results["pairs"].items():
            lines.insert(-1, f"  pair {name}: verified {p['verified']}/{p['requests']}, deliver p50/p99 us "
                             f"{p['deliver_us']['p50']} / {p['deliver_us']['p99']}, {p['handoffs_per_s']} handoffs/s")
    if results.get("engine_listeners_beyond_loopback"):
        lines.insert(-1, "note: Mooncake's own listeners are not on loopback: "
                     + ", ".join(results["engine_listeners_beyond_loopback"])
                     + " (its handshake/TCP ports bind all interfaces; see RELIABILITY.md)")
    if results["failure_reasons"]:
        lines.insert(-1, "failures: " + ", ".join(f"{k}={v}" for k, v in results["failure_reasons"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m orchestrator.report <sweep_dir>`: rebuild summary.csv, .md and .png."""
    import argparse
    import sys

    from .sweep import SweepError, summarize

    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.report",
        description="Rebuild summary.csv, summary.md and summary.png of a Hydra sweep dir.")
    parser.add_argument("sweep_dir", type=Path, help="e.g. outputs/multirun/<date>/<time>")
    args = parser.parse_args(argv)
    try:
        paths = summarize(args.sweep_dir)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for path in paths:
        print(path, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
