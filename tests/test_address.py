"""The address a side would advertise (orchestrator.profile.address): SGLang 0.5.23's
get_local_ip_auto, compiled from the installed release, is the oracle on this host under
every variable the rule reads; the rule's steps and the flags on made-up hosts. The same
rule in network namespaces where the default route is not the peer's network:
tests/test_address_netns.py."""

from __future__ import annotations

import pytest

from orchestrator.profile.address import (
    AddressSource as Step,
)
from orchestrator.profile.address import (
    Host,
    Interface,
    advertise,
    interfaces_from_ip_json,
    judge,
    probe_host,
    summary,
)

from .helpers import sglang_oracle

LO = Interface("lo", ("127.0.0.1/8", "::1/128"), loopback=True)
MGMT = Interface("eth0", ("10.1.0.5/24", "fe80::1/64"))
DATA = Interface("ib0", ("192.168.7.5/24",))
DOCKER = Interface("docker0", ("172.17.0.1/16",), kind="bridge")
TWO = (LO, MGMT, DATA)


def test_each_step_of_the_rule_in_order():
    host = Host({}, TWO, route_source="10.1.0.5", hostname_addr="127.0.1.1")
    assert advertise(host).step is Step.default_route and advertise(host).interface == "eth0"
    nic = Host({"SGLANG_LOCAL_IP_NIC": "ib0"}, TWO, "10.1.0.5")
    assert (advertise(nic).address, advertise(nic).step) == ("192.168.7.5", Step.nic)
    both = Host({"SGLANG_LOCAL_IP_NIC": "ib0", "HOST_IP": "10.9.9.9"}, TWO, "10.1.0.5")
    assert (advertise(both).address, advertise(both).step) == ("10.9.9.9", Step.host_ip)
    first = Host({"SGLANG_HOST_IP": "1.2.3.4", "HOST_IP": "10.9.9.9"}, TWO, "10.1.0.5")
    assert advertise(first).step is Step.sglang_host_ip
    empty = Host({"SGLANG_HOST_IP": "", "SGLANG_LOCAL_IP_NIC": ""}, TWO, "10.1.0.5")
    assert advertise(empty).step is Step.default_route  # empty values do not count, as in SGLang
    gone = Host({"SGLANG_LOCAL_IP_NIC": "eth9"}, TWO, "10.1.0.5")
    assert advertise(gone).step is Step.default_route and "eth9 is no interface" in advertise(gone).note
    offline = Host({}, TWO, None, "192.168.7.5")
    assert (advertise(offline).address, advertise(offline).step) == ("192.168.7.5", Step.hostname)
    nothing = Host({}, TWO, None, "127.0.0.1")
    assert advertise(nothing).address is None and "Can not get local ip" in advertise(nothing).error


def test_the_nic_step_without_netifaces_stops_sglang():
    adv = advertise(Host({"SGLANG_LOCAL_IP_NIC": "ib0"}, TWO, "10.1.0.5", netifaces=False))
    assert adv.address is None and "netifaces" in adv.error
    assert judge(adv, Host())[0].fail


def test_the_nic_step_skips_loopback_and_link_local_as_sglang_does():
    v6 = Interface("v6only", ("fe80::2/64", "2001:db8::5/64"))
    adv = advertise(Host({"SGLANG_LOCAL_IP_NIC": "v6only"}, (LO, v6), None))
    assert adv.address == "2001:db8::5"
    lo = advertise(Host({"SGLANG_LOCAL_IP_NIC": "lo"}, (LO, MGMT), "10.1.0.5"))
    assert lo.step is Step.default_route and "no usable address" in lo.note  # 127.0.0.1 and ::1 skipped


def test_flags():
    default = Host({}, TWO, "10.1.0.5")
    status, detail = summary(advertise(default), judge(advertise(default), default))
    assert status == "WARN" and "3 non-loopback" not in detail and "2 non-loopback" in detail
    # the peer is on ib0's subnet: the default route's choice is the wrong NIC
    flags = judge(advertise(default), default, peer="192.168.7.9")
    assert any(f.fail for f in flags)
    assert "SGLANG_LOCAL_IP_NIC=ib0 (or SGLANG_HOST_IP=192.168.7.5)" in " ".join(f.text for f in flags)
    fixed = Host({"SGLANG_LOCAL_IP_NIC": "ib0"}, TWO, "10.1.0.5")
    assert judge(advertise(fixed), fixed, peer="192.168.7.9") == []
    loop = Host({"SGLANG_HOST_IP": "127.0.0.1"}, TWO, "10.1.0.5")
    assert not judge(advertise(loop), loop)[0].fail and judge(advertise(loop), loop, "192.168.7.9")[0].fail
    link = Host({"SGLANG_HOST_IP": "169.254.3.3"}, TWO)
    assert "link-local" in judge(advertise(link), link)[0].text
    bridge = Host({}, (LO, DOCKER), "172.17.0.1")
    assert "docker or CNI bridge" in judge(advertise(bridge), bridge)[0].text
    far = Host({}, (LO, MGMT), "10.1.0.5")
    (other,) = judge(advertise(far), far, peer="10.2.0.7")
    assert not other.fail and "another subnet" in other.text
    assert judge(advertise(far), far, peer="10.1.0.7") == []


def test_ip_json_is_read():
    text = ('[{"ifname":"lo","link_type":"loopback","addr_info":[{"family":"inet","local":"127.0.0.1",'
            '"prefixlen":8}]},{"ifname":"br0","link_type":"ether","linkinfo":{"info_kind":"bridge"},'
            '"addr_info":[{"family":"inet","local":"10.0.0.1","prefixlen":24},{"family":"inet6",'
            '"local":"fe80::1","prefixlen":64}]}]')
    lo, br = interfaces_from_ip_json(text)
    assert lo.loopback and br.kind == "bridge" and br.addrs == ("10.0.0.1/24", "fe80::1/64")


# ---- SGLang's own function on this host --------------------------------------------------------
@pytest.fixture(scope="module")
def sglang_rule():
    try:
        return sglang_oracle.local_ip_rule()
    except sglang_oracle.OracleUnavailable as exc:
        pytest.skip(f"SGLang oracle unavailable: {exc}")


def _cases(host: Host) -> list[dict[str, str]]:
    names = [i.name for i in host.interfaces]
    cases: list[dict[str, str]] = [{}, {"SGLANG_HOST_IP": "10.3.3.3"}, {"HOST_IP": "10.4.4.4"},
                                   {"SGLANG_HOST_IP": "", "HOST_IP": "10.4.4.4"},
                                   {"SGLANG_LOCAL_IP_NIC": "no-such-nic0"}]
    cases += [{"SGLANG_LOCAL_IP_NIC": n} for n in names]
    return cases


def test_sglang_get_local_ip_auto_is_the_oracle_here(sglang_rule, monkeypatch):
    pytest.importorskip("netifaces")  # SGLang's NIC step imports it
    host = probe_host({})
    assert any(i.loopback for i in host.interfaces), host
    for env in _cases(host):
        for var in ("SGLANG_HOST_IP", "HOST_IP", "SGLANG_LOCAL_IP_NIC"):
            monkeypatch.delenv(var, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        try:
            want = sglang_rule()
        except ValueError:
            want = None
        assert advertise(probe_host(env)).address == want, env
