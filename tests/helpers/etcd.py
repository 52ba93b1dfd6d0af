"""One etcd server for Mooncake's metadata (transport.mooncake.metadata_server=etcd://H:P),
its data dir under a temp dir, run as a child of this process and stopped by pid.

    with Etcd.start(tmp_path) as etcd:          # 127.0.0.1, a free port
        etcd.url                                  # etcd://127.0.0.1:PORT
    Etcd.start(tmp, host="192.0.2.2", exec_prefix=pair.exec_args(pair.decode_ns, []))

Needs Debian's etcd-server (`make cluster-deps`); `missing()` says so for a skip reason.
"""

from __future__ import annotations

import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .procs import Daemon, free_port

START_TIMEOUT_S = 30.0


def etcd_binary() -> Optional[str]:
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/sbin/etcd")
                                         if Path(p).is_file()), None)


def missing() -> Optional[str]:
    if etcd_binary() is None:
        return "etcd is not installed (Debian: apt-get install etcd-server; `make cluster-deps`)"
    return None


@dataclass
class Etcd:
    daemon: Daemon
    host: str
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.port}"

    @classmethod
    def start(cls, base: Path, host: str = "127.0.0.1", port: Optional[int] = None,
              exec_prefix: Sequence[str] = ()) -> "Etcd":
        """`exec_prefix` runs it elsewhere (e.g. `ip netns exec NS`); ports then have to be
        given or free there (a fresh namespace: any)."""
        port = port or free_port(host if not exec_prefix else "127.0.0.1")
        peer = port + 1 if exec_prefix else free_port()
        data = Path(base) / f"etcd-{port}"
        data.mkdir(parents=True, exist_ok=True)
        argv = [*exec_prefix, etcd_binary(), "--name", "pdaux", "--data-dir", str(data / "data"),
                "--listen-client-urls", f"http://{host}:{port}",
                "--advertise-client-urls", f"http://{host}:{port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"pdaux=http://127.0.0.1:{peer}",
                "--log-level", "info", "--logger", "zap"]
        daemon = Daemon.spawn(f"etcd {host}:{port}", argv, data / "etcd.log")
        etcd = cls(daemon, host, port, data)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not etcd.healthy():
            if not daemon.alive() or time.monotonic() > deadline:
                daemon.stop()
                raise RuntimeError(f"etcd did not come up on {host}:{port}\n{daemon.tail()}")
            time.sleep(0.2)
        return etcd

    def healthy(self) -> bool:
        """Its client port accepts and /health says true (checked from this namespace when it
        runs here; from elsewhere, the log line that it serves)."""
        if "serving insecure client requests" in self.daemon.tail(200) or \
                "ready to serve client requests" in self.daemon.tail(200):
            return True
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as s:
                s.sendall(f"GET /health HTTP/1.0\r\nHost: {self.host}\r\n\r\n".encode())
                return b'"health":"true"' in s.recv(4096)
        except OSError:
            return False

    def stop(self) -> Optional[str]:
        return self.daemon.stop()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
