"""The environment a run depended on, saved as fingerprint.json next to its results, so a
run dir can be re-run months later and differences explained (orchestrator.replay)."""

from __future__ import annotations

import platform as _platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from orchestrator.profile.platform import mooncake_distribution, no_gpu_possible, torch_build
from orchestrator.profile.versions import installed_version
from orchestrator.results.schema import PlanInfo

PACKAGES = ("hydra-core", "omegaconf", "structlog", "pyzmq", "torch", "numpy")
REPO = Path(__file__).resolve().parents[2]


def git_commit() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                                  timeout=5, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def gpus() -> dict[str, Any]:
    if no_gpu_possible():  # known without importing torch
        return {"count": 0}
    import torch

    if not torch.cuda.is_available():
        return {"count": 0}
    n = torch.cuda.device_count()
    return {
        "count": n,
        "names": [torch.cuda.get_device_name(i) for i in range(n)],
        "peer_access": [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                        for i in range(n)],
    }


def host_load() -> dict[str, Any]:
    """The machine's load when the run started: its CPU count (the ones this process may run
    on, and all of them) and the 1/5/15-minute load averages; latency drift between two runs
    reads against these (orchestrator.replay prints them beside its ratios)."""
    import os

    usable: Optional[int]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "load_avg": load}


def collect(seed: Optional[int], plan: PlanInfo) -> dict[str, Any]:
    """fingerprint.json: versions, machine, git commit, the plan's MC_* env and the run's seed
    (workload.seed)."""
    build = torch_build()  # torch's version.py: what torch.__version__ and torch.version.cuda say
    packages = {name: installed_version(name) for name in PACKAGES}
    dist = mooncake_distribution()
    packages[dist[0] if dist else "mooncake"] = dist[1] if dist else None
    return {
        "python": sys.version.split()[0],
        "platform": _platform.platform(),
        "hostname": socket.gethostname(),
        "host": host_load(),
        "packages": packages,
        "torch": build.get("__version__"),
        "cuda": build.get("cuda"),
        "gpus": gpus(),
        "mc_env": dict(plan.data["mc_env"]),
        "gpu_sharing": dict(plan.data["gpu_sharing"]),  # as planned (results.json: as the run had it)
        "git": git_commit(),
        "seeds": {"workload.seed": seed},
    }
