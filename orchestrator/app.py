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
from .config import ConfigError, OrchestratorConfig, Role, resolve_host, resolve_seed, validate
from .logs import configure
from .platform import detect
from .progress import Progress
from .results import NoSpace, lock_run_dir, write_atomic
from .rules import check_profile
from .rundir import RunFiles
from .lifecycle import Signals
from .runner import run_handoffs


def run_job(cfg: DictConfig | OrchestratorConfig, run_dir: Path) -> dict[str, Any]:
    """Raises ConfigError for user mistakes (before anything starts). SIGINT and SIGTERM
    end the job with what it measured (results.json says interrupted)."""
    lock = lock_run_dir(run_dir)  # one run per run dir (RunDirBusy: refused, exit 2)
    try:
        with Signals() as signals:
            return _run_job(cfg, run_dir, signals)
    finally:
        lock.close()


def _run_job(cfg, run_dir: Path, signals: Signals) -> dict[str, Any]:
    logging.raiseExceptions = False  # a log handler on a full disk must not print tracebacks
    obj = validate(cfg)
    resolve_host(obj)
    drawn = resolve_seed(obj)
    plan = check_profile(obj, detect())
    log = configure(run_dir, "orchestrator", keep_root_handlers=True,
                    console_level=logging.INFO if obj.logging.console else logging.WARNING)
    log.info("plan", **plan.as_dict())
    for event in plan.events:
        log.warning(event.event, reason=event.reason.value, detail=event.detail)
    fp = fingerprint.collect(obj, plan)
    fp["seeds"]["drawn"] = drawn  # replay passes a drawn seed back (orchestrator.replay)
    write_atomic(run_dir / "fingerprint.json", json.dumps(fp, indent=2) + "\n")

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
    try:
        _write_outputs(obj, run_dir, results)
    except NoSpace as exc:  # after start: one line, exit 3, nothing torn or empty left
        results.update(exit_code=report.EXIT_LOST, error=str(exc))
        if exc.path.name != RunFiles.RESULTS:  # it was written: say how the run ended
            try:
                report.write(run_dir, results)
            except OSError:
                pass
        print(f"error: no space left writing {report.rel(exc.path)}", file=sys.stderr, flush=True)
        return results
    log.info("results", **{k: results.get(k) for k in ("requests", "verified", "corrupted", "failed",
                                                      "routes", "effective_transport", "exit_code")})
    print(report.summary(results, run_dir), flush=True)
    return results


def _write_outputs(obj: OrchestratorConfig, run_dir: Path, results: dict[str, Any]) -> None:
    report.write(run_dir, results)
    if obj.role is not Role.decode and not results["interrupted"]:  # an interrupt ends in 2 s
        plan_d = results["plan"]
        png = run_dir / plots.LATENCY_PNG
        lat = results["latency_us"]
        try:
            plots.run_latency_png(run_dir, f"mem_pool={plan_d['mem_pool']}, buffers on {plan_d['buffer_device']}, "
                                           f"{results['effective_transport'] or plan_d['declared_transport']}"
                                           f"   run {plots.short_dir(run_dir)}",
                                  marks={"send_aux": lat["send_aux"], "taken": lat["taken"],
                                         "handoff": lat["handoff"], "from arrival": lat["e2e"]},
                                  arrival=obj.workload.rate is not None)
        except OSError as exc:
            png.unlink(missing_ok=True)  # no torn or empty image left behind
            if exc.errno in (28, 122):
                raise NoSpace(png) from None
            raise


def refused(run_dir: Path, exc: ConfigError, announce: bool = True) -> dict[str, Any]:
    """A profile refused before start: the run dir keeps the one line in results.json, and
    the line goes to stderr."""
    results = {"refused": str(exc), "key": exc.key, "exit_code": report.EXIT_REFUSED,
               "requests": 0, "verified": 0, "corrupted": 0, "failed": 0, "error": str(exc)}
    write_atomic(RunFiles(run_dir).results, json.dumps(results, indent=2) + "\n")
    if announce:
        print(f"error: {exc}", file=sys.stderr, flush=True)
    return results


def no_space(run_dir: Path, exc: NoSpace) -> dict[str, Any]:
    """The disk filled after start: one line, exit 3, and results.json when it still fits."""
    results = {"requests": 0, "verified": 0, "corrupted": 0, "failed": 0, "error": str(exc),
               "exit_code": report.EXIT_LOST}
    print(f"error: no space left writing {report.rel(exc.path)}", file=sys.stderr, flush=True)
    if exc.path.name != RunFiles.RESULTS:
        try:
            write_atomic(RunFiles(run_dir).results, json.dumps(results, indent=2) + "\n")
        except OSError:
            pass
    return results


def failed_job(run_dir: Path, error: str) -> dict[str, Any]:
    """results.json for a sweep job that raised (the sweep records it as a failed row)."""
    results = {"requests": 0, "verified": 0, "corrupted": 0, "failed": 0, "routes": {},
               "error": error, "exit_code": report.EXIT_LOST}
    write_atomic(RunFiles(run_dir).results, json.dumps(results, indent=2) + "\n")
    print(f"job failed: {error}", file=sys.stderr, flush=True)
    return results
