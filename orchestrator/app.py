"""The task: check the profile, plan, run the handoffs, report. Called by __main__ under
Hydra, once per job (also inside launcher workers, hence logging is configured here)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from . import fingerprint, plots, report
from .config import ConfigError, OrchestratorConfig, Role, resolve_host, validate
from .logs import configure
from .platform import detect
from .progress import Progress
from .results import write_atomic
from .rules import check_profile
from .runner import Signals, run_handoffs


def run_job(cfg: DictConfig | OrchestratorConfig, run_dir: Path) -> dict[str, Any]:
    """Raises ConfigError for user mistakes (before anything starts). SIGINT and SIGTERM
    end the job with what it measured (results.json says interrupted)."""
    with Signals() as signals:
        return _run_job(cfg, run_dir, signals)


def _run_job(cfg, run_dir: Path, signals: Signals) -> dict[str, Any]:
    obj = validate(cfg)
    resolve_host(obj)
    plan = check_profile(obj, detect())
    log = configure(run_dir, "orchestrator", keep_root_handlers=True,
                    console_level=logging.INFO if obj.logging.console else logging.WARNING)
    log.info("plan", **plan.as_dict())
    for event in plan.events:
        log.warning(event.event, reason=event.reason.value, detail=event.detail)
    write_atomic(run_dir / "fingerprint.json", json.dumps(fingerprint.collect(obj, plan), indent=2) + "\n")

    total = obj.workload.requests * obj.endpoints.prefill_ranks  # requests are per prefill rank
    progress = Progress(total, log) if obj.role is not Role.decode else None
    try:
        out = run_handoffs(obj, plan, run_dir, progress=progress, signals=signals)
    finally:
        if progress is not None:
            progress.close()
    results = (report.build_decode_side(obj, plan, out) if obj.role is Role.decode
               else report.build_results(obj, plan, out))
    results["role"], results["run_dir"] = obj.role.value, str(run_dir)
    report.write(run_dir, results)
    if obj.role is not Role.decode and not results["interrupted"]:  # an interrupt ends in 2 s
        plan_d = results["plan"]
        lat = results["latency_us"]
        plots.run_latency_png(run_dir, f"mem_pool={plan_d['mem_pool']}, buffers on {plan_d['buffer_device']}, "
                                       f"{results['effective_transport'] or plan_d['declared_transport']}"
                                       f"   run {plots.short_dir(run_dir)}",
                              marks={"send_aux": lat["send_aux"], "handoff": lat["handoff"],
                                     "from arrival": lat["e2e"]},
                              arrival=obj.workload.rate is not None)
    log.info("results", **{k: results.get(k) for k in ("requests", "verified", "corrupted", "failed",
                                                      "routes", "effective_transport", "exit_code")})
    print(report.summary(results, run_dir), flush=True)
    return results


def refused(run_dir: Path, exc: ConfigError, announce: bool = True) -> dict[str, Any]:
    """A profile refused before start: the run dir keeps the one line in results.json, and
    the line goes to stderr."""
    results = {"refused": str(exc), "key": exc.key, "exit_code": report.EXIT_REFUSED,
               "requests": 0, "verified": 0, "corrupted": 0, "failed": 0, "error": str(exc)}
    write_atomic(run_dir / "results.json", json.dumps(results, indent=2) + "\n")
    if announce:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return results


def failed_job(run_dir: Path, error: str) -> dict[str, Any]:
    """results.json for a sweep job that raised (the sweep records it as a failed row)."""
    results = {"requests": 0, "verified": 0, "corrupted": 0, "failed": 0, "routes": {},
               "error": error, "exit_code": report.EXIT_LOST}
    write_atomic(run_dir / "results.json", json.dumps(results, indent=2) + "\n")
    print(f"job failed: {error}", file=sys.stderr, flush=True)
    return results
