"""`python -m orchestrator [overrides]`: one job, or a sweep with -m. The exit code is the
job's (see orchestrator.report), or the worst of a sweep's jobs (read back from their
results.json when a launcher ran them elsewhere)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .app import failed_job, no_space, refused, run_job
from .config import ConfigError, register_configs
from .results import NoSpace, RunDirBusy

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()
_EXIT: list[int] = []  # every job's exit code, in the order they ran


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    """A job never raises: its results.json says what happened (a refused profile keeps the
    refusal there), so one bad combination is a failed row in a sweep, not a lost sweep."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    single = hc.mode is RunMode.RUN
    try:
        results = run_job(cfg, run_dir)
    except ConfigError as exc:
        results = refused(run_dir, exc)
    except NoSpace as exc:
        results = no_space(run_dir, exc)
    except RunDirBusy as exc:  # refused before start; the other run's files stay untouched
        print(f"error: {exc}", file=sys.stderr, flush=True)
        results = {"exit_code": 2, "verified": 0}
    except Exception as exc:  # noqa: BLE001 - a sweep must survive any one job
        if single:
            raise
        results = failed_job(run_dir, f"{type(exc).__name__}: {exc}")
    _EXIT.append(results["exit_code"])
    return float(results["verified"])


def entry() -> None:
    from .profile import precheck

    problem = precheck(sys.argv[1:])
    if problem is not None:  # Hydra's own errors too: one line, exit 2, nothing started
        print(f"error: {' '.join(problem.split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except SystemExit as exc:
        if exc.code == 1 and not _EXIT:  # Hydra refused before any job ran
            sys.exit(2)
        raise
    from .sweep import SWEEP_EXIT

    codes = _EXIT + SWEEP_EXIT  # SWEEP_EXIT covers jobs a launcher ran in other processes
    if codes:
        sys.exit(max(codes))


if __name__ == "__main__":
    entry()
