"""Small pieces shared by the service helpers: bounded commands, daemons stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

CMD_TIMEOUT_S = 20.0


def ip_binary() -> Optional[str]:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip")
                                       if os.access(p, os.X_OK)), None)


def run(args: Sequence[str], check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    """A service run in the foreground as a child of this process, output to a log file."""

    name: str
    proc: subprocess.Popen
    log: Path

    @classmethod
    def spawn(cls, name: str, argv: Sequence[str], log: Path, env: Optional[dict] = None) -> "Daemon":
        with open(log, "ab") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return cls(name, proc, Path(log))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, wait_s: float = 10.0) -> Optional[str]:
        """SIGTERM, then SIGKILL after `wait_s`; what went wrong, if anything."""
        if not self.alive():
            return None
        try:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(wait_s)
            return None
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                return f"{self.name} (pid {self.pid}) survived SIGKILL"
            return None


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, *daemons: Daemon) -> None:
    """Poll `predicate` until true; raises with the daemons' log tails when `timeout_s` passes
    or one of them exited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (OSError, subprocess.TimeoutExpired):
            pass
        dead = [d for d in daemons if not d.alive()]
        if dead or time.monotonic() > deadline:
            why = (f"{', '.join(f'{d.name} exited {d.proc.returncode}' for d in dead)}" if dead
                   else f"not within {timeout_s:g} s")
            logs = "\n".join(f"--- {d.name} ({d.log}):\n{d.tail()}" for d in daemons)
            raise RuntimeError(f"waiting for {what}: {why}\n{logs}")
        time.sleep(0.2)


def kill_namespace(ip: str, ns: str, wait_s: float = 10.0) -> list[int]:
    """SIGKILL every process still in network namespace `ns` (SIGCONT first, in case one is
    stopped); returns the pids still there after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        proc = run([ip, "netns", "pids", ns], check=False)
        pids = [int(x) for x in proc.stdout.split() if x.isdigit() and int(x) != os.getpid()]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.1)


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, children first."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [p for k in (int(x) for x in out.split()) for p in process_tree(k)] + [pid]


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants (gone ones skipped)."""
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reap(started: list[subprocess.Popen]) -> None:
    """Kill, tree and all, what a test started and left running (a bound that failed); empties
    `started`."""
    for proc in started:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()
    started.clear()
