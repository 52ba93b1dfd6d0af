"""What a run directory holds, named once: the files the processes write, named after the
processes (orchestrator.profile.proc_names), so the process that writes a file and the one
that reads it back (the runner, the report, plots, replay) never spell its name twice."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

# the processes' names are the profile's; here they name files (re-exported: callers read them here too)
from orchestrator.profile.proc_names import ProcName, parse_proc_name
from orchestrator.profile.proc_names import proc_name as proc_name


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
RUN_ID_NAME = ".run.id"  # {"run": id, "sweep": id or null}: the run that owns this dir
SWEEP_ID_NAME = ".sweep.id"  # {"sweep": id}: the sweep that owns this sweep dir


class RunDirBusy(Exception):
    """The run dir cannot be this run's (refused before start: exit 2): another live run holds
    its lock, it holds another run's files, or a path the run opens there is a link or a
    special file."""


class UnsafePath(RunDirBusy):
    """A path the run opens is a symbolic link (a loop too), a FIFO, a socket, a device or a
    directory: refused, never followed or opened for I/O."""


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _unsafe(path: Path | str, what: str) -> UnsafePath:
    return UnsafePath(f"{path} is {what}: refused (a run opens only regular files of its own; "
                      "remove it or choose a new dir)")


def open_regular(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open for a file of the run dir, as the bootstrap file is read (read_shared):
    O_NOFOLLOW (a symbolic link, a loop too, is never followed), O_NONBLOCK (a FIFO cannot
    block the open), O_CLOEXEC, O_NOCTTY; then fstat: anything but a regular file raises
    UnsafePath (after its descriptor is closed). O_NONBLOCK is cleared again on the file
    opened. A full disk raises NoSpace naming the file."""
    import errno
    import fcntl
    import os
    import stat

    extra = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _unsafe(path, "a symbolic link") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):
            try:
                what = _kind(os.lstat(path).st_mode)
            except OSError:
                what = "not a regular file"
            raise _unsafe(path, what) from None
        if full(exc):
            raise NoSpace(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _unsafe(path, _kind(st.st_mode))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_regular(path: Path | str, append: bool = False) -> int:
    """A new file of the run dir, created with O_CREAT|O_EXCL|O_NOFOLLOW (open_regular): a
    link or special file planted at `path` is refused, never followed or truncated. A regular
    file already there (a process of this run starting its file again, a test re-running into
    its dir) is unlinked first, never truncated: a hard link to another file keeps its
    content."""
    import os
    import stat

    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | (os.O_APPEND if append else 0)  # read back: _cut_torn
    for _ in range(4):
        try:
            return open_regular(path, flags)
        except FileExistsError:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                raise _unsafe(path, _kind(st.st_mode)) from None
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    raise _unsafe(path, "replaced while it was being created")


def safe_dir(path: Path | str, create: bool = True) -> Path:
    """A directory of the run (`.hydra`, mps/, mps/log): made when missing (mode 0o755
    under the umask), then checked with lstat: a symbolic link or anything but a directory
    owned by this user raises UnsafePath."""
    import os
    import stat

    path = Path(path)
    if create:
        try:
            os.mkdir(path)
        except FileExistsError:
            pass
        except OSError as exc:
            if full(exc):
                raise NoSpace(path) from None
            raise
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise _unsafe(path, _kind(st.st_mode))
    if st.st_uid != os.getuid():
        raise _unsafe(path, f"a directory of another user (uid {st.st_uid})")
    return path


# Files and dirs in a run dir that only a run writes: any of them there before a run starts
# (a link or special file too) is another run's (refused: never overwritten, never read as ours).
_EVIDENCE = re.compile(r"(requests|decisions|verdicts-).*\.jsonl|results\.json|fingerprint\.json|"
                       r"latency\.png|bootstrap\.json|\.hydra|mps|" + re.escape(RUN_ID_NAME))
# Files a run appends to or opens whose name a stranger can plant (links, FIFOs refused).
_OPENED = re.compile(r"(prefill|decode|orchestrator|metadata_server).*\.log|" + re.escape(LOCK_NAME))


def foreign_files(run_dir: Path) -> list[str]:
    """The names in `run_dir` that another run left (or a stranger planted), sorted: a run's
    data files, `.hydra`, `.run.id`, mps/; and, among the logs and the lock, any symbolic link
    or special file (lstat: nothing is followed)."""
    import os
    import stat

    found = []
    try:
        entries = list(os.scandir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for e in entries:
        if _EVIDENCE.fullmatch(e.name):
            found.append(e.name)
        elif _OPENED.fullmatch(e.name):
            try:
                mode = e.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if not stat.S_ISREG(mode):
                found.append(e.name)
    return sorted(found, key=lambda n: (n.startswith("."), n != RunFiles.RESULTS, n))  # results.json first


def _listed(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


def refuse_foreign(run_dir: Path, where: Optional[str] = None, ignore: Iterable[str] = ()) -> None:
    """Raises RunDirBusy naming what another run left in `run_dir` (foreign_files, but the
    names in `ignore`): a run owns its dir or refuses it; it never overwrites, moves or reads
    another run's files. `where` names the dir in the line (hydra.run.dir=DIR)."""
    skip = set(ignore)
    names = [n for n in foreign_files(run_dir) if n not in skip]
    if names:
        raise RunDirBusy(f"{where or f'hydra.run.dir={run_dir}'} holds another run's files "
                         f"({_listed(names)}): choose a new dir or remove them")


def new_run_id() -> str:
    import secrets

    return secrets.token_hex(8)


def claim_run_dir(run_dir: Path, run: str, sweep: Optional[str] = None) -> None:
    """Mark `run_dir` as run `run`'s (of sweep `sweep`): RUN_ID_NAME, created exclusively
    (a file already there is another run's: RunDirBusy)."""
    claim_file(run_dir / RUN_ID_NAME, {"run": run, "sweep": sweep},
               f"{run_dir} holds another run's files ({RUN_ID_NAME}): choose a new dir or remove them")


def claim_file(path: Path, owner: dict[str, Optional[str]], busy: str) -> None:
    """`owner` as one JSON line in `path`, created exclusively and without following a link
    (open_regular): a file already there raises RunDirBusy(`busy`); a full disk leaves no
    half-written claim (NoSpace)."""
    import json
    import os

    try:
        fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        raise RunDirBusy(busy) from None
    try:
        with open(fd, "w") as fh:
            fh.write(json.dumps(owner) + "\n")
    except OSError as exc:
        path.unlink(missing_ok=True)
        if full(exc):
            raise NoSpace(path) from None
        raise


def run_owner(run_dir: Path | str) -> dict[str, Optional[str]]:
    """{"run": ..., "sweep": ...} from `run_dir`'s RUN_ID_NAME; both None where there is none
    or it cannot be read (a dir no run of this version claimed: tests, the bench's phases)."""
    import json

    try:
        data = json.loads(read_shared(Path(run_dir) / RUN_ID_NAME, 4096))
    except (OSError, ValueError):
        return {"run": None, "sweep": None}
    if not isinstance(data, dict):
        return {"run": None, "sweep": None}
    return {k: (data.get(k) if isinstance(data.get(k), str) else None) for k in ("run", "sweep")}


def sweep_owner(sweep_dir: Path | str) -> Optional[str]:
    """The id of the sweep that claimed `sweep_dir` (SWEEP_ID_NAME), or None."""
    import json

    try:
        data = json.loads(read_shared(Path(sweep_dir) / SWEEP_ID_NAME, 4096))
    except (OSError, ValueError):
        return None
    sweep = data.get("sweep") if isinstance(data, dict) else None
    return sweep if isinstance(sweep, str) else None


def run_of(run_dir: Path | str) -> Optional[str]:
    """The id of the run that owns `run_dir` (run_owner), or None."""
    return run_owner(run_dir)["run"]


def run_tag(run: Optional[str]) -> str:
    """What a run's JSON lines end with to say whose they are: `, "run": "<id>"` (nothing
    without an id). Readers (records.read_jsonl) count only the lines of the dir's own run."""
    return f', "run": "{run}"' if run else ""


def _holder(path: Path) -> str:
    try:
        return read_shared(path, 64).strip() or "?"
    except (OSError, ValueError):
        return "?"


class RunLock:
    """A held run-dir lock: the descriptor of the regular file `path`, locked with flock."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def fileno(self) -> int:
        return self.fd

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        import os

        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_run_dir(run_dir: Path) -> RunLock:
    """Hold `run_dir`'s lock for as long as the returned lock stays open (one run per run
    dir; the kernel drops the lock when the process ends, however it ends). Raises
    RunDirBusy when another process holds it, UnsafePath when the lock path is a link or a
    special file (open_regular: O_NOFOLLOW|O_NONBLOCK, fstat; a FIFO never blocks). A lock
    file that its holder removed at its end (unlock_run_dir) while this process was opening
    it is opened again: the lock held is always the one on the file the path names. The pid
    is written only once the lock is held, through its descriptor."""
    import fcntl
    import os

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    while True:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunDirBusy(f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); "
                             "give this one its own hydra.run.dir") from None
        try:
            same = os.lstat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed it between our open and our lock: take the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        if full(exc):
            raise NoSpace(path) from None
        raise
    return RunLock(path, fd)


def unlock_run_dir(lock: RunLock) -> None:
    """The run's last act: remove the lock file while still holding its lock (a run that
    opened it meanwhile sees it gone and takes a new one, lock_run_dir), then let go."""
    import os

    try:
        if os.lstat(lock.path).st_ino == os.fstat(lock.fileno()).st_ino:
            lock.path.unlink()
    except OSError:
        pass
    lock.close()


def run_dir_busy(run_dir: Path) -> Optional[str]:
    """The refusal line when a live run holds `run_dir`'s lock, when the dir holds another
    run's files (foreign_files), or when its lock path is a link or a special file; else
    None (takes nothing, follows nothing, never blocks)."""
    import fcntl
    import os

    path = run_dir / LOCK_NAME
    if os.path.lexists(path):
        try:
            fd = open_regular(path, os.O_RDONLY)
        except UnsafePath as exc:
            return str(exc)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return (f"{run_dir} is in use by another run (pid {_holder(path)} holds {path}); give "
                        "this one its own hydra.run.dir")
            finally:
                os.close(fd)
    try:
        refuse_foreign(run_dir)
    except RunDirBusy as exc:
        return str(exc)
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
    disk raises NoSpace naming it, not a bare OSError. Opened as open_regular opens: "w"
    creates it anew (create_regular: O_EXCL, a regular file there unlinked first), "a"
    appends to a regular file (created where missing); a link or a special file at its path
    raises UnsafePath. `tag` (run_tag) is what its lines end with: the id of the run that
    owns its dir (RUN_ID_NAME), nothing in a dir no run claimed."""

    def __init__(self, path: Path | str, mode: str = "a", buffering: int = -1):
        import os

        self.path = Path(path)
        if mode not in ("w", "a"):
            raise ValueError(f"RunFile mode {mode!r}: w or a")
        self.tag = run_tag(run_of(self.path.parent))
        self._full = False
        fd = (create_regular(self.path) if mode == "w"
              else open_regular(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT))
        try:
            self.fh = open(fd, mode, buffering=buffering)
        except BaseException:
            os.close(fd)
            raise

    def _guard(self, call: Callable[..., Any], *args: Any) -> Any:
        if self._full:
            raise NoSpace(self.path)
        try:
            return call(*args)
        except OSError as exc:
            if full(exc):
                self._end_full()
                raise NoSpace(self.path) from None
            raise

    def _end_full(self) -> None:
        """The disk filled: cut the file back to its last complete line, then point the
        descriptor at /dev/null, so what is still buffered never lands half (a later flush
        or close writes nowhere; every later write raises NoSpace)."""
        import os

        self._full = True
        try:
            fd = self.fh.fileno()
        except (OSError, ValueError):
            return
        self._cut_torn()
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(null, fd, inheritable=False)
            os.close(null)
        except OSError:
            pass

    def write(self, text: str) -> int:
        return self._guard(self.fh.write, text)

    def flush(self) -> None:
        self._guard(self.fh.flush)

    def _cut_torn(self) -> None:
        """After a full disk: the file is cut back to its last complete line (what the
        buffer could not write whole is dropped, never left half written)."""
        import os

        fd = self.fh.fileno()
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return
            start = max(0, size - (1 << 16))
            while True:
                tail = os.pread(fd, size - start, start)
                nl = tail.rfind(b"\n")
                if nl >= 0:
                    cut = start + nl + 1
                    break
                if start == 0:
                    cut = 0
                    break
                start = max(0, start - (1 << 16))
            if cut != size:
                os.ftruncate(fd, cut)
        except OSError:
            pass

    def fileno(self) -> int:
        return self.fh.fileno()

    @property
    def closed(self) -> bool:
        return self.fh.closed

    def close(self) -> None:
        """(Python closes the descriptor even when the last flush fails: the flush is
        taken first, so a full disk is met with the descriptor still open.)"""
        if self.fh.closed:
            return
        if self._full:
            try:
                self.fh.close()
            except OSError:
                pass
            return
        try:
            self._guard(self.fh.flush)
        finally:
            try:
                self.fh.close()
            except OSError as exc:
                if not full(exc):
                    raise

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


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a file so that a reader sees the old or the new content, never a torn one; a
    failed write leaves no temporary file behind (a full disk raises NoSpace). Safe in a
    shared directory: see _private_temp."""
    import os

    path = Path(path)
    tmp: Optional[Path] = None
    try:
        tmp, fd = _private_temp(path.parent, path.name)
        with open(fd, "wb" if isinstance(text, bytes) else "w") as fh:
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


def write_tables(run_dir: Path, stem: str, data: dict[str, Any], table: str) -> None:
    """A bench's or ladder's outputs: STEM.json (`data`) and STEM.md (`table`), each written
    atomically; the table printed, then where both went."""
    import json
    import os

    write_atomic(run_dir / f"{stem}.json", json.dumps(data, indent=2) + "\n")
    write_atomic(run_dir / f"{stem}.md", table + "\n")
    print(table, flush=True)
    print(f"wrote {os.path.relpath(run_dir / f'{stem}.json')} and {os.path.relpath(run_dir / f'{stem}.md')}",
          flush=True)
