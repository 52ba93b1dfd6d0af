"""One etcd server for Mooncake's metadata (transport.mooncake.metadata_server=etcd://H:P),
its data dir under a temp dir, run as a child of this process and stopped by pid.

    with Etcd.start(tmp_path) as etcd:          # 127.0.0.1, a free port
        etcd.url                                  # etcd://127.0.0.1:PORT
    Etcd.start(tmp, host="192.0.2.2", exec_prefix=pair.exec_args(pair.decode_ns, []))

Needs Debian's etcd-server (`make cluster-deps`); `missing()` says so for a skip reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
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
    exec_prefix: tuple = ()

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
        etcd = cls(daemon, host, port, data, tuple(exec_prefix))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not etcd.healthy():
            if not daemon.alive() or time.monotonic() > deadline:
                daemon.stop()
                raise RuntimeError(f"etcd did not come up on {host}:{port}\n{daemon.tail()}")
            time.sleep(0.2)
        return etcd

    def healthy(self) -> bool:
        """It says it serves clients (its log) and answers a range request where it runs."""
        if "serving client traffic" not in self.daemon.tail(400):
            return False
        try:
            return self.revision() >= 1
        except RuntimeError:
            return False

    def revision(self) -> int:
        """etcd's store revision (1 when fresh; every put or delete adds one), read through its
        v3 HTTP gateway from where it runs (inside its namespace, if any)."""
        body = json.dumps({"key": "AA==", "range_end": "AA==", "count_only": True})
        code = ("import json,sys,urllib.request as u;"
                f"r=u.urlopen(u.Request('http://{self.host}:{self.port}/v3/kv/range',"
                f"data={body!r}.encode()),timeout=5);print(json.load(r)['header']['revision'])")
        proc = subprocess.run([*self.exec_prefix, sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"etcd range request failed: {proc.stderr.strip()[-300:]}")
        return int(proc.stdout.strip())

    def stop(self) -> Optional[str]:
        return self.daemon.stop()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
