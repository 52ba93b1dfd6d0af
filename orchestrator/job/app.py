"""The task: check the profile, plan, build the specs, run the handoffs, report. Called by
__main__ under Hydra, once per job (also inside launcher workers, hence logging is configured
here). The run dir's outputs are opened once before the handoffs and finished once after them
(orchestrator.results.outputs); what a job says when it ends badly is the failure table's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, TypeVar

from omegaconf import DictConfig

from orchestrator.job import failure, warmstart
from orchestrator.job.lifecycle import Signals
from orchestrator.job.specs import build_specs
from orchestrator.profile.config import OrchestratorConfig, typed, validate
from orchestrator.profile.kinds import ConfigError
from orchestrator.profile.platform import detect
from orchestrator.results import reporting
from orchestrator.results.outputs import finish_outputs, open_outputs, write_unless_full
from orchestrator.results.rundir import (
    NoSpace,
    RunDirBusy,
    claim_run_dir,
    lock_run_dir,
    new_run_id,
    refuse_foreign,
    safe_dir,
    sweep_owner,
    unlock_run_dir,
    write_atomic,
)
from orchestrator.results.schema import NotRun, Results

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
            # the rule book on this machine (ConfigError), then what the runner, the endpoints
            # and the report read: once
            specs = build_specs(obj, detect())
            warmstart.start_early()  # the children's imports, beside the rest of this start-up
            outputs = open_outputs(run_dir, specs.report, drawn=given.workload.seed is None)
            from orchestrator.job.runner import run_handoffs  # torch and the rest: only to run

            try:
                out = run_handoffs(specs, run_dir, progress=outputs.progress, signals=signals,
                                   after_watch=outputs.handoffs_ended)
            finally:
                outputs.close_progress()
            results, full = finish_outputs(outputs, out, verbose=_verbose())
            if full is not None:
                _say_full(full)
            return results
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
    files = {name: OmegaConf.to_yaml(node) for name, node in
             (("config.yaml", cfg), ("hydra.yaml", hc), ("overrides.yaml", hc.hydra.overrides.task))}
    out = safe_dir(run_dir / HYDRA_SUBDIR)  # a link or a stranger's dir there: UnsafePath (exit 2)
    for name, text in files.items():
        write_atomic(out / name, text)


def _verbose() -> bool:
    """hydra.verbose set (true, or a list of loggers) in this Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and bool(HydraConfig.get().verbose)


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
    write_unless_full(run_dir, results, exc)
    _say_full(exc)
    return results


def _say_full(exc: NoSpace) -> None:
    """A full disk's line (the failure table's: exit 3)."""
    failure.say(failure.ending(exc, f"no space left writing {reporting.rel(exc.path)}"))
