"""The processes' names: "prefill", "decode", "prefill0", "decode1.0" (proc_name), and back
(parse_proc_name). One spelling for every floor: the plan names the processes that share a GPU
by them, the endpoints log under them, and the run directory's files carry them
(orchestrator.results.rundir)."""

from __future__ import annotations

import re
from dataclasses import dataclass


def proc_name(kind: str, index: int, count: int, tp_rank: int = 0, tp: int = 1) -> str:
    """"prefill"/"decode" for a single process, "prefill0", "decode3", "decode1.0" (instance
    1, TP rank 0) otherwise; names the process's log files."""
    if kind == "decode" and tp > 1:
        return f"decode{index}.{tp_rank}"
    return kind if count == 1 else f"{kind}{index}"


@dataclass(frozen=True)
class ProcName:
    """A process name decoded: what proc_name was given, as far as the name tells it."""

    kind: str  # "prefill" or "decode"
    index: int  # prefill rank or decode instance (0 for a single process)
    tp_rank: int  # the rank in its decode instance's TP group (0 without one)

    @property
    def tp_leader(self) -> bool:
        """Rank 0 of its TP group (every process outside one): the one whose verdicts count."""
        return self.tp_rank == 0


_PROC_NAME = re.compile(r"(prefill|decode)(?:(\d+)(?:\.(\d+))?)?")


def parse_proc_name(name: str) -> ProcName:
    """proc_name's inverse: "decode1.2" -> ("decode", 1, 2), "prefill" -> ("prefill", 0, 0)."""
    m = _PROC_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"not a process name: {name!r}")
    return ProcName(m[1], int(m[2] or 0), int(m[3] or 0))
