"""`python -m orchestrator [overrides]`: one job, or a sweep with -m."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .app import failed_job, run_job, user_error
from .config import ConfigError, register_configs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    """Single run: exit 2 on a config mistake, 1 unless every request was verified.
    Multirun: a job never raises; its results.json says what went wrong, so one bad
    combination is a failed row in the sweep summary, not a lost sweep."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    single = hc.mode is RunMode.RUN
    try:
        results = run_job(cfg, run_dir)
    except ConfigError as exc:
        if single:
            user_error(exc)
        results = failed_job(run_dir, cfg, str(exc))
    except Exception as exc:  # noqa: BLE001 - a sweep must survive any one job
        if single:
            raise
        results = failed_job(run_dir, cfg, f"{type(exc).__name__}: {exc}")
    ok = results["verified"] == results["requests"] and results["error"] is None
    if not ok and single:
        raise SystemExit(1)
    return float(results["verified"])


if __name__ == "__main__":
    main()
