"""`python -m orchestrator [overrides]`: one job, or a sweep with -m. The exit code is the
job's (see orchestrator.results.reporting), or the worst of a sweep's jobs (read back from their
results.json when a launcher ran them elsewhere); every other ending (a refusal, an interrupt,
a full disk) is a row of the failure table (orchestrator.job.failure)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, NoReturn

_COMPOSING = [True]  # imports, a sweep's bad-file scan and the pre-check: nothing written yet


def _early(signum: int, _frame: object) -> None:
    failure = sys.modules.get("orchestrator.job.failure")
    if failure is None or not hasattr(failure, "exit_now"):  # still importing the table itself
        os.write(2, f"interrupted ({signal.Signals(signum).name}) while importing: no job was running\n".encode())
        os._exit(128 + signum)
    if _COMPOSING[0]:
        # a raise here can land in OmegaConf, whose clean-up turns it into a config error that
        # compose reports and goes on from (the command ran on after SIGTERM): say it, leave now
        end = failure.ending(failure.EarlyStop(signum), phase=_PHASE[0])
        failure.say(end)
        failure.exit_now(end.code, logs=False)
    raise failure.EarlyStop(signum)


_PHASE = ["importing"]  # what the command is doing when no job's own handlers are in place


def _interrupted(signum: int) -> NoReturn:
    app = sys.modules.get("orchestrator.job.app")
    phase = getattr(app, "PHASE", [None])[0] or _PHASE[0]
    failure.leave(failure.EarlyStop(signum), phase=phase)


if __name__ == "__main__":  # before torch, Hydra and the rest are imported
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, _early)

from orchestrator.job import failure  # noqa: E402  (after the handlers: the interrupt line, before the rest)

try:
    from pathlib import Path

    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import DictConfig

    from orchestrator.job.app import ended, run_job
    from orchestrator.preflight.compose import job_refusal
    from orchestrator.profile.config import CONF_DIR, ConfigError, register_configs

    register_configs()
except failure.EarlyStop as _exc:
    _interrupted(_exc.signum)


def _app(command: failure.Command) -> Callable[[], Any]:
    """Hydra's task function for this command: each job's exit code goes to `command`."""

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def main(cfg: DictConfig) -> float:
        return _job(cfg, command)

    return main


def _job(cfg: DictConfig, command: failure.Command) -> float:
    """A job never raises: its results.json says what happened (a refused profile keeps the
    refusal there), so one bad combination is a failed row in a sweep, not a lost sweep."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    single = hc.mode is RunMode.RUN
    _PHASE[0] = "starting the job"
    try:
        results = run_job(cfg, run_dir)
    except Exception as exc:  # noqa: BLE001 - a sweep must survive any one job
        if single and failure.unforeseen(exc):
            raise
        text = job_refusal(exc, hc.runtime, hc.overrides.task) if isinstance(exc, ConfigError) else None
        results = ended(run_dir, exc, text)
    command.jobs.append(results.exit_code)
    _PHASE[0] = "ending" if single else "between the sweep's jobs"
    if results.ending.signal and not single and _in_process(hc):
        # an interrupted job ends the sweep, not only itself (where the sweep runs here: a
        # launcher's worker, e.g. a Slurm job, returns its results to its launcher instead)
        raise failure.SweepStopped(results.exit_code, str(hc.sweep.dir))
    return float(results.verified)


def _in_process(hc: Any) -> bool:
    """Whether the jobs run in this process (Hydra's basic launcher)."""
    target = str((hc.launcher or {}).get("_target_", ""))
    return target.endswith("BasicLauncher")


def _sweep_stopped(exc: failure.SweepStopped) -> NoReturn:
    """Interrupted: results.json, the logs and the summary are written and every child is
    ended; the interpreter's own teardown is skipped (failure.exit_now)."""
    from orchestrator.sweep.sweep import SweepError, summarize, sweep_status

    sweep_dir = Path(str(exc))
    try:
        for path in summarize(sweep_dir, png=False):
            print(f"sweep summary: {path}", flush=True)
        print(f"sweep: {sweep_status(sweep_dir)}", flush=True)
    except SweepError:
        pass
    end = failure.ending(exc)
    failure.say(end)
    failure.exit_now(end.code)


def entry() -> None:
    try:
        _entry()
    except failure.SweepStopped as exc:
        _sweep_stopped(exc)
    except (failure.EarlyStop, KeyboardInterrupt) as exc:  # before a job started, or between jobs
        _interrupted(exc.signum if isinstance(exc, failure.EarlyStop) else signal.SIGINT)


def _checked(args: Any) -> None:
    """The command line passed its checks: composing is over (a signal now raises
    failure.EarlyStop), and a single run's children's forkserver starts importing torch now,
    beside Hydra's own start (orchestrator.job.warmstart)."""
    _COMPOSING[0] = False
    if not (args.help or args.hydra_help or args.cfg or args.info or args.multirun or args.shell_completion):
        from orchestrator.job import warmstart

        warmstart.start_early()


def _entry() -> None:
    from orchestrator.preflight.compose import hydra_command
    from orchestrator.sweep import bad_files

    # a sweep's config-dir files that cannot be composed fail only the jobs that pick them
    argv, refused = bad_files.split_sweep(sys.argv[1:])
    command = failure.Command(refused=tuple(refused))
    sys.argv[1:] = argv
    _PHASE[0] = "composing the config"
    if not any(a.startswith(("hydra.output_subdir=", "++hydra.output_subdir=")) for a in argv):
        # a job saves .hydra/ itself, under its run dir's lock (app.save_hydra): a second
        # run started into the same dir then writes nothing there
        sys.argv.append("hydra.output_subdir=null")
    with failure.running(command):  # the sweep's callback (sweep.SweepSummary) reads and adds to it
        hydra_command(_app(command), argv, started=lambda: bool(command.jobs), checked=_checked)
    failure.exit_with(command.exit_code())


if __name__ == "__main__":
    entry()
