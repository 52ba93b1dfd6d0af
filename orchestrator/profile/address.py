"""Which address a serving side would advertise, by SGLang 0.5.23's rule, and what is wrong
with it.

SGLang 0.5.23 picks the address a prefill or decode advertises (its bootstrap info, and the
hostname Mooncake is initialised with) in ``sglang/srt/utils/network.py:get_local_ip_auto``:

1. ``SGLANG_HOST_IP``, else ``HOST_IP`` (any non-empty value, taken as it is);
2. the interface named by ``SGLANG_LOCAL_IP_NIC``: its first IPv4 address other than
   127.0.0.1 / 0.0.0.0, else its first IPv6 address outside fe80:: and ::1. This step imports
   ``netifaces``: without it SGLang raises ImportError and does not start; an interface that
   does not exist (or has no such address) falls through with a warning;
3. the source address of a UDP connect towards 8.8.8.8 (then 2001:4860:4860::8888): the
   default route's interface, which need not be the one the peer can reach;
4. the first address the hostname resolves to, unless it is 127.0.0.1, 0.0.0.0 or ::1;
5. otherwise ``ValueError("Can not get local ip")``: SGLang does not start.

:func:`advertise` is that rule on a :class:`Host` (what the rule reads: the environment, the
interfaces and their addresses, the default route's source, the hostname's address),
naming the step that chose. :func:`probe_host` reads a live host with the standard library
and iproute2's ``ip -d -j addr`` (the NIC step reads the interface table the way netifaces
does; tests/test_address.py holds both against SGLang's own function, netifaces included).
:func:`judge` flags what a peer on another host would trip on: loopback, link-local, a
docker / CNI bridge, another subnet than the peer's, and a default-route choice on a host
with several non-loopback interfaces. No I/O but :func:`probe_host`.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping, Optional, Sequence, Union

IPNet = Union[ipaddress.IPv4Interface, ipaddress.IPv6Interface]

HOST_IP_VARS = ("SGLANG_HOST_IP", "HOST_IP")
NIC_VAR = "SGLANG_LOCAL_IP_NIC"
REMOTE_TARGETS = (("8.8.8.8", 80), ("2001:4860:4860::8888", 80))  # SGLang's get_local_ip_by_remote
# interfaces of a container runtime or a CNI plugin: an address on one is reachable from this
# host (and its containers), not from a peer on another host
# (a pod's own eth0 is a veth: its address is the pod's, which is right; the bridge is on the node)
BRIDGE_KINDS = frozenset({"bridge"})
BRIDGE_PREFIXES = ("docker", "br-", "cni", "virbr", "podman", "kube-bridge", "lxcbr", "lxdbr")


class AddressSource(Enum):
    """The step of SGLang 0.5.23's rule that chose the address."""

    sglang_host_ip = "SGLANG_HOST_IP"
    host_ip = "HOST_IP"
    nic = "SGLANG_LOCAL_IP_NIC"
    default_route = "default route"  # UDP connect towards 8.8.8.8
    hostname = "hostname"
    none = "none"  # SGLang does not start


@dataclass(frozen=True)
class Interface:
    name: str
    addrs: tuple[str, ...] = ()  # "address/prefix", in the kernel's order (as netifaces lists them)
    kind: str = ""  # ip -d's link kind (veth, bridge, dummy, ...); "" for a physical NIC
    loopback: bool = False

    def networks(self) -> list[IPNet]:
        return [ipaddress.ip_interface(a) for a in self.addrs]


@dataclass(frozen=True)
class Host:
    """What SGLang's rule reads on one host."""

    env: Mapping[str, str] = field(default_factory=dict)
    interfaces: tuple[Interface, ...] = ()
    route_source: Optional[str] = None  # the source address of a UDP connect towards 8.8.8.8 (or v6)
    hostname_addr: Optional[str] = None  # the hostname's first address (getaddrinfo)
    netifaces: bool = True  # SGLang's NIC step can import netifaces here

    def interface_of(self, address: str) -> Optional[Interface]:
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return None
        return next((i for i in self.interfaces if any(n.ip == ip for n in i.networks())), None)

    def others(self) -> list[Interface]:
        """Non-loopback interfaces with an address that is neither loopback nor link-local."""
        return [i for i in self.interfaces if not i.loopback and any(
            not (n.ip.is_loopback or n.ip.is_link_local) for n in i.networks())]


@dataclass(frozen=True)
class Advertised:
    address: Optional[str]
    step: AddressSource
    interface: Optional[str] = None  # the interface holding the address, when it is this host's
    note: str = ""  # what the rule skipped on the way (a NIC without address, ...)
    error: Optional[str] = None  # why SGLang would not start

    def describe(self) -> str:
        if self.address is None:
            return f"none: {self.error}"
        where = f" on {self.interface}" if self.interface else ""
        how = {AddressSource.sglang_host_ip: "SGLANG_HOST_IP is set", AddressSource.host_ip: "HOST_IP is set",
               AddressSource.nic: "the address of SGLANG_LOCAL_IP_NIC's interface",
               AddressSource.default_route: "no SGLANG_HOST_IP/HOST_IP/SGLANG_LOCAL_IP_NIC: the default "
                                   "route's source (UDP connect towards 8.8.8.8)",
               AddressSource.hostname: "no variable, no default route: the hostname's address"}[self.step]
        return f"{self.address}{where} (step {self.step.value}: {how}{'; ' + self.note if self.note else ''})"


def _nic_address(iface: Interface) -> Optional[str]:
    """SGLang's get_local_ip_by_nic on one interface: the first IPv4 other than 127.0.0.1 and
    0.0.0.0, else the first IPv6 not starting with fe80:: and not ::1 (scope stripped)."""
    nets = iface.networks()
    for n in nets:
        if n.version == 4 and str(n.ip) not in ("127.0.0.1", "0.0.0.0"):
            return str(n.ip)
    for n in nets:
        text = str(n.ip)
        if n.version == 6 and not text.startswith("fe80::") and text != "::1":
            return text
    return None


def advertise(host: Host) -> Advertised:
    """SGLang 0.5.23's get_local_ip_auto on `host`, naming the step that chose."""
    env = host.env
    for var, step in zip(HOST_IP_VARS, (AddressSource.sglang_host_ip, AddressSource.host_ip)):
        if env.get(var, ""):
            value = env[var]
            iface = host.interface_of(value)
            return Advertised(value, step, iface.name if iface else None)
    notes = []
    nic = env.get(NIC_VAR)
    if nic:
        if not host.netifaces:
            return Advertised(None, AddressSource.none, error=f"{NIC_VAR}={nic} needs the netifaces package, "
                              "which is not installed: SGLang raises ImportError at start-up "
                              "(pip install netifaces in the image)")
        iface = next((i for i in host.interfaces if i.name == nic), None)
        address = _nic_address(iface) if iface is not None else None
        if address is not None:
            return Advertised(address, AddressSource.nic, nic)
        notes.append(f"{NIC_VAR}={nic} " + ("is no interface here" if iface is None else
                                             "has no usable address") + " (SGLang warns and goes on)")
    if host.route_source:
        iface = host.interface_of(host.route_source)
        return Advertised(host.route_source, AddressSource.default_route, iface.name if iface else None,
                          "; ".join(notes))
    addr = host.hostname_addr
    if addr and addr not in ("127.0.0.1", "0.0.0.0", "::1"):
        iface = host.interface_of(addr)
        return Advertised(addr, AddressSource.hostname, iface.name if iface else None, "; ".join(notes))
    return Advertised(None, AddressSource.none, note="; ".join(notes),
                      error="no variable, no default route and no usable hostname address: SGLang "
                            "raises ValueError('Can not get local ip') at start-up")


# ---------------------------------------------------------------------------------------------
# A live host


def interfaces_from_ip_json(text: str) -> tuple[Interface, ...]:
    """`ip -d -j addr show` output as Interfaces."""
    out = []
    for item in json.loads(text or "[]"):
        addrs = tuple(f"{a['local']}/{a['prefixlen']}" for a in item.get("addr_info", [])
                      if a.get("family") in ("inet", "inet6") and "local" in a)
        kind = (item.get("linkinfo") or {}).get("info_kind", "") or ""
        out.append(Interface(item["ifname"], addrs, kind, item.get("link_type") == "loopback"))
    return tuple(out)


def route_source() -> Optional[str]:
    """SGLang's get_local_ip_by_remote socket part: no packet is sent."""
    for dns_host, dns_port in REMOTE_TARGETS:
        try:
            family, socktype, proto, _, sockaddr = socket.getaddrinfo(
                dns_host, dns_port, socket.AF_UNSPEC, socket.SOCK_DGRAM, 0, socket.AI_ADDRCONFIG)[0]
            with socket.socket(family, socktype, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except (socket.gaierror, OSError):
            continue
    return None


def hostname_address() -> Optional[str]:
    try:
        return str(socket.getaddrinfo(socket.gethostname(), None, socket.AF_UNSPEC, 0, 0,
                                      socket.AI_ADDRCONFIG)[0][4][0])
    except Exception:  # noqa: BLE001 - SGLang's own catch-all
        return None


def probe_host(env: Mapping[str, str]) -> Host:
    """This host, as SGLang's rule would read it under `env`."""
    import importlib.util

    ifaces: tuple[Interface, ...] = ()
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        proc = subprocess.run([ip, "-d", "-j", "addr", "show"], capture_output=True, text=True, timeout=5)
        if proc.returncode == 0:
            ifaces = interfaces_from_ip_json(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    if not ifaces:  # no iproute2: names only
        ifaces = tuple(Interface(name, loopback=name == "lo") for _, name in socket.if_nameindex())
    return Host(dict(env), ifaces, route_source(), hostname_address(),
                importlib.util.find_spec("netifaces") is not None)


# ---------------------------------------------------------------------------------------------
# What is wrong with it


@dataclass(frozen=True)
class Flag:
    fail: bool
    text: str


def _is_bridge(iface: Optional[Interface]) -> bool:
    return iface is not None and (iface.kind in BRIDGE_KINDS or iface.name.startswith(BRIDGE_PREFIXES))


def fix_for(host: Host, peer: Optional[str] = None) -> str:
    """The variable to set: the interface on the peer's subnet when one is, else any."""
    target = None
    if peer:
        target = on_subnet_of(host, peer)
    if target is None:
        cands = host.others()
        target = (cands[0], _nic_address(cands[0]) or "") if len(cands) == 1 else None
    if target is None:
        return f"set {NIC_VAR}=<the interface the peer reaches> (or SGLANG_HOST_IP=<its address>)"
    return f"set {NIC_VAR}={target[0].name} (or SGLANG_HOST_IP={target[1]})"


def on_subnet_of(host: Host, peer: str) -> Optional[tuple[Interface, str]]:
    """This host's interface (and address) whose subnet holds `peer`."""
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return None
    for iface in host.interfaces:
        for n in iface.networks():
            if n.version == ip.version and ip in n.network and not n.ip.is_loopback:
                return iface, str(n.ip)
    return None


def judge(adv: Advertised, host: Host, peer: Optional[str] = None) -> list[Flag]:
    """What a peer would trip on. `peer`: the address the other side advertises, when known."""
    if adv.address is None:
        return [Flag(True, adv.error or "no address")]
    try:
        ip = ipaddress.ip_address(adv.address.split("%")[0])
    except ValueError:
        return [Flag(True, f"{adv.address!r} is no IP address: SGLang hands it to Mooncake and to "
                           "its bootstrap as it is; set an address")]
    out: list[Flag] = []
    iface = host.interface_of(adv.address)
    peer_ip = None
    if peer:
        try:
            peer_ip = ipaddress.ip_address(peer)
        except ValueError:
            peer_ip = None
    if ip.is_loopback:
        remote = peer_ip is not None and not peer_ip.is_loopback
        out.append(Flag(remote, f"{adv.address} is a loopback address: only a peer on this very host "
                                f"reaches it; {fix_for(host, peer)}"))
    elif ip.is_link_local:
        out.append(Flag(False, f"{adv.address} is link-local: reachable on its own link only, and "
                               f"not routed; {fix_for(host, peer)}"))
    if _is_bridge(iface):
        assert iface is not None
        out.append(Flag(False, f"{adv.address} is on {iface.name} ({iface.kind or 'a container bridge'}): "
                               "a docker or CNI bridge, reachable from this host's containers, not "
                               f"from a peer on another host; {fix_for(host, peer)}"))
    if peer_ip is not None and iface is not None and not ip.is_loopback:
        mine = next((n for n in iface.networks() if n.ip == ip), None)
        if mine is not None and mine.version == peer_ip.version and peer_ip not in mine.network:
            there = on_subnet_of(host, str(peer_ip))
            if there is not None:
                out.append(Flag(True, f"{adv.address} ({mine.network} on {iface.name}) is on another "
                                      f"subnet than the peer's {peer}, which {there[0].name} "
                                      f"({there[1]}) is on: the peer would reach this side over "
                                      f"another network, if at all; {fix_for(host, peer)}"))
            else:
                out.append(Flag(False, f"{adv.address} ({mine.network} on {iface.name}) is on another "
                                       f"subnet than the peer's {peer}: traffic goes through a "
                                       "router; check the peer can reach it"))
    if adv.step is AddressSource.default_route:
        others = host.others()
        if len(others) > 1:
            names = ", ".join(i.name for i in others)
            out.append(Flag(False, f"chosen by the default route on a host with {len(others)} "
                                   f"non-loopback interfaces ({names}): the peer may reach only "
                                   f"another one; {fix_for(host, peer)}"))
    return out


def summary(adv: Advertised, flags: Sequence[Flag]) -> tuple[str, str]:
    """(status, detail) for a doctor line: FAIL, WARN or OK."""
    status = "FAIL" if any(f.fail for f in flags) else "WARN" if flags else "OK"
    detail = "would advertise " + adv.describe()
    if flags:
        detail += ". " + " ".join(f.text + "." for f in flags)
    return status, detail
