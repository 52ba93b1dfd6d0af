"""Detect what this machine offers (CUDA devices, the Mooncake build) as a plan.Platform.

Kept apart from plan.py so the rules stay pure: this is the only place that asks torch and
the installed Mooncake wheel what exists.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import time
from importlib import metadata
from typing import Iterable, Optional

from orchestrator.profile.plan import Platform
from orchestrator.profile.sharing import MPS_CONTROL, running_daemon

MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
)
# The one clock of the run's deadlines, ages and heartbeats (CLOCK_MONOTONIC: see boot_id). A
# module imports it as its own `_clock`, so a test can move one module's clock (runner's).
clock = time.monotonic


def pid_namespace() -> str:
    """This process's PID namespace, as the kernel names it (e.g. "pid:[4026531836]"); ""
    when it cannot be read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def boot_id() -> str:
    """This kernel's boot id: two processes that share it share CLOCK_MONOTONIC, so a
    timestamp taken by one is comparable with the other's (network namespaces included)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """`mount`/`path` and each of its parents up to `mount` that exist, leaf first (a quota
    anywhere above applies too). A cgroup namespace shows the path as "/": the mount is then
    the process's own cgroup."""
    parts = [p for p in path.strip("/").split("/") if p]
    out = []
    for n in range(len(parts), -1, -1):
        d = os.path.join(mount, *parts[:n])
        if os.path.isdir(d):
            out.append(d)
    return out


def cgroup_cpu_limit(root: str = "/") -> Optional[float]:
    """The CPUs this process's cgroups let it use: the tightest CPU quota on its cgroup path
    (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), or None where none is set.
    `root` is where /proc and /sys are read from (tests give a fake tree)."""
    lines = _read(os.path.join(root, "proc/self/cgroup"))
    if lines is None:
        return None
    base = os.path.join(root, "sys/fs/cgroup")
    limits: list[float] = []
    for line in lines.splitlines():
        hid, _, rest = line.partition(":")
        ctrls, _, path = rest.partition(":")
        if hid == "0" and not ctrls:  # v2 (unified; under .../unified on a hybrid host)
            mounts = [base, os.path.join(base, "unified")]
            for d in (d for m in mounts for d in _cgroup_dirs(m, path)):
                quota, _, period = (_read(os.path.join(d, "cpu.max")) or "max").partition(" ")
                if quota != "max" and period:
                    limits.append(int(quota) / int(period))
        elif "cpu" in ctrls.split(","):  # v1: mounted as cpu,cpuacct (or cpu, linked)
            for mount in (os.path.join(base, ctrls), os.path.join(base, "cpu")):
                for d in _cgroup_dirs(mount, path):
                    q = _read(os.path.join(d, "cpu.cfs_quota_us"))
                    p = _read(os.path.join(d, "cpu.cfs_period_us"))
                    if q and p and int(q) > 0 and int(p) > 0:
                        limits.append(int(q) / int(p))
                if os.path.isdir(mount):
                    break
    return min(limits) if limits else None


def usable_cores(root: str = "/", affinity: Optional[Iterable[int]] = None) -> int:
    """The cores this process may run on: its CPU affinity (taskset, cpusets), cut to its
    cgroup CPU quota (a container's --cpus) rounded down, at least 1. Not os.cpu_count(),
    which counts the host's cores: 2 pinned cores of a 16-core host are 2."""
    cores = len(set(affinity) if affinity is not None else os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, math.floor(limit))
    return max(1, cores)


def mooncake_distribution() -> tuple[str, str] | None:
    """(pip name, version) of the installed Mooncake wheel, or None."""
    for name in MOONCAKE_DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def mooncake_has_cuda() -> bool:
    """CUDA builds ship mooncake.allocator (NVLinkAllocator); the non-CUDA wheel does not."""
    dist = mooncake_distribution()
    if dist is None or dist[0].endswith("-non-cuda"):
        return False
    return importlib.util.find_spec("mooncake.allocator") is not None


def rdma_devices(sysfs: str = "/sys/class/infiniband") -> tuple[str, ...]:
    """The RDMA devices the kernel offers (what Mooncake's rdma transport would open)."""
    try:
        return tuple(sorted(os.listdir(sysfs)))
    except OSError:
        return ()


def host_mem_available(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """MemAvailable in bytes, or None where the kernel does not say."""
    try:
        for line in open(meminfo):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def torch_build() -> dict[str, Optional[str]]:
    """torch's version.py (__version__, cuda, hip), read without importing torch (3 s on a
    loaded box); {} without torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    import ast

    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError):
        return {}
    out: dict[str, Optional[str]] = {"__version__": None, "cuda": None, "hip": None}
    for node in tree.body:  # `name = 'literal'` or `name: type = literal` (none executed)
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id in out and isinstance(value, ast.Constant):
            out[target.id] = None if value.value is None else str(value.value)
    return out if out["__version__"] is not None else {}


def no_gpu_possible(build: Optional[dict[str, Optional[str]]] = None) -> bool:
    """True where torch can see no GPU, known without importing it: a CPU-only build, or an
    NVIDIA (non-ROCm) build on a machine with no NVIDIA device nodes."""
    b = torch_build() if build is None else build
    if not b:  # no torch (nothing can see a GPU), or a version.py not read: ask torch
        return importlib.util.find_spec("torch") is None
    if b.get("cuda") is None and b.get("hip") is None:
        return True
    nodes = any(n[len("nvidia"):].isdigit() for n in _listdir("/dev") if n.startswith("nvidia"))
    return b.get("hip") is None and not nodes and not _listdir("/proc/driver/nvidia/gpus")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def detect() -> Platform:
    """The machine as the rule book sees it. torch is imported only where it could see a
    GPU or an NPU: a refusal or a CPU run's parent stays free of it (fast feedback)."""
    gpu_mem: tuple[int, ...] = ()
    if no_gpu_possible() and importlib.util.find_spec("torch_npu") is None:
        cuda_devices, npu = 0, False
    else:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        try:
            gpu_mem = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(cuda_devices))
        except Exception:  # noqa: BLE001 - not known: not checked
            gpu_mem = ()
        npu = hasattr(torch, "npu") and bool(getattr(torch.npu, "is_available", lambda: False)())
    return Platform(
        cuda_devices=cuda_devices,
        cpu_count=usable_cores(),
        npu=npu,
        mooncake_cuda=mooncake_has_cuda(),
        rdma_devices=rdma_devices(),
        env=dict(os.environ),
        host_mem_bytes=host_mem_available(),
        gpu_mem_bytes=gpu_mem,
        mps_control=shutil.which(MPS_CONTROL),
        mps_pipe=running_daemon(os.environ, os.path.exists),
    )
