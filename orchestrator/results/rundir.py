"""What a run directory holds, named once: the processes' names (which also name their log
and record files) and the files they write, so the process that writes a file and the one
that reads it back (the runner, the report, plots, replay) never spell its name twice."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TextIO


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
        """The run's results (orchestrator.results.reporting), written once at its end."""
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


def lock_run_dir(run_dir: Path) -> TextIO:
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
        try:
            fh = open(path, "a+")
        except OSError as exc:
            if full(exc):
                raise NoSpace(path) from None
            raise
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


def unlock_run_dir(fh: TextIO) -> None:
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

    def __init__(self, path: Path | str):
        super().__init__(28, f"no space left writing {path}")
        self.path = Path(path)

    def __str__(self) -> str:
        return f"no space left writing {self.path}"

    def __reduce__(self) -> tuple[type, tuple[str]]:  # crosses the runner's pipe
        return NoSpace, (str(self.path),)


def full(exc: BaseException) -> bool:
    """Whether `exc` is the disk (or a quota) filling up."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space_in(exc: Optional[BaseException]) -> Optional["NoSpace"]:
    """The NoSpace that `exc` is or was raised from (its cause or context chain), if any."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, NoSpace):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


NO_SPACE = "NoSpace: "  # how an endpoint's one-line error starts when its disk filled


def no_space_line(exc: BaseException) -> Optional[str]:
    """An endpoint's error line for a full disk, naming the file where it is known (a
    RunFile's NoSpace), else None. A bare ENOSPC (or a thread's error text carrying one)
    names the run dir."""
    found = no_space_in(exc)
    if found is not None:
        return f"{NO_SPACE}{found}"
    seen: Optional[BaseException] = exc
    for _ in range(16):
        if seen is None:
            break
        text = str(seen)
        if NO_SPACE in text:  # a thread's error, as text
            return NO_SPACE + text[text.index(NO_SPACE) + len(NO_SPACE):].splitlines()[0]
        if full(seen) or "[Errno 28]" in text or "[Errno 122]" in text:
            name = getattr(seen, "filename", None)
            return f"{NO_SPACE}no space left writing {name or 'a file of the run dir'}"
        seen = seen.__cause__ or seen.__context__
    return None


def no_space_path(line: str) -> Optional[str]:
    """The file named by an endpoint's NoSpace error line, else None."""
    head = f"{NO_SPACE}no space left writing "
    return line[len(head):] if line.startswith(head) else None


class RunFile:
    """A file a process of the run appends lines to (records, verdicts, decisions): a full
    disk raises NoSpace naming it, not a bare OSError."""

    def __init__(self, path: Path | str, mode: str = "a", buffering: int = -1):
        self.path = Path(path)
        try:
            self.fh = open(self.path, mode, buffering=buffering)
        except OSError as exc:
            if full(exc):
                raise NoSpace(self.path) from None
            raise

    def _guard(self, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            if full(exc):
                raise NoSpace(self.path) from None
            raise

    def write(self, text: str) -> int:
        return self._guard(self.fh.write, text)

    def flush(self) -> None:
        self._guard(self.fh.flush)

    def fileno(self) -> int:
        return self.fh.fileno()

    @property
    def closed(self) -> bool:
        return self.fh.closed

    def close(self) -> None:
        """(Python closes the descriptor even when the last flush fails.)"""
        if not self.fh.closed:
            self._guard(self.fh.close)

    def __enter__(self) -> RunFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _private_temp(directory: Path, name: str) -> tuple[Path, int]:
    """A new temporary file beside `name` in `directory`: a random name, created with
    O_CREAT|O_EXCL|O_NOFOLLOW, so a symlink or file planted in a shared directory is never
    opened or followed (the target is then replaced by rename, which follows nothing)."""
    import os
    import secrets

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = directory / f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return tmp, os.open(tmp, flags, 0o644)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {directory / name}")


def write_atomic(path: Path, text: str) -> None:
    """Write a file so that a reader sees the old or the new content, never a torn one; a
    failed write leaves no temporary file behind (a full disk raises NoSpace). Safe in a
    shared directory: see _private_temp."""
    import os

    path = Path(path)
    tmp: Optional[Path] = None
    try:
        tmp, fd = _private_temp(path.parent, path.name)
        with open(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass
        if full(exc) and not isinstance(exc, NoSpace):
            raise NoSpace(path) from None
        raise


class NotARegularFile(ValueError):
    """A shared file that is a FIFO, a device, a directory, or too large to be ours."""


def read_shared(path: Path | str, limit: int = 1 << 16) -> str:
    """The text of a file in a shared place (transport.bootstrap_file). Opened with
    O_NONBLOCK (a FIFO planted there cannot block the open) and checked with fstat: anything
    but a regular file of at most `limit` bytes raises NotARegularFile; a missing one
    FileNotFoundError."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(f"{path} is not a regular file")
        if st.st_size > limit:
            raise NotARegularFile(f"{path} is larger than {limit} bytes")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")
