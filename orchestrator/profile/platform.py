"""Detect what this machine offers (CUDA devices, the Mooncake build) as a plan.Platform.

Kept apart from plan.py so the rules stay pure: this is the only place that asks torch and
the installed Mooncake wheel what exists.
"""

from __future__ import annotations

import importlib.util
import os
from importlib import metadata

from orchestrator.profile.plan import Platform

MOONCAKE_DISTRIBUTIONS = (
    "mooncake-transfer-engine-cuda13",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-non-cuda",
)


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


def host_mem_available(meminfo: str = "/proc/meminfo"):
    """MemAvailable in bytes, or None where the kernel does not say."""
    try:
        for line in open(meminfo):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def detect() -> Platform:
    import torch

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        gpu_mem = tuple(torch.cuda.get_device_properties(i).total_memory for i in range(cuda_devices))
    except Exception:  # noqa: BLE001 - not known: not checked
        gpu_mem = ()
    npu = hasattr(torch, "npu") and bool(getattr(torch.npu, "is_available", lambda: False)())
    return Platform(
        cuda_devices=cuda_devices,
        cpu_count=len(os.sched_getaffinity(0)),
        npu=npu,
        mooncake_cuda=mooncake_has_cuda(),
        rdma_devices=rdma_devices(),
        env=dict(os.environ),
        host_mem_bytes=host_mem_available(),
        gpu_mem_bytes=gpu_mem,
    )
