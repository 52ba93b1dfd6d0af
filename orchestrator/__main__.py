"""`python -m orchestrator [overrides]`: one job, or a sweep with -m. The exit code is the
job's (see orchestrator.results.reporting), or the worst of a sweep's jobs (read back from their
results.json when a launcher ran them elsewhere)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


class _EarlyStop(BaseException):
    """SIGINT/SIGTERM before a job's own handlers are in place (imports, Hydra's start)."""


_COMPOSING = [True]  # imports, a sweep's bad-file scan and the pre-check: nothing written yet


def _early(signum: int, _frame: object) -> None:
    if _COMPOSING[0]:
        # a raise here can land in OmegaConf, whose clean-up turns it into a config error that
        # compose reports and goes on from (the command ran on after SIGTERM): say it, leave now
        print(f"interrupted ({signal.Signals(signum).name}) while {_PHASE[0]}: no job was running",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + signum)
    raise _EarlyStop(signum)


_PHASE = ["importing"]  # what the command is doing when no job's own handlers are in place


def _interrupted(signum: int) -> None:
    app = sys.modules.get("orchestrator.job.app")
    phase = getattr(app, "PHASE", [None])[0] or _PHASE[0]
    print(f"interrupted ({signal.Signals(signum).name}) while {phase}: no job was running",
          file=sys.stderr, flush=True)
    sys.exit(128 + signum)


if __name__ == "__main__":  # before torch, Hydra and the rest are imported
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _early)

try:
    from pathlib import Path

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from orchestrator.job.app import failed_job, no_space, refused, run_job
    from orchestrator.preflight.compose import job_refusal
    from orchestrator.profile.config import CONF_DIR, ConfigError, register_configs
    from orchestrator.results.rundir import NoSpace, RunDirBusy
    from orchestrator.results.schema import EXIT_REFUSED, NotRun

    register_configs()
except _EarlyStop as _exc:
    _interrupted(_exc.args[0])

_EXIT: list[int] = []  # every job's exit code, in the order they ran


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    """A job never raises: its results.json says what happened (a refused profile keeps the
    refusal there), so one bad combination is a failed row in a sweep, not a lost sweep."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    single = hc.mode is RunMode.RUN
    _PHASE[0] = "starting the job"
    try:
        results = run_job(cfg, run_dir)
    except ConfigError as exc:
        results = refused(run_dir, exc, line=job_refusal(exc, hc.runtime, hc.overrides.task))
    except NoSpace as exc:
        results = no_space(run_dir, exc)
    except RunDirBusy as exc:  # refused before start; the other run's files stay untouched
        print(f"error: {exc}", file=sys.stderr, flush=True)
        results = NotRun(EXIT_REFUSED, str(exc))  # not written
    except Exception as exc:  # noqa: BLE001 - a sweep must survive any one job
        if single:
            raise
        results = failed_job(run_dir, f"{type(exc).__name__}: {exc}")
    _EXIT.append(results.exit_code)
    _PHASE[0] = "ending" if single else "between the sweep's jobs"
    if results.ending.signal and not single and _in_process(hc):
        # an interrupted job ends the sweep, not only itself (where the sweep runs here: a
        # launcher's worker, e.g. a Slurm job, returns its results to its launcher instead)
        raise _SweepStopped(results.exit_code, str(hc.sweep.dir))
    return float(results.verified)


def _in_process(hc: Any) -> bool:
    """Whether the jobs run in this process (Hydra's basic launcher)."""
    target = str((hc.launcher or {}).get("_target_", ""))
    return target.endswith("BasicLauncher")


class _SweepStopped(BaseException):
    """A sweep's job was interrupted: no further job starts (args: exit code, sweep dir)."""


def _leave(code: int) -> None:
    """Interrupted: results.json, the logs and the summary are written and every child is
    ended; the interpreter's own teardown (torch and the rest loaded) can take most of a
    second on a loaded box, past the 2 s a stop is given. Flush and leave now."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry() -> None:
    try:
        _entry()
    except _SweepStopped as exc:
        code, sweep_dir = exc.args
        from orchestrator.sweep.sweep import SweepError, summarize, sweep_status

        try:
            for path in summarize(Path(sweep_dir), png=False):
                print(f"sweep summary: {path}", flush=True)
            print(f"sweep: {sweep_status(Path(sweep_dir))}", flush=True)
        except SweepError:
            pass
        print(f"sweep interrupted: the jobs not yet started were not run (summary.png: python -m "
              f"orchestrator.report {sweep_dir})", file=sys.stderr, flush=True)
        _leave(code)
    except (_EarlyStop, KeyboardInterrupt) as exc:  # before a job started, or between jobs
        _interrupted(exc.args[0] if isinstance(exc, _EarlyStop) else signal.SIGINT)


def _checked(args: Any) -> None:
    """The command line passed its checks: composing is over (a signal now raises _EarlyStop),
    and a single run's children's forkserver starts importing torch now, beside Hydra's own
    start (orchestrator.job.warmstart)."""
    _COMPOSING[0] = False
    if not (args.help or args.hydra_help or args.cfg or args.info or args.multirun or args.shell_completion):
        from orchestrator.job import warmstart

        warmstart.start_early()


def _entry() -> None:
    from orchestrator.preflight.compose import hydra_command
    from orchestrator.sweep import bad_files

    # a sweep's config-dir files that cannot be composed fail only the jobs that pick them
    argv, bad_files.REFUSED[:] = bad_files.split_sweep(sys.argv[1:])
    sys.argv[1:] = argv
    _PHASE[0] = "composing the config"
    if not any(a.startswith(("hydra.output_subdir=", "++hydra.output_subdir=")) for a in argv):
        # a job saves .hydra/ itself, under its run dir's lock (app.save_hydra): a second
        # run started into the same dir then writes nothing there
        sys.argv.append("hydra.output_subdir=null")
    hydra_command(main, argv, started=lambda: bool(_EXIT), checked=_checked)
    from orchestrator.sweep.sweep import SWEEP_EXIT

    codes = _EXIT + SWEEP_EXIT  # SWEEP_EXIT covers jobs a launcher ran in other processes
    if codes and max(codes) in (130, 143):
        _leave(max(codes))
    if codes:
        sys.exit(max(codes))


if __name__ == "__main__":
    entry()
