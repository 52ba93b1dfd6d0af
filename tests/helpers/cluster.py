"""A Slurm cluster on this machine, for the tests that run real jobs (tests/test_cluster.py).

    munged      one munge daemon, its key and socket under the cluster's temp dir
    slurmctld   `pdctl`, in a "login" network namespace holding a bridge (192.0.2.254); the
                client commands (sbatch, sinfo, scancel, and the orchestrator submitting
                through submitit) run there too: `Cluster.login_exec(argv)`
    slurmd x2   `pdnode1` (192.0.2.1) and `pdnode2` (192.0.2.2), each in its own network
                namespace and UTS namespace (its own hostname), joined to the login
                namespace's bridge by a veth pair

This host's own namespace is left alone (on the CI boxes its eth0 is itself in 192.0.2.0/24).

Everything (slurm.conf, state, spool dirs, logs, munge key and socket) lives under one temp
dir; the daemons run in the foreground as children of this process and `stop()` ends them by
pid, then whatever is left in the node namespaces (job steps), then the namespaces and the
bridge. Every wait is bounded. The addresses are TEST-NET-1 (192.0.2.0/24, never routed); one
cluster per machine at a time (a lock file under /run/lock, waited for, bounded).

Needs root, iproute2, `unshare`, and Debian's slurm-wlm and munge (`make cluster-deps`);
`Cluster.unavailable()` says what is missing, for a skip reason. Also a command line, to try it:

    python -m tests.helpers.cluster      (root; prints sinfo, waits for Enter, stops)
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .procs import Daemon, ip_binary, kill_namespace, run, wait_for

LOGIN = "login"        # the namespace of slurmctld and of every client command (sbatch, submitit)
CTL_HOST = "pdctl"
HOST_IP = "192.0.2.254"
NODES = (("pdnode1", "192.0.2.1"), ("pdnode2", "192.0.2.2"))
PREFIX = 24
NODE_CPUS = 2          # what each node declares (the box has 2 cores; both nodes share them)
NODE_MEMORY_MB = 2048  # declared, not enforced (task/none): what sinfo shows and the scheduler counts
PARTITION = "debug"
LOCK = Path("/run/lock/pd-aux-test-cluster.lock")
SLURM_BINARIES = ("slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "sinfo", "squeue", "scancel",
                  "scontrol")


class ClusterUnavailable(RuntimeError):
    """Why the cluster cannot be built here (the tests skip with this text)."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin", "/usr/bin")
                                       if os.access(p := f"{d}/{name}", os.X_OK)), None)


def missing() -> Optional[str]:
    """None when this machine can run the cluster, else why not (one line)."""
    if os.geteuid() != 0:
        return f"the test cluster needs root (network namespaces, munged, slurmd); uid {os.geteuid()}"
    lacking = [b for b in ("munged", *SLURM_BINARIES, "unshare", "nsenter") if _which(b) is None]
    if ip_binary() is None:
        lacking.append("ip (iproute2)")
    if lacking:
        return (f"not installed: {', '.join(lacking)} (Debian: apt-get install slurm-wlm munge; "
                f"`make cluster-deps`)")
    return None


@dataclass
class Cluster:
    base: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    ctl_port: int = 0
    daemons: list[Daemon] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    bridge: Optional[str] = None
    _lock: Optional[int] = None

    # ---- names and paths ----------------------------------------------------------------------
    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    def ns(self, node: str) -> str:
        return f"pdaux-{node}-{self.tag}"

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, sinfo, submitit): this cluster's conf."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def node_exec(self, node: str, argv: Sequence[str]) -> list[str]:
        """argv run inside `node`'s network namespace (LOGIN: the login namespace).
        nsenter, not `ip netns exec`: the latter mounts a fresh /sys, without the cgroup
        mounts slurmd looks for. nsenter execs in place: the pid is the command's."""
        return [_which("nsenter"), f"--net=/run/netns/{self.ns(node)}", "--", *argv]

    def login_exec(self, argv: Sequence[str]) -> list[str]:
        """argv run where the cluster's clients run (with `env`: SLURM_CONF)."""
        return self.node_exec(LOGIN, argv)

    def _as_host(self, name: str, argv: Sequence[str], where: str = LOGIN) -> list[str]:
        """argv in `where`'s network namespace and a UTS namespace of its own, named `name`."""
        return self.node_exec(where, [_which("unshare"), "--uts", "sh", "-c",
                                      'hostname "$0" && exec "$@"', name, *argv])

    # ---- set-up -------------------------------------------------------------------------------
    @classmethod
    def start(cls, base: Optional[Path] = None, lock_wait_s: float = 300.0) -> "Cluster":
        problem = missing()
        if problem:
            raise ClusterUnavailable(problem)
        base = Path(base or tempfile.mkdtemp(prefix="pd-aux-cluster-"))
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)  # munged refuses a key or socket dir others can write to
        cluster = cls(base)
        try:
            cluster._take_lock(lock_wait_s)
            cluster._network()
            cluster._munge()
            cluster._slurm()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _take_lock(self, wait_s: float) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock = fd
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ClusterUnavailable(f"another test cluster holds {LOCK} for over {wait_s:g} s") from None
                time.sleep(0.5)

    def _network(self) -> None:
        """A login namespace holding the bridge (192.0.2.254) and a veth pair from it into
        each node's namespace. Nothing is added to this host's own namespace: its addresses
        may be anything, 192.0.2.0/24 included."""
        ip = ip_binary()
        login = self.ns(LOGIN)
        run([ip, "netns", "add", login])
        self.namespaces.append(login)
        self.bridge = "pdbr0"
        run([ip, "-n", login, "link", "set", "lo", "up"])
        run([ip, "-n", login, "link", "add", self.bridge, "type", "bridge"])
        run([ip, "-n", login, "addr", "add", f"{HOST_IP}/{PREFIX}", "dev", self.bridge])
        run([ip, "-n", login, "link", "set", self.bridge, "up"])
        for i, (node, addr) in enumerate(NODES):
            ns = self.ns(node)
            run([ip, "netns", "add", ns])
            self.namespaces.append(ns)
            login_end, node_end = f"pdh{i}", "eth0"
            run([ip, "-n", login, "link", "add", login_end, "type", "veth", "peer", "name", node_end,
                 "netns", ns])
            run([ip, "-n", login, "link", "set", login_end, "master", self.bridge])
            run([ip, "-n", login, "link", "set", login_end, "up"])
            run([ip, "-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", node_end])
            run([ip, "-n", ns, "link", "set", "lo", "up"])
            run([ip, "-n", ns, "link", "set", node_end, "up"])
            run([ip, "-n", ns, "route", "add", "default", "via", HOST_IP])

    def _munge(self) -> None:
        mdir = self.base / "munge"
        mdir.mkdir(mode=0o700)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        log = self.base / "log"
        log.mkdir(exist_ok=True)
        self.daemons.append(Daemon.spawn(
            "munged", [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                       f"--key-file={key}", f"--pid-file={mdir / 'munged.pid'}",
                       f"--seed-file={mdir / 'munge.seed'}", f"--log-file={log / 'munged.log'}"],
            log / "munged.out"))
        wait_for(lambda: self.munge_socket.exists(), 20, "munged's socket", self.daemons[-1])

    def _write_conf(self) -> None:
        b = self.base
        for d in ("state", "spool", "log", *(f"spool/{n}" for n, _ in NODES)):
            (b / d).mkdir(exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={NODE_CPUS} "
                          f"RealMemory={NODE_MEMORY_MB} State=UNKNOWN" for n, a in NODES)
        self.conf.write_text(f"""# written by tests/helpers/cluster.py
ClusterName=pdaux{self.tag}
SlurmctldHost={CTL_HOST}({HOST_IP})
SlurmctldPort={self.ctl_port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={b / 'state'}
SlurmdSpoolDir={b / 'spool'}/%n
SlurmctldPidFile={b / 'slurmctld.pid'}
SlurmdPidFile={b / 'spool'}/slurmd.%n.pid
SlurmctldLogFile={b / 'log' / 'slurmctld.log'}
SlurmdLogFile={b / 'log'}/slurmd.%n.log
SlurmdDebug=info
SlurmctldDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1   # heterogeneous jobs start only from the backfill pass (default every 30 s)
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=600
SlurmdTimeout=60
InactiveLimit=0
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _slurm(self) -> None:
        self.ctl_port = 6817  # the login namespace is new: nothing else listens there
        self._write_conf()
        log = self.base / "log"
        ctl = Daemon.spawn("slurmctld", self._as_host(CTL_HOST, [_which("slurmctld"), "-D", "-i", "-f",
                                                               str(self.conf)]),
                           log / "slurmctld.out", env=self.env)
        self.daemons.append(ctl)
        wait_for(lambda: self.scontrol("ping").returncode == 0 and "UP" in self.scontrol("ping").stdout,
                 60, "slurmctld answering `scontrol ping`", ctl)
        for node, _ in NODES:
            # its own UTS namespace: `hostname` in a job says pdnode1/pdnode2; exec keeps the pid
            argv = self._as_host(node, [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)],
                                 where=node)
            self.daemons.append(Daemon.spawn(f"slurmd {node}", argv, log / f"slurmd.{node}.out",
                                             env=self.env))
        wait_for(self._nodes_idle, 90, "both nodes idle in sinfo", *self.daemons[-2:])

    def _nodes_idle(self) -> bool:
        out = self.sinfo("-h", "-N", "-o", "%N %t").stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n, _ in NODES)

    # ---- client commands ----------------------------------------------------------------------
    def command(self, name: str, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.login_exec([_which(name), *args]), capture_output=True, text=True,
                              env=self.env, timeout=timeout)

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self.command("scontrol", *args)

    def sinfo(self, *args: str) -> subprocess.CompletedProcess:
        return self.command("sinfo", *args)

    def squeue(self, *args: str) -> subprocess.CompletedProcess:
        return self.command("squeue", *args)

    # ---- tear-down ----------------------------------------------------------------------------
    def stop(self) -> list[str]:
        """Ends everything this cluster started, by pid, in reverse order; then what is left in
        the node namespaces (job steps), the namespaces, the bridge. Returns what went wrong."""
        problems: list[str] = []
        for daemon in reversed(self.daemons):
            problem = daemon.stop()
            if problem:
                problems.append(problem)
        self.daemons.clear()
        ip = ip_binary()
        for ns in list(self.namespaces):
            left = kill_namespace(ip, ns)
            if left:
                problems.append(f"{ns}: processes {left} survived SIGKILL")
            proc = run([ip, "netns", "del", ns], check=False)
            if proc.returncode == 0:
                self.namespaces.remove(ns)
            else:
                problems.append(f"ip netns del {ns}: {proc.stderr.strip()}")
        self.bridge = None  # went with the login namespace, as did the veth pairs
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
        return problems

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    c = Cluster.start()
    try:
        print(f"cluster under {c.base}; SLURM_CONF={c.conf}")
        print(c.sinfo().stdout)
        print("a shell on its login namespace (sbatch, sinfo, python -m orchestrator -m ...):\n"
              f"  SLURM_CONF={c.conf} {' '.join(c.login_exec(['bash']))}")
        input("Enter stops it ")
    finally:
        print(c.stop() or "stopped")
