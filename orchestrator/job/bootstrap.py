"""The job's part of a split run's bootstrap, and Mooncake's metadata server.

The bootstrap itself (the decode side's server, the prefill side's lookup, both sides' peer
checks) is a conversation between the two hosts' transports: orchestrator.handoff.transport.
bootstrap, handed a BootstrapSpec and the run's secret. While the decode side serves, the
runner hears its decode processes here (`DecodeWatch`): a prefill rank done with an instance
(its bye, a refusal, its loss), or a decode's failure; the serving ends when every prefill rank
said bye to every instance.
"""

from __future__ import annotations

import socket
import subprocess
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol, Sequence

from orchestrator.job import protocol
from orchestrator.job.lifecycle import RunFailed
from orchestrator.profile.platform import clock as _clock
from orchestrator.results.records import RunResult
from orchestrator.results.rundir import create_regular, proc_name


class DecodeProc(Protocol):
    """A decode process as the runner holds it."""

    name: str
    proc: BaseProcess
    conn: protocol.Channel
    index: int  # its decode instance
    tp_rank: int


class DecodeWatch:
    """What the decode processes tell the runner while the decode side serves its bootstrap
    (handed to serve_bootstrap as its `watch`): True once every prefill rank (`want`:
    endpoints.prefill_ranks) said bye to every instance; a decode's failure is a RunFailed."""

    def __init__(self, decodes: Sequence[DecodeProc], want: int, out: RunResult) -> None:
        self.decodes, self.want, self.out = decodes, want, out
        self.leaders = [d for d in decodes if d.tp_rank == 0]
        self.byes: dict[int, set[int]] = {}

    def __call__(self) -> bool:
        for d in self.decodes:
            self._read(d)
        if self.leaders and all(len(self.byes.get(d.index, ())) >= self.want for d in self.leaders):
            self.out.prefills_seen = sorted(set().union(*self.byes.values()))
            return True
        return False

    def _read(self, d: DecodeProc) -> None:
        """What decode process `d` told the runner: a prefill rank done with it, or a failure."""
        leader = d in self.leaders
        while d.conn.poll(0):
            try:
                msg = d.conn.recv()
            except (EOFError, OSError):
                raise RunFailed(f"{d.name} closed its pipe") from None
            match msg:
                case protocol.Bye(rank=rank) if leader:
                    self.byes.setdefault(d.index, set()).add(rank)
                case protocol.Refused(rank=rank, why=why) if leader:  # that rank is done here, and failed
                    self.byes.setdefault(d.index, set()).add(rank)
                    name = proc_name("prefill", rank, self.want)
                    self.out.error = self.out.error or f"{name} refused at bootstrap: {why}"
                case protocol.PrefillLost(rank=rank, why=why) if leader:
                    self.byes.setdefault(d.index, set()).add(rank)
                    self.out.lost.setdefault(proc_name("prefill", rank, self.want), why)
                case protocol.Error(line=line):
                    self.out.heard(line)
                    raise RunFailed(f"{d.name} endpoint failed: {line}")
        if not d.proc.is_alive():
            raise RunFailed(f"{d.name} exited with code {d.proc.exitcode}")


def start_metadata_server(url: str, run_dir: Path) -> subprocess.Popen[bytes]:
    """Mooncake's own HTTP metadata server (mooncake_http_metadata_server, in the wheel) for
    an http://HOST:PORT/metadata address on this host; returns the process."""
    import sys
    from urllib.parse import urlsplit

    u = urlsplit(url)
    assert u.hostname is not None  # config checked it: http://HOST:PORT/metadata
    import os

    log = os.fdopen(create_regular(run_dir / "metadata_server.log", append=True), "ab")  # no link followed
    proc = subprocess.Popen([sys.executable, "-m", "mooncake.http_metadata_server", "--host", u.hostname,
                             "--port", str(u.port)], stdout=log, stderr=log, start_new_session=True)
    deadline = _clock() + 20
    while _clock() < deadline:
        with socket.socket() as s:
            if s.connect_ex((u.hostname, u.port)) == 0:
                return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RunFailed(f"mooncake_http_metadata_server did not come up at {url} (see metadata_server.log)")
