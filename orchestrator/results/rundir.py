"""What a run directory holds, named once: the processes' names (which also name their log
and record files) and the files they write, so the process that writes a file and the one
that reads it back (the runner, the report, plots, replay) never spell its name twice."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


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


class RunFiles:
    """The files of one run directory. A prefill rank's requests and decisions files carry
    its name only when the run has more than one rank (requests.jsonl, else
    requests-prefill1.jsonl); a decode process's verdicts file always does
    (verdicts-decode.jsonl, verdicts-decode1.0.jsonl)."""

    RESULTS = "results.json"

    def __init__(self, root: Path | str):
        self.root = Path(root)

    @staticmethod
    def _suffix(prefill: str, ranks: int) -> str:
        return "" if ranks == 1 else f"-{prefill}"

    def requests(self, prefill: str, ranks: int) -> Path:
        """Prefill process `prefill`'s records, one line per request (of `ranks` ranks)."""
        return self.root / f"requests{self._suffix(prefill, ranks)}.jsonl"

    def decisions(self, prefill: str, ranks: int) -> Path:
        """Prefill process `prefill`'s decision log (of `ranks` ranks)."""
        return self.root / f"decisions{self._suffix(prefill, ranks)}.jsonl"

    def all_requests(self) -> list[Path]:
        """Every prefill rank's requests file, in name order."""
        return sorted(self.root.glob("requests*.jsonl"))

    def all_decisions(self) -> list[Path]:
        """Every prefill rank's decisions file, in name order."""
        return sorted(self.root.glob("decisions*.jsonl"))

    def verdicts(self, decode: str) -> Path:
        """Decode process `decode`'s verdicts, one line per request it judged."""
        return self.root / f"verdicts-{decode}.jsonl"

    def all_verdicts(self) -> list[tuple[ProcName, Path]]:
        """Every decode process's verdicts file with its process name decoded, in name order."""
        return [(parse_proc_name(p.stem.removeprefix("verdicts-")), p)
                for p in sorted(self.root.glob("verdicts-decode*.jsonl"))]

    @property
    def results(self) -> Path:
        """The run's results (orchestrator.reporting), written once at its end."""
        return self.root / self.RESULTS

    def log(self, role: str) -> Path:
        """Process `role`'s structured log (JSON lines)."""
        return self.root / f"{role}.log"

    def stderr_log(self, role: str) -> Path:
        """Process `role`'s fd 2: glog lines, warnings, a traceback."""
        return self.root / f"{role}.stderr.log"

    def mooncake_log(self, role: str) -> Path:
        """What process `role`'s Mooncake engine logged while it came up."""
        return self.root / f"{role}.mooncake.log"


LOCK_NAME = ".run.lock"


class RunDirBusy(Exception):
    """Another live run holds this run dir's lock (refused before start: exit 2)."""


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def lock_run_dir(run_dir: Path):
    """Hold `run_dir`'s lock for as long as the returned file stays open (one run per run
    dir; the kernel drops the lock when the process ends, however it ends). Raises
    RunDirBusy when another process holds it. A lock file that its holder removed at its end
    (unlock_run_dir) while this process was opening it is opened again: the lock held is
    always the one on the file the path names."""
    import fcntl
    import os

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    while True:
        fh = open(path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.close()
            raise RunDirBusy(f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); "
                             "give this one its own hydra.run.dir") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()  # its holder removed it between our open and our lock: take the new one
    fh.truncate(0)
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def unlock_run_dir(fh) -> None:
    """The run's last act: remove the lock file while still holding its lock (a run that
    opened it meanwhile sees it gone and takes a new one, lock_run_dir), then let go."""
    import os

    path = Path(fh.name)
    try:
        if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
            path.unlink()
    except OSError:
        pass
    fh.close()


def run_dir_busy(run_dir: Path) -> Optional[str]:
    """The refusal line when a live run holds `run_dir`'s lock, else None (takes nothing)."""
    import fcntl

    path = run_dir / LOCK_NAME
    if not path.exists():
        return None
    try:
        with open(path) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return (f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); give this "
                "one its own hydra.run.dir")
    return None


class NoSpace(OSError):
    """The disk filled while writing `path` (after start: exit 3, one line)."""

    def __init__(self, path: Path):
        super().__init__(28, f"no space left writing {path}")
        self.path = path

    def __str__(self) -> str:
        return f"no space left writing {self.path}"


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that a reader sees the old or the new content, never a torn one; a
    failed write leaves no temporary file behind (a full disk raises NoSpace)."""
    import errno
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(exc, NoSpace):
            raise NoSpace(path) from None
        raise
