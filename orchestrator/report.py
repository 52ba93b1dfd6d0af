"""Turn what the endpoints measured into results.json and a console summary."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from .endpoints.prefill import RECORD_FIELDS
from .plan import Plan
from .runner import RunOutput
from .stats import latency_summary

_I = {name: i for i, name in enumerate(RECORD_FIELDS)}


def build_results(requests: int, plan: Plan, out: RunOutput) -> dict[str, Any]:
    recs = out.records
    outcomes = Counter(r[_I["outcome"]] for r in recs)
    routes = Counter(r[_I["route"]] for r in recs if r[_I["route"]])
    sent = [r for r in recs if r[_I["route"]]]
    verified = outcomes.get("verified", 0)
    wall = out.wall_s
    transports = set(out.transports.values())
    effective = transports.pop() if len(transports) == 1 else (
        "mixed:" + ",".join(f"{k}={v}" for k, v in sorted(out.transports.items()))
        if transports else None)
    return {
        "requests": requests,
        "verified": verified,
        "corrupted": outcomes.get("corrupted", 0),
        "failed": requests - verified - outcomes.get("corrupted", 0),
        "routes": dict(routes),
        "failure_reasons": dict(Counter(r[_I["detail"]] for r in recs if r[_I["outcome"]] != "verified")),
        "latency_us": {
            "send_aux": latency_summary([r[_I["send_us"]] for r in sent]),
            "deliver": latency_summary([r[_I["deliver_us"]] for r in sent if r[_I["outcome"]] == "verified"]),
            "handoff": latency_summary([r[_I["handoff_us"]] for r in sent if r[_I["outcome"]] == "verified"]),
        },
        "handoffs_per_s": round(verified / wall, 1) if wall > 0 else None,
        "mb_per_s": round(verified * out.row_bytes / wall / 1e6, 3) if wall > 0 else None,
        "bytes_per_request": out.row_bytes,
        "wall_s": round(wall, 4),
        "effective_transport": effective,
        "declared_transport": plan.declared_transport,
        "endpoint_transports": out.transports,
        "decode_stats": out.decode_stats,
        "plan": plan.as_dict(),
        "error": out.error,
    }


def write(run_dir: Path, results: dict[str, Any], out: RunOutput) -> None:
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    with open(run_dir / "requests.jsonl", "w") as fh:
        for rec in out.records:
            fh.write(json.dumps(dict(zip(RECORD_FIELDS, rec))) + "\n")


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
    if results["failure_reasons"]:
        lines.insert(-1, "failures: " + ", ".join(f"{k}={v}" for k, v in results["failure_reasons"].items()))
    return "\n".join(lines)
