"""Before a sweep goes to Slurm (hydra/launcher=slurm, slurm_pd): what the partition offers
against what the launcher asks for, and submitit's polling noise out of the console.

Called from the sweep callback (orchestrator.sweep.sweep.SweepSummary.on_multirun_start), in the
submitting process, before the launcher submits anything. A request no node of the partition
can hold would pend forever (squeue: `PartitionConfig`, or `Resources` for good) with nothing
on the console saying why; it is refused here with one line naming the key, the value and what
`sinfo` says the nodes have.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

SUBMITIT_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
SINFO_FORMAT = "%N|%P|%c|%m"  # node, partition (default marked *), CPUs, memory (MB)
SINFO_TIMEOUT_S = 30.0
LOG_NAME = "submitit.log"


class LauncherRequestError(ValueError):
    """A launcher request no node can hold; str() is one line, `key` the first key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    default: bool  # the cluster's default partition
    cpus: int
    memory_mb: int


def is_slurm_launcher(launcher: Any) -> bool:
    return str(_get(launcher, "_target_") or "") == SUBMITIT_LAUNCHER


def _get(node: Any, key: str) -> Any:
    try:
        return node.get(key) if hasattr(node, "get") else getattr(node, key, None)
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve here: unknown
        return None


def parse_sinfo(text: str) -> list[Node]:
    """Lines of `sinfo -h -N -o '%N|%P|%c|%m'` (a node in several partitions: one line each).
    A memory that is not a number counts 0; 0 or 1 (RealMemory not configured: Slurm's
    default is 1) is not checked."""
    nodes = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        name, part, cpus, mem = parts
        try:
            nodes.append(Node(name, part.rstrip("*"), part.endswith("*"), int(cpus.rstrip("+")),
                              int(mem.rstrip("+")) if mem.rstrip("+").isdigit() else 0))
        except ValueError:
            continue
    return nodes


def check_request(launcher: Any, nodes: list[Node]) -> Optional[str]:
    """Raises LauncherRequestError when no node of the launcher's partition (its `partition`,
    else the default one) has the CPUs (`cpus_per_task` x `tasks_per_node`) or the memory
    (`mem_gb`, Slurm's GB: 1024 MB) one job asks for. Returns a warning line when it cannot
    tell (no nodes listed), else None."""
    wanted = _get(launcher, "partition")
    if not nodes:
        return "sinfo lists no nodes: the launcher's request was not checked"
    if wanted:
        parts = sorted({n.partition for n in nodes})
        if wanted not in parts:
            raise LauncherRequestError("hydra.launcher.partition", (
                f"hydra.launcher.partition={wanted}: sinfo lists no such partition; "
                f"it has {', '.join(parts)}"))
        chosen, label = [n for n in nodes if n.partition == wanted], f"partition {wanted}"
    else:
        chosen = [n for n in nodes if n.default] or nodes
        label = f"partition {chosen[0].partition} (the default)" if chosen[0].default else "the cluster"
    max_cpus = max(n.cpus for n in chosen)
    max_mem = max(n.memory_mb for n in chosen)
    offer = (f"sinfo: {label}, {len(chosen)} node{'s' if len(chosen) != 1 else ''}, at most "
             f"{max_cpus} CPUs and {max_mem} MB per node")
    asked: list[tuple[str, str, str]] = []  # key, value asked, what is allowed
    cpt, tpn = _get(launcher, "cpus_per_task"), _get(launcher, "tasks_per_node") or 1
    if isinstance(cpt, int) and isinstance(tpn, int) and cpt * tpn > max_cpus:
        value = f"{cpt}" + (f" (x tasks_per_node={tpn})" if tpn != 1 else "")
        asked.append(("hydra.launcher.cpus_per_task", value, f"cpus_per_task<={max_cpus // tpn}"))
    mem_gb = _get(launcher, "mem_gb")
    if isinstance(mem_gb, (int, float)) and max_mem > 1 and mem_gb * 1024 > max_mem:
        asked.append(("hydra.launcher.mem_gb", f"{mem_gb}", f"mem_gb<={max_mem // 1024}"))
    if asked:
        raise LauncherRequestError(asked[0][0], (
            f"{' and '.join(f'{k}={v}' for k, v, _ in asked)} "
            f"{'ask' if len(asked) > 1 else 'asks'} for more than any node has, the jobs would "
            f"pend forever ({offer}); allowed: {', '.join(a for _, _, a in asked)}"))
    return None


def sinfo_nodes() -> tuple[Optional[list[Node]], Optional[str]]:
    """(nodes, None), or (None, why not) when sinfo is not here or fails."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None, "no sinfo on this host: the launcher's request was not checked"
    try:
        proc = subprocess.run([sinfo, "-h", "-N", "-o", SINFO_FORMAT], capture_output=True, text=True,
                              timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"sinfo did not answer ({exc}): the launcher's request was not checked"
    if proc.returncode != 0:
        why = " ".join((proc.stderr or proc.stdout).split())[:200]
        return None, f"sinfo exited {proc.returncode} ({why}): the launcher's request was not checked"
    return parse_sinfo(proc.stdout), None


def precheck(launcher: Any) -> Optional[str]:
    """The check against this host's sinfo; a warning line when it could not be made."""
    nodes, why = sinfo_nodes()
    if nodes is None:
        return why
    return check_request(launcher, nodes)


def quiet_submitit(log_path: Path) -> None:
    """submitit's own messages (among them "Bypassing sacct error ... status may be
    inaccurate", three lines per poll where Slurm keeps no accounting) go to `log_path`, not
    the console; so does what sacct itself writes to stderr ("Slurm accounting storage is
    disabled"). submitit still reads the job states it can get and the jobs' result files."""
    try:
        from submitit.core import logger as submitit_logger  # its dictConfig runs on import
        from submitit.slurm import slurm as submitit_slurm
    except ImportError:
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = submitit_logger.get_logger()
    for handler in list(log.handlers):
        log.removeHandler(handler)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    watcher = submitit_slurm.SlurmInfoWatcher
    original = getattr(watcher, "_pd_aux_make_command", None) or watcher._make_command

    def _make_command(self: Any) -> Optional[list[str]]:  # the same sacct call, its stderr appended to the log
        command = original(self)
        if command is None:
            return None
        return ["sh", "-c", f'exec "$@" 2>>{shlex.quote(str(log_path))}', *command[:1], *command]

    watcher._pd_aux_make_command = original  # type: ignore[attr-defined]  # a patch: ours, once
    watcher._make_command = _make_command  # type: ignore[method-assign]
