"""Two network namespaces joined by one veth pair, for running the two sides of a run
"across hosts" on one machine (tests/test_netns.py).

The namespaces see only themselves: each has `lo` and its veth end, addressed from TEST-NET-1
(192.0.2.0/24, reserved for documentation, never routed), and no other route. Every command
here is bounded in time; `destroy()` kills whatever still runs inside and removes the
namespaces (the veth pair goes with them), and is safe to call on a half-built pair.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from .procs import kill_namespace

PREFILL_IP = "192.0.2.1"
DECODE_IP = "192.0.2.2"
PREFIX = 24
CMD_TIMEOUT_S = 10.0


def ip_binary() -> Optional[str]:
    return shutil.which("ip") or next((p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip")
                                       if os.access(p, os.X_OK)), None)


class NetnsUnavailable(RuntimeError):
    """Why namespaces cannot be used here (the test skips with this text)."""


def _run(args: Sequence[str], check: bool = True, timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


@dataclass
class NetnsPair:
    """prefill namespace (192.0.2.1) <-veth-> decode namespace (192.0.2.2)."""

    ip: str
    tag: str = field(default_factory=lambda: f"{os.getpid()}{uuid.uuid4().hex[:4]}")
    created: list[str] = field(default_factory=list)

    @property
    def prefill_ns(self) -> str:
        return f"pdaux-p-{self.tag}"

    @property
    def decode_ns(self) -> str:
        return f"pdaux-d-{self.tag}"

    @property
    def prefill_dev(self) -> str:  # interface names: at most 15 characters
        return f"pdp{self.tag}"[:15]

    @property
    def decode_dev(self) -> str:
        return f"pdd{self.tag}"[:15]

    # ---- set-up and tear-down -----------------------------------------------------------------
    @classmethod
    def create(cls) -> "NetnsPair":
        """Raises NetnsUnavailable when this process cannot make namespaces (not root, no
        iproute2, no netns support); anything else that fails is an error, after clean-up."""
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (this test runs as uid "
                                   f"{os.geteuid()})")
        ip = ip_binary()
        if ip is None:
            raise NetnsUnavailable("no `ip` command (iproute2) to create network namespaces")
        pair = cls(ip)
        try:
            probe = _run([ip, "netns", "add", pair.prefill_ns], check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NetnsUnavailable(f"`ip netns add` cannot run: {exc}") from None
        if probe.returncode != 0:
            raise NetnsUnavailable(f"`ip netns add` does not work here (exit {probe.returncode}): "
                                   f"{probe.stderr.strip() or probe.stdout.strip()}")
        pair.created.append(pair.prefill_ns)
        try:
            pair._build()
        except BaseException:
            pair.destroy()
            raise
        return pair

    def _build(self) -> None:
        ip = self.ip
        _run([ip, "netns", "add", self.decode_ns])
        self.created.append(self.decode_ns)
        # created inside the prefill namespace, so a failure never leaves it in the host's
        _run([ip, "-n", self.prefill_ns, "link", "add", self.prefill_dev, "type", "veth",
              "peer", "name", self.decode_dev, "netns", self.decode_ns])
        for ns, dev, addr in ((self.prefill_ns, self.prefill_dev, PREFILL_IP),
                              (self.decode_ns, self.decode_dev, DECODE_IP)):
            _run([ip, "-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", dev])
            _run([ip, "-n", ns, "link", "set", "lo", "up"])
            _run([ip, "-n", ns, "link", "set", dev, "up"])
        self.wait_link_up()

    def destroy(self) -> list[str]:
        """Kill every process inside, delete the namespaces; returns what went wrong (if
        anything), so a caller can report it without masking the test's own failure."""
        problems: list[str] = []
        for ns in list(self.created):
            try:
                left = self.kill_all(ns)
                if left:
                    problems.append(f"{ns}: processes {left} survived SIGKILL")
                proc = _run([self.ip, "netns", "del", ns], check=False)
                if proc.returncode != 0:
                    problems.append(f"ip netns del {ns}: {proc.stderr.strip()}")
                else:
                    self.created.remove(ns)
            except (OSError, subprocess.TimeoutExpired) as exc:
                problems.append(f"{ns}: {exc}")
        # the veth pair lives and dies with the namespaces; should a half-made end have
        # landed in this namespace, remove it too
        for dev in (self.prefill_dev, self.decode_dev):
            if Path(f"/sys/class/net/{dev}").exists():
                _run([self.ip, "link", "del", dev], check=False)
        return problems

    # ---- inside the namespaces ----------------------------------------------------------------
    def exec_args(self, ns: str, argv: Sequence[str]) -> list[str]:
        """`ip netns exec NS argv...`: iproute2 execs the command in place, so the pid of the
        Popen is the pid of the command itself (signals reach it directly)."""
        return [self.ip, "netns", "exec", ns, *argv]

    def pids(self, ns: str) -> list[int]:
        proc = _run([self.ip, "netns", "pids", ns], check=False)
        return [int(x) for x in proc.stdout.split() if x.isdigit()]

    def kill_all(self, ns: str, wait_s: float = 5.0) -> list[int]:
        """SIGKILL every process in `ns` (SIGCONT first, in case one is stopped); returns the
        pids still there after `wait_s`."""
        return kill_namespace(self.ip, ns, wait_s)

    def set_link(self, ns: str, dev: str, up: bool) -> None:
        _run([self.ip, "-n", ns, "link", "set", dev, "up" if up else "down"])

    def cut(self) -> None:
        """The decode side's end of the wire goes down: the decode host is unreachable."""
        self.set_link(self.decode_ns, self.decode_dev, up=False)

    def restore(self) -> None:
        self.set_link(self.decode_ns, self.decode_dev, up=True)
        self.set_link(self.prefill_ns, self.prefill_dev, up=True)
        self.wait_link_up()

    def wait_link_up(self, timeout_s: float = 10.0) -> None:
        """Both veth ends report carrier (operstate UP), bounded."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [_run([self.ip, "-n", ns, "-o", "link", "show", dev]).stdout
                      for ns, dev in ((self.prefill_ns, self.prefill_dev),
                                      (self.decode_ns, self.decode_dev))]
            if all("state UP" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth pair not up within {timeout_s:g} s: {states}")
            time.sleep(0.05)

    def routes(self, ns: str, family: str = "-4") -> list[str]:
        """Every route of `ns` in every table, one per line (local and broadcast included)."""
        out = _run([self.ip, "-n", ns, family, "route", "show", "table", "all"]).stdout
        return [ln.strip() for ln in out.splitlines() if ln.strip()]


MGMT_DEV = "mgmt0"  # each multi-homed host's management interface, the default route's
MGMT_PEER = "mgmt0x"  # its veth peer, left in the same namespace without an address: a dead end
MGMT_NETS = {"prefill": ("198.51.100.1/24", "198.51.100.254"),  # TEST-NET-2
             "decode": ("203.0.113.1/24", "203.0.113.254")}  # TEST-NET-3


@dataclass
class MultiHomedPair(NetnsPair):
    """Two "hosts" with two interfaces each: the default route goes through a management
    interface (one end of a veth pair whose other end stays in the namespace, unaddressed: the
    gateway never answers ARP, so what is routed there goes nowhere), the peer is reachable only
    through the data interface (the veth between the two, 192.0.2.0/24). SGLang's default-route
    step picks the management address, which the peer cannot reach."""

    def _build(self) -> None:
        super()._build()
        for ns, side in ((self.prefill_ns, "prefill"), (self.decode_ns, "decode")):
            addr, gateway = MGMT_NETS[side]
            _run([self.ip, "-n", ns, "link", "add", MGMT_DEV, "type", "veth", "peer", "name", MGMT_PEER])
            _run([self.ip, "-n", ns, "addr", "add", addr, "dev", MGMT_DEV])
            _run([self.ip, "-n", ns, "link", "set", MGMT_PEER, "up"])
            _run([self.ip, "-n", ns, "link", "set", MGMT_DEV, "up"])
            _run([self.ip, "-n", ns, "route", "add", "default", "via", gateway, "dev", MGMT_DEV])

    def mgmt_ip(self, side: str) -> str:
        return MGMT_NETS[side][0].split("/")[0]
