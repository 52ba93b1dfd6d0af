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
import tempfile
import time
from pathlib import Path
from typing import Any

from orchestrator.job import failure
from orchestrator.preflight.compose import OneLineParser
from orchestrator.results.records import read_jsonl
from orchestrator.results.rundir import RunFiles, write_atomic
from orchestrator.results.schema import JobResults, Results

DECISION_KEYS = ("mem_pool", "buffer_device", "route", "reason", "transport", "row_bytes",
                 "outcome")


INSTANTIATE_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")
NOT_REPLAYABLE = "is not replayable: a replay takes the task config only (no hydra node, no _target_)"


class NotReplayable(Exception):
    """A run dir's saved config that replay will not run; str() is one line naming the file and
    the key."""


def _code_key(data: dict, prefix: str = "") -> str | None:
    """The first key of a saved config that would make Hydra run something rather than read a
    value: the hydra node (callbacks, launcher, sweeper, searchpath, job_logging ...), a
    defaults list (it picks configs, hydra's among them), or an instantiate key (_target_ ...)."""
    for key, value in data.items():
        name = f"{prefix}{key}"
        if not prefix and key == "hydra":
            sub = next(iter(value), None) if isinstance(value, dict) else None
            return f"hydra.{sub}" if sub is not None else "hydra"
        if not prefix and key == "defaults":
            return "defaults"
        if key in INSTANTIATE_KEYS:
            return name
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict):
                found = _code_key(item, f"{name}[{i}]." if isinstance(value, list) else f"{name}.")
                if found:
                    return found
    return None


def task_config(run_dir: Path) -> dict[str, Any]:
    """The run dir's saved task config (.hydra/config.yaml) as data: bounded before it is
    parsed (size, YAML aliases), parsed safely, refused if it carries anything Hydra would run
    (_code_key), and validated against the schema by a structured merge (nothing is
    instantiated). .hydra/hydra.yaml and overrides.yaml are never read: the replay's own Hydra
    config is conf/'s, and its only overrides are the run dir, the job name and the seed.

    Raises NotReplayable with one line naming the file and the key."""
    import yaml
    from omegaconf import OmegaConf

    from orchestrator.preflight.compose import yaml_bounds
    from orchestrator.profile.config import ConfigError, validate

    path = run_dir / ".hydra" / "config.yaml"
    if path.is_symlink():
        raise NotReplayable(f"{path}: a symlink (a replay reads the run dir's own file only)")
    problem = yaml_bounds(path)
    if problem is not None:
        raise NotReplayable(problem)
    try:
        data = yaml.safe_load(path.read_bytes())
    except (OSError, yaml.YAMLError) as exc:
        raise NotReplayable(f"{path}: not a readable YAML config ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise NotReplayable(f"{path}: not a mapping of config sections")
    key = _code_key(data)
    if key is not None:
        raise NotReplayable(f"{path}: {key} {NOT_REPLAYABLE}")
    try:
        validate(OmegaConf.create(data))
    except ConfigError as exc:
        raise NotReplayable(f"{path}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - OmegaConf's own refusals (a bad interpolation ...)
        raise NotReplayable(f"{path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return data


def _fill(run_dir: Path) -> str:
    import yaml

    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        return "inline"
    from orchestrator.preflight.compose import yaml_bounds

    problem = yaml_bounds(path)
    if problem is not None:
        raise NotReplayable(problem)
    cfg = yaml.safe_load(path.read_bytes()) or {}
    workload = cfg.get("workload") if isinstance(cfg, dict) else None
    return str((workload if isinstance(workload, dict) else {}).get("fill", "inline"))


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
        return failure.tell(failure.Refusal(f"{run_dir} is not a complete run dir (missing {', '.join(missing)})"))
    try:
        task = task_config(run_dir)
        seeds = json.loads((run_dir / "fingerprint.json").read_text()).get("seeds", {})
    except NotReplayable as exc:
        return failure.tell(failure.Refusal(str(exc)))
    except (OSError, ValueError, AttributeError) as exc:
        return failure.tell(failure.Refusal(f"{run_dir / 'fingerprint.json'}: not a readable fingerprint "
                                            f"({exc})"))
    out = (args.out or run_dir / "replays" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    drawn = seeds.get("workload.seed") if isinstance(seeds, dict) and seeds.get("drawn") else None
    if drawn is not None and (isinstance(drawn, bool) or not isinstance(drawn, int)):
        return failure.tell(failure.Refusal(f"{run_dir / 'fingerprint.json'}: seeds.workload.seed={drawn!r} "
                                            "is not a whole number"))
    with tempfile.TemporaryDirectory(prefix="replay-config-") as conf:
        # the task config only, re-written from the data checked above: Hydra sees one file in a
        # fresh dir (no config group of the run dir, no hydra.yaml, no overrides.yaml)
        import yaml

        (Path(conf) / "config.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
        cmd = [sys.executable, "-m", "orchestrator", "--config-path", conf,
               "--config-name", "config", f"hydra.run.dir={out}", "hydra.job.name=orchestrator"]
        if drawn is not None:  # the run drew its seed
            cmd.append(f"workload.seed={drawn}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if not RunFiles(out).results.exists():
        return failure.tell(failure.Refusal(f"the replay did not produce results (exit {proc.returncode}):\n"
                                            f"{proc.stderr[-2000:]}"))
    try:
        rep = compare(run_dir, out)
    except NotReplayable as exc:
        return failure.tell(failure.Refusal(str(exc)))
    write_atomic(out / "replay.json", json.dumps(rep, indent=2) + "\n")
    print(render(rep))
    codes = rep.get("exit_codes") or {}
    same_ending = codes.get("original") == codes.get("replay")  # a run that now ends otherwise differs
    return 0 if rep["requests_identical"] and rep["decisions_identical"] and same_ending else 1


if __name__ == "__main__":
    raise SystemExit(main())
