"""`python -m orchestrator [overrides]`: one job, or a sweep with -m."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from .app import run_job, user_error
from .config import ConfigError, register_configs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    try:
        results = run_job(cfg, Path(hc.runtime.output_dir))
    except ConfigError as exc:
        user_error(exc)
    ok = results["verified"] == results["requests"] and results["error"] is None
    if not ok and hc.mode is RunMode.RUN:
        raise SystemExit(1)
    return float(results["verified"])


if __name__ == "__main__":
    main()
