"""Which of a run's processes share a GPU, and how CUDA MPS is had for them (endpoints.mps).

Without MPS, two processes on one GPU time-slice it: each device touch of one costs a context
switch of the other (about 300-400 us on an H200), and a one-GPU run then measures that, not
the transport. Under MPS they share one context and run side by side, much as on two GPUs.

Pure: the machine is described by the Platform (plan.py) the caller passes in. The run's own
control daemon is started and stopped by orchestrator.job.mps.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Optional

from orchestrator.profile.config import ConfigError, MpsMode
from orchestrator.profile.proc_names import proc_name

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")  # what a process joins a daemon by
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # where a CUDA process looks for a daemon without the variable
TIME_SLICING = ("time-slice it (each device touch of one process costs a context switch of the "
                "other, about 300-400 us on an H200: one-GPU latencies measure that, not the "
                "transport)")


class MpsDaemon(Enum):
    """How the run's processes get MPS: the run's own control daemon, one the user started
    (CUDA_MPS_PIPE_DIRECTORY, or the default pipe dir), or none."""

    own = "own"
    user = "user"
    none = "none"


@dataclass(frozen=True)
class GpuSharing:
    """The run's processes on each GPU it uses, and the MPS decision for them (`why`: one line)."""

    mode: MpsMode
    gpus: tuple[tuple[int, tuple[str, ...]], ...] = ()  # (GPU, names of the processes on it)
    daemon: MpsDaemon = MpsDaemon.none
    why: str = ""
    control: Optional[str] = None  # the nvidia-cuda-mps-control a run-owned daemon runs
    pipe_dir: Optional[str] = None  # the user's daemon's pipe dir

    @property
    def shared(self) -> dict[int, tuple[str, ...]]:
        """GPUs with more than one of the run's processes on them."""
        return {gpu: names for gpu, names in self.gpus if len(names) > 1}

    @property
    def mps(self) -> bool:
        return self.daemon is not MpsDaemon.none

    def as_dict(self) -> dict:
        return {"gpus": {str(gpu): list(names) for gpu, names in self.gpus},
                "shared": {str(gpu): list(names) for gpu, names in self.shared.items()},
                "mps_setting": self.mode.value, "mps": self.mps, "daemon": self.daemon.value,
                "why": self.why}


def _where(shared: dict) -> str:
    return "; ".join(f"{', '.join(names)} on GPU {gpu}" for gpu, names in shared.items())


def sharing_warning(record: dict) -> Optional[str]:
    """The one line a run on a shared GPU without MPS prints, from a `gpu_sharing` record
    (GpuSharing.as_dict(), as the run had it); None: nothing to say."""
    shared = record.get("shared") or {}
    if not shared or record.get("mps"):
        return None
    why = record.get("error") or record.get("why")
    return (f"{_where(shared)} without CUDA MPS ({why}): they {TIME_SLICING}; "
            f"endpoints.mps=auto starts MPS where {MPS_CONTROL} is on PATH")


def sharing_line(record: dict) -> Optional[str]:
    """The summary's line for a run under MPS (None: no MPS)."""
    if not record.get("mps"):
        return None
    where = _where(record.get("shared") or {}) or "each process on a GPU of its own"
    servers = record.get("servers")
    return (f"CUDA MPS on: {where} ({record.get('why')}"
            + (f"; MPS server pid {', '.join(servers)}" if servers else "") + ")")


def processes_on_gpus(prefill_gpus: Optional[tuple[int, ...]], decode_gpus: Optional[tuple[int, ...]],
                      decode_ranks: int, decode_tp: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """(GPU, process names) for every GPU a process of the run uses, GPUs in order."""
    on: dict[int, list[str]] = {}
    prefill_gpus, decode_gpus = prefill_gpus or (), decode_gpus or ()
    for r, gpu in enumerate(prefill_gpus):
        on.setdefault(gpu, []).append(proc_name("prefill", r, len(prefill_gpus)))
    for j, gpu in enumerate(decode_gpus):
        on.setdefault(gpu, []).append(proc_name("decode", j // decode_tp, decode_ranks, j % decode_tp, decode_tp))
    return tuple((gpu, tuple(names)) for gpu, names in sorted(on.items()))


def running_daemon(env: Mapping[str, str], exists: Callable[[str], bool]) -> Optional[str]:
    """The pipe dir of an MPS control daemon already running for processes with `env`
    (CUDA_MPS_PIPE_DIRECTORY, else the default), judged by its control pipe; None: none.
    `exists(path)` asks the file system (os.path.exists). A pipe dir that is a symbolic
    link or not this user's, or a control pipe that is a link, is never joined: the default
    /tmp/nvidia-mps is anyone's to plant (the run starts its own daemon instead)."""
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIR
    return pipe if exists(f"{pipe}/control") and _ours(pipe) else None


def _ours(pipe: str) -> bool:
    """The pipe dir is a directory of this user's, and its control pipe no link (lstat)."""
    import os
    import stat

    try:
        st, ctl = os.lstat(pipe), os.lstat(f"{pipe}/control")
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not stat.S_ISLNK(ctl.st_mode) \
        and ctl.st_uid == os.getuid()


def sharing_rule(mode: MpsMode, gpus: tuple[tuple[int, tuple[str, ...]], ...], control: Optional[str],
                 user_pipe: Optional[str]) -> GpuSharing:
    """endpoints.mps for the processes on `gpus`: `control` is nvidia-cuda-mps-control's path
    (None: not on PATH), `user_pipe` the pipe dir of a daemon already running (None: none).

    auto: MPS where two of the run's processes share a GPU: the user's daemon, else the run's
    own where the control program is on PATH. on: MPS for every GPU process of the run, or a
    ConfigError where it cannot be had. off: none started (a daemon found in the default pipe
    dir is still joined by CUDA itself, and recorded so)."""
    shared = any(len(names) > 1 for _, names in gpus)

    def refuse(why: str) -> ConfigError:
        return ConfigError("endpoints.mps", mode.value, f"auto or off here ({why})")

    if mode is MpsMode.off:
        if gpus and user_pipe:
            return GpuSharing(mode, gpus, MpsDaemon.user, f"endpoints.mps=off, but CUDA joins the daemon "
                              f"running at {user_pipe}", pipe_dir=user_pipe)
        return GpuSharing(mode, gpus, MpsDaemon.none, "endpoints.mps=off")
    if not gpus:
        if mode is MpsMode.on:
            raise refuse("no process of this run is on a GPU: its buffers live on the host")
        return GpuSharing(mode, gpus, MpsDaemon.none, "no process on a GPU")
    if mode is MpsMode.auto and not shared:
        return GpuSharing(mode, gpus, MpsDaemon.none, "each process has a GPU of its own")
    if user_pipe:
        return GpuSharing(mode, gpus, MpsDaemon.user, f"the daemon running at {user_pipe}", pipe_dir=user_pipe)
    if control:
        return GpuSharing(mode, gpus, MpsDaemon.own, "the run's own control daemon", control=control)
    if mode is MpsMode.on:
        raise refuse(f"{MPS_CONTROL} is not on PATH and no MPS daemon is running "
                     "(CUDA_MPS_PIPE_DIRECTORY names none)")
    return GpuSharing(mode, gpus, MpsDaemon.none, f"{MPS_CONTROL} is not on PATH")
