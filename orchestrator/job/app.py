"""The task: check the profile, plan, run the handoffs, report. Called by __main__ under
Hydra, once per job (also inside launcher workers, hence logging is configured here)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig
from structlog.stdlib import BoundLogger

from orchestrator.job import failure, warmstart
from orchestrator.job.check import check_profile
from orchestrator.job.lifecycle import Signals
from orchestrator.job.specs import build_specs
from orchestrator.profile.config import (
    LoggingConfig,
    OrchestratorConfig,
    WorkloadConfig,
    typed,
    validate,
)
from orchestrator.profile.kinds import ConfigError, Role
from orchestrator.profile.plan import Plan
from orchestrator.profile.platform import detect
from orchestrator.results import fingerprint, plots, reporting
from orchestrator.results.logs import configure
from orchestrator.results.progress import ProgressMeter, mode_for
from orchestrator.results.report_spec import ReportSpec
from orchestrator.results.rundir import (
    NoSpace,
    RunDirBusy,
    RunFiles,
    claim_run_dir,
    lock_run_dir,
    new_run_id,
    refuse_foreign,
    safe_dir,
    sweep_owner,
    unlock_run_dir,
    write_atomic,
)
from orchestrator.results.schema import DecodeSideResults, JobResults, NotRun, Results

R = TypeVar("R", bound=Results)
# What a job is doing before its own signal handlers are in place (python -m orchestrator's
# interrupt line names it; None: the job's handlers say it themselves, or no job runs)
PHASE: list[Optional[str]] = [None]


def run_job(cfg: DictConfig | OrchestratorConfig, run_dir: Path) -> Results:
    """Raises ConfigError for user mistakes (before anything starts). SIGINT and SIGTERM
    end the job with what it measured (results.json says interrupted)."""
    PHASE[0] = "preparing the run dir"
    lock = lock_run_dir(run_dir)  # one run per run dir (RunDirBusy: refused, exit 2)
    try:
        own_run_dir(run_dir)  # another run's files there: refused (RunDirBusy), never overwritten
        save_hydra(cfg, run_dir)  # .hydra/ only under the lock: a loser writes nothing
        PHASE[0] = "starting the children"
        with Signals() as signals:
            logging.raiseExceptions = False  # a log handler on a full disk must not print tracebacks
            given = typed(cfg)
            obj = validate(given, resolve=True)  # host and seed resolved in a new config, then checked: once
            plan = check_profile(obj, detect())
            warmstart.start_early()  # the children's imports, beside the rest of this start-up
            specs = build_specs(obj, plan)  # what the runner, the endpoints and the report read: once
            log = _log_plan(run_dir, obj.logging, plan)
            _write_fingerprint(run_dir, obj.workload, plan, drawn=given.workload.seed is None)
            w, lg = obj.workload, obj.logging
            total = w.requests * obj.endpoints.prefill_ranks  # requests are per prefill rank
            progress = (ProgressMeter(total if w.duration_s is None else None, log, every_s=lg.progress_every_s,
                                      mode=mode_for(lg.progress, lg.console), duration_s=w.duration_s)
                        if obj.role is not Role.decode else None)
            from orchestrator.job.runner import run_handoffs  # torch and the rest: only to run

            drawer = plots.Drawer(run_dir) if obj.role is not Role.decode else None
            try:
                out = run_handoffs(specs, run_dir, progress=progress, signals=signals,
                                   after_watch=drawer.start if drawer is not None else None)
            finally:
                if progress is not None:
                    progress.close()
            spec = specs.report
            results = (reporting.build_decode_side(spec, plan, out) if spec.role is Role.decode
                       else reporting.build_results(spec, plan, out))
            return _finish(spec, run_dir, results, out.no_space, log, drawer)
    finally:
        unlock_run_dir(lock)  # last: no .run.lock with a dead pid stays behind
        PHASE[0] = None


HYDRA_SUBDIR = ".hydra"


def own_run_dir(run_dir: Path) -> None:
    """Under the run dir's lock: refuse a dir that holds another run's files (rundir.
    refuse_foreign: RunDirBusy, exit 2; nothing of theirs is touched), then claim it for a
    new run id (rundir.claim_run_dir), of the sweep that owns the sweep dir for a sweep's job.
    Every records, verdicts and decisions line of the run then carries that id, and readers
    (recovery, the report, replay) count only the lines of the dir's own run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc: Any = HydraConfig.get() if HydraConfig.initialized() else None
    ignore: set[str] = set()
    where = f"hydra.run.dir={run_dir}"
    sweep: Optional[str] = None
    if hc is not None:
        if hc.output_subdir is not None:  # Hydra saved it itself, before this job began
            ignore.add(str(hc.output_subdir))
        if hc.mode is RunMode.MULTIRUN:
            where = f"the job dir {run_dir}"
            sweep = sweep_owner(Path(hc.sweep.dir))
    refuse_foreign(run_dir, where, ignore)
    claim_run_dir(run_dir, new_run_id(), sweep)


def save_hydra(cfg: object, run_dir: Path) -> None:
    """What Hydra's own run_job would have saved to `.hydra/` (the entry point turns that
    off: hydra.output_subdir=null) for the job config `cfg`, saved here under the run dir's
    lock, atomically; a full disk raises NoSpace naming the file. Nothing outside a Hydra
    job (tests, the bench), or where Hydra saved it itself (hydra.output_subdir set)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    hc: Any = HydraConfig.instance().cfg if HydraConfig.initialized() else None  # {"hydra": ...}
    if hc is None or not isinstance(cfg, DictConfig) or hc.hydra.output_subdir is not None:
        return
    out = safe_dir(run_dir / HYDRA_SUBDIR)  # a link or a stranger's dir there: UnsafePath (exit 2)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hc), ("overrides.yaml", hc.hydra.overrides.task)):
        write_atomic(out / name, OmegaConf.to_yaml(node))


def _log_plan(run_dir: Path, logs: LoggingConfig, plan: Plan) -> BoundLogger:
    """The run's structured log (logging.console: on the console too), opened with the plan."""
    log = configure(run_dir, "orchestrator", keep_root_handlers=True,
                    console_level=logging.INFO if logs.console else logging.WARNING)
    log.info("plan", **plan.as_dict())
    for event in plan.events:
        log.warning(event.event, reason=event.reason.value, detail=event.detail)
    return log


def _write_fingerprint(run_dir: Path, workload: WorkloadConfig, plan: Plan, drawn: bool) -> None:
    fp = fingerprint.collect(workload, plan)
    fp["seeds"]["drawn"] = drawn  # replay passes a drawn seed back (orchestrator.replay)
    write_atomic(run_dir / "fingerprint.json", json.dumps(fp, indent=2) + "\n")


def _finish(spec: ReportSpec, run_dir: Path, results: JobResults | DecodeSideResults,
            no_space: Optional[str], log: BoundLogger, drawer: Optional[plots.Drawer] = None) -> Results:
    """results.json, the summary as soon as it is written, then latency.png (drawn by
    `drawer`'s process, which started when the handoffs ended; waited for here); a full disk
    (`no_space`: the file an endpoint or the runner could not write) ends it in one line."""
    results.role, results.run_dir = spec.role.value, str(run_dir)
    if no_space is not None:  # an endpoint's file, or a record the runner appended
        full = NoSpace(no_space)
        results.failed_writing(str(full))
        try:
            _write_outputs(spec, run_dir, results)
        except NoSpace:
            pass
        if drawer is not None:
            drawer.wait()
        return _no_space(run_dir, results, full)
    try:
        _write_outputs(spec, run_dir, results, drawer)
    except NoSpace as exc:  # after start: one line, exit 3, nothing torn or empty left
        if drawer is not None:
            drawer.wait()
        results.failed_writing(str(exc))
        return _no_space(run_dir, results, exc)
    log.info("results", **results.headline())
    late = (isinstance(results, JobResults) and _plotted(spec, results) and results.ending.interrupted
            and results.latency_us.send_aux.measured)  # an interrupted run's latency.png
    text = reporting.summary(results, run_dir, plot=late, drawing=drawer is not None and drawer.asked)
    print(text, flush=True)
    _save_summary(run_dir, text)
    drawn = drawer.wait() if drawer is not None else None  # (after the summary: off its path)
    if drawn == "no space":
        full = NoSpace(run_dir / plots.LATENCY_PNG)
        results.failed_writing(str(full))
        return _no_space(run_dir, results, full)
    if drawn is not None:
        print(f"warning: {plots.LATENCY_PNG} not drawn: {drawn}", file=sys.stderr, flush=True)
    if _verbose():
        print(_phases_line(results), flush=True)
    if late:  # drawn beside and after this process's exit: a stop ends in about 2 s
        assert isinstance(results, JobResults)
        plots.draw_later(run_dir, _latency_title(spec, run_dir, results), spec.load.rate is not None,
                         spec.percentiles)
    return results


def _save_summary(run_dir: Path, text: str) -> None:
    """summary.txt: the console's summary, as printed (a full disk loses only this copy)."""
    try:
        write_atomic(run_dir / SUMMARY_TXT, text + "\n")
    except (OSError, NoSpace):
        pass


SUMMARY_TXT = "summary.txt"


def _verbose() -> bool:
    """hydra.verbose set (true, or a list of loggers) in this Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and bool(HydraConfig.get().verbose)


def _phases_line(results: JobResults | DecodeSideResults) -> str:
    """hydra.verbose: each process's start-up, phase by phase (results.json startup_phases)."""
    per = results.timing.startup_phases or {}
    return "start-up phases (s): " + ("; ".join(
        f"{name} " + ", ".join(f"{phase} {s:g}" for phase, s in phases.items()) for name, phases in per.items())
        or "none measured")


def _plotted(spec: ReportSpec, results: Results) -> bool:
    """Whether this run draws latency.png (a run of the prefill side)."""
    return spec.role is not Role.decode and isinstance(results, JobResults)


def _write_outputs(spec: ReportSpec, run_dir: Path, results: JobResults | DecodeSideResults,
                   drawer: Optional[plots.Drawer] = None) -> None:
    reporting.write(run_dir, results)
    if _plotted(spec, results) and not results.ending.interrupted:  # an interrupted run's: after its summary
        assert isinstance(results, JobResults)  # (_plotted)
        if drawer is not None and drawer.proc is not None:  # started when the handoffs ended
            drawer.draw(_latency_title(spec, run_dir, results), spec.load.rate is not None,
                        spec.percentiles)
        else:
            _latency_png(spec, run_dir, results)


def _latency_title(spec: ReportSpec, run_dir: Path, results: JobResults) -> str:
    """latency.png's title: the plan, the transport, the rank/TP layout, the run."""
    plan, e = results.plan, spec.ranks
    transport = results.transports.effective_transport or plan.declared_transport
    ended = " (interrupted: what ran)" if results.ending.interrupted else ""
    layout = plots.layout_label(e.prefill, e.decode, e.decode_tp)
    return (f"mem_pool={plan.mem_pool}, buffers on {plan.buffer_device}, {transport}; {layout}\n"
            f"run {plots.short_dir(run_dir)}{ended}")


def _latency_png(spec: ReportSpec, run_dir: Path, results: JobResults) -> None:
    """latency.png: the CDFs of the run's latencies, the summary's own marks on them."""
    png = run_dir / plots.LATENCY_PNG
    lat = results.latency_us
    try:
        plots.run_latency_png(run_dir, _latency_title(spec, run_dir, results),
                              marks={"send_aux": lat.send_aux, "taken": lat.taken,
                                     "handoff": lat.handoff, "from arrival": lat.e2e},
                              arrival=spec.load.rate is not None, qs=spec.percentiles)
    except OSError as exc:
        png.unlink(missing_ok=True)  # no torn or empty image left behind
        if exc.errno in (28, 122):
            raise NoSpace(png) from None
        raise


def ended(run_dir: Path, exc: Exception, text: Optional[str] = None) -> NotRun:
    """A job that raised, as its results; its code and its line are the failure table's
    (job.failure). A refusal keeps its line (`text`, else the error's own) in results.json; a
    busy run dir is refused untouched (nothing written there); a full disk writes results.json
    where it still fits; anything else (a sweep's job) is a failed row."""
    if isinstance(exc, NoSpace):
        return _no_space(run_dir, NotRun(failure.ending(exc).code, str(exc)), exc)
    if isinstance(exc, RunDirBusy):
        end = failure.ending(exc)
        failure.say(end)
        return NotRun(end.code, str(exc))  # not written
    if isinstance(exc, ConfigError):
        line = text or str(exc)
        end = failure.ending(exc, line)
        results = NotRun(end.code, line, refused=line, key=exc.key)
    else:
        end = failure.ending(exc)
        results = NotRun(end.code, f"{type(exc).__name__}: {exc}", routes={})
    reporting.write(run_dir, results)
    failure.say(end)
    return results


def _no_space(run_dir: Path, results: R, exc: NoSpace) -> R:
    """results.json says how the run ended unless it is the file that did not fit; one line."""
    if exc.path.name != RunFiles.RESULTS:
        try:
            reporting.write(run_dir, results)
        except OSError:
            pass
    failure.say(failure.ending(exc, f"no space left writing {reporting.rel(exc.path)}"))
    return results


