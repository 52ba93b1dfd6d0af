"""CUDA MPS for a run's processes that share a GPU (endpoints.mps; the decision is
orchestrator.profile.sharing's, made before the run).

A run-owned control daemon is started, and stopped, by a small reaper process that the runner
holds by a pipe: the reaper runs `nvidia-cuda-mps-control -d` with the run's pipe and log dirs
(in the run dir), says whether it came up, then blocks reading the pipe. The runner closes the
pipe at the end of the run, on failure and on an interrupt; when the runner dies any other way
(SIGKILL included) the kernel closes it. Either way the reaper reads EOF, sends `quit` to the
daemon and waits until the daemon is gone. The reaper ignores SIGINT, SIGTERM and SIGHUP and
runs in a session of its own, so a Ctrl-C or a signal to the run's process group cannot stop
it before its quit. Nothing here changes a device setting (the compute mode included).

The children join through CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY, set in the
runner's environment while it spawns them (a spawned child inherits it) and restored after.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from structlog.stdlib import BoundLogger

from orchestrator.profile.sharing import MPS_CONTROL, MPS_ENV, GpuSharing, MpsDaemon
from orchestrator.results.rundir import NotARegularFile, read_shared, safe_dir

START_S = 15.0  # the daemon's start, bounded
STOP_S = 15.0  # the reaper's quit (it waits for the clients still attached), then the daemon's exit
MAX_PIPE_DIR = 64  # the daemon's unix sockets live in the pipe dir: sun_path holds 107 bytes

# The reaper: argv = control program, pipe dir, log dir, start and stop bounds (s). stdout: one
# line, "up PID" (the daemon's pid, from the line its control.log starts with) or why not.
# stdin: held open by the runner; EOF (the runner closed it, or died) quits the daemon, waits
# for its pid to be gone, and kills it if the quit did not end it in time.
REAPER = r"""
import os, re, signal, stat, subprocess, sys, time
SIGS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
for s in SIGS:
    signal.signal(s, signal.SIG_IGN)
def default():  # the daemon must not inherit the ignored signals
    for s in SIGS:
        signal.signal(s, signal.SIG_DFL)
def alive(pid):  # a zombie no one reaps counts as gone
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
control, pipe, logs, start_s, stop_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
def regular(path, flags):  # never through a link, never blocked by a FIFO: a regular file or none
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd
try:
    out = open(regular(os.path.join(logs, "reaper.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab", buffering=0)
except OSError as exc:
    sys.stdout.write(f"reaper.log: {exc}\n")
    sys.exit(1)
rc = subprocess.run([control, "-d"], stdin=subprocess.DEVNULL, stdout=out, stderr=out, preexec_fn=default).returncode
pid, deadline = None, time.monotonic() + start_s
while rc == 0 and pid is None and time.monotonic() < deadline:
    try:
        with open(regular(os.path.join(logs, "control.log"), os.O_RDONLY), "rb") as fh:
            m = re.search(rb"Control +(\d+)\] Starting control daemon", fh.read())
    except OSError:
        m = None
    if m and os.path.exists(os.path.join(pipe, "control")):
        pid = int(m[1])
    else:
        time.sleep(0.02)
sys.stdout.write(f"up {pid}\n" if pid else f"exit code {rc}\n" if rc else f"no daemon within {start_s:g} s\n")
sys.stdout.flush()
if pid:
    sys.stdin.buffer.read()
    try:
        subprocess.run([control], input=b"quit\n", stdout=out, stderr=out, timeout=stop_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + stop_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if alive(pid):
        out.write(b"reaper: the daemon did not quit in time: killed\n")
        os.kill(pid, signal.SIGKILL)
"""


class MpsError(RuntimeError):
    """The run's own MPS daemon did not start; the message says why."""


class OwnDaemon:
    """The run's own MPS control daemon, behind its reaper (see the module's doc)."""

    def __init__(self, control: str, run_dir: Path):
        self.control = control
        self.root = run_dir / "mps"
        self.log_dir = self.root / "log"
        pipe = self.root / "pipe"
        self.link: Optional[Path] = None  # a short path to the pipe dir, where the run dir's is long
        self.pipe_dir = pipe
        self.reaper: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None  # the daemon's
        run_dir.mkdir(parents=True, exist_ok=True)
        for d in (self.root, pipe, self.log_dir):  # a link or a stranger's dir there: UnsafePath
            safe_dir(d)
        if len(str(pipe)) > MAX_PIPE_DIR:
            self.link = Path(tempfile.mkdtemp(prefix="mps-")) / "pipe"
            self.link.symlink_to(pipe.resolve())
            self.pipe_dir = self.link

    @property
    def env(self) -> dict[str, str]:
        return dict(zip(MPS_ENV, (str(self.pipe_dir), str(self.log_dir))))

    def start(self) -> None:
        """Start the reaper and, through it, the daemon; return once the daemon's control pipe
        is there (`pid`: the daemon's). Raises MpsError (the reaper is gone then)."""
        self.reaper = subprocess.Popen(
            [sys.executable, "-c", REAPER, self.control, str(self.pipe_dir), str(self.log_dir), str(START_S),
             str(STOP_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env}, start_new_session=True)
        assert self.reaper.stdout is not None  # (PIPE)
        line = b""
        if select.select([self.reaper.stdout], [], [], START_S + 5)[0]:
            line = self.reaper.stdout.readline()
        said = line.decode(errors="replace").strip()
        if said.startswith("up "):
            self.pid = int(said.split()[1])
            return
        self.stop()
        last = _last_line(self.log_dir / "reaper.log")
        raise MpsError(f"{self.control} -d: {said or 'no answer'}" + (f" ({last})" if last else ""))

    def stop(self) -> Optional[str]:
        """Quit the daemon (through the reaper) and wait for it; None, or what went wrong."""
        problem = None
        if self.reaper is not None:
            assert self.reaper.stdin is not None  # (PIPE)
            with contextlib.suppress(OSError):
                self.reaper.stdin.close()
            try:
                self.reaper.wait(2 * STOP_S + 5)
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
                problem = f"the MPS daemon (pid {self.pid}) did not quit within {2 * STOP_S + 5:g} s"
            if self.reaper.stdout is not None:
                self.reaper.stdout.close()
            self.reaper = None
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.link.unlink()
                self.link.parent.rmdir()
            self.link = None
        return problem


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in read_shared(path).splitlines() if ln.strip()]
    except (OSError, NotARegularFile):
        return ""
    return lines[-1] if lines else ""


def record_servers(record: dict, sharing: GpuSharing) -> None:
    """Under MPS, once the children have their CUDA contexts: the MPS servers the daemon runs
    for them (`get_server_list`: one pid per server), in the run's `gpu_sharing` record. None
    where the daemon cannot be asked (the user's, without the control program on PATH)."""
    if not record.get("mps"):
        return
    control = sharing.control or shutil.which(MPS_CONTROL)
    servers = None
    if control:
        try:  # (the daemon's variables are in os.environ while the run lasts)
            out = subprocess.run([control], input=b"get_server_list\n", capture_output=True, timeout=5)
            servers = out.stdout.decode(errors="replace").split() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    record["servers"] = servers


@contextlib.contextmanager
def mps_for(sharing: GpuSharing, planned: dict, run_dir: Path, log: BoundLogger) -> Iterator[dict]:
    """While the run's processes are spawned and run: MPS as `sharing` decided (the run's own
    daemon started here, and stopped on the way out, however the block ends), its variables
    in os.environ for the children. Yields the run's `gpu_sharing` record: `planned` (the
    decision as results.json's plan records it, GpuSharing.as_dict(): a job's specs hold it
    rendered) with what was had (a daemon that did not start: `error`, and no MPS)."""
    record = dict(planned)
    own: Optional[OwnDaemon] = None
    saved = {k: os.environ.get(k) for k in MPS_ENV}
    try:
        if sharing.daemon is MpsDaemon.own:
            assert sharing.control is not None  # (sharing_rule: own only with the program found)
            own = OwnDaemon(sharing.control, run_dir)
            try:
                own.start()
            except MpsError as exc:
                own = None
                record.update(mps=False, daemon=MpsDaemon.none.value, error=str(exc))
                log.error("mps_not_started", error=str(exc))
            else:
                os.environ.update(own.env)
                record.update(pipe_dir=str(own.pipe_dir), daemon_pid=own.pid)
                log.info("mps_started", **own.env)
        elif sharing.daemon is MpsDaemon.user:
            record["pipe_dir"] = sharing.pipe_dir
            log.info("mps_joined", pipe_dir=sharing.pipe_dir)
        yield record
    finally:
        if own is not None:
            problem = own.stop()
            if problem:
                record["error"] = problem
                log.error("mps_not_stopped", error=problem)
            else:
                log.info("mps_stopped")
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
