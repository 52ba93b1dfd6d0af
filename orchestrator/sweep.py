"""Sweep summaries: scan a sweep dir's job results into summary.csv, summary.md, summary.png.

Every job writes its own results.json (a failed job too, marked with its error), so the
summary is built by scanning the sweep dir, not from Hydra's callback arguments (the basic
sweeper skips on_multirun_end when a job raised). `python -m orchestrator.report <dir>`
rebuilds the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def summarize(sweep_dir: Path) -> list[Path]:
    """Write summary.csv, summary.md and summary.png into sweep_dir; return their paths."""
    raise NotImplementedError("sweep summaries are being written")


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        for path in summarize(sweep_dir):
            print(f"sweep summary: {path}", flush=True)
