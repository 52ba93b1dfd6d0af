"""`python -m orchestrator.replay RUN_DIR [--out DIR]`: re-run a run dir and compare.

The saved composed config (.hydra/config.yaml) is run again through the same entry point
(`python -m orchestrator`), into RUN_DIR/replays/<time>/ unless --out is given. Then:
- deterministic outputs must be identical: per request (by rid) the bootstrap room, the
  row's content fingerprint and the outcome; per decision (by rid and decode process)
  mem_pool, buffer_device, route, reason, transport, row_bytes and outcome. Slots, send
  grouping and timestamps are left out: slots are drawn at random, and which requests share
  a coalesced send depends on timing. With workload.fill=ahead a row's content is its
  slot's, so the fingerprint is left out too.
- latencies are compared as ratios (replay / original) of p50, p99, p999;
- the fingerprints (packages, git commit, GPUs, MC_* env) are diffed to explain changes.
Exit 0 when the deterministic outputs and the two exit codes are identical, 1 when they differ,
2 on bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.preflight.compose import OneLineParser
from orchestrator.results.records import read_jsonl
from orchestrator.results.rundir import RunFiles
from orchestrator.results.schema import JobResults, Results

DECISION_KEYS = ("mem_pool", "buffer_device", "route", "reason", "transport", "row_bytes",
                 "outcome")


def _fill(run_dir: Path) -> str:
    import yaml

    path = run_dir / ".hydra" / "config.yaml"
    cfg = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    return str((cfg.get("workload") or {}).get("fill", "inline"))


def deterministic(run_dir: Path) -> dict[str, Any]:
    content = _fill(run_dir) != "ahead"
    requests = {r["rid"]: (r["room"], r["checksum"] if content else None, r["outcome"])
                for path in RunFiles(run_dir).all_requests() for r in read_jsonl(path, strict=True)}
    decisions = {(d["rid"], d["decode"]): tuple(d.get(k) for k in DECISION_KEYS)
                 for path in RunFiles(run_dir).all_decisions() for d in read_jsonl(path, strict=True)}
    return {"requests": requests, "decisions": decisions}


def _diff(a: dict, b: dict, limit: int = 5) -> list[str]:
    out = []
    for key in sorted(set(a) | set(b), key=str):
        if a.get(key) != b.get(key):
            out.append(f"{key}: {a.get(key)} -> {b.get(key)}")
            if len(out) >= limit:
                break
    return out


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out


def _host(run_dir: Path) -> dict[str, Any]:
    """fingerprint.json's `host` (CPU count, load averages at start; {} for a run dir written
    before it was recorded)."""
    host = json.loads((run_dir / "fingerprint.json").read_text()).get("host")
    return host if isinstance(host, dict) else {}


def _load_line(host: dict[str, Any]) -> str:
    load = host.get("load_avg")
    if not host:
        return "not recorded"
    avg = "/".join(f"{x:g}" for x in load) if isinstance(load, list) else "?"
    return f"load {avg} (1/5/15 min) on {host.get('cpu_count', '?')} CPUs"


def compare(original: Path, replay: Path) -> dict[str, Any]:
    a, b = deterministic(original), deterministic(replay)
    ra, rb = Results.read(original), Results.read(replay)
    assert isinstance(ra, JobResults) and isinstance(rb, JobResults)  # both runs ran (their latencies are read)
    latency = {}
    for metric in ("send_aux", "handoff"):
        pa, pb = (getattr(r.latency_us, metric) for r in (ra, rb))
        for q, x, y in zip(("p50", "p99", "p999"), (pa.p50, pa.p99, pa.p999), (pb.p50, pb.p99, pb.p999)):
            latency[f"{metric}.{q}"] = {"original_us": x, "replay_us": y,
                                        "ratio": round(y / x, 3) if x and y else None}
    fa = _flatten(json.loads((original / "fingerprint.json").read_text()))
    fb = _flatten(json.loads((replay / "fingerprint.json").read_text()))
    ignore = ("hostname", "host.load_avg")  # the load is printed beside the ratios instead
    env_diff = {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb))
                if fa.get(k) != fb.get(k) and not k.startswith(ignore)}
    return {
        "original": str(original), "replay": str(replay),
        "requests_identical": a["requests"] == b["requests"],
        "decisions_identical": a["decisions"] == b["decisions"],
        "requests_compared": len(a["requests"]), "decisions_compared": len(a["decisions"]),
        "request_differences": _diff(a["requests"], b["requests"]),
        "decision_differences": _diff(a["decisions"], b["decisions"]),
        "latency": latency,
        "fingerprint_differences": env_diff,
        "host": {"original": _host(original), "replay": _host(replay)},
        "exit_codes": {"original": ra.exit_code, "replay": rb.exit_code},
    }


def render(rep: dict[str, Any]) -> str:
    same = rep["requests_identical"] and rep["decisions_identical"]
    lines = [
        f"replay of {rep['original']}",
        f"  into {rep['replay']}",
        f"deterministic outputs: {'IDENTICAL' if same else 'DIFFERENT'} "
        f"({rep['requests_compared']} request checksums, {rep['decisions_compared']} decisions)",
    ]
    for d in rep["request_differences"] + rep["decision_differences"]:
        lines.append(f"  differs: {d}")
    codes = rep.get("exit_codes") or {}
    if codes:
        same_code = codes.get("original") == codes.get("replay")
        lines.append(f"exit code: original {codes.get('original')}, replay {codes.get('replay')}"
                     + ("" if same_code else "  (DIFFERENT)")
                     + ("; this command exits 0: the outputs are identical, the run's own outcome "
                        "is the exit code above" if same_code and codes.get("original") else ""))
    host = rep.get("host") or {}
    lines.append("latency (replay / original), read against each run's load at start:")
    lines.append(f"  original: {_load_line(host.get('original') or {})}")
    lines.append(f"  replay:   {_load_line(host.get('replay') or {})}")
    for name, v in rep["latency"].items():
        lines.append(f"  {name:<15} {v['original_us']} -> {v['replay_us']} us  x{v['ratio']}")
    if rep["fingerprint_differences"]:
        lines.append("environment differences:")
        for k, (x, y) in rep["fingerprint_differences"].items():
            lines.append(f"  {k}: {x} -> {y}")
    else:
        lines.append("environment: same fingerprint")
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m orchestrator.replay", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where the replay runs")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dir = args.run_dir.resolve()
    needed = [".hydra/config.yaml", "results.json", "fingerprint.json"]
    missing = [n for n in needed if not (run_dir / n).exists()]
    for pattern in ("requests", "decisions"):
        if not list(run_dir.glob(f"{pattern}*.jsonl")):
            missing.append(f"{pattern}.jsonl")
    if missing:
        print(f"error: {run_dir} is not a complete run dir (missing {', '.join(missing)})",
              file=sys.stderr)
        return 2
    out = (args.out or run_dir / "replays" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    cmd = [sys.executable, "-m", "orchestrator", "--config-path", str(run_dir / ".hydra"),
           "--config-name", "config", f"hydra.run.dir={out}", "hydra.job.name=orchestrator"]
    seeds = json.loads((run_dir / "fingerprint.json").read_text()).get("seeds", {})
    if seeds.get("drawn") and seeds.get("workload.seed") is not None:  # the run drew its seed
        cmd.append(f"workload.seed={seeds['workload.seed']}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not RunFiles(out).results.exists():
        print(f"error: the replay did not produce results (exit {proc.returncode}):\n"
              f"{proc.stderr[-2000:]}", file=sys.stderr)
        return 2
    rep = compare(run_dir, out)
    (out / "replay.json").write_text(json.dumps(rep, indent=2) + "\n")
    print(render(rep))
    codes = rep.get("exit_codes") or {}
    same_ending = codes.get("original") == codes.get("replay")  # a run that now ends otherwise differs
    return 0 if rep["requests_identical"] and rep["decisions_identical"] and same_ending else 1


if __name__ == "__main__":
    raise SystemExit(main())
