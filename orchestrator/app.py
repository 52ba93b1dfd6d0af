"""The task: validate the config, plan, run the handoffs, report. Called by __main__ under
Hydra, once per job (also inside launcher workers, hence logging is configured here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from . import auth, faults, fingerprint, report
from .config import ConfigError, validate
from .logs import configure
from .plan import make_plan
from .platform import detect
from .progress import Progress
from .runner import run_handoffs


def run_job(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Raises ConfigError for user mistakes (before anything starts)."""
    log = configure(run_dir, "orchestrator", keep_root_handlers=True)
    obj = validate(cfg)
    plan = make_plan(obj, detect())
    faults.check(obj.faults, plan)
    auth.from_env(obj.transport.secret_env)  # a named but unset secret is a config mistake
    log.info("plan", **plan.as_dict())
    for event in plan.events:
        log.warning(event.event, reason=event.reason.value, detail=event.detail)

    (run_dir / "fingerprint.json").write_text(json.dumps(fingerprint.collect(obj, plan), indent=2) + "\n")

    total = obj.workload.requests * obj.endpoints.prefill_ranks  # requests are per prefill rank
    progress = Progress(total, log)
    try:
        out = run_handoffs(obj, plan, run_dir, progress=progress)
    finally:
        progress.close()
    results = report.build_results(total, plan, out)
    report.write(run_dir, results)
    log.info("results", **{k: results[k] for k in ("requests", "verified", "corrupted", "failed",
                                                  "routes", "effective_transport")})
    print(report.summary(results, run_dir), flush=True)
    return results


def user_error(exc: ConfigError) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def failed_job(run_dir: Path, cfg: DictConfig, error: str) -> dict[str, Any]:
    """results.json for a job that could not run (sweeps record it as a failed row)."""
    requests = (OmegaConf.select(cfg, "workload.requests", default=0)
                * OmegaConf.select(cfg, "endpoints.prefill_ranks", default=1))
    results = {"requests": requests, "verified": 0, "corrupted": 0, "failed": requests,
               "routes": {}, "error": error}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"job failed: {error}", file=sys.stderr, flush=True)
    return results
